"""Predicted time of one scheduler iteration, from measured profiles or a roofline.

One iteration on a TP x PP replica costs
- `cpu`: the serving system's serial host work (schedule, prepare inputs,
  sample, process outputs, worker messaging), by batch size;
- `stage`: one pipeline stage on the device: its share of the layers, each
  the sum of its token-level ops (by total tokens), its attention (each
  prefill chunk by size and cached tokens, the decodes by count and mean
  context, or group by group for a kernel that pads to each group's longest) and its TP
  all-reduces (by message size), plus embedding and LM head;
- `send`: activations to the next stage (PP > 1 only).
A profiled CPU's CPU-second times are scaled by its host slowdown (wall per CPU second).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..attention_plan import padded_groups, split_chunks
from ..scheduler.output import SchedulerOutput
from . import profile_store as P
from .hardware import GPUS, GpuSpec, ModelSpec
from .roofline import (
    DTYPE_BYTES,
    Efficiency,
    allreduce_time,
    attention_flops_bytes,
    fit_attention,
    fit_linear,
    layer_ops,
)


@dataclass(frozen=True)
class BatchShape:
    """All an iteration's cost depends on: its prefill chunks and its decodes."""

    prefills: tuple[tuple[int, int], ...] = ()  # (new tokens, tokens cached before)
    num_decodes: int = 0
    decode_context_sum: int = 0  # cached tokens the decodes attend to, summed
    num_sampled: int = 0
    # Each decode's context. A kernel that pads KV to the longest of each length group
    # (this engine's CPU attention, stallfree/attention_plan.py) costs by those groups,
    # not by the sum. Empty: every decode at the mean.
    decode_contexts: tuple[int, ...] = ()

    @property
    def decode_context_mean(self) -> float:
        return self.decode_context_sum / self.num_decodes if self.num_decodes else 0.0

    @property
    def num_tokens(self) -> int:
        return sum(c for c, _ in self.prefills) + self.num_decodes

    @property
    def num_seqs(self) -> int:
        return len(self.prefills) + self.num_decodes

    @classmethod
    def of(cls, prefills: tuple[tuple[int, int], ...], decode_contexts: tuple[int, ...],
           num_sampled: int) -> BatchShape:
        """From (new tokens, cached) per prefill chunk and each decode's context."""
        return cls(tuple(prefills), len(decode_contexts), sum(decode_contexts), num_sampled,
                   tuple(decode_contexts))

    @classmethod
    def from_output(cls, out: SchedulerOutput) -> BatchShape:
        """As the engine's kernel runs the batch: every one-token chunk attends as a decode."""
        return cls.of(*split_chunks((c.start, c.num_tokens) for c in out.chunks),
                      sum(c.samples for c in out.chunks))

    @classmethod
    def decode(cls, batch: int, context: int) -> BatchShape:
        return cls((), batch, batch * context, batch, (context,) * batch)

    @classmethod
    def prefill(cls, chunk: int, cached: int = 0, samples: bool = True) -> BatchShape:
        return cls(((chunk, cached),), 0, 0, int(samples))


@dataclass(frozen=True)
class IterationCost:
    cpu: float  # serial host time per iteration
    stage: float  # device time of one pipeline stage
    send: float = 0.0  # stage-to-stage transfer

    def total(self, pp: int = 1) -> float:
        """Latency of one iteration through every stage (no other micro-batch in flight)."""
        return self.cpu + pp * self.stage + (pp - 1) * self.send


class CostModel(Protocol):
    pp: int

    def iteration(self, batch: BatchShape) -> IterationCost: ...

    def describe(self) -> dict[str, Any]: ...


@dataclass
class ConstantCostModel:
    """Stage time = base + per_token * tokens + per_seq * requests; for tests and what-ifs."""

    base: float = 0.01
    per_token: float = 0.0
    per_seq: float = 0.0
    cpu: float = 0.0
    send: float = 0.0
    pp: int = 1

    def iteration(self, batch: BatchShape) -> IterationCost:
        stage = self.base + self.per_token * batch.num_tokens + self.per_seq * batch.num_seqs
        return IterationCost(self.cpu, stage, self.send if self.pp > 1 else 0.0)

    def describe(self) -> dict[str, Any]:
        return {"kind": "constant", "base_s": self.base, "per_token_s": self.per_token,
                "per_seq_s": self.per_seq, "cpu_s": self.cpu}


def _weights(model: ModelSpec, tp: int) -> dict[str, float]:
    """Per-rank size of what each op streams: its weights (GEMMs) or its width (elementwise)."""
    return {op: nbytes for op, (_, nbytes) in layer_ops(model, tp, 0).items()} | {
        op: flops for op, (flops, _) in layer_ops(model, tp, 1).items()
        if op in ("input_layernorm", "post_attention_layernorm", "attn_rope", "mlp_act", "add")}


