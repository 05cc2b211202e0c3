"""`stallfree convert --to-hf DIR`: a model (default: the shipped GGUF) as a Hugging Face folder.

Peers that cannot read our GGUF (vLLM) then serve the very same weights:
the tensors are the ones our own loader produces (GGUF dequantised to
float32, llama.cpp's Q/K row order undone), so a benchmark compares
schedulers, not checkpoints. Our model fuses q/k/v and gate/up into one
matrix each; they are split back into Hugging Face's names here, by the
same row ranges the loader used to fuse them.

Written: config.json, generation_config.json, model.safetensors and the
tokenizer files (tokenizer.json, tokenizer_config.json with the chat
template, special_tokens_map.json). transformers and our loader both read it.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any

from ..config import DTYPES

_FUSED = re.compile(r"(.*)\.(qkv_proj|gate_up_proj)\.(weight|bias)$")


def hf_config(cfg: Any, dtype: str = "float32") -> dict[str, Any]:
    """A transformers config.json for our ModelConfig (llama or qwen2)."""
    arch = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2")}
    if cfg.architecture not in arch:
        raise ValueError(f"converting a {cfg.architecture} model is not supported; "
                         f"supported: {sorted(arch)}")
    name, model_type = arch[cfg.architecture]
    scaling = None
    if cfg.rope_scaling:
        if cfg.rope_scaling["rope_type"] == "freq_factors":
            # llama.cpp stores llama3 scaling as baked per-frequency divisors; HF has no
            # such form, and guessing the llama3 parameters back could change the model.
            raise ValueError("cannot write rope scaling stored as GGUF frequency factors "
                             "as a Hugging Face config")
        scaling = dict(cfg.rope_scaling)
    out: dict[str, Any] = {
        "architectures": [name], "model_type": model_type,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": scaling, "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
        "initializer_range": 0.02, "attention_dropout": 0.0, "use_cache": True,
        "torch_dtype": dtype,
    }
    if model_type == "llama":
        out |= {"attention_bias": cfg.attention_bias, "mlp_bias": False, "pretraining_tp": 1}
    else:
        out |= {"use_sliding_window": False, "sliding_window": None}
    return out


def hf_state_dict(model: Any, dtype: Any) -> dict[str, Any]:
    """Our parameters under Hugging Face names, fused matrices split, contiguous copies."""
    cfg = model.config
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    i = cfg.intermediate_size
    parts = {"qkv_proj": [("q_proj", 0, q), ("k_proj", q, q + kv), ("v_proj", q + kv, q + 2 * kv)],
             "gate_up_proj": [("gate_proj", 0, i), ("up_proj", i, 2 * i)]}
    out = {}
    for name, param in model.named_weights():
        m = _FUSED.match(name)
        pieces = ([(f"{m.group(1)}.{n}.{m.group(3)}", a, b) for n, a, b in parts[m.group(2)]]
                  if m else [(name, 0, param.shape[0])])
        for hf_name, a, b in pieces:
            # clone: our matmul weights are column-major views; safetensors wants owners.
            out[hf_name] = param.detach()[a:b].to(dtype).contiguous().clone()
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def convert_to_hf(out_dir: str, model_path: str | None = None, dtype: str = "float32",
                  overwrite: bool = False) -> str:
    """Writes the HF folder; returns its path."""
    import torch
    from safetensors.torch import save_file

    from ..model.loader import load_model
    from ..model.tokenizer import load_tokenizer

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise ValueError(f"{out_dir} exists and is not empty (use --force to overwrite)")
    os.makedirs(out_dir, exist_ok=True)
    model, cfg = load_model(model_path, torch.float32, "cpu")
    config = hf_config(cfg, dtype)
    tensors = hf_state_dict(model, getattr(torch, dtype))
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({k: v for k, v in gen.items() if v is not None}, f, indent=2)
    tokenizer = load_tokenizer(model_path)
    tokenizer.save_pretrained(out_dir)
    _portable_tokenizer_config(out_dir, tokenizer.chat_template, cfg.max_position_embeddings)
    os.chmod(os.path.join(out_dir, "model.safetensors"), 0o644)  # safetensors writes 0600
    return out_dir


def _portable_tokenizer_config(out_dir: str, chat_template: str | None, max_len: int) -> None:
    """Makes tokenizer_config.json readable by transformers 4.x too (a peer's may be older).

    transformers 5 writes its own class name (TokenizersBackend), keeps the chat
    template only in chat_template.jinja and records load-time flags; 4.x knows
    the fast tokenizer as PreTrainedTokenizerFast (5.x accepts that name too)
    and reads the template from this file.
    """
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path) as f:
        tok = json.load(f)
    for key in ("is_local", "local_files_only"):
        tok.pop(key, None)
    tok["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok["model_max_length"] = max_len
    if chat_template:
        tok["chat_template"] = chat_template
    with open(path, "w") as f:
        json.dump(tok, f, indent=2)
