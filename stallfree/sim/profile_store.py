"""Readers of the measured profiles (Vidur's CSV layout) with interpolation between grid points.

Layout under a profile root (default: stallfree/data/profiles, provenance in
its SOURCES.md; `stallfree profile` writes the same layout for this machine):

    <device>/compute/<org>/<model>/mlp.csv     token-level ops by num_tokens x TP
    <device>/compute/attention*.csv            attention by (chunk, cached) / (batch, context)
    <device>/network/<node>/{all_reduce,send_recv}.csv
    <device>/cpu_overheads.csv                 serving-system CPU time by batch size
    <device>/host.json                         wall per CPU second while profiled (CPU only)

Every time is read from the `time_stats.<op>.median` column (milliseconds in
the files) and returned in seconds. Outside a grid, times grow with the work
(tokens, or attention FLOPs / bytes) from the nearest edge and never shrink
below it: small inputs are launch-bound, large ones throughput-bound.
"""
from __future__ import annotations

import bisect
import functools
import glob
import json
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from .profile_csv import read_csv

PROFILE_ROOT = Path(__file__).resolve().parent.parent / "data" / "profiles"
MS = 1e-3
# Attention backends whose decode gathers KV into dense tensors padded to the longest
# context of each call (stallfree/attention_plan.py): a call costs requests x longest.
PADDED_DECODE_BACKENDS = ("stallfree.paged_attention",)

# Token-level ops of one decoder layer in mlp.csv ("emb" is per model, not per layer).
LAYER_OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
             "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")


def _median(row: dict[str, str], op: str) -> float | None:
    value = row.get(f"time_stats.{op}.median")
    return float(value) * MS if value not in (None, "") else None


