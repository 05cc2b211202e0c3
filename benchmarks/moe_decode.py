"""A mixture-of-experts model's decode step against dense models of equal active and of
equal total parameters, through the engine.

Run: .venv/bin/python benchmarks/moe_decode.py [--batches 1,8,32] [--rounds 5]
Three random-weight models saved as Hugging Face directories, alike but for their MLPs:
Mixtral-style (E experts of I, top-k), a Mistral whose MLP is k*I wide (the same
parameters per token) and one whose MLP is E*I wide (the same parameters in all). Each
round times `--steps` decode steps of every model at every batch size, models
interleaved; the table gives the medians and the MoE step's ratio to each dense one.
"""
from __future__ import annotations

# stallfree before torch, as `stallfree serve` imports them (stallfree/huge_pages.py).
from stallfree import LLM, SamplingParams

# isort: split
import argparse
import statistics
import tempfile
import time

import torch
import transformers

BASE = dict(vocab_size=8192, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
            num_key_value_heads=4, head_dim=64, max_position_embeddings=1024,
            sliding_window=None, tie_word_embeddings=False)
PROMPT = 48


def save(folder: str, moe: bool, intermediate: int, experts: int, top_k: int) -> str:
    if moe:
        config = transformers.MixtralConfig(**BASE, intermediate_size=intermediate,
                                            num_local_experts=experts,
                                            num_experts_per_tok=top_k)
        model = transformers.MixtralForCausalLM(config)
    else:
        config = transformers.MistralConfig(**BASE, intermediate_size=intermediate)
        model = transformers.MistralForCausalLM(config)
    model.save_pretrained(folder, safe_serialization=True)
    from stallfree.model.tokenizer import load_tokenizer

    load_tokenizer(None).save_pretrained(folder)  # any tokenizer: the prompts are ids
    return folder


def decode_step_ms(llm: LLM, batch: int, steps: int, seed: int) -> float:
    """Median time of `steps` decode steps of `batch` requests, after their prefills."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        prompt = [(seed * 31 + i * 7 + j) % 8000 + 10 for j in range(PROMPT)]
        engine.add_request(f"r{seed}-{i}", prompt, params)
    while any(r.num_computed_tokens < PROMPT for r in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times) * 1e3


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            line = next(line for line in f if line.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"
    keep = ("avx2", "fma", "avx512", "amx", "vnni")
    return " ".join(w for w in line.split(":")[1].split() if w.startswith(keep))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=1024, help="one expert's width")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    torch.manual_seed(0)
    batches = [int(b) for b in args.batches.split(",")]
    e, k, i = args.experts, args.top_k, args.intermediate
    with tempfile.TemporaryDirectory() as tmp:
        specs = {"moe": (True, i), "dense, equal active": (False, k * i),
                 "dense, equal total": (False, e * i)}
        llms = {name: LLM(save(f"{tmp}/{n}", moe, width, e, k), dtype="float32",
                          kv_cache_memory=256 << 20)
                for n, (name, (moe, width)) in enumerate(specs.items())}
        times = {(name, b): [] for name in llms for b in batches}
        for r in range(args.rounds):
            for b in batches:
                for name, llm in llms.items():
                    times[name, b].append(decode_step_ms(llm, b, args.steps, r))
    print(f"CPU flags: {cpu_flags()}; torch threads {torch.get_num_threads()}")
    print(f"{e} experts of {i}, top-{k}; hidden {BASE['hidden_size']}, "
          f"{BASE['num_hidden_layers']} layers, float32; median of {args.rounds} rounds of "
          f"{args.steps} decode steps\n")
    print("| batch | MoE ms | dense equal-active ms | dense equal-total ms | MoE / active | "
          "MoE / total |")
    print("|---|---|---|---|---|---|")
    for b in batches:
        moe, active, total = (statistics.median(times[name, b]) for name in llms)
        print(f"| {b} | {moe:.2f} | {active:.2f} | {total:.2f} | {moe / active:.2f} | "
              f"{moe / total:.2f} |")


if __name__ == "__main__":
    main()
