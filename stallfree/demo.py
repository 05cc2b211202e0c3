"""`make demo`: a few chat prompts of varied length served together on the default model."""
from __future__ import annotations

import numpy as np

from .llm import LLM
from .sampling_params import SamplingParams

PROMPTS = [
    "Hi! What is your name?",
    "Give me three tips for writing clear Python code.",
    "Explain in a short paragraph why the sky looks blue during the day.",
    "Summarise the following text in two sentences.\n\n" + " ".join(
        ["Large language model serving systems must balance throughput and latency. "
         "Prefills are compute bound, while decodes are memory bound. "
         "Batching many decodes together is cheap, but a long prefill in the same "
         "batch can stall every running decode for a long time."] * 12),
    "Write a haiku about autumn leaves.",
    "What is the capital of France, and what is it famous for?",
]


def main() -> None:
    llm = LLM(token_budget=256)
    params = SamplingParams(temperature=0.0, max_tokens=96)
    outputs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params)
    for prompt, out in zip(PROMPTS, outputs):
        gaps = out.tbt
        p99 = float(np.percentile(gaps, 99)) * 1000 if gaps else float("nan")
        short = prompt if len(prompt) < 70 else prompt[:67] + "..."
        print(f"\n>>> {short}  [{len(out.prompt_token_ids)} prompt tokens]")
        print(out.text.strip())
        print(f"    TTFT {out.ttft * 1000:.0f} ms | P99 TBT {p99:.0f} ms | "
              f"{len(out.token_ids)} tokens | finish: {out.finish_reason}")


if __name__ == "__main__":
    main()