def interp(xs: list[float], ys: list[float], x: float) -> float:
    """Linear inside [xs[0], xs[-1]]; clamped below; proportional to x above."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1] * x / xs[-1]
    i = bisect.bisect_right(xs, x)
    x0, x1 = xs[i - 1], xs[i]
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - x0) / (x1 - x0)


def _grid(points: dict[float, list[float]]) -> tuple[list[float], list[float]]:
    """Sorted xs and the mean of the (duplicate) measurements at each."""
    xs = sorted(points)
    return xs, [sum(points[x]) / len(points[x]) for x in xs]


# ---- token-level ops ----------------------------------------------------------------------
@dataclass
class MlpProfile:
    """Per-layer op times of one model shape on one device, by TP degree and token count."""

    path: str
    shape: dict[str, int]  # n_head, n_kv_head, n_embd, n_expanded_embd, vocab_size, gated
    ops: dict[int, dict[str, tuple[list[float], list[float]]]]  # tp -> op -> (tokens, s)

    @classmethod
    def load(cls, path: str | os.PathLike) -> MlpProfile:
        rows = read_csv(path)
        shape = {k: int(float(rows[0][k])) for k in ("n_head", "n_kv_head", "n_embd",
                                                    "n_expanded_embd", "vocab_size")}
        shape["gated"] = int(rows[0]["use_gated_mlp"] in ("True", "1", "true"))
        acc: dict[int, dict[str, dict[float, list[float]]]] = defaultdict(
            lambda: defaultdict(lambda: defaultdict(list)))
        for r in rows:
            tp, n = int(r["num_tensor_parallel_workers"]), float(r["num_tokens"])
            for op in (*LAYER_OPS, "emb", "lm_head"):
                t = _median(r, op)
                if t is not None:
                    acc[tp][op][n].append(t)
        ops = {tp: {op: _grid(pts) for op, pts in by_op.items()} for tp, by_op in acc.items()}
        return cls(str(path), shape, ops)

    @property
    def tps(self) -> list[int]:
        return sorted(self.ops)

    def op_time(self, op: str, num_tokens: int, tp: int) -> float | None:
        table = self.ops.get(tp, {}).get(op)
        return None if table is None else interp(*table, num_tokens)


# ---- attention --------------------------------------------------------------------------
@dataclass
class AttentionProfile:
    """Attention kernel time per layer on one rank, for one head shape."""

    path: str
    q_heads: int  # per rank
    kv_heads: int  # per rank
    head_dim: int
    # prefill: chunk -> (cached tokens, s); decode: batch -> (context, s)
    prefill: dict[int, tuple[list[float], list[float]]]
    decode: dict[int, tuple[list[float], list[float]]]
    padded_decode: bool = False  # decode cost by each call's longest context, not the mean
    kv_dtype_bytes: int = 0  # bytes per KV element in the profiled kernel (0: not recorded)

    @classmethod
    def load(cls, path: str | os.PathLike) -> AttentionProfile:
        rows = read_csv(path)
        r0 = rows[0]
        tp = int(r0["num_tensor_parallel_workers"])
        q, kv = int(r0["n_q_head"]) // tp, max(1, int(r0["n_kv_head"]) // tp)
        pre: dict[int, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
        dec: dict[int, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
        for r in rows:
            reshape = (_median(r, "attn_input_reshape") or 0.0) + \
                (_median(r, "attn_output_reshape") or 0.0)
            if r["is_prefill"] in ("True", "1", "true"):
                t = _median(r, "attn_prefill")
                if t is not None:
                    pre[int(r["prefill_chunk_size"])][float(r["kv_cache_size"])].append(t + reshape)
            else:
                t = _median(r, "attn_decode")
                if t is not None:
                    dec[int(r["batch_size"])][float(r["kv_cache_size"])].append(t + reshape)
        return cls(str(path), q, kv, int(r0["n_embd"]) // int(r0["n_q_head"]),
                   {c: _grid(p) for c, p in pre.items()}, {b: _grid(p) for b, p in dec.items()},
                   r0.get("attention_backend") in PADDED_DECODE_BACKENDS,
                   int(r0.get("kv_dtype_bytes") or 0))

    @functools.cached_property
    def _chunks(self) -> list[int]:
        return sorted(self.prefill)

    @functools.cached_property
    def _batches(self) -> list[int]:
        return sorted(self.decode)

    def prefill_time(self, chunk: int, cached: int) -> float:
        """One chunk of `chunk` new tokens after `cached` tokens of the same request."""
        chunks = self._chunks
        c = min(max(chunk, chunks[0]), chunks[-1])
        i = bisect.bisect_left(chunks, c)
        if chunks[i] == c:
            t, kmax = self._prefill_row(c, cached)
        else:  # between two profiled chunk sizes: linear in the chunk size
            c0, c1 = chunks[i - 1], chunks[i]
            t0, k0 = self._prefill_row(c0, cached)
            t1, k1 = self._prefill_row(c1, cached)
            w = (c - c0) / (c1 - c0)
            t, kmax = t0 + w * (t1 - t0), min(k0, k1)
        # Outside the grid: scale by causal attention work, c * (cached + c / 2).
        work = chunk * (cached + chunk / 2)
        ref = c * (min(cached, kmax) + c / 2)
        return t * max(1.0, work / ref)

    def _prefill_row(self, chunk: int, cached: int) -> tuple[float, float]:
        ks, ts = self.prefill[chunk]
        k = min(cached, ks[-1])
        return (ts[0] if k <= ks[0] else interp(ks, ts, k)), ks[-1]

    def decode_time(self, batch: int, context: float) -> float:
        """A decode batch of `batch` requests at `context` tokens (the mean, or the longest
        for a padded backend)."""
        batches = self._batches
        b = min(max(batch, batches[0]), batches[-1])
        i = bisect.bisect_left(batches, b)
        if batches[i] == b:
            t = self._decode_at(b, b, context)
        else:  # between two profiled batch sizes: linear in the batch size
            b0, b1 = batches[i - 1], batches[i]
            t0, t1 = self._decode_at(b0, b, context), self._decode_at(b1, b, context)
            t = t0 + (b - b0) / (b1 - b0) * (t1 - t0)
        return t * max(1.0, batch / b)  # beyond the largest batch: linear in requests

    def _decode_at(self, row: int, batch: int, context: float) -> float:
        """Profiled batch `row` read for `batch` x `context`: at the same context, or for a
        padded kernel at the same gathered tokens (its cache effects follow tokens, not context);
        beyond the row's longest context, linear in tokens."""
        ctx = batch * context / row if self.padded_decode else context
        t, cmax = self._decode_row(row, ctx)
        return t * max(1.0, ctx / cmax)

    def _decode_row(self, batch: int, context: float) -> tuple[float, float]:
        cs, ts = self.decode[batch]
        c = min(context, cs[-1])
        return (ts[0] if c <= cs[0] else interp(cs, ts, c)), cs[-1]


