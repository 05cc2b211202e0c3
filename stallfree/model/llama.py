"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over a paged KV cache."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata, paged_attention
from .config import ModelConfig
from .layers import RMSNorm, RotaryEmbedding, SwiGLUMLP, apply_rope


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        # q, k, v fused into one matmul: rows are [q | k | v].
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        # Rotate q and k heads together: one RoPE pass instead of two.
        qk = qkv[:, :self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads,
                                                       self.head_dim)
        qk = apply_rope(qk, cos, sin)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(t, self.q_size))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                      config.rope_theta, config.rope_scaling)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        # Tied models read the embedding matrix in compute_logits instead of holding
        # a second Parameter: sharing survives every device/dtype move that way.
        self.lm_head = (None if config.tie_word_embeddings
                        else nn.Linear(config.hidden_size, config.vocab_size, bias=False))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] flat over the batch. Returns hidden states [T, hidden]."""
        attn_metadata.prepare()
        x = self.model.embed_tokens(input_ids)
        # One RoPE lookup per forward, shared by all layers.
        cos, sin = self.model.rotary.lookup(positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, attn_metadata, kv_cache[i])
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32. Call only on rows that are sampled."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def reset_buffers(self) -> None:
        """Rebuild derived buffers; needed after `to_empty` (they hold garbage then)."""
        self.model.rotary.reset_table()


def allocate_kv_cache(config: ModelConfig, num_blocks: int, block_size: int,
                      dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Zeroed cache [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim].

    Zeros (not empty) matter: padded decode gathers read unused slots, and masked
    keys must still be finite so they contribute exactly nothing.
    """
    return torch.zeros(config.num_hidden_layers, 2, num_blocks, block_size,
                       config.num_key_value_heads, config.head_dim, dtype=dtype, device=device)


def kv_cache_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * elem
