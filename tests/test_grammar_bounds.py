"""Hostile constraints: the mask holds at any temperature, compiles are bounded in time
and size and cancelled with their request, and the compiled-grammar cache is bounded."""
from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from stallfree import SamplingParams
from stallfree.executor.sampler import Sampler
from stallfree.request import Request
from stallfree.structured import build_grammar
from stallfree.structured_outputs import ConstraintError, StructuredOutputs


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


# ---- what cannot be enforced is refused -----------------------------------------------
@pytest.mark.parametrize("schema", [
    {"$ref": "http://example.com/person.json"},
    {"type": "object", "properties": {"a": {"$ref": "other.json#/$defs/a"}}},
    {"type": "array", "items": {"$ref": 5}},
])
def test_an_external_ref_is_refused_naming_the_field(schema):
    with pytest.raises(ConstraintError) as err:
        build_grammar(StructuredOutputs(json=schema, source="response_format.json_schema"
                                                            ".schema"))
    assert err.value.param == "response_format.json_schema.schema" and "$ref" in str(err.value)


def test_a_local_ref_still_compiles():
    build_grammar(StructuredOutputs(json={"$ref": "#/$defs/a",
                                          "$defs": {"a": {"type": "integer"}}}))