# ---- network and CPU -------------------------------------------------------------------
@dataclass
class NetworkProfile:
    """Collective time by message size (bytes), per (num_workers, devices_per_node)."""

    path: str
    tables: dict[tuple[int, int], tuple[list[float], list[float]]]

    @classmethod
    def load(cls, path: str | os.PathLike) -> NetworkProfile:
        rows = read_csv(path)
        acc: dict[tuple[int, int], dict[float, list[float]]] = defaultdict(
            lambda: defaultdict(list))
        for r in rows:
            t = _median(r, r["collective"])
            if t is not None:
                acc[(int(r["num_workers"]), int(r["devices_per_node"]))][float(r["size"])].append(t)
        return cls(str(path), {k: _grid(v) for k, v in acc.items()})

    def time(self, num_bytes: float, workers: int, per_node: int) -> float | None:
        table = self.tables.get((workers, per_node))
        return None if table is None else interp(*table, num_bytes)


@dataclass
class CpuOverheadProfile:
    """Per-iteration CPU time of the serving system (schedule, prepare, sample, process)."""

    path: str
    tables: dict[tuple[str, int], tuple[list[float], list[float], float]]  # (bs, s, comm s)

    PARTS = ("schedule", "sampler_e2e", "prepare_inputs_e2e", "process_model_outputs")

    @classmethod
    def load(cls, path: str | os.PathLike) -> CpuOverheadProfile:
        acc: dict[tuple[str, int], dict[float, list[float]]] = defaultdict(
            lambda: defaultdict(list))
        comm: dict[tuple[str, int], list[float]] = defaultdict(list)
        for r in read_csv(path):
            key = (r["model_name"], int(r["tensor_parallel_degree"]))
            acc[key][float(r["batch_size"])].append(
                sum(float(r.get(f"{p}_median") or 0.0) for p in cls.PARTS) * MS)
            comm[key].append(float(r.get("ray_comm_time_mean") or 0.0) * MS)
        return cls(str(path), {k: (*_grid(v), sum(comm[k]) / len(comm[k]))
                               for k, v in acc.items()})

    def pick(self, profile_name: str | None, tp: int) -> tuple[str, int]:
        """The profiled (model, TP) closest to ours: same model, else same TP, else any."""
        keys = sorted(self.tables)
        for ok in (lambda k: k == (profile_name, tp), lambda k: k[0] == profile_name,
                   lambda k: k[1] == tp):
            hits = [k for k in keys if ok(k)]
            if hits:
                return hits[0]
        return min(keys, key=lambda k: abs(k[1] - tp))

    def time(self, key: tuple[str, int], batch_size: int, distributed: bool) -> float:
        bs, ts, comm = self.tables[key]
        # Extrapolate linearly in the batch size beyond the grid (per-request work).
        if batch_size > bs[-1]:
            slope = (ts[-1] - ts[0]) / (bs[-1] - bs[0])
            base = ts[-1] + slope * (batch_size - bs[-1])
        else:
            base = interp(bs, ts, batch_size)
        return base + (comm if distributed else 0.0)


# ---- finding files ------------------------------------------------------------------------
@functools.cache
def load_mlp(path: str) -> MlpProfile:
    return MlpProfile.load(path)


@functools.cache
def load_attention(path: str) -> AttentionProfile:
    return AttentionProfile.load(path)


@functools.cache
def load_network(path: str) -> NetworkProfile:
    return NetworkProfile.load(path)


@functools.cache
def load_cpu(path: str) -> CpuOverheadProfile:
    return CpuOverheadProfile.load(path)


def mlp_paths(root: Path, device: str) -> list[str]:
    return sorted(glob.glob(str(root / device / "compute" / "*" / "*" / "mlp.csv")))


def attention_paths(root: Path, device: str) -> list[str]:
    return sorted(glob.glob(str(root / device / "compute" / "attention*.csv")))


def network_path(root: Path, device: str, node: str | None, collective: str) -> str | None:
    if node is None:
        return None
    path = root / device / "network" / node / f"{collective}.csv"
    return str(path) if path.is_file() else None


def cpu_path(root: Path, device: str) -> str | None:
    path = root / device / "cpu_overheads.csv"
    return str(path) if path.is_file() else None


def load_host_slowdown(root: Path, device: str) -> float | None:
    """Wall seconds per CPU second of the profiled host (`stallfree profile` on a CPU)."""
    path = root / device / "host.json"
    return float(json.loads(path.read_text())["wall_per_cpu"]) if path.is_file() else None
