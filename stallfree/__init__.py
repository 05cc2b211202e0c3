"""stallfree: an LLM serving engine with chunked prefills and stall-free batching."""
from __future__ import annotations

from typing import TYPE_CHECKING

from . import huge_pages

huge_pages.request_for_torch()  # before torch loads: it reads the switch only then

from .sampling_params import SamplingParams  # noqa: E402

if TYPE_CHECKING:
    from .llm import LLM

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # LLM pulls in torch; loading it lazily keeps the pure-Python scheduler and
    # the CLI's argument parsing free of that import.
    if name == "LLM":
        from .llm import LLM

        return LLM
    raise AttributeError(f"module 'stallfree' has no attribute {name!r}")
