"""One decoder layer, as ModelConfig describes it: attention (fused q/k/v, optional per-head
q/k norms, a sliding window, soft-capped scores), a gated MLP or a mixture of experts, and
RMSNorms before each (Gemma adds norms on both outputs)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata, paged_attention
from .config import ModelConfig
from .kernel_table import KernelTable
from .layers import RMSNorm, SwiGLUMLP, apply_rope, rope_and_cache
from .linear import Linear
from .moe import SparseMoE
from .parallel import Shard


def local_heads(config: ModelConfig, shard: Shard) -> tuple[int, int]:
    """(query heads, KV heads) on this rank: whole GQA groups, so no KV head is shared."""
    lo, hi = shard.tp_range(config.num_key_value_heads)
    group = config.num_attention_heads // config.num_key_value_heads
    return (hi - lo) * group, hi - lo


class Attention(nn.Module):
    kernels: KernelTable | None = None  # the model's; set by CausalLM.prepack

    def __init__(self, config: ModelConfig, shard: Shard, layer: int) -> None:
        super().__init__()
        self.shard = shard
        self.num_heads, self.num_kv_heads = local_heads(config, shard)
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = config.attention_scale or self.head_dim ** -0.5
        self.window = config.layer_window(layer)
        self.softcap = config.attn_logit_softcap
        # q, k, v fused into one matmul: rows are [q | k | v].
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                               bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.q_norm is not None:
            self._norm_heads(qkv)
        cached = rope_and_cache(qkv, cos, sin, kv_cache, meta.slot_mapping, self.num_heads,
                                self.num_kv_heads, self.kernels)
        qk = qkv[:, :self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads,
                                                       self.head_dim)
        if not cached:  # the torch path: q and k heads rotated together, in one pass
            qk = apply_rope(qk, cos, sin)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale, cached, window=self.window,
                              softcap=self.softcap)
        # Row-parallel: each rank holds a slice of the heads' contribution.
        return self.shard.all_reduce(self.o_proj(out.reshape(t, self.q_size)))

    def _norm_heads(self, qkv: torch.Tensor) -> None:
        """RMSNorm over each q and each k head of qkv, in place (before RoPE)."""
        t, d, q_end = qkv.shape[0], self.head_dim, self.q_size + self.kv_size
        for norm, lo, hi in ((self.q_norm, 0, self.q_size), (self.k_norm, self.q_size, q_end)):
            heads = qkv[:, lo:hi].reshape(-1, d)
            qkv[:, lo:hi] = norm(heads.contiguous()).view(t, hi - lo)


class GeGLUMLP(SwiGLUMLP):
    """Gemma's MLP: gelu_tanh(gate) * up. gate_up is packed as a plain matrix (the fused
    kernels apply SiLU), and the activation runs in torch."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__(hidden_size, intermediate_size)
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


def build_mlp(config: ModelConfig, shard: Shard, layer: int) -> nn.Module:
    if config.layer_is_sparse(layer):
        if shard.tp_size > 1:
            raise ValueError("mixture-of-experts models run without tensor parallelism")
        return SparseMoE(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                         config.num_experts_per_tok, config.moe_renormalize, config.hidden_act)
    lo, hi = shard.tp_range(config.intermediate_size)
    mlp = SwiGLUMLP if config.hidden_act == "silu" else GeGLUMLP
    return mlp(config.hidden_size, hi - lo)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, shard: Shard, layer: int) -> None:
        """`layer`: its global number (windows and MoE placement are per layer)."""
        super().__init__()
        self.shard = shard
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, shard, layer)
        # Before the MLP, whatever a checkpoint calls it (Gemma: pre_feedforward_layernorm).
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = build_mlp(config, shard, layer)
        self.attn_output_norm = self.mlp_output_norm = None
        if config.sandwich_norms:
            self.attn_output_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.mlp_output_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Rotary table: 0 the model's, 1 the windowed layers' own base (Gemma 3).
        self.rope_table = int(config.local_rope_theta is not None
                              and config.layer_window(layer) is not None)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the next norm adds
        the two in the same pass, and the stream's values are the plain
        x + attn(norm(x)) + mlp(norm(...)) of the reference."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, cos, sin, meta, kv_cache)
        if self.attn_output_norm is not None:
            h = self.attn_output_norm(h)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        h = self.shard.all_reduce(self.mlp(h))
        if self.mlp_output_norm is not None:
            h = self.mlp_output_norm(h)
        return h, residual
