"""Small random-weight models saved as Hugging Face directories (with the default
model's tokenizer), so tests that need a model but not its quality start in seconds."""
from __future__ import annotations

import functools
from pathlib import Path

import torch

LLAMA = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
             tie_word_embeddings=False)


@functools.cache
def _default_tokenizer():
    from stallfree.model.tokenizer import load_tokenizer

    return load_tokenizer(None)  # rebuilt from the GGUF's metadata: seconds, so once


def save_tiny_model(folder: Path, kind: str = "llama", seed: int = 0, **overrides) -> str:
    """A random `kind` ("llama" or "mistral") model in `folder`; returns its path."""
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[kind]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**LLAMA, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    _default_tokenizer().save_pretrained(folder)
    return str(folder)
