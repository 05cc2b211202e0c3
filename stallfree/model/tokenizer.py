"""Tokenizer loading (offline only) for GGUF files and Hugging Face directories."""
from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from . import build_cache
from .config import ModelConfig
from .loader import default_model_path
from .tool_prompt import template_handles_tools, with_tools_in_messages


def load_tokenizer(path: str | None) -> Any:
    """A transformers tokenizer, chat template included. None: the default model's."""
    from transformers import AutoTokenizer

    path = default_model_path() if path is None else os.fspath(path)
    if os.path.isdir(path):
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"{path}: expected a .gguf file or a Hugging Face model directory")
        return _gguf_tokenizer(path)
    raise FileNotFoundError(f"tokenizer path does not exist: {path}")


def _gguf_tokenizer(path: str) -> Any:
    """transformers rebuilds the tokenizer (and chat template) from GGUF metadata, parsing
    every field of the file: seconds of each start-up. The result is saved once as a
    tokenizer directory and loaded from there after (where the cache cannot be written,
    it is rebuilt every time)."""
    import tokenizers
    import transformers
    from transformers import AutoTokenizer

    cached = build_cache.entry("tokenizers", path, transformers.__version__,
                               tokenizers.__version__)
    if (cached / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(cached, local_files_only=True)
    folder, name = os.path.split(os.path.abspath(path))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        written = Path(tempfile.mkdtemp(dir=cached.parent))
        tokenizer.save_pretrained(written)
        build_cache.publish(written, cached)
    except OSError as e:
        logging.getLogger(__name__).info("tokenizer cache not written (%s)", e)
    return tokenizer


def eos_token_ids(tokenizer: Any, config: ModelConfig) -> frozenset[int]:
    """Every token that ends generation: the model config's eos ids plus the tokenizer's."""
    ids = set(config.eos_token_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def chat_prompt_ids(tokenizer: Any, conversation: list[dict[str, Any]],
                    add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The prompt token ids of a conversation under the tokenizer's chat template.

    `tools` (OpenAI function tools) and tool messages go to the template; one that
    ignores tools gets them written into the messages (model/tool_prompt.py).
    Raises ValueError unless the conversation is a non-empty list of {'role',
    'content'} dicts; the template's own errors (e.g. a role it refuses) pass through.
    """
    if not conversation or not all(isinstance(m, dict) and "role" in m and "content" in m
                                   for m in conversation):
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    extra: dict[str, Any] = {}
    if template_handles_tools(tokenizer):
        extra = {"tools": tools} if tools else {}
    elif tools or any(m["role"] == "tool" or m.get("tool_calls") for m in conversation):
        conversation = with_tools_in_messages(conversation, tools)
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                        tokenize=True, **extra)
    # Newer transformers return a BatchEncoding rather than a bare list.
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
