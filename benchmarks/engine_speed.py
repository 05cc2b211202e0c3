"""Prefill and decode speed of the engine on the default model, beside this machine's floors.

Run: .venv/bin/python benchmarks/engine_speed.py [--quick] [--batches 1,32] [--rounds N]
[--no-prefill]
The engine's figures are medians of repeated measurements taken in this one run, the
floors beside them the best of repeated calls; each decode row is the median of rounds
that measure their floors again just before their steps, the ratio per round.
--kernel-ab OP=IMPL [--dtype D]: only the decode steps (prefill chunks for the ops of
prefill), on the engine's kernel table and on the table with that one choice overridden (the
`kernels` setting, e.g. decode_attention=torch or layer_loop=python; `stallfree info` lists
the ops and implementations), rounds interleaved, side by side. The model is repacked at each
switch, so a matmul choice's weights are packed for it.
"""
from __future__ import annotations

# stallfree before torch, as `stallfree serve` imports them: its import asks torch for huge
# pages, which torch reads only as it loads (stallfree/huge_pages.py).
from stallfree import LLM, SamplingParams

# isort: split
import argparse
import statistics
import time

import torch
from device_timing import device_name, synchronize

from stallfree.kernel_ops import parse_kernels
from stallfree.model.decoder import kv_cache_bytes_per_token

PREFILL = {"prefill_attention"}  # compared on prefill chunks
DECODE_ROUNDS = 3


def _best_time(fn, repeats: int, device: torch.device) -> float:
    """The fastest of `repeats` calls: a floor is what the hardware can do, and a call that
    another process interrupted says nothing about that. On CUDA each call is timed to its
    kernels' end, not their launch."""
    def call() -> None:
        fn()
        synchronize(device)

    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def memory_floor_gbps(device: torch.device, repeats: int = 9) -> float:
    """Read bandwidth: the faster of two reads of a 268 MB fp32 matrix, a matrix-vector
    product and a sum. Each streams the matrix once; which one the CPU's library reads
    faster differs by machine (17 against 39 GB/s on a 2-core EPYC, docs/benchmarks.md)."""
    # A GPU reads 268 MB in tens of microseconds, where the sync after each call would
    # weigh: it reads four times as much.
    mat = torch.randn(32768 if device.type == "cuda" else 8192, 8192, device=device)
    vec = torch.randn(8192, device=device)
    seconds = min(_best_time(lambda: torch.mv(mat, vec), repeats, device),
                  _best_time(mat.sum, repeats, device))
    return mat.numel() * 4 / seconds / 1e9


def matmul_floor_gflops(device: torch.device, dtype: torch.dtype, repeats: int = 15) -> float:
    # A GPU finishes 2048^3 in tens of microseconds, where its launch weighs as much.
    n = 8192 if device.type == "cuda" else 2048
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = _best_time(lambda: a @ b, repeats, device)
    return 2 * n**3 / seconds / 1e9


def _prompts(count: int, length: int, salt: int) -> list[list[int]]:
    return [[(salt * 7919 + i * 104729 + j * 31) % 40000 + 100 for j in range(length)]
            for i in range(count)]


