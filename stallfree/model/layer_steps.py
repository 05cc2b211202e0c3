"""A decoder layer's sequence, described once: the steps every family's layer is made of,
in order, from ModelConfig alone. Each backend runs this description: the Python layer
(decoder_layer.py, the reference, on every device) and the C++ loop (layer_loop.py lowers
it for csrc/layer_loop.cpp). A new layer feature is a step here, its Python run there and
its case in the C++ loop; a feature the C++ loop has no case for says so
(`native_reason`), and such models take the Python layers.

The stream between steps is (h, residual): an ADD_NORM step adds h into the residual first
(the layer's two skip connections), except at the model's first, which starts it; a NORM
step normalises h alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from .config import ModelConfig


class Op(IntEnum):
    """The steps; the values are csrc/layer_loop.cpp's `Op`."""

    ADD_NORM = 1  # h, residual = norm(h + residual), h + residual (first: norm(h), h)
    NORM = 2  # h = norm(h)
    MATMUL = 3  # h = h @ W.T (+ bias)
    GATED = 4  # h = act(h @ gate.T) * (h @ up.T), W = [gate; up]
    QK_NORM = 5  # an RMSNorm over each q and each k head of h = qkv, in place
    ATTEND = 6  # RoPE on q, k of h = qkv, k and v into the cache; h = attention(q) [T, Hq D]
    EXPERTS = 7  # h = a mixture of experts (moe.py)


@dataclass(frozen=True)
class Step:
    op: Op
    module: str  # the layer's submodule holding the step's weights
    act: str = ""  # GATED: ModelConfig.hidden_act
    reduce: bool = False  # summed over the tensor-parallel ranks after it (row-parallel)
    window: int | None = None  # ATTEND: the sliding window (ModelConfig.layer_window)
    rope_table: int = 0  # ATTEND: 0 the model's rotary table, 1 the windowed layers' own
    softcap: float | None = None  # ATTEND: scores -> softcap * tanh(scores / softcap)


def layer_steps(config: ModelConfig, layer: int) -> tuple[Step, ...]:
    """The steps of layer `layer` (global numbering: windows and experts are per layer)."""
    window = config.layer_window(layer)
    steps = [Step(Op.ADD_NORM, "input_layernorm"), Step(Op.MATMUL, "self_attn.qkv_proj")]
    if config.qk_norm:
        steps.append(Step(Op.QK_NORM, "self_attn"))
    steps += [Step(Op.ATTEND, "self_attn", window=window,
                   rope_table=int(config.local_rope_theta is not None and window is not None),
                   softcap=config.attn_logit_softcap or None),
              Step(Op.MATMUL, "self_attn.o_proj", reduce=True)]
    if config.sandwich_norms:
        steps.append(Step(Op.NORM, "attn_output_norm"))
    # Before the MLP, whatever a checkpoint calls it (Gemma: pre_feedforward_layernorm).
    steps.append(Step(Op.ADD_NORM, "post_attention_layernorm"))
    if config.layer_is_sparse(layer):
        steps.append(Step(Op.EXPERTS, "mlp", reduce=True))
    else:
        steps += [Step(Op.GATED, "mlp.gate_up_proj", act=config.hidden_act),
                  Step(Op.MATMUL, "mlp.down_proj", reduce=True)]
    if config.sandwich_norms:
        steps.append(Step(Op.NORM, "mlp_output_norm"))
    return tuple(steps)


# The activations the C++ loop applies: SiLU fused into the matmul, tanh-GELU after it.
NATIVE_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


def native_reason(step: Step) -> str | None:
    """Why the C++ loop has no case for `step`, whatever its weights (None: it has)."""
    if step.op is Op.EXPERTS:
        return "a mixture of experts (its routing runs in Python)"
    if step.op is Op.ATTEND and step.window is not None:
        return f"a {step.window}-token sliding window"
    if step.op is Op.ATTEND and step.rope_table:
        return "attention with a rotary table of its own"
    if step.op is Op.GATED and step.act not in NATIVE_ACTIVATIONS:
        return f"the {step.act} activation"
    return None


def model_native_reason(config: ModelConfig) -> str | None:
    """Why the C++ loop cannot run this model's layers, from its description alone."""
    for layer in range(config.num_hidden_layers):
        for step in layer_steps(config, layer):
            reason = native_reason(step)
            if reason is not None:
                return f"the {config.architecture} layers have {reason}"
    return None
