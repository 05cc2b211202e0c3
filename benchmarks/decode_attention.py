"""Decode attention of one engine iteration (all layers): the gather path beside the kernel
that reads the paged cache in place.

Run: .venv/bin/python benchmarks/decode_attention.py [--threads 1 2] [--dtype float32 bfloat16]
     [--flex] [--quick] [--history] [--baseline-rev REV] [--huge-pages-ab] [--tiles-ab]
     [--kv-dtype int8] [--shapes 32x512 8xmixed ...]

Default model's shapes (9 query heads, 3 KV heads x 64, block size 16), a 1 GiB KV cache
of random values (30 layers) with each request's blocks scattered through it; batches of
1/8/32/64 decodes at 512 and 1024 tokens and mixed (a few long requests among short ones,
mean ~270 tokens). Variants, run in turn within every round (interleaved, so a load change
on a shared machine hits them alike):
  gather   the torch path: length groups, calls capped at MAX_CALL_BYTES, each call
           gathering its blocks into a reused buffer, then SDPA (stallfree/attention_plan.py)
  kernel   the C++ kernel (stallfree/model/csrc/paged_decode.cpp): no gather, no padding
  flex     --flex: torch's flex_attention compiled for CPU, the cache as one long K/V with
           a block mask from the block tables (compiled once, dynamic shapes; timing only,
           see flex_variant)
  op       with either option below: the kernel's op called alone (no K/V write, no Python)
  baseline --baseline-rev REV: the op as it was at git revision REV, built beside it
  4k-pages --huge-pages-ab: the op on a copy of the cache advised against huge pages, so
           `op` (advised for them) vs `4k-pages` is what 2 MiB pages buy
  vectors  --tiles-ab: the op with its scores in vectors, not AMX tiles (bf16 caches on a
           CPU with AMX; elsewhere both take the vector path)
  int8     --kv-dtype int8: the op over an int8 cache (stallfree/model/csrc/paged_int8.h)
           holding the same values quantized (same blocks, same tables), beside `op` over
           the float cache: `op / int8` is what reading 1 byte per value (+4 per row)
           instead of the dtype's buys
With --history, the gather path's earlier steps too (fresh: a new gather tensor per call,
one call padded to the longest; buffer: into the reused buffer; groups: + length groups).
Prints median milliseconds per layer: CPU time with one thread (robust to other load),
wall time with more (CPU time would count every thread), and the CPU's vector flags.
"""
from __future__ import annotations

import argparse
import mmap
import random
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch

import stallfree.attention_plan as plan
from stallfree.model.attention import AttentionMetadata, GatherWorkspace, paged_attention
from stallfree.model.kernel_table import choose_kernels, default_kernels
from stallfree.model.kernels import MARCH, unavailable_reason, vector_flags
from stallfree.model.loader import default_model_path, load_model_config

BLOCK = 16
# (decodes, long requests among them, their context): the rest are short (mean ~270 tokens).
MIXED = {1: (1, 1, 700), 8: (8, 1, 1015), 32: (32, 4, 1500), 64: (64, 8, 1500)}
BATCHES = [1, 8, 32, 64]


@contextmanager
def rule(padding_factor: float, call_bytes: int):
    saved = plan.MAX_PADDING_FACTOR, plan.MAX_CALL_BYTES
    plan.MAX_PADDING_FACTOR, plan.MAX_CALL_BYTES = padding_factor, call_bytes
    try:
        yield
    finally:
        plan.MAX_PADDING_FACTOR, plan.MAX_CALL_BYTES = saved


def contexts(batch: int, kind: str, rng: random.Random) -> list[int]:
    if kind != "mixed":
        return [int(kind)] * batch
    n, n_long, long_ctx = MIXED[batch]
    return ([long_ctx - rng.randrange(60) for _ in range(n_long)]
            + [int(rng.expovariate(1 / 250)) + 20 for _ in range(n - n_long)])


