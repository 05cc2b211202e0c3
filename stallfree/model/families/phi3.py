"""Phi-3 (mini/medium, 4k context): a Llama whose checkpoints fuse q/k/v and gate/up, the
way our layers hold them (weights.py splits them per rank). LongRoPE (the 128k variants) is
refused by the rope check, partial rotary factors by hf_rope."""

from .base import Family

FAMILY = Family(
    name="phi3",
    hf_architectures=("Phi3ForCausalLM",),
    model_types=("phi3",),
    gguf_architectures=("phi3",),
    # llama.cpp's Phi-3 files hold gate and up in one "ffn_up" tensor, q/k/v in "attn_qkv".
    gguf_layer_names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
)
