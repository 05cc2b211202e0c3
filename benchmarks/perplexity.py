"""Perplexity of a model on the shipped essay, scored by the engine's own prompt logprobs.

Run: .venv/bin/python benchmarks/perplexity.py [--dtype float32] [--window 1024]
     .venv/bin/python benchmarks/perplexity.py --configs "quantization=none" \
         "quantization=auto" "quantization=int8" "quantization=auto,dtype=bfloat16"
     .venv/bin/python benchmarks/perplexity.py --quantization none \
         --kernels decode_attention=torch,prefill_attention=torch \
         --configs kv_cache_dtype=auto kv_cache_dtype=int8

The text is stallfree/data/text/perplexity_essay.txt (provenance in the README beside
it). It is tokenized once and cut into windows of `--window` tokens without overlap; each
window is one prompt, scored with max_tokens=0 and prompt_logprobs=0, so the engine
computes every position exactly as a prefill would and generates nothing. The first
token of a window has no logprob (nothing precedes it) and is not counted. Perplexity is
exp(-mean logprob) over every counted token.

Each config (`key=value,key=value`, engine settings by the names LLM takes) builds an
LLM on top of the flags' settings, scores the text, and shuts it down; a markdown table
then compares them, the first being the baseline. `--quantization`, `--kv-cache-dtype` and
`--kernels` are passed to LLM only when given (the engine's defaults otherwise).
"""
from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from pathlib import Path

from stallfree.executor.hardware import vector_flags
from stallfree.llm import LLM
from stallfree.sampling_params import SamplingParams

TEXT = Path(__file__).resolve().parent.parent / "stallfree" / "data" / "text" \
    / "perplexity_essay.txt"


def windows(token_ids: Sequence[int], window: int) -> list[list[int]]:
    """Consecutive, non-overlapping slices of `window` tokens; the tail is kept when it has
    at least two tokens (one alone has nothing to predict)."""
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    cuts = [list(token_ids[i:i + window]) for i in range(0, len(token_ids), window)]
    return [c for c in cuts if len(c) >= 2]


def usable_window(llm: LLM, window: int) -> int:
    """`window`, clamped so that a window is a prompt the engine accepts: the scheduler
    refuses a prompt of max_model_len tokens or more (it must leave room for output)."""
    return max(2, min(window, llm.engine.max_model_len - 1))


def perplexity(llm: LLM, token_ids: Sequence[int], window: int) -> tuple[float, int]:
    """(perplexity, tokens scored) of `token_ids` under `llm`, window by window.

    All windows go to the engine in one `generate` call: the scheduler batches and chunks
    them as it would any prompts, which is the path under test (chunked prefill included).
    """
    window = usable_window(llm, window)
    prompts = windows(token_ids, window)
    if not prompts:
        raise ValueError("need at least two tokens to score")
    params = SamplingParams(max_tokens=0, prompt_logprobs=0, temperature=0)
    outputs = llm.generate(prompts, params)
    total, count = 0.0, 0
    for prompt, out in zip(prompts, outputs):
        table = out.prompt_logprobs
        if table is None or len(table) != len(prompt):
            raise RuntimeError(f"request {out.request_id}: expected {len(prompt)} prompt "
                               f"logprobs, got {None if table is None else len(table)}")
        for position, entry in enumerate(table[1:], 1):
            if entry.token_id != prompt[position]:
                raise RuntimeError(f"logprob of token {entry.token_id} where the prompt has "
                                   f"{prompt[position]}")
            total += entry.logprob
            count += 1
    return math.exp(-total / count), count


def parse_config(text: str) -> dict[str, object]:
    """`key=value,key=value` -> engine args. Numbers become int or float and true/false
    bools (LLM takes typed values; the CLI's parsers do not run here); anything else stays
    a string, so a setting's own names ("none", "auto", "int8") reach it unchanged."""
    settings: dict[str, object] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"config {text!r}: expected key=value, got {part!r}")
        settings[key.strip().replace("-", "_")] = _typed(value.strip())
    return settings


def _typed(value: str) -> object:
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def score_config(model: str | None, token_ids: Sequence[int], window: int,
                 engine_args: dict[str, object]) -> dict[str, object]:
    """Builds one LLM, scores the text, shuts the LLM down (its memory is freed before the
    next config loads)."""
    started = time.perf_counter()
    llm = LLM(model, **engine_args)
    try:
        loaded = time.perf_counter()
        used = usable_window(llm, window)
        ppl, scored = perplexity(llm, token_ids, used)
        done = time.perf_counter()
        info = llm.engine.info
        return {"ppl": ppl, "scored": scored, "window": used, "dtype": info.dtype,
                "kv": info.kv_cache_dtype, "load_s": loaded - started,
                "score_s": done - loaded}
    finally:
        llm.shutdown()


def markdown_table(rows: list[tuple[str, dict[str, object]]]) -> str:
    base = rows[0][1]["ppl"]
    lines = ["| config | dtype | KV cache | window | tokens scored | perplexity "
             "| ratio to first | load s | score s |",
             "|---|---|---|---|---:|---:|---:|---:|---:|"]
    for label, r in rows:
        lines.append(f"| {label} | {r['dtype']} | {r['kv']} | {r['window']} | {r['scored']} "
                     f"| {r['ppl']:.4f} | {r['ppl'] / base:.4f} "
                     f"| {r['load_s']:.1f} | {r['score_s']:.1f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="GGUF or HF directory (default model)")
    parser.add_argument("--text", type=Path, default=TEXT)
    parser.add_argument("--window", type=int, default=1024,
                        help="tokens per scored prompt (clamped below max_model_len)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="score only the text's first N tokens (quick runs)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--kv-cache-dtype", default=None, help="auto, int8 (engine setting)")
    parser.add_argument("--kernels", default=None, metavar="OP=IMPL,...",
                        help="kernel table overrides, e.g. decode_attention=torch")
    parser.add_argument("--configs", nargs="+", default=None, metavar="K=V[,K=V]",
                        help="settings to compare, each over the flags' settings")
    args = parser.parse_args(argv)

    base: dict[str, object] = {"dtype": args.dtype}
    for name in ("quantization", "kv_cache_dtype", "kernels"):
        if getattr(args, name) is not None:
            base[name] = getattr(args, name)

    print(f"cpu flags: {vector_flags() or '(none found)'}")
    token_ids = _tokenize(args.model, args.text.read_text(encoding="utf-8"))
    if args.max_tokens is not None:
        token_ids = token_ids[:args.max_tokens]
    print(f"text: {args.text.name}, {len(token_ids)} tokens")
    rows: list[tuple[str, dict[str, object]]] = []
    for config in args.configs or [""]:
        engine_args = {**base, **parse_config(config)}
        label = ", ".join(f"{k}={v}" for k, v in engine_args.items())
        result = score_config(args.model, token_ids, args.window, engine_args)
        print(f"{label}: perplexity {result['ppl']:.4f} over {result['scored']} tokens "
              f"(load {result['load_s']:.1f} s, score {result['score_s']:.1f} s)", flush=True)
        rows.append((label, result))
    print()
    print(markdown_table(rows))


def _tokenize(model: str | None, text: str) -> list[int]:
    """The text's ids as the engine itself tokenizes a string prompt (LLMEngine.tokenize:
    the model's tokenizer, called plainly). Only the tokenizer is loaded: it depends on the
    model alone, so every config scores the same ids and the ratios compare like with
    like."""
    from stallfree.model.tokenizer import load_tokenizer

    return list(load_tokenizer(model)(text)["input_ids"])


if __name__ == "__main__":
    main()
