"""Phi-3 and Gemma 2 GGUF files written by llama.cpp's own converter (convert_hf_to_gguf.py)
load and give transformers' greedy tokens.

Their converters read the vocabulary only from a SentencePiece `tokenizer.model`, so each tiny
model gets its own: a small byte-fallback BPE SentencePiece model trained here on a shipped
essay, with the Hugging Face tokenizer of the family built from its pieces, and the model's
vocab_size set to the SentencePiece size. The GGUF then carries a SentencePiece ("llama")
vocabulary, which the engine's tokenizer (rebuilt by transformers from the file) reads back.

The converter is unpacked by `make converter` (tests/test_gguf_families.py says how).
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from stallfree import LLM, SamplingParams
from stallfree.model import load_model
from stallfree.model.kernels import unavailable_reason
from stallfree.model.loader import load_model_config
from stallfree.model.quant_load import weight_types
from test_gguf_families import CONVERTER, STEPS, convert_command
from tiny_models import build_tiny_model

ESSAY = Path(__file__).resolve().parent.parent / "stallfree" / "data" / "text" / \
    "perplexity_essay.txt"
VOCAB = 512  # 256 byte pieces, the specials, then BPE merges of the essay
HEAD_DIM = 16  # tiny_models.LLAMA's


# What each family's SentencePiece model and tokenizer look like (their special pieces in the
# real models' order; Llama-style models prepend a space to the text, Gemma's do not), and
# what its tiny model sets for the test.
# Gemma 2's files keep neither query_pre_attn_scalar nor which layers are local: llama.cpp
# takes 1/sqrt(head_dim) and the even layers local (transformers' default layer_types too).
# Its converter drops lm_head.weight (llama.cpp reads the output from token_embd), so the
# embeddings are tied, as in the released models.
SPECS = {
    "phi3": dict(
        spm=dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1, add_dummy_prefix=True),
        tokens=dict(unk_token="<unk>", bos_token="<s>", eos_token="</s>", add_bos_token=True),
        model=dict(bos_token_id=1, eos_token_id=2)),
    "gemma2": dict(
        spm=dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>",
                 bos_piece="<bos>", add_dummy_prefix=False),
        tokens=dict(pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>",
                    mask_token=None, add_bos_token=True),
        model=dict(bos_token_id=2, eos_token_id=1, pad_token_id=0, tie_word_embeddings=True,
                   query_pre_attn_scalar=HEAD_DIM)),
}


def essay_lines() -> list[str]:
    return [line for line in ESSAY.read_text(encoding="utf-8").splitlines() if line.strip()]


def train_sentencepiece(kind: str, path: Path):
    """A byte-fallback BPE SentencePiece model of VOCAB pieces written to `path`; returns its
    processor. Identity normalisation and kept whitespace, so the Hugging Face tokenizer built
    from its pieces (hf_tokenizer) splits text as it does."""
    import io

    import sentencepiece as spm

    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(essay_lines()), model_writer=proto, vocab_size=VOCAB,
        model_type="bpe", byte_fallback=True, character_coverage=1.0,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        split_digits=True, num_threads=1, minloglevel=2, **SPECS[kind]["spm"])
    path.write_bytes(proto.getvalue())
    return spm.SentencePieceProcessor(model_file=str(path))


def hf_tokenizer(kind: str, sp):
    """The family's transformers tokenizer (Llama's for Phi-3, as the released models ship)
    over the SentencePiece model's pieces, its merges ranked by piece score as transformers'
    own conversion ranks them (which needs protobuf, absent here)."""
    from transformers import GemmaTokenizer, LlamaTokenizer
    from transformers.tokenization_utils_base import generate_merges

    size = sp.get_piece_size()
    vocab = {sp.id_to_piece(i): i for i in range(size)}
    specials = {sp.id_to_piece(i) for i in range(size) if sp.is_control(i) or sp.is_unknown(i)}
    merges = generate_merges(vocab, skip_tokens=specials)
    if kind == "phi3":
        return LlamaTokenizer(vocab=vocab, merges=merges, add_prefix_space=True, legacy=False,
                              **SPECS[kind]["tokens"])
    return GemmaTokenizer(vocab=vocab, merges=merges, **SPECS[kind]["tokens"])


def text_and_prompt(sp) -> tuple[str, list[int]]:
    """An essay passage of about 40 tokens and its ids (bos first): longer than Gemma 2's
    16-token window and than the 12-token prefill chunks."""
    words = " ".join(essay_lines()[3:6]).split()
    text = " ".join(words[:next(n for n in range(1, len(words))
                                if len(sp.encode(" ".join(words[:n]))) >= 40)])
    return text, [sp.bos_id()] + sp.encode(text)


@pytest.fixture(scope="module", params=sorted(SPECS))
def converted(request, tmp_path_factory):
    if not (CONVERTER / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"llama.cpp's converter is not unpacked in {CONVERTER} (`make converter`)")
    pytest.importorskip("sentencepiece")
    kind = request.param
    folder = tmp_path_factory.mktemp(kind)
    hf = folder / "hf"
    hf.mkdir()
    sp = train_sentencepiece(kind, hf / "tokenizer.model")
    tokenizer = hf_tokenizer(kind, sp)
    text, prompt = text_and_prompt(sp)
    for line in essay_lines():
        assert tokenizer(line).input_ids == [sp.bos_id()] + sp.encode(line), (kind, line)
    extra = dict(SPECS[kind]["model"], vocab_size=sp.get_piece_size())
    ref = build_tiny_model(kind, attn_implementation="eager", **extra)
    ref.save_pretrained(hf, safe_serialization=True)
    tokenizer.save_pretrained(hf)
    env = dict(os.environ, PYTHONPATH=str(CONVERTER / "gguf-py"))
    for outtype in ("f32", "q8_0"):
        done = subprocess.run(convert_command(str(hf), str(folder / f"{outtype}.gguf"), outtype),
                              env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    return kind, str(folder / "f32.gguf"), ref, text, prompt


def test_converted_gguf_loads_as_its_family(converted):
    kind, path, ref, _, _ = converted
    config = load_model_config(path)
    assert config.architecture == kind
    assert config.vocab_size == ref.config.vocab_size
    if kind == "gemma2":
        assert config.sliding_window == ref.config.sliding_window
        assert config.window_layers == [True, False, True]
        assert (config.attention_scale or HEAD_DIM ** -0.5) == pytest.approx(HEAD_DIM ** -0.5)
        assert config.attn_logit_softcap == ref.config.attn_logit_softcapping
        assert config.final_logit_softcap == ref.config.final_logit_softcapping
    else:
        assert config.sliding_window is None


def test_converted_gguf_gives_transformers_greedy_tokens(converted):
    kind, path, ref, text, prompt = converted
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(STEPS):
            ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
    llm = LLM(path, dtype="float32", quantization="none", kv_cache_memory=8 << 20,
              block_size=16, max_num_batched_tokens=12)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=STEPS,
                                                ignore_eos=True))[0]
    assert out.token_ids == ids[len(prompt):], kind
    # The engine's tokenizer, rebuilt from the file's SentencePiece vocabulary, splits the
    # passage as SentencePiece did.
    assert llm.tokenizer(text).input_ids == prompt, kind


def test_converted_q8_0_gguf_stays_quantized_and_close(converted):
    """The same model as Q8_0: the first step's top logprobs within Q8_0's rounding of the
    float file's, and (where the CPU kernels are built) every matmul weight kept quantized,
    Phi-3's fused q/k/v and gate/up included."""
    kind, path, _, _, prompt = converted
    q8_path = path.removesuffix("f32.gguf") + "q8_0.gguf"
    tops = []
    for file, many in ((path, 5), (q8_path, 20)):
        # Gemma 2's capped logits (within +-3 over 512 tokens) lie close together, so Q8_0
        # may reorder the top 5: the float file's are looked up in the Q8_0 file's top 20.
        params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=many)
        llm = LLM(file, dtype="float32", kv_cache_memory=8 << 20, block_size=16)
        tops.append(dict(llm.generate([prompt], params)[0].outputs[0].logprobs[0].top))
    for token, value in tops[0].items():
        assert abs(tops[1].get(token, -1e9) - value) < 0.1, (kind, token)
    model, _ = load_model(q8_path, torch.float32, "cpu", quantization="auto")
    if unavailable_reason() is not None:
        pytest.skip(f"weights dequantized at load: {unavailable_reason()}")
    types = weight_types(model)
    assert "float32" not in types and types.get("q8_32", 0) > 0, types


def test_partial_rotary_gguf_is_refused(tmp_path):
    """Phi-4-mini's kind of file (the phi3 architecture, half of each head rotated) is
    refused at its metadata, as its config.json is, not loaded with the wrong RoPE."""
    if not (CONVERTER / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"llama.cpp's converter is not unpacked in {CONVERTER} (`make converter`)")
    pytest.importorskip("sentencepiece")
    hf = tmp_path / "hf"
    hf.mkdir()
    sp = train_sentencepiece("phi3", hf / "tokenizer.model")
    hf_tokenizer("phi3", sp).save_pretrained(hf)
    build_tiny_model("phi3", vocab_size=sp.get_piece_size(), partial_rotary_factor=0.5,
                     **SPECS["phi3"]["model"]).save_pretrained(hf, safe_serialization=True)
    out = tmp_path / "partial.gguf"
    done = subprocess.run(convert_command(str(hf), str(out)), capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(CONVERTER / "gguf-py")),
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    with pytest.raises(ValueError, match="partial rotary"):
        load_model_config(str(out))
    with pytest.raises(ValueError, match="partial rotary"):
        load_model_config(str(hf))
