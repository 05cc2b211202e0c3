"""A GGUF file's metadata, parsed once.

gguf-py's reader builds every field of the file: a chat model's vocabulary and merges
are ~100K strings, seconds of every start-up, where the engine needs only the model
config and where each tensor lies. After the first parse both are saved as a small JSON
(build_cache.py), and later loads map the tensors straight from the file at the offsets
it records.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import build_cache
from .config import ModelConfig
from .families import config_from_gguf


@dataclass(frozen=True)
class IndexedTensor:
    """What the loader reads of a gguf ReaderTensor."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # GGUF order: fastest dim first
    data: np.ndarray  # as the reader gives it: typed, or raw quantised blocks


def read_gguf(path: str) -> tuple[ModelConfig, list[Any]]:
    """(config, tensors) of a GGUF file, from its saved index where there is one."""
    import gguf

    index = build_cache.entry("gguf", path, getattr(gguf, "__version__", ""))
    if index.exists():
        try:
            return _from_index(path, json.loads(index.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            logging.getLogger(__name__).info("GGUF index %s unreadable (%s): parsing", index, e)
    reader = gguf.GGUFReader(path)
    config = config_from_gguf(reader)
    _save(index, config, reader.tensors)
    return config, list(reader.tensors)


def _from_index(path: str, saved: dict) -> tuple[ModelConfig, list[IndexedTensor]]:
    from gguf import GGMLQuantizationType

    raw = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = []
    for t in saved["tensors"]:
        dtype = np.dtype(t["dtype"])
        count = int(np.prod(t["data_shape"]))
        data = raw[t["offset"]:t["offset"] + count * dtype.itemsize].view(dtype)
        tensors.append(IndexedTensor(t["name"], GGMLQuantizationType(t["type"]),
                                     np.array(t["shape"]), data.reshape(t["data_shape"])))
    return ModelConfig(**saved["config"]), tensors


def _save(index: Path, config: ModelConfig, tensors: list[Any]) -> None:
    saved = {"config": dataclasses.asdict(config),
             "tensors": [{"name": t.name, "type": int(t.tensor_type),
                          "shape": [int(d) for d in t.shape], "offset": int(t.data_offset),
                          "dtype": t.data.dtype.str, "data_shape": list(t.data.shape)}
                         for t in tensors]}
    try:
        text = json.dumps(saved)
        index.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=index.parent, delete=False) as f:
            f.write(text)
        build_cache.publish(Path(f.name), index)
    except (OSError, TypeError, ValueError) as e:  # read-only folder, or a config field
        logging.getLogger(__name__).info("GGUF index not written (%s)", e)  # JSON can't hold
