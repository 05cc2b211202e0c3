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


def _group_text(text: str, min_tokens: int) -> tuple[str, bool]:
    """Feeds `text` one character-token at a time through a RequestGroup (stop ",")."""
    from server_utils import FakeTokenizer
    from stallfree import SamplingParams
    from stallfree.request_group import RequestGroup

    tok = FakeTokenizer()
    group = RequestGroup("r", None, [1], SamplingParams(stop=[","], min_tokens=min_tokens,
                                                        max_tokens=50), 0.0, tok, set())
    streamed, hit = "", False
    for token in tok(text)["input_ids"]:
        group.children[0].output_token_ids.append(token)  # as the scheduler does first
        delta, hit = group.append(0, token, None)
        streamed += delta
        if hit:
            break
    return streamed + group.detokenizers[0].flush(), hit


def test_min_tokens_holds_off_stop_strings():
    assert _group_text("a,b,c,d", min_tokens=0) == ("a", True)
    # The first "," is token 2 of 3 needed; the second (token 4) counts, as in vLLM.
    assert _group_text("a,b,c,d", min_tokens=3) == ("a,b", True)
    assert _group_text("a,b,c,d", min_tokens=4) == ("a,b", True)  # the stop token is the 4th
    assert _group_text("a,b,c,d", min_tokens=7) == ("a,b,c,d", False)
