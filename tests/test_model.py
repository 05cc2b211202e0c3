"""Our decoder vs Hugging Face transformers on small random-weight models.

Weights reach our model through the HF-directory loader (save_pretrained with
safetensors, then load_model), so the fused q/k/v and gate/up copies are tested too.
"""
from __future__ import annotations

import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stallfree.model import (
    AttentionMetadata,
    CausalLM,
    ModelConfig,
    allocate_kv_cache,
    kv_cache_bytes_per_token,
    load_model,
)
from stallfree.model.families import config_from_hf

BLOCK_SIZE = 4
NUM_BLOCKS = 48
TOL = 1e-4

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)

CASES = {
    "llama_gqa_untied": ("llama", dict(tie_word_embeddings=False)),
    "llama_tied_llama3_rope": ("llama", dict(
        tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "qwen2_bias": ("qwen2", dict(tie_word_embeddings=False, rope_theta=1000000.0)),
}


def _build_reference(kind: str, extra: dict):
    from transformers import LlamaConfig, Qwen2Config
    from transformers import LlamaForCausalLM as HFLlama
    from transformers import Qwen2ForCausalLM as HFQwen2

    torch.manual_seed(0)
    if kind == "llama":
        ref = HFLlama(LlamaConfig(**SMALL, **extra, attn_implementation="eager"))
    else:
        ref = HFQwen2(Qwen2Config(**SMALL, **extra, attn_implementation="eager"))
    # Default init leaves biases at zero and norms at one; randomise everything so
    # a wrongly placed bias or norm weight shows up in the logits.
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.08)
    return ref.float().eval()


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    kind, extra = CASES[request.param]
    ref = _build_reference(kind, extra)
    folder = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(folder, safe_serialization=True)
    model, config = load_model(str(folder), torch.float32, "cpu")
    return model, config, ref


def _ref_logits(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float()


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


class _Request:
    """Token ids plus a shuffled block table; tracks how many tokens are cached."""

    def __init__(self, ids: list[int], blocks: list[int]) -> None:
        self.ids, self.blocks, self.cached = ids, blocks, 0


def _step(model: CausalLM, kv: torch.Tensor,
          batch: list[tuple[_Request, int]]) -> torch.Tensor:
    """One forward over (request, num_new_tokens) entries; returns logits for every row."""
    meta = AttentionMetadata.build([(r.cached, n, r.blocks) for r, n in batch], BLOCK_SIZE, "cpu")
    ids = torch.tensor([t for r, n in batch for t in r.ids[r.cached:r.cached + n]])
    pos = torch.cat([torch.arange(r.cached, r.cached + n) for r, n in batch])
    with torch.inference_mode():
        logits = model.compute_logits(model(ids, pos, meta, kv))
    for r, n in batch:
        r.cached += n
    return logits


def _shuffled_blocks(seed: int) -> list[int]:
    blocks = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(blocks)
    return blocks


def test_single_prefill_matches_hf(pair):
    model, config, ref = pair
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (29,), generator=gen).tolist()
    kv = allocate_kv_cache(config, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu")
    req = _Request(ids, _shuffled_blocks(0)[:8])
    ours = _step(model, kv, [(req, len(ids))])
    assert ours.dtype == torch.float32 and ours.shape == (29, config.vocab_size)
    assert _rel_err(ours, _ref_logits(ref, ids)) < TOL


def test_chunked_prefill_then_decodes_match_hf(pair):
    model, config, ref = pair
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, config.vocab_size, (30,), generator=gen).tolist()
    expected = _ref_logits(ref, ids)
    kv = allocate_kv_cache(config, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu")
    req = _Request(ids, _shuffled_blocks(1)[:8])  # non-contiguous, out-of-order blocks
    for n in [7, 3, 9, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1]:
        start = req.cached
        ours = _step(model, kv, [(req, n)])
        assert _rel_err(ours, expected[start:start + n]) < TOL, f"chunk at {start}+{n}"
    assert req.cached == len(ids)


def test_mixed_batch_matches_hf(pair):
    model, config, ref = pair
    gen = torch.Generator().manual_seed(3)
    lens = [22, 13, 9, 17, 26]
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in lens]
    blocks = _shuffled_blocks(2)
    reqs = [_Request(s, blocks[i * 8:(i + 1) * 8]) for i, s in enumerate(seqs)]
    kv = allocate_kv_cache(config, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu")
    # Warm the caches: request 0 has a cached prefix of 8, request 1 starts fresh,
    # requests 2-4 are fully prefilled except their last token.
    _step(model, kv, [(reqs[0], 8)])
    for r in reqs[2:]:
        _step(model, kv, [(r, len(r.ids) - 1)])
    starts = [r.cached for r in reqs]
    batch = [(reqs[0], 6), (reqs[1], 10), (reqs[2], 1), (reqs[3], 1), (reqs[4], 1)]
    ours = _step(model, kv, batch)
    row = 0
    for (_, n), start, s in zip(batch, starts, seqs):
        expected = _ref_logits(ref, s)[start:start + n]
        assert _rel_err(ours[row:row + n], expected) < TOL, f"request at {start}+{n}"
        row += n


def test_decodes_in_several_length_groups_match_hf(pair, monkeypatch):
    """Decodes of very different lengths run in separate gathers (no merging here), in
    an order that differs from the batch's; every row must still get its own logits."""
    import stallfree.attention_plan as plan

    monkeypatch.setattr(plan, "CALL_COST_TOKENS", 0)
    model, config, ref = pair
    gen = torch.Generator().manual_seed(4)
    lens = [4, 41, 10, 33, 2]  # contexts of the decode step
    assert len(plan.decode_groups(lens, BLOCK_SIZE)) == 3  # [41, 33], [10], [4, 2]
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in lens]
    blocks = _shuffled_blocks(5)
    reqs = [_Request(s, blocks[i * 11:(i + 1) * 11]) for i, s in enumerate(seqs)]
    kv = allocate_kv_cache(config, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu")
    for r in reqs:
        _step(model, kv, [(r, len(r.ids) - 1)])
    ours = _step(model, kv, [(r, 1) for r in reqs])
    for i, s in enumerate(seqs):
        assert _rel_err(ours[i:i + 1], _ref_logits(ref, s)[-1:]) < TOL, f"decode of {lens[i]}"


def test_tied_model_has_no_separate_lm_head(pair):
    model, config, _ = pair
    assert (model.lm_head is None) == config.tie_word_embeddings


def test_metadata_rejects_decode_before_prefill():
    with pytest.raises(ValueError, match="before decodes"):
        AttentionMetadata.build([(3, 1, [0]), (0, 5, [1, 2])], BLOCK_SIZE, "cpu")
    with pytest.raises(ValueError, match="cannot hold"):
        AttentionMetadata.build([(0, 9, [0, 1])], BLOCK_SIZE, "cpu")


def test_metadata_slot_mapping():
    meta = AttentionMetadata.build([(2, 3, [5, 1]), (6, 1, [0, 7])], BLOCK_SIZE, "cpu")
    # positions 2,3 -> block 5; 4 -> block 1; position 6 -> block 7 offset 2
    assert meta.slot_mapping.tolist() == [22, 23, 4, 30]
    assert meta.num_prefill_tokens == 3 and meta.prefill_context_lens == [5]
    assert meta.decode_context_lens.tolist() == [7]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 40)), min_size=1, max_size=6),
       st.sampled_from([1, 4, 16]), st.randoms(use_true_random=False))
