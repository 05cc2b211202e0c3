"""Model layer: config, the model families and their decoder, paged attention, weight and
tokenizer loading."""
from .attention import AttentionMetadata, paged_attention
from .config import ModelConfig
from .decoder import CausalLM, allocate_kv_cache, kv_cache_bytes_per_token
from .loader import default_model_path, load_model
from .tokenizer import eos_token_ids, load_tokenizer

__all__ = [
    "AttentionMetadata",
    "CausalLM",
    "ModelConfig",
    "allocate_kv_cache",
    "default_model_path",
    "eos_token_ids",
    "kv_cache_bytes_per_token",
    "load_model",
    "load_tokenizer",
    "paged_attention",
]