class Case:
    """One batch of decodes over every layer of the cache, runnable by each variant."""

    def __init__(self, lens: list[int], cache: torch.Tensor, heads: tuple[int, int, int],
                 rng: random.Random) -> None:
        self.layers, num_blocks = cache.shape[0], cache.shape[2]
        self.cache, self.heads = cache, heads
        hq, hkv, hd = heads
        seqs = [(c - 1, 1, [rng.randrange(num_blocks) for _ in range(-(-c // BLOCK))])
                for c in lens]
        self.meta = AttentionMetadata.build(seqs, BLOCK, "cpu", GatherWorkspace(),
                                            kernels=default_kernels())
        self.torch_meta = AttentionMetadata.build(  # the same batch on the torch path
            seqs, BLOCK, "cpu", GatherWorkspace(),
            kernels=choose_kernels({"decode_attention": "torch"}))
        self.q = torch.randn(len(lens), hq, hd, dtype=cache.dtype)
        self.k = torch.randn(len(lens), hkv, hd, dtype=cache.dtype)

    def torch_path(self, fresh: bool = False) -> None:
        for i in range(self.layers):
            if fresh:  # a new destination per gather, as before the reused buffer
                self.torch_meta.workspace = GatherWorkspace()
            paged_attention(self.q, self.k, self.k, self.cache[i], self.torch_meta,
                            self.heads[2] ** -0.5)

    def kernel(self) -> None:
        for i in range(self.layers):
            paged_attention(self.q, self.k, self.k, self.cache[i], self.meta,
                            self.heads[2] ** -0.5)

    def op(self, namespace: str = "stallfree", cache: torch.Tensor | None = None,
           tiles: bool = True) -> None:
        """The kernel's op alone, reading the cache (no new K/V written, no Python around
        it): how --baseline-rev, --huge-pages-ab and --tiles-ab compare like with like."""
        cache = self.cache if cache is None else cache
        fn = getattr(torch.ops, namespace).paged_decode
        tables, lens = self.meta.decode_block_tables, self.meta.decode_context_lens
        # Older revisions (a baseline) had no `tiles` argument.
        extra = (tiles,) if "tiles" in str(fn.default._schema) else ()
        for i in range(self.layers):
            fn(self.q, cache[i], tables, lens, self.heads[2] ** -0.5, -1, *extra)


def build_baseline(rev: str) -> None:
    """Builds the kernel as it was at git revision `rev` (its source and the headers beside
    it) as op namespace stallfree_baseline."""
    from torch.utils.cpp_extension import load

    from stallfree.model.kernels import CFLAGS

    folder = Path(tempfile.mkdtemp())
    listed = subprocess.run(["git", "ls-tree", "--full-tree", "--name-only", rev,
                             "stallfree/model/csrc/"],
                            capture_output=True, text=True, cwd=Path(__file__).parent)
    headers = [Path(line).name for line in listed.stdout.split() if line.endswith(".h")]
    for name in ["paged_decode.cpp", *headers]:
        shown = subprocess.run(["git", "show", f"{rev}:stallfree/model/csrc/{name}"],
                               capture_output=True, text=True, cwd=Path(__file__).parent)
        if shown.returncode == 0:
            text = shown.stdout.replace("TORCH_LIBRARY(stallfree,", "TORCH_LIBRARY("
                                        "stallfree_baseline,")
            text = text.replace("TORCH_LIBRARY_IMPL(stallfree,",
                                "TORCH_LIBRARY_IMPL(stallfree_baseline,")
            (folder / name).write_text(text)
        elif name.endswith(".cpp"):
            raise SystemExit(f"git show {rev}: {shown.stderr.strip()}")
    load(name="paged_decode_baseline", sources=[str(folder / "paged_decode.cpp")],
         extra_cflags=list(CFLAGS), extra_ldflags=["-fopenmp"], is_python_module=False)


def cache_in_pages(shape: tuple[int, ...], dtype: torch.dtype, huge: bool) -> torch.Tensor:
    """Random cache values in anonymous memory advised for (or against) 2 MiB pages."""
    return _pages(shape, dtype, huge).normal_()


def _pages(shape: tuple[int, ...], dtype: torch.dtype, huge: bool) -> torch.Tensor:
    nbytes = dtype.itemsize * int(torch.Size(shape).numel())
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(buf, dtype=dtype).view(shape)  # keeps buf alive


def int8_cache(cache: torch.Tensor) -> torch.Tensor:
    """`cache`'s values as an int8 cache (rows of head_dim int8 values q, then their float32
    scale s = max|x| / 127; x ~ s * q), in 2 MiB pages, a layer at a time."""
    out = _pages((*cache.shape[:-1], cache.shape[-1] + 4), torch.int8, huge=True)
    for layer, rows in zip(out, cache):
        x = rows.float()
        s = x.abs().amax(-1, keepdim=True) / 127
        layer[..., :-4] = torch.where(s > 0, x / s, 0.0).round_().clamp_(-127, 127)
        layer[..., -4:] = s.view(torch.int8)
    return out


def flex_variant(case: Case) -> Callable[[], None]:
    """flex_attention over the cache seen as one sequence of num_blocks * BLOCK keys; each
    request (a batch entry) attends its table's blocks.

    Timing only: every block counts as full (up to 15 keys too many per request), since
    Inductor's CPU flex template fails to compile a mask_mod that reads a per-request
    tensor (the context), and with no full blocks at all (torch 2.13).
    """
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    compiled = flex_variant.__dict__.setdefault(
        "fn", torch.compile(flex_attention, dynamic=True))
    layers, _, nb, bs, hkv, hd = case.cache.shape
    tables, lens = case.meta.decode_block_tables, case.meta.decode_context_lens
    b = tables.shape[0]
    kv_idx = torch.zeros(b, 1, 1, nb, dtype=torch.int32)
    kv_idx[:, 0, 0, :tables.shape[1]] = tables.to(torch.int32)
    full = (-(-lens // bs)).to(torch.int32)[:, None, None]
    mask = BlockMask.from_kv_blocks(torch.zeros_like(full), torch.zeros_like(kv_idx), full,
                                    kv_idx, BLOCK_SIZE=(1, bs), mask_mod=None,
                                    seq_lengths=(1, nb * bs))
    q = case.q[:, :, None]

    def run() -> None:
        for i in range(layers):
            k, v = (case.cache[i, j].reshape(1, nb * bs, hkv, hd).transpose(1, 2)
                    .expand(b, -1, -1, -1) for j in range(2))
            compiled(q, k, v, block_mask=mask, enable_gqa=True, scale=hd ** -0.5)

    return run


def measure(variants: dict[str, Callable[[], None]], rounds: int, threads: int
            ) -> dict[str, float]:
    """Median seconds of each variant, run in turn within every round."""
    clock = time.process_time if threads == 1 else time.perf_counter
    for fn in variants.values():
        fn()  # warm-up: grows buffers, compiles
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            start = clock()
            fn()
            times[name].append(clock() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--flex", action="store_true", help="flex_attention compiled for CPU too")
    ap.add_argument("--history", action="store_true", help="the gather path's earlier steps")
    ap.add_argument("--quick", action="store_true", help="two batches, three rounds")
    ap.add_argument("--baseline-rev", metavar="REV",
                    help="a git revision whose kernel is timed beside this one")
    ap.add_argument("--huge-pages-ab", action="store_true",
                    help="the kernel on a cache in 4 KiB pages too")
    ap.add_argument("--tiles-ab", action="store_true",
                    help="the kernel with its scores in vectors too (not AMX tiles)")
    ap.add_argument("--kv-dtype", nargs="+", choices=["auto", "int8"], default=["auto"],
                    help="int8: the op over an int8 cache too (auto: the dtype's cache only)")
    ap.add_argument("--shapes", nargs="+", metavar="BxCONTEXT",
                    help="batches to time, e.g. 32x512 8xmixed (default: all, or --quick's)")
    args = ap.parse_args()
    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"the kernel is not available: {reason}")
    if args.baseline_rev:
        build_baseline(args.baseline_rev)
    cfg = load_model_config(default_model_path())
    heads = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    layers, rounds = cfg.num_hidden_layers, 3 if args.quick else 7
    shapes = [(b, kind) for b in BATCHES for kind in ("512", "1024", "mixed")]
    if args.quick:
        shapes = [(8, "mixed"), (32, "512")]
    if args.shapes:
        shapes = [(int(b), kind) for b, kind in (x.split("x", 1) for x in args.shapes)]
    int8 = "int8" in args.kv_dtype
    print(f"CPU flags: {vector_flags()}  (kernels: -march={MARCH})")
    # Each as (its time / the time of what it is compared with): > 1 means the latter is faster.
    versus = {"gather": "kernel", "flex": "kernel", "baseline": "op", "4k-pages": "op",
              "vectors": "op"}
    others = ((["op"] if args.baseline_rev or args.huge_pages_ab or args.tiles_ab or int8
               else [])
              + (["baseline"] if args.baseline_rev else [])
              + (["4k-pages"] if args.huge_pages_ab else [])
              + (["vectors"] if args.tiles_ab else []) + (["flex"] if args.flex else [])
              + (["int8"] if int8 else []))
    # (numerator, denominator) of each ratio column.
    ratios = [(n, versus[n]) for n in ["gather", *others] if n in versus]
    ratios += [("op", "int8")] if int8 else []
    for dtype in map(lambda name: getattr(torch, name), args.dtype):
        per_block = 2 * layers * BLOCK * heads[1] * heads[2] * dtype.itemsize
        # Random values, so that pages are real (zeros would all be one); in 2 MiB pages, as
        # the engine's cache is where THP allows (stallfree/huge_pages.py).
        shape = (layers, 2, (1 << 30) // per_block, BLOCK, heads[1], heads[2])
        cache = cache_in_pages(shape, dtype, huge=True)
        small_pages = cache_in_pages(shape, dtype, huge=False) if args.huge_pages_ab else None
        quantized = int8_cache(cache) if int8 else None
        for threads in args.threads:
            torch.set_num_threads(threads)
            rng = random.Random(0)
            print(f"\n{layers} layers, {heads[0]} query / {heads[1]} KV heads x {heads[2]}, "
                  f"{dtype}, {threads} thread(s): median ms per layer ({rounds} rounds, "
                  f"{'CPU' if threads == 1 else 'wall'} time)")
            names = (["fresh", "buffer", "groups"] if args.history else []) + ["gather",
                                                                              "kernel"]
            names += others
            print("| decodes | contexts | mean | " + " | ".join(names) + " |"
                  + "".join(f" {a} / {b} |" for a, b in ratios))
            print("|---" * (3 + len(names) + len(ratios)) + "|")
            for batch, kind in shapes:
                lens = contexts(batch, kind, rng)
                case = Case(lens, cache, heads, rng)
                variants: dict[str, Callable[[], None]] = {}
                if args.history:
                    for name, factor, cap, fresh in (("fresh", 1e9, 1 << 62, True),
                                                     ("buffer", 1e9, 1 << 62, False),
                                                     ("groups", 2, 1 << 62, False)):
                        variants[name] = partial(_with_rule, factor, cap,
                                                 partial(case.torch_path, fresh))
                variants["gather"] = case.torch_path
                variants["kernel"] = case.kernel
                if "op" in others:
                    variants["op"] = case.op
                if args.baseline_rev:
                    variants["baseline"] = partial(case.op, "stallfree_baseline")
                if small_pages is not None:
                    variants["4k-pages"] = partial(case.op, cache=small_pages)
                if args.tiles_ab:
                    variants["vectors"] = partial(case.op, tiles=False)
                if args.flex:
                    variants["flex"] = flex_variant(case)
                if quantized is not None:
                    variants["int8"] = partial(case.op, cache=quantized)
                ms = {k: v * 1e3 / layers for k, v in measure(variants, rounds,
                                                               threads).items()}
                print(f"| {batch} | {kind} | {sum(lens) / len(lens):.0f} | "
                      + " | ".join(f"{ms[n]:.3f}" for n in names)
                      + "".join(f" | {ms[a] / ms[b]:.2f}x" for a, b in ratios)
                      + " |", flush=True)
        del cache, small_pages, quantized


def _with_rule(factor: float, cap: int, fn: Callable[[], None]) -> None:
    with rule(factor, cap):
        fn()


if __name__ == "__main__":
    main()