def decode_step_seconds(llm: LLM, batch: int, context: int, steps: int) -> float:
    """Median iteration time once `batch` requests with `context`-token prompts all decode."""
    budget = 2048
    # Early requests decode while later ones still prefill; give them enough tokens
    # to still be running once the whole batch decodes together.
    max_tokens = steps + -(-batch * context // budget) + 2
    kv_bytes = kv_cache_bytes_per_token(llm.engine.model_config, llm.engine.dtype)
    llm.reconfigure(token_budget=budget, max_num_seqs=max(128, batch),
                    kv_cache_memory=int(1.2 * batch * (context + max_tokens + 16) * kv_bytes))
    llm.engine.iterations.clear()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(_prompts(batch, context, batch), params)
    decodes = [r.end - r.start for r in llm.engine.iterations
               if r.num_prefill_tokens == 0 and r.num_seqs == batch]
    assert len(decodes) >= steps // 2, "the batch never decoded together"
    return statistics.median(decodes)


def prefill_tokens_per_second(llm: LLM, chunk: int, prompt_len: int) -> float:
    """A `prompt_len`-token prompt prefilled in chunks of `chunk` tokens (chunking overhead
    included)."""
    llm.reconfigure(token_budget=chunk, kv_cache_memory=None)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rates = []
    for salt in range(3):
        llm.engine.iterations.clear()
        llm.generate(_prompts(1, prompt_len, 1000 + chunk + salt), params)
        records = [r for r in llm.engine.iterations if r.num_prefill_tokens > 0]
        rates.append(sum(r.num_prefill_tokens for r in records)
                     / sum(r.end - r.start for r in records))
    return statistics.median(rates)


def kernel_ab(llm: LLM, override: str, sizes: list[int], rounds: int) -> None:
    """The engine's table against it with one op's choice overridden ("op=impl"), rounds
    interleaved: prefill tokens/s of a 2048-token prompt at each chunk size (a prefill op),
    else the decode step time at 512-token contexts at each batch size."""
    (name, impl), = parse_kernels(override).items()
    executor = llm.engine.executor
    tables = {True: {}, False: {name: impl}}
    default = executor.kernels.rows()
    prefill = name in PREFILL
    what = "prefill, 2048-token prompt in chunks" if prefill else "decode step, 512-token contexts"
    unit = "tok/s" if prefill else "ms/step"
    chosen = next(i for op, i, _ in default if op == name)
    print(f"{what}, {llm.engine.dtype}, {torch.get_num_threads()} threads; {name}: median of "
          f"{rounds} interleaved rounds")
    print(f"| {'chunk' if prefill else 'batch'} | {name}={impl} {unit} | {name}={chosen} {unit} "
          "| speed-up |\n|---|---|---|---|")
    for size in sizes:
        values: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(rounds):
            for on in (False, True):
                executor.use_kernels(tables[on])
                values[on].append(prefill_tokens_per_second(llm, size, 2048) if prefill
                                  else decode_step_seconds(llm, size, 512, steps=8) * 1e3)
        old, new = (statistics.median(values[k]) for k in (False, True))
        print(f"| {size} | {old:.1f} | {new:.1f} | {new / old if prefill else old / new:.2f}x |",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer sizes (a smoke run)")
    parser.add_argument("--dtype", default=None, help="engine dtype (default: the engine's)")
    parser.add_argument("--kernel-ab", default=None, metavar="OP=IMPL",
                        help="decode steps on the engine's kernel table and with this "
                             "choice overridden only")
    # The next three shape the floors' tables (not --kernel-ab's comparison).
    parser.add_argument("--batches", default=None,
                        help="decode batch sizes, comma-separated (default 1,8,32,64; "
                        "--quick 1,8)")
    parser.add_argument("--rounds", type=int, default=DECODE_ROUNDS,
                        help="decode rounds per batch size, each with its own floors")
    parser.add_argument("--no-prefill", action="store_true", help="decode steps only")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    llm = LLM(max_model_len=4096, dtype=args.dtype)
    if args.kernel_ab and args.kernel_ab.partition("=")[0] in PREFILL:
        kernel_ab(llm, args.kernel_ab, [512] if args.quick else [128, 512, 2048],
                  3 if args.quick else 5)
        return
    if args.kernel_ab:
        kernel_ab(llm, args.kernel_ab, [1, 8] if args.quick else [1, 8, 32, 64],
                  3 if args.quick else 5)
        return
    engine = llm.engine
    device, dtype = engine.device, engine.dtype
    numels = engine.executor.model.weight_numels()
    weight_bytes = sum(numels.values()) * dtype.itemsize
    params_non_embedding = sum(n for name, n in numels.items() if "embed" not in name)
    bandwidth = memory_floor_gbps(device)
    matmul = matmul_floor_gflops(device, dtype)
    decode_floor_ms = weight_bytes / (bandwidth * 1e9) * 1000
    # Here, not at the top: engine_ab.py runs this module's decode_step_seconds on other
    # revisions' code, which may lack it.
    from stallfree.executor.hardware import vector_flags

    flags = vector_flags()
    print(f"device {device_name(device)}, dtype {dtype}, threads {torch.get_num_threads()}; "
          f"CPU flags: {flags}; huge pages {engine.info.huge_pages}")
    print(f"weights {weight_bytes / 1e6:.0f} MB; measured read bandwidth {bandwidth:.1f} GB/s "
          f"-> decode floor {decode_floor_ms:.1f} ms/step; matmul {matmul:.0f} GFLOP/s")

    if not args.no_prefill:
        prefill_table(llm, args.quick, params_non_embedding, matmul)
    batches = ([int(b) for b in args.batches.split(",")] if args.batches
               else [1, 8] if args.quick else [1, 8, 32, 64])
    decode_table(llm, batches, args.rounds, weight_bytes, params_non_embedding)


def prefill_table(llm: LLM, quick: bool, params_non_embedding: int, matmul: float) -> None:
    print("\nprefill (2048-token prompt in chunks)")
    print("| chunk | tokens/s | GFLOP/s | % of matmul rate |\n|---|---|---|---|")
    chunks = [64, 512, 2048] if quick else [64, 128, 256, 512, 1024, 2048]
    for chunk in chunks:
        rate = prefill_tokens_per_second(llm, chunk, 2048)
        gflops = rate * 2 * params_non_embedding / 1e9
        print(f"| {chunk} | {rate:.0f} | {gflops:.1f} | {100 * gflops / matmul:.0f}% |")


def decode_table(llm: LLM, batches: list[int], decode_rounds: int, weight_bytes: int,
                 params_non_embedding: int) -> None:
    engine = llm.engine
    device, dtype = engine.device, engine.dtype
    # A step's floors: the bytes it must read (weights and the batch's KV) at the measured
    # bandwidth, and its matmul FLOPs (every weight, LM head included) at the matmul rate.
    kv_bytes = kv_cache_bytes_per_token(engine.model_config, dtype)
    matmul_params = params_non_embedding + (0 if engine.executor.model.lm_head is not None
                                            else engine.model_config.vocab_size
                                            * engine.model_config.hidden_size)
    # Each round measures the floors again just before its steps, and its ratio is taken
    # against them: on a shared machine the read rate swings (41 against 62 GB/s between two
    # runs minutes apart on a 2-core EPYC), and a step must be judged against what the
    # memory gave at that time. The table shows the medians over the rounds.
    # Attention's two products (q.k and p.v over every context token, every query head and
    # layer) are FLOPs a step must do as well. The compute floor once counted the weights'
    # matmuls only; "x matmul floor" keeps that ratio, comparable with earlier results.
    cfg = engine.model_config
    attention_flops_per_token = 4 * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers
    print(f"\ndecode step, 512-token contexts (floor: the larger of memory and compute; "
          f"medians of {decode_rounds} rounds, each with its own floors)")
    print("| batch | ms/step | tokens/s | memory floor ms | compute floor ms | x floor "
          "| x matmul floor | x floor, each round |\n|---|---|---|---|---|---|---|---|")
    for batch in batches:
        rounds = []
        for _ in range(decode_rounds):
            read_gbps = memory_floor_gbps(device, repeats=3)
            gflops = matmul_floor_gflops(device, dtype, repeats=5)
            seconds = decode_step_seconds(llm, batch, 512, steps=16)
            memory_ms = (weight_bytes + batch * 512 * kv_bytes) / (read_gbps * 1e9) * 1e3
            matmul_ms = 2 * matmul_params * batch / (gflops * 1e9) * 1e3
            compute_ms = matmul_ms + batch * 512 * attention_flops_per_token / (gflops * 1e6)
            rounds.append((seconds * 1e3, memory_ms, compute_ms,
                           seconds * 1e3 / max(memory_ms, compute_ms),
                           seconds * 1e3 / max(memory_ms, matmul_ms)))
        ms, memory_ms, compute_ms, ratio, matmul_ratio = (
            statistics.median(r[i] for r in rounds) for i in range(5))
        each = " ".join(f"{r[3]:.2f}" for r in rounds)
        print(f"| {batch} | {ms:.1f} | {batch / ms * 1e3:.0f} | {memory_ms:.1f} | "
              f"{compute_ms:.1f} | {ratio:.2f} | {matmul_ratio:.2f} | {each} |", flush=True)


if __name__ == "__main__":
    main()
