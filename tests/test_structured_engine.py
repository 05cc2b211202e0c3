"""Constrained decoding end to end on the default model (offline API)."""
from __future__ import annotations

import json
import re
import threading
from concurrent.futures import Future

import jsonschema
import pytest

from json_schemas import SCHEMAS
from stallfree import SamplingParams
from stallfree.model.decoder import kv_cache_bytes_per_token
from stallfree.structured import GrammarCompileService


@pytest.fixture
def llm(default_llm):
    default_llm.reconfigure(token_budget=512, kv_cache_memory=None)
    return default_llm


def _chat(llm, text: str) -> list[int]:
    return llm.apply_chat_template([{"role": "user", "content": text}])


@pytest.fixture(scope="module")
def json_answers(default_llm) -> list[tuple[dict, object, object]]:
    """(schema, greedy output, sampled output) for every schema, generated in one batch;
    max_tokens far above what any answer needs: the grammar, not the limit, ends them."""
    default_llm.reconfigure(token_budget=512, kv_cache_memory=None)
    prompts, params = [], []
    for i, (prompt, schema) in enumerate(SCHEMAS):
        for temperature, seed in ((0.0, None), (1.0, i)):
            prompts.append(_chat(default_llm, f"{prompt} Answer in JSON."))
            params.append(SamplingParams(temperature=temperature, seed=seed, max_tokens=512,
                                         structured_outputs={"json": schema}))
    outs = default_llm.generate(prompts, params)
    return [(schema, outs[2 * i], outs[2 * i + 1]) for i, (_, schema) in enumerate(SCHEMAS)]


def test_json_schemas_always_parse_and_validate_greedy_and_sampled(json_answers):
    assert len(json_answers) >= 20
    for schema, *outs in json_answers:
        for out in outs:
            assert out.finish_reason == "stop", out.text
            jsonschema.validate(json.loads(out.text), schema)


def test_regex_choice_and_finite_grammar_outputs_always_match(llm):
    regexes = [r"\d{3}-\d{4}", r"(yes|no), because [a-z ]{1,30}\.", r"[A-Z][a-z]{2,10}",
               r"#[0-9a-f]{6}"]
    choices = [["red", "green", "blue"], ["It is true.", "It is false.", "Nobody knows."]]
    grammar = 'root ::= ("a" | "the") " " ("red" | "blue") " " ("cat" | "dog")'
    finite = {f"{a} {c} {d}" for a in ("a", "the") for c in ("red", "blue") for d in ("cat", "dog")}
    cases = ([("regex", r) for r in regexes] + [("choice", c) for c in choices]
             + [("grammar", grammar)])
    prompts, params = [], []
    for kind, value in cases:
        for seed in (None, 1):
            prompts.append(_chat(llm, "Answer briefly: what do you see?"))
            params.append(SamplingParams(temperature=0.0 if seed is None else 1.2, seed=seed,
                                         max_tokens=64, structured_outputs={kind: value}))
    for out, p in zip(llm.generate(prompts, params), params):
        spec = p.structured_outputs
        assert out.finish_reason == "stop", out.text
        if spec.kind == "regex":
            assert re.fullmatch(spec.regex, out.text), (spec.regex, out.text)
        elif spec.kind == "choice":
            assert out.text in spec.choice
        else:
            assert out.text in finite


def test_constrained_requests_leave_their_neighbours_tokens_unchanged(llm):
    free = [_chat(llm, t) for t in ("Name three rivers.", "Tell me about cats.")]
    free_params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                   SamplingParams(temperature=0.7, top_p=0.9, seed=12, max_tokens=8,
                                  ignore_eos=True)]
    alone = [o.token_ids for o in llm.generate(free, free_params)]
    constrained = [SamplingParams(temperature=0.0, max_tokens=8,
                                  structured_outputs={"json": SCHEMAS[0][1]}),
                   SamplingParams(temperature=1.0, seed=3, max_tokens=8,
                                  structured_outputs={"regex": "[0-9 ]+"})]
    outs = llm.generate(free + [_chat(llm, "Describe a person."), _chat(llm, "Numbers?")],
                        free_params + constrained)
    assert [o.token_ids for o in outs[:2]] == alone
    ids = {o.request_id for o in outs}
    mixed = [r for r in llm.engine.iterations if set(r.request_ids) >= ids]
    assert mixed, "the constrained requests never shared an iteration with the others"


