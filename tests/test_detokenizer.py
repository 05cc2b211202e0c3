"""Incremental detokenization equals whole decoding; stop strings cut across token edges."""
from __future__ import annotations

from stallfree.detokenizer import IncrementalDetokenizer

TEXT = "Café déjà vu 🙂 — naïve coöperation, 東京 and 3.14159!\nNew line."


def _feed(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[str, bool]:
    streamed, hit = "", False
    for token in ids:
        delta, hit = detok.append(token)
        streamed += delta
        if hit:
            break
    return streamed + detok.flush(), hit


def test_streamed_text_equals_full_decode(default_llm):
    tok = default_llm.tokenizer
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tok, stop=[])
    streamed, hit = _feed(detok, ids)
    assert not hit
    assert streamed == detok.text == tok.decode(ids, skip_special_tokens=True)


def test_stop_string_spanning_tokens_is_cut(default_llm):
    tok = default_llm.tokenizer
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tok, stop=["coöperation"])
    streamed, hit = _feed(detok, ids)
    assert hit and streamed == detok.text == TEXT[:TEXT.index("coöperation")]
    kept, hit = _feed(IncrementalDetokenizer(tok, stop=["vu 🙂"], include_stop=True), ids)
    assert hit and kept == TEXT[:TEXT.index("vu 🙂") + len("vu 🙂")]


def test_held_back_text_is_flushed_at_the_end(default_llm):
    tok = default_llm.tokenizer
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tok, stop=["never appears here"])
    streamed, hit = _feed(detok, ids)
    assert not hit and streamed == TEXT
