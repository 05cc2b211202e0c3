"""A long prompt arrives while requests decode: the stall under `vllm`, none under `sarathi`.

Run: .venv/bin/python benchmarks/stall_demo.py [--out docs/stall_demo.png]
Four short requests decode; once each has 10 tokens, a ~2,000-token prompt
arrives. Under `vllm` (whole prefills, budget 4096) every decode waits for that
prefill; under `sarathi` (budget 256) the prefill is cut into chunks that ride
along with the decodes. Prints the longest gap between tokens of each policy
and writes one plot of every token's emission time.
"""
from __future__ import annotations

import argparse
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from stallfree import LLM, SamplingParams  # noqa: E402

SHORT = ["Tell me about the history of Rome.", "List some uses of copper.",
         "Describe a sunrise over the sea.", "What makes a good teacher?"]
POLICIES = [("vllm", 4096), ("sarathi", 256)]


def _long_prompt(llm: LLM, tokens: int) -> list[int]:
    text = " ".join(f"Record {i}: sensor {i % 17} read {i * 37 % 1000} units." for i in range(400))
    ids = llm.engine.tokenize(text)
    assert len(ids) >= tokens, "filler text too short"
    return ids[:tokens]


def run(llm: LLM, policy: str, budget: int, long_prompt: list[int]) -> dict:
    llm.reconfigure(policy=policy, token_budget=budget)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    ids = [f"short-{i}" for i in range(len(SHORT))]
    for rid, prompt in zip(ids, SHORT):
        engine.add_request(rid, prompt, params)
    start, long_added, outputs = time.monotonic(), False, {}
    while engine.has_unfinished_requests():
        outputs.update((out.request_id, out) for out in engine.step().finished)
        if not long_added and all(len(engine.request_output(r).token_ids) >= 10 for r in ids):
            engine.add_request("long", long_prompt,
                               SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
            long_added, long_arrival = True, time.monotonic()
    gaps = [g for rid in ids for g in outputs[rid].tbt]
    return {"policy": policy, "budget": budget, "start": start, "long_arrival": long_arrival,
            "outputs": outputs, "max_gap": max(gaps),
            "long_ttft": outputs["long"].ttft}


def plot(results: list[dict], path: str) -> None:
    fig, axes = plt.subplots(len(results), 1, figsize=(9, 2.6 * len(results)), sharex=True)
    for ax, res in zip(axes, results):
        for row, (rid, out) in enumerate(res["outputs"].items()):
            times = [t - res["start"] for t in out.outputs[0].token_times]
            ax.plot(times, [row] * len(times), "|", markersize=10,
                    color="tab:red" if rid == "long" else "tab:blue")
        ax.axvline(res["long_arrival"] - res["start"], color="gray", linestyle="--", linewidth=1)
        ax.set_yticks(range(len(res["outputs"])), list(res["outputs"]))
        ax.set_title(f"{res['policy']} (token budget {res['budget']}): longest gap between "
                     f"tokens {res['max_gap'] * 1000:.0f} ms", fontsize=10)
    axes[-1].set_xlabel("seconds since the first request (dashed: the long prompt arrives)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="docs/stall_demo.png")
    parser.add_argument("--long-tokens", type=int, default=2000)
    args = parser.parse_args()
    llm = LLM(max_model_len=4096)
    long_prompt = _long_prompt(llm, args.long_tokens)
    results = [run(llm, policy, budget, long_prompt) for policy, budget in POLICIES]
    print("| policy | token budget | longest TBT of the decoding requests "
          "| TTFT of the long prompt |")
    print("|---|---|---|---|")
    for res in results:
        print(f"| {res['policy']} | {res['budget']} | {res['max_gap'] * 1000:.0f} ms "
              f"| {res['long_ttft']:.2f} s |")
    ratio = results[0]["max_gap"] / results[1]["max_gap"]
    print(f"longest gap, vllm / sarathi: {ratio:.1f}x")
    plot(results, args.out)
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
