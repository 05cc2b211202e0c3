"""One decoder layer, as ModelConfig describes it: attention (fused q/k/v, optional per-head
q/k norms, a sliding window, soft-capped scores), a gated MLP or a mixture of experts, and
RMSNorms before each (Gemma adds norms on both outputs)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .attention import AttentionMetadata, paged_attention
from .config import ModelConfig
from .kernel_table import KernelTable
from .layer_steps import Op, Step, layer_steps
from .layers import RMSNorm, SwiGLUMLP, apply_rope, rope_and_cache
from .linear import Linear
from .moe import ACTIVATIONS, SparseMoE
from .parallel import Shard


def local_heads(config: ModelConfig, shard: Shard) -> tuple[int, int]:
    """(query heads, KV heads) on this rank: whole GQA groups, so no KV head is shared."""
    lo, hi = shard.tp_range(config.num_key_value_heads)
    group = config.num_attention_heads // config.num_key_value_heads
    return (hi - lo) * group, hi - lo


class Attention(nn.Module):
    kernels: KernelTable | None = None  # the model's; set by CausalLM.prepack

    def __init__(self, config: ModelConfig, shard: Shard) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = local_heads(config, shard)
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = config.attention_scale or self.head_dim ** -0.5
        # q, k, v fused into one matmul: rows are [q | k | v].
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                               bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def attend(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               meta: AttentionMetadata, kv_cache: torch.Tensor, window: int | None,
               softcap: float | None) -> torch.Tensor:
        """RoPE on q and k of qkv [T, (Hq + 2 Hkv) D], k and v into the cache; the
        attention output [T, Hq D] (layer_steps.Op.ATTEND)."""
        t = qkv.shape[0]
        cached = rope_and_cache(qkv, cos, sin, kv_cache, meta.slot_mapping, self.num_heads,
                                self.num_kv_heads, self.kernels)
        qk = qkv[:, :self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads,
                                                       self.head_dim)
        if not cached:  # the torch path: q and k heads rotated together, in one pass
            qk = apply_rope(qk, cos, sin)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale, cached, window=window,
                              softcap=softcap)
        return out.reshape(t, self.q_size)

    def norm_heads(self, qkv: torch.Tensor) -> None:
        """RMSNorm over each q and each k head of qkv, in place (before RoPE)."""
        t, d, q_end = qkv.shape[0], self.head_dim, self.q_size + self.kv_size
        for norm, lo, hi in ((self.q_norm, 0, self.q_size), (self.k_norm, self.q_size, q_end)):
            heads = qkv[:, lo:hi].reshape(-1, d)
            qkv[:, lo:hi] = norm(heads.contiguous()).view(t, hi - lo)


class GeGLUMLP(nn.Module):
    """Gemma's MLP weights, no forward of its own: gate_up is packed as a plain matrix (the
    fused kernels apply SiLU), and its Op.GATED step applies gelu_tanh(gate) * up."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)


def build_mlp(config: ModelConfig, shard: Shard, layer: int) -> nn.Module:
    if config.layer_is_sparse(layer):
        if shard.tp_size > 1:
            raise ValueError("mixture-of-experts models run without tensor parallelism")
        return SparseMoE(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                         config.num_experts_per_tok, config.moe_renormalize, config.hidden_act)
    lo, hi = shard.tp_range(config.intermediate_size)
    mlp = SwiGLUMLP if config.hidden_act == "silu" else GeGLUMLP
    return mlp(config.hidden_size, hi - lo)


@dataclass(frozen=True)
class LayerInputs:
    """What the layers' steps read besides the stream and their cache, one per forward:
    the rotary tables (cos, signed sin; layer_steps.Step.rope_table picks one), the
    batch, and the shard whose ranks the row-parallel steps sum over."""

    tables: Sequence[tuple[torch.Tensor, torch.Tensor]]
    meta: AttentionMetadata
    shard: Shard


Stream = tuple[torch.Tensor, torch.Tensor | None]


def _add_norm(norm: RMSNorm, step: Step, h: torch.Tensor, residual: torch.Tensor | None,
              inputs: LayerInputs, kv_cache: torch.Tensor) -> Stream:
    return (norm(h), h) if residual is None else norm.add_forward(h, residual)


def _norm(norm: RMSNorm, step: Step, h: torch.Tensor, residual: torch.Tensor | None,
          inputs: LayerInputs, kv_cache: torch.Tensor) -> Stream:
    return norm(h), residual


def _matmul(module: nn.Module, step: Step, h: torch.Tensor, residual: torch.Tensor | None,
            inputs: LayerInputs, kv_cache: torch.Tensor) -> Stream:
    h = module(h)  # a Linear (Op.MATMUL) or SparseMoE (Op.EXPERTS)
    return (inputs.shard.all_reduce(h) if step.reduce else h), residual


def _gated(module: Linear, step: Step, h: torch.Tensor, residual: torch.Tensor | None,
           inputs: LayerInputs, kv_cache: torch.Tensor) -> Stream:
    if step.act == "silu":  # a GatedLinear: SiLU fused where a kernel runs it
        return module(h), residual
    gate, up = module(h).chunk(2, dim=-1)
    return ACTIVATIONS[step.act](gate) * up, residual


def _qk_norm(attn: Attention, step: Step, h: torch.Tensor, residual: torch.Tensor | None,
             inputs: LayerInputs, kv_cache: torch.Tensor) -> Stream:
    attn.norm_heads(h)
    return h, residual


def _attend(attn: Attention, step: Step, h: torch.Tensor, residual: torch.Tensor | None,
            inputs: LayerInputs, kv_cache: torch.Tensor) -> Stream:
    cos, sin = inputs.tables[step.rope_table]
    return attn.attend(h, cos, sin, inputs.meta, kv_cache, step.window,
                       step.softcap), residual


# Each step's Python run: the reference the C++ loop's cases are held to.
_RUN = {Op.ADD_NORM: _add_norm, Op.NORM: _norm, Op.MATMUL: _matmul, Op.GATED: _gated,
        Op.QK_NORM: _qk_norm, Op.ATTEND: _attend, Op.EXPERTS: _matmul}


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, shard: Shard, layer: int) -> None:
        """`layer`: its global number (windows and MoE placement are per layer)."""
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, shard)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = build_mlp(config, shard, layer)
        self.attn_output_norm = self.mlp_output_norm = None
        if config.sandwich_norms:
            self.attn_output_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.mlp_output_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.steps = layer_steps(config, layer)
        # Each step with the submodule holding its weights, found once.
        self.step_modules = tuple((step, self.get_submodule(step.module))
                                  for step in self.steps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, inputs: LayerInputs,
                kv_cache: torch.Tensor) -> Stream:
        """(this layer's output, the residual stream before it): the next norm adds the
        two in the same pass, and the stream's values are the plain
        x + attn(norm(x)) + mlp(norm(...)) of the reference."""
        h = x
        for step, module in self.step_modules:
            h, residual = _RUN[step.op](module, step, h, residual, inputs, kv_cache)
        return h, residual