@dataclass
class ProfiledCostModel:
    """Measured profiles where they exist, scaled proxies where close, a roofline otherwise."""

    model: ModelSpec
    gpu: GpuSpec
    tp: int = 1
    pp: int = 1
    node: str | None = None  # network profile folder; default: the GPU's
    root: Path = P.PROFILE_ROOT
    linear: str = "auto"  # auto | roofline
    attention: str = "auto"  # auto | roofline
    extra_cpu: tuple[float, float] = (0.0, 0.0)  # calibration: + a + b * requests per iteration
    slowdown: float | None = None  # wall per CPU second; None: the profile's host.json, else 1
    block_size: int = 16  # KV block size: padded decode kernels gather whole blocks
    sources: dict[str, str] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if self.model.num_heads % self.tp:
            raise ValueError(f"TP{self.tp} does not divide {self.model.name}'s "
                             f"{self.model.num_heads} attention heads")
        if self.node is None:
            self.node = self.gpu.default_node
        self.layers_per_stage = math.ceil(self.model.num_layers / self.pp)
        self._linear_cache: dict[int, float] = {}
        self._setup_linear()
        self._setup_attention()
        self._setup_network()
        # Host overheads are the serving system's, not the GPU's: A100's file serves every
        # GPU; a measured device (this CPU) must bring its own.
        cpu = P.cpu_path(self.root, self.gpu.name) or (
            P.cpu_path(P.PROFILE_ROOT, "a100") if self.gpu.name in GPUS else None)
        self._cpu = P.load_cpu(cpu) if cpu else None
        if self._cpu:
            self._cpu_key = self._cpu.pick(self.model.profile_name, self.tp)
            self.sources["cpu"] = f"{cpu} {self._cpu_key}"
        else:
            self.sources["cpu"] = "none (0 s)"
        if self.slowdown is None:
            self.slowdown = P.load_host_slowdown(self.root, self.gpu.name) or 1.0
        self.sources["host"] = f"x{self.slowdown:.3g} wall per CPU second"

    # ---- token-level ops -----------------------------------------------------------------
    def _setup_linear(self) -> None:
        device = self.gpu.name
        paths = P.mlp_paths(self.root, device)
        profs = [P.load_mlp(p) for p in paths]
        fit_on = profs or [P.load_mlp(p) for p in P.mlp_paths(self.root, "a100")]
        self._linear_eff = fit_linear(self.gpu if profs else GPUS["a100"], fit_on) \
            if fit_on else Efficiency()
        self._mlp: P.MlpProfile | None = None
        self._ratio: dict[str, float] = {}
        # The profiles are of dense MLPs: an MoE layer reads a batch-dependent number of
        # experts (ModelSpec.experts_read), which no weight-size ratio of theirs follows.
        if self.linear == "auto" and not self.model.is_moe:
            best = None
            for prof in profs:
                if self.tp not in prof.tps:
                    continue
                proxy = _shape_as_model(prof)
                ratio = {op: w / _weights(proxy, self.tp)[op]
                         for op, w in _weights(self.model, self.tp).items()}
                spread = max(max(r, 1 / r) for r in ratio.values())
                if spread <= 2.0 and (best is None or spread < best[0]):
                    best = (spread, prof, ratio)
            if best is not None:
                _, self._mlp, self._ratio = best
                exact = all(abs(r - 1) < 1e-9 for r in self._ratio.values())
                how = "exact shape" if exact else "proxy scaled by weight size"
                self.sources["linear"] = f"{self._mlp.path} ({how})"
        if self._mlp is None:
            moe = " (MoE: no expert profile)" if self.model.is_moe else ""
            self.sources["linear"] = f"roofline {self._linear_eff}{moe}"

    def _linear_layer(self, tokens: int) -> float:
        t = self._linear_cache.get(tokens)
        if t is None:
            if self._mlp is not None:
                t = sum((self._mlp.op_time(op, tokens, self.tp) or 0.0) * r
                        for op, r in self._ratio.items())
            else:
                t = sum(self._linear_eff.time(self.gpu, f, b)
                        for f, b in layer_ops(self.model, self.tp, tokens).values())
            self._linear_cache[tokens] = t
        return t

    def _ends(self, tokens: int, sampled: int) -> float:
        """Embedding lookup and the LM head over the sampled rows."""
        h, v = self.model.hidden_size, self.model.vocab_size // self.tp
        emb = lm = None
        if self._mlp is not None:
            emb = self._mlp.op_time("emb", tokens, self.tp)
            lm = self._mlp.op_time("lm_head", sampled, self.tp) if sampled else 0.0
        if emb is None:
            emb = self._linear_eff.time(self.gpu, 0.0, DTYPE_BYTES * tokens * h * 2)
        if lm is None and sampled:
            lm = self._linear_eff.time(self.gpu, 2.0 * sampled * h * v,
                                       DTYPE_BYTES * (h * v + sampled * (h + v)))
        return emb + (lm or 0.0)

    # ---- attention -------------------------------------------------------------------------
    def _setup_attention(self) -> None:
        m, tp = self.model, self.tp
        self._attn: P.AttentionProfile | None = None
        paths = P.attention_paths(self.root, self.gpu.name)
        if self.attention == "auto" and paths:
            profs = [P.load_attention(p) for p in paths]
            self._attn = min(profs, key=lambda a: (a.head_dim != m.head_dim,
                                                   abs(a.q_heads - m.num_heads // tp)))
            a = self._attn
            self._q_ratio = (m.num_heads // tp) * m.head_dim / (a.q_heads * a.head_dim)
            self._kv_ratio = m.kv_heads_per_rank(tp) * m.head_dim / (a.kv_heads * a.head_dim)
            # One layer's K+V per token as the profiled kernel stored it (0: unknown).
            self._kv_call_bytes = 2 * m.kv_heads_per_rank(tp) * m.head_dim * a.kv_dtype_bytes
            self.sources["attention"] = (f"{a.path} (prefill x{self._q_ratio:.3g}, "
                                         f"decode x{self._kv_ratio:.3g} for head counts)")
            return
        ref = P.attention_paths(self.root, "a100")
        self._attn_eff = fit_attention(GPUS["a100"], P.load_attention(ref[0])) if ref \
            else Efficiency(0.5, 0.5, 1e-5)
        self.sources["attention"] = f"roofline {self._attn_eff}"

    def _attention(self, b: BatchShape) -> float:
        m, tp = self.model, self.tp
        if self._attn is not None:
            t = sum(self._attn.prefill_time(c, k) for c, k in b.prefills) * self._q_ratio
            if b.num_decodes:
                calls = [(b.num_decodes, b.decode_context_mean)]
                if self._attn.padded_decode and b.decode_contexts:
                    calls = padded_groups(list(b.decode_contexts), self.block_size,
                                          self._kv_call_bytes)
                t += sum(self._attn.decode_time(n, ctx) for n, ctx in calls) * self._kv_ratio
            return t
        eff, t = self._attn_eff, 0.0
        for c, k in b.prefills:
            flops, nbytes, _ = attention_flops_bytes(m, tp, c, k)
            t += eff.time(self.gpu, flops, nbytes)
        if b.num_decodes:
            nbytes = attention_flops_bytes(m, tp, 0, 0, b.decode_context_sum)[2]
            t += eff.time(self.gpu, 0.0, nbytes)
        return t

    # ---- communication ------------------------------------------------------------------
    def _setup_network(self) -> None:
        ar = P.network_path(self.root, self.gpu.name, self.node, "all_reduce")
        sr = P.network_path(self.root, self.gpu.name, self.node, "send_recv")
        self._ar = P.load_network(ar) if ar else None
        self._sr = P.load_network(sr) if sr else None
        # Stages on different nodes when the replica outgrows one node (the paper's Falcon).
        per_node = 4 if self.node and "pairwise" in self.node else 8
        self._cross_node = self.tp * self.pp > per_node
        self.sources["network"] = f"{ar or 'roofline all-reduce'}; {sr or 'roofline send'}"

    def _allreduce(self, tokens: int) -> float:
        if self.tp == 1:
            return 0.0
        nbytes = tokens * self.model.hidden_size * DTYPE_BYTES
        t = self._ar.time(nbytes, self.tp, self.tp) if self._ar else None
        return allreduce_time(self.gpu, nbytes, self.tp) if t is None else t

    def _send(self, tokens: int) -> float:
        if self.pp == 1:
            return 0.0
        nbytes = tokens * self.model.hidden_size * DTYPE_BYTES
        t = self._sr.time(nbytes, 2, 1 if self._cross_node else 2) if self._sr else None
        return nbytes / self.gpu.link_bandwidth + 10e-6 if t is None else t

    # ---- the iteration --------------------------------------------------------------------
    def iteration(self, b: BatchShape) -> IterationCost:
        tokens = b.num_tokens
        layer = self._linear_layer(tokens) + self._attention(b) \
            + self.model.allreduces_per_layer * self._allreduce(tokens)
        stage = self.layers_per_stage * layer + self._ends(tokens, b.num_sampled)
        cpu = self.extra_cpu[0] + self.extra_cpu[1] * b.num_seqs
        if self._cpu is not None:
            cpu += self._cpu.time(self._cpu_key, b.num_seqs, self.tp * self.pp > 1)
        # A measured CPU's host time is its steps less its ops (stallfree/profiler/run.py):
        # negative where the engine runs its layers for less than the ops timed one by one.
        # That corrects the stage (a stage's share of it: it was measured on the whole
        # model), never a time of its own, and never below nothing.
        share = self.layers_per_stage / self.model.num_layers
        stage, cpu = max(stage + min(cpu, 0.0) * share, 0.0), max(cpu, 0.0)
        k = self.slowdown
        return IterationCost(cpu * k, stage * k, self._send(tokens))

    def describe(self) -> dict[str, Any]:
        return {"kind": "profiled", "model": self.model.name, "gpu": self.gpu.name,
                "tp": self.tp, "pp": self.pp, "node": self.node,
                "extra_cpu_s": list(self.extra_cpu), "slowdown": self.slowdown,
                "sources": dict(self.sources)}


def _shape_as_model(p: P.MlpProfile) -> ModelSpec:
    s = p.shape
    return ModelSpec("profile", 1, s["n_embd"], s["n_expanded_embd"], s["n_head"], s["n_kv_head"],
                     s["n_embd"] // s["n_head"], s["vocab_size"], gated_mlp=bool(s["gated"]))
