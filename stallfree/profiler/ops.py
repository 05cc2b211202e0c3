"""Each token-level op of one decoder layer (and the embedding and LM head), by token count.

The ops are the engine's own modules, reached through the model's attributes
(`model.model.layers[i].self_attn.qkv_proj`, `layer.mlp.gate_up_proj`, ...), so each is
timed in the kernel the engine runs it in. Where the engine computes SiLU x up inside the
gate/up matmul (linear.fuses_gate), mlp_up_proj times both and mlp_act is zero.

Each call of a layer's op takes the next layer's module, as an iteration does: the engine
reads a layer's weights once per iteration, from memory, and layer 0's weights called again
and again would stay in the CPU's caches. An op's weights over all layers (20-105 MB in
bf16 for the default model) may still partly stay in a large last-level cache.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from ..model.layers import apply_rope
from ..model.linear import fuses_gate, silu_mul
from ..sim.profile_csv import stat_columns, time_stats
from .timing import cpu_ms_interleaved

LM_HEAD_MAX_ROWS = 256  # logits of more rows than requests in a batch are never computed
# Small ops get more calls, so that few-token rows (a light load's decodes, a fraction of a
# millisecond each) are medians of as many calls as a 64-token row is of tokens.
CALLS_TOKENS = 64
OPS = ("emb", "input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
       "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add", "lm_head")


def profile_ops(model: Any, cfg: Any, grid: dict[str, Any]) -> list[dict[str, Any]]:
    """Each token-level op of a layer (and the embedding / LM head) at each token count."""
    shape = {"n_head": cfg.num_attention_heads, "n_kv_head": cfg.num_key_value_heads,
             "n_embd": cfg.hidden_size, "n_expanded_embd": cfg.intermediate_size,
             "vocab_size": cfg.vocab_size, "use_gated_mlp": True,
             "num_tensor_parallel_workers": 1}
    layer = model.model.layers[0]  # the fused-gate check: every layer's alike
    calls, rows = {}, {t: shape | {"num_tokens": t} for t in grid["tokens"]}
    for t in grid["tokens"]:
        for op in OPS:
            if op == "lm_head" and t > LM_HEAD_MAX_ROWS:  # blank: the reader scales up
                rows[t] |= {k: "" for k in stat_columns(op, time_stats([0.0]))}
            elif op == "mlp_act" and fuses_gate(layer.mlp.gate_up_proj.packed, t,
                                                      model.kernels):
                rows[t] |= stat_columns(op, time_stats([0.0]))
            else:
                calls[(t, op)] = (partial(_op_call, model, cfg, t, op),
                                  grid["repeats"] * max(1, CALLS_TOKENS // t))
    for (t, op), stats in cpu_ms_interleaved(calls).items():
        rows[t] |= stat_columns(op, stats)
    return list(rows.values())


def _op_call(model: Any, cfg: Any, t: int, op: str) -> Callable[[], Any]:
    """The op's call on `t` tokens; a layer's op takes the next layer's module each call."""
    layer = model.model.layers[0]  # shapes: every layer's alike
    nxt = itertools.cycle(model.model.layers).__next__
    attn, h, hd, inter = layer.self_attn, cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    # A norm's weight: the embedding's may have gone to its packing (linear.repack).
    weight = layer.input_layernorm.weight
    dev, dt = weight.device, weight.dtype
    x, y = torch.randn(t, h, dtype=dt, device=dev), torch.randn(t, h, dtype=dt, device=dev)
    ids = torch.randint(0, cfg.vocab_size, (t,), device=dev)
    cos, sin = model.model.rotary.lookup(torch.arange(t, device=dev), dt)
    qk = torch.randn(t, cfg.num_attention_heads + cfg.num_key_value_heads, hd, dtype=dt,
                     device=dev)
    up = torch.randn(t, 2 * inter, dtype=dt, device=dev)
    attn_out = torch.randn(t, attn.q_size, dtype=dt, device=dev)
    return {"emb": lambda: model.model.embed_tokens(ids),
            "input_layernorm": lambda: nxt().input_layernorm(x),
            "attn_pre_proj": lambda: nxt().self_attn.qkv_proj(x),
            "attn_rope": lambda: apply_rope(qk, cos, sin),
            "attn_post_proj": lambda: nxt().self_attn.o_proj(attn_out),
            # The engine adds the residual in the norm's pass (add_forward).
            "post_attention_layernorm": lambda: nxt().post_attention_layernorm.add_forward(x, y),
            "mlp_up_proj": lambda: nxt().mlp.gate_up_proj(x),
            "mlp_act": lambda: silu_mul(up),
            "mlp_down_proj": lambda: nxt().mlp.down_proj(up[:, :inter]),
            "add": lambda: x + y,
            "lm_head": lambda: model.compute_logits(x)}[op]
