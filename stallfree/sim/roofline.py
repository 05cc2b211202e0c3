"""Roofline op times for shapes or devices without a profile, with efficiencies fitted to profiles.

An op takes max(FLOPs / (peak * e_compute), bytes / (bandwidth * e_memory))
plus a launch latency. The three constants are fitted per device to the
measured profiles of that device (or A100's when it has none): e_compute from
large-batch GEMMs, e_memory from small-batch GEMMs, the latency from the
smallest measured times. Attention gets its own pair from the attention
profile (prefill is FLOP-bound, decode reads the KV cache).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from .hardware import GpuSpec, ModelSpec
from .profile_store import AttentionProfile, MlpProfile

DTYPE_BYTES = 2


def layer_ops(model: ModelSpec, tp: int, tokens: int) -> dict[str, tuple[float, float]]:
    """(FLOPs, bytes) of each token-level op of one layer on one rank (mlp.csv's op names).

    An MoE layer's MLP ops (TP shards every expert, as vLLM's Mixtral does) run on the
    T x k (token, expert) rows but read only the experts those rows hit, and a router
    (replicated on every rank) scores the E experts of each token.
    """
    h, hd, t = model.hidden_size, model.head_dim, tokens
    q, kv = model.num_heads // tp, model.kv_heads_per_rank(tp)
    inter = model.mlp_intermediate_size // tp
    up = inter * (2 if model.gated_mlp else 1)
    # Rows through the MLP and weight matrices it reads: for dense, T and one.
    rows, mats = (t * model.experts_per_token, model.experts_read(t)) if model.is_moe \
        else (t, 1.0)

    def gemm(k: int, n: int, rows: float = t, mats: float = 1.0) -> tuple[float, float]:
        return 2.0 * rows * k * n, DTYPE_BYTES * (mats * k * n + rows * k + rows * n)

    def elementwise(width: int, passes: int = 2, rows: float = t) -> tuple[float, float]:
        return float(rows * width), float(DTYPE_BYTES * rows * width * passes)

    ops = {
        "input_layernorm": elementwise(h), "post_attention_layernorm": elementwise(h),
        "attn_pre_proj": gemm(h, (q + 2 * kv) * hd), "attn_rope": elementwise((q + kv) * hd),
        "attn_post_proj": gemm(q * hd, h), "mlp_up_proj": gemm(h, up, rows, mats),
        "mlp_act": elementwise(up, 3 if model.gated_mlp else 2, rows),
        "mlp_down_proj": gemm(inter, h, rows, mats), "add": elementwise(h, 3),
    }
    if model.is_moe:
        ops["mlp_router"] = gemm(h, model.num_experts)
    return ops


@dataclass
class Efficiency:
    compute: float = 0.7
    memory: float = 0.7
    latency: float = 5e-6  # seconds per op (launch)

    def time(self, gpu: GpuSpec, flops: float, num_bytes: float) -> float:
        return max(flops / (gpu.peak_flops * self.compute),
                   num_bytes / (gpu.mem_bandwidth * self.memory)) + self.latency


def _shape_model(p: MlpProfile) -> ModelSpec:
    s = p.shape
    return ModelSpec("profiled", 1, s["n_embd"], s["n_expanded_embd"], s["n_head"],
                     s["n_kv_head"], s["n_embd"] // s["n_head"], s["vocab_size"],
                     gated_mlp=bool(s["gated"]))


def fit_linear(gpu: GpuSpec, profiles: list[MlpProfile]) -> Efficiency:
    """Efficiencies of GEMMs on `gpu` from its measured mlp profiles (medians over points)."""
    comp: list[float] = []
    mem: list[float] = []
    small: list[float] = []
    for p in profiles:
        shape = _shape_model(p)
        for tp in p.tps:
            for tokens in (1, 8, 2048, 4096):
                ops = layer_ops(shape, tp, tokens)
                for op in ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj"):
                    t = p.op_time(op, tokens, tp)
                    if not t:
                        continue
                    flops, nbytes = ops[op]
                    if tokens >= 2048:
                        comp.append(flops / gpu.peak_flops / t)
                    else:
                        mem.append(nbytes / gpu.mem_bandwidth / t)
                for op in ("input_layernorm", "add", "attn_rope"):
                    if tokens == 1 and (t := p.op_time(op, 1, tp)):
                        small.append(t)
    if not comp or not mem:
        return Efficiency()
    return Efficiency(min(1.0, statistics.median(comp)), min(1.0, statistics.median(mem)),
                      statistics.median(small) if small else 5e-6)


def attention_flops_bytes(model: ModelSpec, tp: int, chunk: int, cached: int,
                          decode_tokens: float = 0.0) -> tuple[float, float, float]:
    """(prefill FLOPs of one chunk, its KV bytes, decode KV bytes of `decode_tokens` contexts)."""
    q, kv, hd = model.num_heads // tp, model.kv_heads_per_rank(tp), model.head_dim
    flops = 4.0 * q * hd * chunk * (cached + chunk / 2)  # QK^T and PV, causal
    kv_bytes = 2.0 * kv * hd * DTYPE_BYTES * (cached + chunk)
    return flops, kv_bytes, 2.0 * kv * hd * DTYPE_BYTES * decode_tokens


def fit_attention(gpu: GpuSpec, p: AttentionProfile) -> Efficiency:
    """Prefill FLOP efficiency and decode bandwidth efficiency from an attention profile."""
    shape = ModelSpec("profiled", 1, p.q_heads * p.head_dim, 1, p.q_heads, p.kv_heads,
                      p.head_dim, 1)
    comp = []
    for chunk, cached in ((1024, 0), (1024, 1024), (2048, 0), (2048, 2048), (4096, 0)):
        flops = attention_flops_bytes(shape, 1, chunk, cached)[0]
        comp.append(flops / gpu.peak_flops / p.prefill_time(chunk, cached))
    mem = []
    for batch, ctx in ((64, 2048), (128, 2048), (128, 4032)):
        nbytes = attention_flops_bytes(shape, 1, 0, 0, batch * ctx)[2]
        mem.append(nbytes / gpu.mem_bandwidth / p.decode_time(batch, ctx))
    return Efficiency(statistics.median(comp), statistics.median(mem),
                      p.decode_time(1, 32))


def allreduce_time(gpu: GpuSpec, num_bytes: float, workers: int) -> float:
    """Ring all-reduce: 2 (n - 1) / n of the message over each link, plus a latency."""
    return 2.0 * (workers - 1) / workers * num_bytes / gpu.link_bandwidth + 10e-6
