"""Mistral: a Llama with sliding-window attention in every layer (when its config has
one). llama.cpp writes it as the "llama" GGUF architecture, with the window lost."""

from .base import Family

FAMILY = Family(
    name="mistral",
    hf_architectures=("MistralForCausalLM",),
    model_types=("mistral",),
)
