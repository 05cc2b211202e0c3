"""Hostile constraints: the mask holds at any temperature, compiles are bounded in time
and size and cancelled with their request, and the compiled-grammar cache is bounded."""
from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from stallfree import SamplingParams
from stallfree.executor.sampler import Sampler
from stallfree.request import Request


# ---- the mask holds at every temperature ---------------------------------------------
@pytest.mark.parametrize("temperature", [1e300, 3.5e38, 3.4e38, 1e30])
@pytest.mark.parametrize("extra", [{}, {"top_p": 0.9}, {"top_k": 5}, {"min_p": 0.1}])
def test_a_huge_temperature_keeps_the_mask(temperature, extra):
    vocab = 100
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0))
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    bitmask.zero_()
    allowed = {5, 70}
    for t in allowed:
        bitmask[0, t // 32] |= 1 << (t % 32)
    requests = [Request(rid, [1, 2], SamplingParams(temperature=temperature, **extra), 0.0,
                        eos_token_ids=frozenset({0})) for rid in ("masked", "free")]
    picked = [Sampler(seed=seed)(logits, requests, bitmask, {"masked": 0})
              for seed in range(40)]
    assert {masked for masked, _ in picked} == allowed  # uniform over the allowed: both
    assert len({free for _, free in picked}) > 2  # unmasked: anything, no NaN row
