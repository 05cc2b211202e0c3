"""Model layer: config, Llama-family decoder, paged attention, weight and tokenizer loading."""
from .attention import AttentionMetadata, paged_attention
from .config import ModelConfig
from .llama import LlamaForCausalLM, allocate_kv_cache, kv_cache_bytes_per_token
from .loader import default_model_path, load_model
from .tokenizer import eos_token_ids, load_tokenizer

__all__ = [
    "AttentionMetadata",
    "LlamaForCausalLM",
    "ModelConfig",
    "allocate_kv_cache",
    "default_model_path",
    "eos_token_ids",
    "kv_cache_bytes_per_token",
    "load_model",
    "load_tokenizer",
    "paged_attention",
]
