"""Constrained decoding with xgrammar: grammars from constraints, compiled off the engine
thread, and per-request matchers that give each step's allowed tokens as a bitmask."""
from __future__ import annotations

from .compiler import GrammarCompileService
from .decoding import GrammarMatchers
from .grammar import build_grammar

__all__ = ["GrammarCompileService", "GrammarMatchers", "build_grammar"]
