"""Weight and tokenizer loading: the default GGUF vs transformers, GGUF quant types, errors."""
from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from stallfree.model import (
    AttentionMetadata,
    allocate_kv_cache,
    default_model_path,
    eos_token_ids,
    load_model,
    load_tokenizer,
)
from stallfree.model.linear import plain_weight

PROMPT = ("The paged KV cache stores keys and values in fixed-size blocks, so a serving "
          "engine can grow many sequences at once without fragmenting memory. Explain why.")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def default_model():
    return load_model(None, torch.float32, "cpu")


def _hf_gguf_reference(path: str):
    """transformers' own GGUF conversion (dequantise + un-permute) into its Llama model.

    `from_pretrained(gguf_file=...)` would do the same but requires `accelerate`, which
    this project does not depend on; the conversion function underneath does not.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = dict(load_gguf_checkpoint(path)["config"])
    cfg.pop("_model_name_or_path", None)
    hf_config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    ref = AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager",
                                           dtype=torch.float32)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=ref)["tensors"]
    ref.load_state_dict(tensors, strict=False)
    ref.tie_weights()
    return ref.eval()


def test_default_gguf_matches_transformers(default_model, tokenizer):
    model, config = default_model
    ids = tokenizer(PROMPT)["input_ids"]
    assert 30 <= len(ids) <= 50
    ref = _hf_gguf_reference(default_model_path())
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0].float()
    kv = allocate_kv_cache(config, 8, 16, torch.float32, "cpu")
    meta = AttentionMetadata.build([(0, len(ids), [5, 2, 7, 0])], 16, "cpu")
    with torch.inference_mode():
        ours = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), meta, kv))
    err = (ours - expected).abs().max() / expected.abs().max()
    assert err < 1e-4, err


def test_default_config(default_model):
    _, config = default_model
    assert config.architecture == "llama" and config.tie_word_embeddings
    assert config.num_key_value_heads < config.num_attention_heads  # GQA


def test_default_tokenizer(tokenizer, default_model):
    _, config = default_model
    assert tokenizer.chat_template
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}],
                                         tokenize=False, add_generation_prompt=True)
    assert "Hi there" in chat
    ids = tokenizer(PROMPT)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == PROMPT
    eos = eos_token_ids(tokenizer, config)
    assert tokenizer.eos_token_id in eos and config.eos_token_id in eos


def test_a_gguf_tokenizer_is_rebuilt_once_then_loaded_from_its_cache(tmp_path, monkeypatch):
    """The first load parses the GGUF and saves a tokenizer directory; the next loads that,
    and tokenizes, templates and decodes exactly as the rebuilt one."""
    monkeypatch.setenv("STALLFREE_BUILD_DIR", str(tmp_path))
    rebuilt = load_tokenizer(None)
    saved = list((tmp_path / "tokenizers").iterdir())
    assert len(saved) == 1 and (saved[0] / "tokenizer.json").exists()
    cached = load_tokenizer(None)
    assert list((tmp_path / "tokenizers").iterdir()) == saved  # loaded, not written again
    texts = [PROMPT, "def f(x):\n    return x**2  # \u00fcn\u00efc\u00f8d\u00e9 \u4f60\u597d",
             "  two  spaces\t\ttabs", "<|im_start|>user"]
    for text in texts:
        assert cached.encode(text) == rebuilt.encode(text), text
        assert cached.decode(cached.encode(text)) == rebuilt.decode(rebuilt.encode(text))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert (cached.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == rebuilt.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    assert (cached.eos_token_id, cached.bos_token_id, len(cached)) == (
        rebuilt.eos_token_id, rebuilt.bos_token_id, len(rebuilt))


# ------------------------------------------------------------------ hand-written GGUF

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 64, 4, 2, 16, 96, 64


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The row order llama.cpp's converter writes for llama Q/K (pairs rotary halves)."""
    return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _write_gguf(path, arch: str = "llama") -> dict[str, tuple[np.ndarray, object]]:
    """A one-layer model mixing tensor types; returns name -> (stored data, type)."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_eos_token_id(2)

    def mat(rows: int, cols: int) -> np.ndarray:
        return rng.standard_normal((rows, cols)).astype(np.float32)

    plan = {  # name: (numpy [rows, cols] or [n], type)
        "token_embd.weight": (mat(VOCAB, HIDDEN), Q.Q8_0),
        "output_norm.weight": (rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32), Q.F32),
        "output.weight": (mat(VOCAB, HIDDEN), Q.F16),
        "blk.0.attn_norm.weight": (rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32), Q.F32),
        "blk.0.ffn_norm.weight": (rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32), Q.F32),
        "blk.0.attn_q.weight": (mat(HEADS * HEAD_DIM, HIDDEN), Q.Q4_0),
        "blk.0.attn_k.weight": (mat(KV_HEADS * HEAD_DIM, HIDDEN), Q.Q4_1),
        "blk.0.attn_v.weight": (mat(KV_HEADS * HEAD_DIM, HIDDEN), Q.Q8_0),
        "blk.0.attn_output.weight": (mat(HIDDEN, HEADS * HEAD_DIM), Q.Q5_0),
        "blk.0.ffn_gate.weight": (mat(FFN, HIDDEN), Q.Q4_1),
        "blk.0.ffn_up.weight": (mat(FFN, HIDDEN), Q.Q5_1),
        "blk.0.ffn_down.weight": (mat(HIDDEN, FFN), Q.F32),
    }
    stored = {}
    for name, (data, qtype) in plan.items():
        q = gguf.quants.quantize(data, qtype)
        w.add_tensor(name, q, raw_dtype=qtype if q.dtype == np.uint8 else None)
        stored[name] = (q, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


@pytest.mark.parametrize("metadata", ["parsed", "from its index"])
def test_gguf_quant_types_load_exactly(tmp_path, monkeypatch, metadata):
    """Parsed by gguf's reader, or mapped from the offsets a first parse saved (the reader
    then never runs): every tensor loads exactly."""
    import gguf
    from gguf.quants import dequantize

    from stallfree.model import build_cache, gguf_index

    monkeypatch.setattr(build_cache, "build_dir", lambda: tmp_path / "build")
    path = tmp_path / "tiny.gguf"
    stored = _write_gguf(path)
    if metadata == "from its index":
        gguf_index.read_gguf(str(path))
        assert len(list((tmp_path / "build" / "gguf").iterdir())) == 1

        def no_parse(*args, **kwargs):
            raise AssertionError("the GGUF was parsed again")
        monkeypatch.setattr(gguf, "GGUFReader", no_parse)
    model, config = load_model(str(path), torch.float32, "cpu")
    assert (config.hidden_size, config.num_key_value_heads, config.head_dim) \
        == (HIDDEN, KV_HEADS, HEAD_DIM)
    assert not config.tie_word_embeddings and config.eos_token_id == 2

    def deq(name: str) -> torch.Tensor:
        q, qtype = stored[name]
        return torch.from_numpy(np.array(dequantize(q, qtype), dtype=np.float32))

    def plain(module: torch.nn.Module) -> torch.Tensor:  # read back where packed alone
        return plain_weight(module.weight, module.packed)

    layer = model.model.layers[0]
    q_rows, kv_rows = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    qkv = plain(layer.self_attn.qkv_proj)
    gate_up = plain(layer.mlp.gate_up_proj)
    checks = {
        "token_embd.weight": model.model.embed_tokens.weight,
        "output_norm.weight": model.model.norm.weight,
        "output.weight": plain(model.lm_head),
        "blk.0.attn_norm.weight": layer.input_layernorm.weight,
        "blk.0.ffn_norm.weight": layer.post_attention_layernorm.weight,
        "blk.0.attn_v.weight": qkv[q_rows + kv_rows:],
        "blk.0.attn_output.weight": plain(layer.self_attn.o_proj),
        "blk.0.ffn_gate.weight": gate_up[:FFN],
        "blk.0.ffn_up.weight": gate_up[FFN:],
        "blk.0.ffn_down.weight": plain(layer.mlp.down_proj),
    }
    for name, param in checks.items():
        torch.testing.assert_close(param, deq(name), rtol=0, atol=0, msg=name)
    # Q/K come back in HF row order: permuting them the way llama.cpp does gives the file's rows.
    for name, rows, heads in (("blk.0.attn_q.weight", qkv[:q_rows], HEADS),
                              ("blk.0.attn_k.weight", qkv[q_rows:q_rows + kv_rows], KV_HEADS)):
        permuted = torch.from_numpy(_llama_cpp_permute(rows.numpy(), heads))
        torch.testing.assert_close(permuted, deq(name), rtol=0, atol=0, msg=name)


def test_info_names_what_a_load_keeps_quantized(tmp_path, monkeypatch):
    """`stallfree info`'s weights line follows the load's plan: fused matrices held in their
    common format, and a matrix of a type without a kernel (F16, F32) not counted."""
    from stallfree.model import build_cache
    from stallfree.model.loader import planned_weights
    from stallfree.model.parallel import Shard

    monkeypatch.setattr(build_cache, "build_dir", lambda: tmp_path / "build")
    path = tmp_path / "tiny.gguf"
    _write_gguf(path)
    line, kept = planned_weights(str(path), "auto", torch.device("cpu"), Shard())
    # qkv (Q4_0, Q4_1, Q8_0) and gate/up (Q4_1, Q5_1) fused in q8_16m; o (Q5_0) and the
    # embedding (Q8_0) in q8_32; down (F32) and the LM head (F16) stay floats.
    assert kept and line.endswith("kept quantized as q8_16m x2, q8_32 x2"), line
    line, kept = planned_weights(str(path), "none", torch.device("cpu"), Shard())
    assert not kept and "dequantized" in line


def test_gguf_unknown_arch(tmp_path):
    import gguf

    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="gpt2"):
        load_model(str(path), torch.float32, "cpu")


def test_hf_dir_unknown_arch(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 8,
        "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
        "num_attention_heads": 2}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_model(str(tmp_path), torch.float32, "cpu")


def test_missing_paths(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_model(str(tmp_path / "nope.gguf"), torch.float32, "cpu")
    with pytest.raises(FileNotFoundError):
        load_tokenizer(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path), torch.float32, "cpu")  # empty directory
