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
def default_tokenizer():
    from stallfree.model.tokenizer import load_tokenizer

    return load_tokenizer(None)  # rebuilt from the GGUF's metadata: seconds, so once


# Each family's transformers classes, and what its tiny model sets beyond LLAMA: windows
# shorter than the tests' prompts, experts, soft-caps.
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_theta=500000.0, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1000000.0)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0, sliding_window=None)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        sliding_window=16, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0, num_hidden_layers=3, hidden_activation="gelu_pytorch_tanh",
        pad_token_id=0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        sliding_window=16, query_pre_attn_scalar=24, num_hidden_layers=3, pad_token_id=0,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 1000000.0}})),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=48, sliding_window=None)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        num_hidden_layers=3, mlp_only_layers=[1])),
}


def build_tiny_model(kind: str = "llama", seed: int = 0, **overrides):
    """A random transformers model of family `kind` (FAMILIES), every weight randomised
    so a misplaced norm or bias shows in the logits."""
    import transformers

    config_name, model_name, extra = FAMILIES[kind]
    config = getattr(transformers, config_name)(**{**LLAMA, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                # Gemma's norms scale by (1 + w): around 0 there, around 1 elsewhere.
                p.uniform_(-0.5, 0.5) if kind.startswith("gemma") else p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)
    return model.float().eval()


def save_tiny_model(folder: Path, kind: str = "llama", seed: int = 0, **overrides) -> str:
    """A random model of family `kind` (FAMILIES) in `folder`; returns its path."""
    model = build_tiny_model(kind, seed, **overrides)
    model.save_pretrained(folder, safe_serialization=True)
    default_tokenizer().save_pretrained(folder)
    return str(folder)