def test_metadata_slot_mapping_is_each_tokens_block_and_offset(spans, block_size, rng):
    seqs = []
    for start, count in sorted(spans, key=lambda s: s[1] == 1):  # prefills before decodes
        table = rng.sample(range(500), -(-(start + count) // block_size))
        seqs.append((start, count, table))
    meta = AttentionMetadata.build(seqs, block_size, "cpu")
    expect = [table[p // block_size] * block_size + p % block_size
              for start, count, table in seqs for p in range(start, start + count)]
    assert meta.slot_mapping.tolist() == expect
    assert meta.slot_mapping.dtype == torch.int64


def test_kv_cache_shape_and_bytes():
    config = ModelConfig(architecture="llama", **{k: v for k, v in SMALL.items()
                                                  if k not in ("bos_token_id", "eos_token_id")})
    kv = allocate_kv_cache(config, 3, BLOCK_SIZE, torch.float16, "cpu")
    assert kv.shape == (2, 2, 3, BLOCK_SIZE, 2, 16) and not kv.any()
    assert kv_cache_bytes_per_token(config, torch.float16) == 2 * 2 * 2 * 16 * 2


def test_config_from_hf_rejects_unknown_rope_and_arch():
    base = dict(SMALL, architectures=["LlamaForCausalLM"])
    cfg = config_from_hf(dict(base, rope_scaling={"type": "linear", "factor": 2.0}))
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    with pytest.raises(ValueError, match="rope_scaling"):
        config_from_hf(dict(base, rope_scaling={"rope_type": "yarn", "factor": 2.0}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        config_from_hf(dict(base, architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError, match="partial rotary"):
        config_from_hf(dict(base, partial_rotary_factor=0.5))
    with pytest.raises(ValueError, match="hidden activation"):
        config_from_hf(dict(base, hidden_act="relu"))


def test_clean_kv_blocks_zeroes_only_blocks_a_chunk_starts_and_leaves_part_unwritten():
    from stallfree.executor.model_runner import clean_kv_blocks

    cache = torch.full((2, 2, 8, BLOCK_SIZE, 1, 2), float("nan"))
    seqs = [(0, 6, [1, 2]),  # fills block 1, starts block 2 and leaves half of it: clean 2
            (4, 4, [3, 4]),  # fills block 4 exactly: nothing to clean
            (9, 1, [5, 6, 7]),  # a decode inside block 7, begun by an earlier chunk
            (12, 1, [0, 0, 0, 6])]  # a decode starting block 6: clean it
    clean_kv_blocks(cache, seqs, BLOCK_SIZE)
    zeroed = [b for b in range(8) if torch.equal(cache[:, :, b], torch.zeros_like(cache[:, :, b]))]
    assert zeroed == [2, 6]
    assert torch.isnan(cache[:, :, [0, 1, 3, 4, 5, 7]]).all()