def test_preempted_requests_recompute_and_keep_following_their_grammar(llm, json_answers):
    # The longer answers; a cache too small for all of them at once forces recomputes,
    # after which each matcher must carry on from the request's kept outputs.
    chosen = [7, 8, 16]
    prompts = [_chat(llm, f"{SCHEMAS[i][0]} Answer in JSON.") for i in chosen]
    params = [SamplingParams(temperature=0.0, max_tokens=80,
                             structured_outputs={"json": SCHEMAS[i][1]}) for i in chosen]
    engine = llm.engine
    block_bytes = kv_cache_bytes_per_token(engine.model_config, engine.dtype) * 16
    llm.reconfigure(token_budget=128, kv_cache_memory=8 * block_bytes)
    try:
        outs = llm.generate(prompts, params)
    finally:
        llm.reconfigure(token_budget=512, kv_cache_memory=None)
    assert sum(o.outputs[0].num_preemptions for o in outs) > 0, "nothing was preempted"
    # Greedy: the same tokens as without preemption.
    assert [o.token_ids for o in outs] == [json_answers[i][1].token_ids for i in chosen]


class GatedService(GrammarCompileService):
    """Compiles as usual but hands nothing out before `gate` opens (or fails then)."""

    def __init__(self, base: GrammarCompileService, fail: bool = False) -> None:
        super().__init__(base.tokenizer, base.vocab_size, frozenset(base.stop_token_ids))
        self.gate = threading.Event()
        self.fail = fail

    def submit(self, spec):
        inner, outer = super().submit(spec), Future()

        def hand_out() -> None:
            self.gate.wait()
            if self.fail:
                outer.set_exception(RuntimeError("compile failed"))
            else:
                outer.set_result(inner.result())
        threading.Thread(target=hand_out, daemon=True).start()
        return outer


@pytest.mark.parametrize("fail", [False, True])
def test_a_compiling_grammar_never_holds_up_the_others(llm, fail):
    engine = llm.engine
    original, engine.grammars = engine.grammars, GatedService(engine.grammars, fail)
    try:
        engine.add_request("free", _chat(llm, "Hello!"),
                           SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        engine.add_request("json", _chat(llm, "Describe a person."),
                           SamplingParams(temperature=0.0, max_tokens=64,
                                          structured_outputs={"json": SCHEMAS[0][1]}))
        finished = {}
        while "free" not in finished:
            step = engine.step()
            assert step.record is not None  # every step runs an iteration
            assert "json" not in step.record.request_ids
            finished.update({o.request_id: o for o in step.finished})
        assert engine.request_output("json").first_scheduled_time is None
        engine.grammars.gate.set()
        while engine.has_unfinished_requests():
            finished.update({o.request_id: o for o in engine.step().finished})
    finally:
        engine.grammars.shutdown()
        engine.grammars = original
    if fail:
        assert finished["json"].finish_reason == "abort" and finished["json"].text == ""
    else:
        assert finished["json"].finish_reason == "stop"
        jsonschema.validate(json.loads(finished["json"].text), SCHEMAS[0][1])


def test_bad_constraints_raise_before_anything_is_queued(llm):
    for spec, field in (({"regex": "(("}, "structured_outputs.regex"),
                        ({"json": {"type": "nope"}}, "structured_outputs.json"),
                        ({"grammar": "root ::= missing"}, "structured_outputs.grammar")):
        with pytest.raises(ValueError, match=re.escape(field)):
            llm.generate(["fine", "also fine"],
                         [SamplingParams(max_tokens=4), SamplingParams(structured_outputs=spec)])
        assert not llm.engine.has_unfinished_requests()


def test_the_grammar_ends_a_request_that_ignores_eos(llm):
    out = llm.generate(_chat(llm, "Yes or no?"),
                       SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True,
                                      structured_outputs={"choice": ["yes", "no"]}))[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    assert len(out.token_ids) <= 3  # the answer and its stop token, then it ended
