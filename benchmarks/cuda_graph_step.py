"""A decode step of the default model as the engine launches it, beside the same step
replayed from a CUDA graph: what graphs would buy a GPU, where a small model's step is
hundreds of small kernel launches (the engine has no graph path yet).

Run: python benchmarks/cuda_graph_step.py [--batches 1,8,32,64] [--context 512]
     [--rounds 20] [--dtype bfloat16]
The step is the model's forward over one decode token per request (512-token contexts,
each request's blocks consecutive), the logits and their argmax: the engine's model and
KV cache, without its scheduler and sampler. Prints the median milliseconds per step,
launched and replayed, and the ratio. On a CPU only the launched step runs.
"""
from __future__ import annotations

# stallfree before torch, as `stallfree serve` imports them (see engine_speed.py).
from stallfree import LLM

# isort: split
import argparse

import torch
from device_timing import device_name, median_seconds

from stallfree.model.attention import AttentionMetadata


def decode_inputs(runner, batch: int, context: int):
    """Token ids, positions and attention metadata of `batch` decodes at `context`."""
    bs = runner.block_size
    per = -(-context // bs)
    seqs = [(context - 1, 1, list(range(i * per, (i + 1) * per))) for i in range(batch)]
    meta = AttentionMetadata.build(seqs, bs, runner.device, runner.workspace,
                                   pad_block=runner.null_block)
    ids = torch.randint(100, 40000, (batch,), device=runner.device)
    positions = torch.full((batch,), context - 1, device=runner.device)
    return ids, positions, meta


def graphed(step, device: torch.device):
    """`step` captured in a CUDA graph after warm-up calls on a side stream (they grow the
    gather buffer and fill the attention plan, so that capture sees no allocation from the
    host); returns its replay."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--dtype", default=None, help="engine dtype (default: the engine's)")
    args = ap.parse_args()
    llm = LLM(max_model_len=4096, dtype=args.dtype)
    runner = llm.engine.executor.runner
    model, device = runner.model, runner.device
    print(f"{device_name(device)}, {llm.engine.dtype}, decode steps at {args.context}-token "
          "contexts")
    print("| decodes | launched ms | graph ms | launched / graph |\n|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        ids, positions, meta = decode_inputs(runner, batch, args.context)

        @torch.inference_mode()
        def step(ids=ids, positions=positions, meta=meta) -> torch.Tensor:
            hidden = model(ids, positions, meta, runner.kv_cache)
            return model.compute_logits(hidden).argmax(dim=-1)

        launched = median_seconds(step, args.rounds, device) * 1e3
        if device.type != "cuda":
            print(f"| {batch} | {launched:.2f} | - | - |", flush=True)
            continue
        try:
            replay = graphed(step, device)
        except Exception as failure:  # noqa: BLE001 - the table says why, and goes on
            # A capture that fails inside the block fails again at its end: the first
            # error is the one that says why.
            first = failure.__context__ or failure
            print(f"| {batch} | {launched:.2f} | capture failed: {type(first).__name__}: "
                  f"{str(first)[:200]} | - |", flush=True)
            continue
        graph = median_seconds(replay, args.rounds, device) * 1e3
        print(f"| {batch} | {launched:.2f} | {graph:.2f} | {launched / graph:.1f}x |",
              flush=True)


if __name__ == "__main__":
    main()
