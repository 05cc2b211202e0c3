"""Special tokens' texts in a tool request's reply: kept for a parser that reads some of
them (skip_special_tokens off: Mistral's [TOOL_CALLS], Llama 3.1's <|python_tag|>), the
others then stripped from the content, whole or streamed (tools.ToolReply).
"""
from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any


def special_token_texts(tokenizer: Any) -> frozenset[str]:
    """The text of each of the tokenizer's special tokens: what decoding drops when it
    skips special tokens (a test's fake tokenizer may have none)."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    texts = {str(t.content) for t in added.values() if getattr(t, "special", False)}
    texts.update(getattr(tokenizer, "all_special_tokens", None) or ())
    return frozenset(t for t in texts if t)


@dataclass(frozen=True)
class SpecialTexts:
    """Special tokens' texts to strip, compiled once per app and parser (a vocabulary may
    have hundreds: Llama 3's reserved tokens, Mistral's control tokens)."""

    pattern: re.Pattern[str] | None
    prefixes: frozenset[str]  # every proper prefix of one: what a stream may end in
    longest: int

    @classmethod
    def of(cls, texts: Collection[str]) -> SpecialTexts:
        # Longest first: a token whose text begins another's must not cut that one short.
        ordered = sorted(texts, key=len, reverse=True)
        pattern = re.compile("|".join(map(re.escape, ordered))) if ordered else None
        return cls(pattern, frozenset(t[:n] for t in ordered for n in range(1, len(t))),
                   len(ordered[0]) if ordered else 0)

    def strip(self, text: str) -> str:
        return text if self.pattern is None else self.pattern.sub("", text)

    def held_back(self, text: str) -> int:
        """How many characters at the end of `text` could begin a special token's text."""
        for n in range(min(self.longest - 1, len(text)), 0, -1):
            if text[-n:] in self.prefixes:
                return n
        return 0


NO_SPECIALS = SpecialTexts.of(())  # strips nothing: special tokens were skipped


class SpecialTokenStripper:
    """Strips special tokens' texts from text as it streams in. A token's text may come
    split over pieces (the detokenizer holds text back for stop strings, the splitter for
    its markers), so a tail that could begin one waits for the next piece."""

    def __init__(self, specials: SpecialTexts) -> None:
        self.specials = specials
        self._held = ""

    def feed(self, text: str, last: bool = False) -> str:
        """The stripped text that `text` completes (all of it when `last`)."""
        text = self.specials.strip(self._held + text)
        cut = len(text) - (0 if last else self.specials.held_back(text))
        self._held = text[cut:]
        return text[:cut]
