"""Incremental detokenization and stop-string matching for one output sequence."""
from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Grows the text one token at a time without re-decoding the whole output.

    Decoding a short window of recent tokens (instead of each token alone)
    keeps byte-level merges and leading-space rules right; a trailing U+FFFD
    means a multi-byte character is still incomplete, so its text waits.
    `skip_special_tokens` False keeps special tokens' text, stop strings matched
    against it too (as vLLM).
    """

    def __init__(self, tokenizer: Any, stop: list[str], include_stop: bool = False,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop = include_stop
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0
        self._emitted = 0  # characters of `text` already returned to the caller
        self._max_stop_len = max((len(s) for s in stop), default=0)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def append(self, token_id: int, check_stop: bool = True) -> tuple[str, bool]:
        """Adds a token; returns (new text, whether a stop string ended the text).

        `check_stop` False (min_tokens not reached yet) lets a stop string pass, as in
        vLLM: only one that ends after the new text counts later on."""
        self.token_ids.append(token_id)
        prefix = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset:])
        if full.endswith("\ufffd"):
            return "", False
        delta = full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        return self._add_text(delta, check_stop)

    def _add_text(self, delta: str, check_stop: bool) -> tuple[str, bool]:
        start = len(self.text)
        self.text += delta
        if self.stop and delta and check_stop:
            # Only a stop string that overlaps the new text can be new.
            search_from = max(0, start - self._max_stop_len + 1)
            hits = [(i, s) for s in self.stop if (i := self.text.find(s, search_from)) != -1]
            if hits:
                index, stop = min(hits)
                self.text = self.text[:index + len(stop) if self.include_stop else index]
                return self.flush(), True
        # Hold back a tail that could still grow into a stop string, so streamed
        # text never has to be taken back.
        return self._take(len(self.text) - max(self._max_stop_len - 1, 0)), False

    def flush(self) -> str:
        """The text not yet handed out; call when the sequence ends."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        out = self.text[self._emitted:end] if end > self._emitted else ""
        self._emitted = max(self._emitted, end)
        return out
