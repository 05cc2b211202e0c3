"""The decoder-only model every family runs (families/, config.ModelConfig) over a paged KV
cache: embedding, the layers of decoder_layer.py, final norm and logits."""
from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from ..kernel_ops import check_kernels
from . import kv_quant
from .attention import AttentionMetadata
from .config import ModelConfig
from .decoder_layer import Attention, DecoderLayer, LayerInputs, local_heads
from .kernel_table import Choice, KernelTable, choose_kernels
from .layer_loop import LayerLoop
from .layers import RMSNorm, RotaryEmbedding
from .linear import Linear, PackedWeight, linear, repack
from .moe import SparseMoE
from .parallel import Shard, VocabParallelEmbedding

logger = logging.getLogger("stallfree.model")


class DecoderModel(nn.Module):
    """The stage's layers only; the embedding on the first stage (and on the last when
    tied to the LM head), the final norm on the last."""

    def __init__(self, config: ModelConfig, shard: Shard) -> None:
        super().__init__()
        first, last = shard.is_first_stage, shard.is_last_stage
        needs_embedding = first or (last and config.tie_word_embeddings)
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size, shard)
                             if needs_embedding else None)
        lo, hi = shard.layer_range(config.num_hidden_layers)
        self.layers = nn.ModuleList(DecoderLayer(config, shard, i) for i in range(lo, hi))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if last else None
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                      config.rope_theta, config.rope_scaling)
        self.local_rotary = None
        if any(step.rope_table for layer in self.layers for step in layer.steps):
            self.local_rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                                config.local_rope_theta, None)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig, shard: Shard | None = None) -> None:
        super().__init__()
        shard = shard or Shard()
        shard.check(config.num_hidden_layers, config.num_key_value_heads)
        self.config = config
        self.shard = shard
        self.model = DecoderModel(config, shard)
        # Tied models read the embedding matrix in compute_logits instead of holding
        # a second Parameter: sharing survives every device/dtype move that way.
        lo, hi = shard.tp_range(config.vocab_size)
        self.lm_head = (Linear(config.hidden_size, hi - lo, bias=False)
                        if shard.is_last_stage and not config.tie_word_embeddings else None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata, kv_cache: torch.Tensor,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [T] flat over the batch; `hidden` replaces the embedding
        on later pipeline stages. Returns hidden states [T, hidden] (normed on the last)."""
        attn_metadata.kernels = self.kernels  # the table the weights were packed for
        attn_metadata.prepare(kv_cache[0])
        if hidden is None:
            x = self.model.embed_tokens(input_ids)
            if self.config.embedding_scale is not None:
                # In the dtype, as the reference rounds it (Gemma).
                x = x * torch.tensor(self.config.embedding_scale, dtype=x.dtype)
        else:
            x = hidden
        # One RoPE lookup per table per forward, shared by the layers.
        cos, sin = self.model.rotary.lookup(positions, x.dtype)
        loop = self.layer_loop
        if loop is not None and loop.fits(x, attn_metadata, kv_cache):
            x, residual = loop(x, cos, sin, attn_metadata, kv_cache)
            if loop.final_norm is not None:  # applied in the loop's call
                return x
        else:
            tables = [(cos, sin)]
            if self.model.local_rotary is not None:
                tables.append(self.model.local_rotary.lookup(positions, x.dtype))
            residual, inputs = None, LayerInputs(tables, attn_metadata, self.shard)
            for i, layer in enumerate(self.model.layers):
                x, residual = layer(x, residual, inputs, kv_cache[i])
        if residual is None:  # a stage without layers
            return x if self.model.norm is None else self.model.norm(x)
        if self.model.norm is None:  # the next stage gets the whole stream
            return x + residual
        return self.model.norm.add_forward(x, residual)[0]

    @property
    def logits_from_embedding(self) -> bool:
        """Whether this stage computes logits from the (tied) embedding matrix: the last
        stage of a tied model; a first stage only looks the embedding up."""
        return self.lm_head is None and self.shard.is_last_stage \
            and self.model.embed_tokens is not None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32. Call only on rows that are sampled."""
        if self.lm_head is not None:
            logits = self.lm_head(hidden)
        else:
            logits = linear(hidden, self.model.embed_tokens.weight, packed=self.logits_packed,
                            kernels=self.kernels)
        logits = self.shard.gather_vocab(logits.float(), self.config.vocab_size)
        cap = self.config.final_logit_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap

    # The tied embedding's packing (linear.repack); lm_head, a Linear, holds its own.
    logits_packed: PackedWeight | None = None
    # The layers in one C++ call where their weights allow it (layer_loop.py); set by prepack.
    layer_loop: LayerLoop | None = None
    layer_loop_reason: str | None = "weights not prepacked"
    # Which implementation runs each op (kernel_table.py), and the overrides it was chosen
    # with; set by prepack.
    kernels: KernelTable | None = None
    kernel_overrides: dict[str, str] = {}

    def _dtype_and_device(self) -> tuple[torch.dtype, torch.device]:
        # A pipeline stage may hold no weight at all; it computes nothing then.
        param = next(self.parameters(), None)
        return ((param.dtype, param.device) if param is not None
                else (torch.float32, torch.device("cpu")))

    def prepack(self, overrides: Mapping[str, str] | str | None = None) -> None:
        """Choose each op's implementation for this model (the kernel table, with the
        `kernels` setting's `overrides`) and reorder the matmul weights for it; once their
        values are final. Called again, it repacks for the new table."""
        dtype, device = self._dtype_and_device()
        self.kernel_overrides = check_kernels(overrides)
        quantized = any(p.quant is not None for *_, p in self._packings())
        kernels = choose_kernels(overrides, dtype=dtype, device_type=device.type,
                                 tp_size=self.shard.tp_size, head_dim=self.config.head_dim,
                                 quantized=quantized)
        for moe in [m for m in self.modules() if isinstance(m, SparseMoE)]:
            moe.split_experts()  # Linears of their own, packed below like the others
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepack(kernels)
            elif isinstance(module, (RMSNorm, Attention)):
                module.kernels = kernels
        embed = self.model.embed_tokens
        if self.logits_from_embedding:
            if self.logits_packed is None or self.logits_packed.quant is None:  # else as loaded
                self.logits_packed = repack(embed, self.logits_packed, kernels=kernels)
            # Where the plain matrix went, the embedding's lookups read the packing.
            embed.packed = self.logits_packed if embed.weight is None else None
        if embed is not None:
            embed.dtype = dtype
        layouts = sorted({p.layout for *_, p in self._packings()})
        if layouts:
            held = self.held_bytes()
            logger.info("matmul weights prepacked for %s: %.0f MB, beside %.0f MB of plain "
                        "matrices kept", "+".join(layouts), held["packings"] / 1e6,
                        held["plain beside packings"] / 1e6)
        self.layer_loop, self.layer_loop_reason = LayerLoop.build(
            self.model.layers, self.shard, kernels, self.model.norm)
        if self.layer_loop is None and kernels.layer_loop.kernel:  # the weights refused it
            kernels = kernels.with_choice("layer_loop", Choice("python", self.layer_loop_reason))
        self.kernels = kernels

    def _packings(self) -> Iterator[tuple[str, nn.Module, PackedWeight]]:
        """(weight name, its module, packing) of every packed matrix: the Linears', and the
        tied embedding's as the LM head."""
        for name, module in self.named_modules():
            if isinstance(module, Linear) and module.packed is not None:
                yield f"{name}.weight", module, module.packed
        embed = self.model.embed_tokens
        if self.logits_packed is not None:
            yield "model.embed_tokens.weight", embed, self.logits_packed
        elif embed is not None and embed.packed is not None:  # an untied, quantized one
            yield "model.embed_tokens.weight", embed, embed.packed

    def _packed_only(self) -> Iterator[tuple[str, PackedWeight]]:
        """(weight name, packing) of each matrix whose plain copy went (linear.repack)."""
        return ((name, p) for name, module, p in self._packings() if module.weight is None)

    def held_bytes(self) -> dict[str, int]:
        """Bytes the weights take: "packings" (for the CPU kernels), "plain beside packings"
        (kept where a packing does not serve every call), "other" (the rest: norms, an
        embedding that is only looked up)."""
        packs = list(self._packings())
        beside = sum(m.weight.nbytes for _, m, _ in packs if m.weight is not None)
        return {"packings": sum(p.nbytes for *_, p in packs), "plain beside packings": beside,
                "other": sum(p.nbytes for p in self.parameters()) - beside}

    def weight_numels(self) -> dict[str, int]:
        """Values per weight, by this model's names, as loaded (packed-only ones too)."""
        numels = {name: p.numel() for name, p in self.named_parameters()}
        return numels | {name: math.prod(p.shape) for name, p in self._packed_only()}

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, values) of every weight, by this model's names (q/k/v and gate/up fused);
        a packed-only matrix is read back from its packing, a copy each."""
        yield from self.named_parameters()
        for name, packed in self._packed_only():
            yield name, packed.unpack()

    def reset_buffers(self) -> None:
        """Rebuild derived buffers; needed after `to_empty` (they hold garbage then)."""
        for rotary in (self.model.rotary, self.model.local_rotary):
            if rotary is not None:
                rotary.reset_table()


def allocate_kv_cache(config: ModelConfig, num_blocks: int, block_size: int,
                      dtype: torch.dtype, device: torch.device | str,
                      shard: Shard | None = None) -> torch.Tensor:
    """Zeroed cache [num_layers, 2, num_blocks, block_size, num_kv_heads, W] of the cache
    dtype `dtype`: W = head_dim for a float cache, head_dim + 4 for an int8 one (each row's
    values, then its float32 scale: kv_quant.py).

    Zeros (not empty) matter: padded decode gathers read unused slots, and masked
    keys must still be finite so they contribute exactly nothing (an int8 row of zeros has
    scale 0.0: it reads as zeros).
    """
    layers, kv_heads = _local_kv_shape(config, shard or Shard())
    return torch.zeros(layers, 2, num_blocks, block_size, kv_heads,
                       kv_quant.row_width(config.head_dim, dtype), dtype=dtype, device=device)


def kv_cache_bytes_per_token(config: ModelConfig, dtype: torch.dtype,
                             shard: Shard | None = None) -> int:
    """Bytes one token's KV takes in a cache of `dtype` on the rank holding `shard`
    (default: the whole model); an int8 cache's scales included."""
    layers, kv_heads = _local_kv_shape(config, shard or Shard())
    elem = torch.empty((), dtype=dtype).element_size()
    return layers * 2 * kv_heads * kv_quant.row_width(config.head_dim, dtype) * elem


def _local_kv_shape(config: ModelConfig, shard: Shard) -> tuple[int, int]:
    lo, hi = shard.layer_range(config.num_hidden_layers)
    return hi - lo, local_heads(config, shard)[1]
