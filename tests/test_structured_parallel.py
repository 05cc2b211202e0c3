"""Constrained decoding with the model in worker processes: the bitmask travels with the
batch to the sampling rank, and matchers stay right with micro-batches in flight."""
from __future__ import annotations

import re

from stallfree import LLM, SamplingParams
from test_parallel import ENGINE, small_model  # noqa: F401 - the fixture, shared

PROMPTS = [[(11 * i + 5 * j) % 4000 + 20 for j in range(n)] for i, n in enumerate((4, 21, 9))]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=40,
                         structured_outputs={"regex": r"[a-z]{2,6}-[0-9]{2}"}),
          SamplingParams(temperature=1.0, seed=4, max_tokens=40,
                         structured_outputs={"choice": ["north", "south", "east or west"]}),
          SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)]


def test_pipeline_stages_constrain_like_one_process(small_model):  # noqa: F811
    single = LLM(small_model, **ENGINE).generate(PROMPTS, PARAMS)
    with LLM(small_model, pipeline_parallel_size=2, **ENGINE) as llm:
        staged = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in staged] == [o.token_ids for o in single]
    assert re.fullmatch(r"[a-z]{2,6}-[0-9]{2}", staged[0].text)
    assert staged[1].text in ("north", "south", "east or west")
    assert len(staged[2].token_ids) == 12
