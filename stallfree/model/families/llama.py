"""Llama 2 and 3.x (rope scaling: llama3, linear) and models that share its layout
(SmolLM2, TinyLlama)."""

from .base import Family

FAMILY = Family(
    name="llama",
    hf_architectures=("LlamaForCausalLM",),
    model_types=("llama",),
    gguf_architectures=("llama",),
    gguf_rope_rows_permuted=True,
)
