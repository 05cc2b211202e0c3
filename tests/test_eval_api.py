"""The evaluation-grade completions API on the default model, over HTTP with the official
client: echo + logprobs give every prompt token's logprob as transformers computes it,
max_tokens 0 scores without generating, /tokenizer_info, and lm-eval end to end."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
import torch

from server_utils import ServerProcess

MODEL = "smol"
PROMPTS = ["The capital of France is Paris, and the capital of Italy is Rome.",
           "One, two, three, four, five, six, seven, eight, nine, ten"]
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def server():
    # The weights dequantized: the scores are held to transformers' on the same weights.
    proc = ServerProcess("--served-model-name", MODEL, "--max-model-len", "512",
                         "--dtype", "float32", "--quantization", "none")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def _ids(server, text: str) -> list[int]:
    body = {"prompt": text, "add_special_tokens": False}
    return httpx.post(server.url + "/tokenize", json=body, timeout=30).json()["tokens"]


def test_echo_logprobs_equal_transformers_per_prompt_token(server, client, hf_reference):
    for text in PROMPTS:
        ids = _ids(server, text)
        done = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, echo=True,
                                          logprobs=2, temperature=0)
        choice = done.choices[0]
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(ids) + 2 and lp.token_logprobs[0] is None
        assert lp.top_logprobs[0] is None and len(lp.text_offset) == len(ids) + 2
        reference = _reference_logprobs(hf_reference, ids)
        want = [reference[i - 1, ids[i]].item() for i in range(1, len(ids))]
        assert lp.token_logprobs[1:len(ids)] == pytest.approx(want, abs=1e-3)
        for position in range(1, len(ids)):
            best = reference[position - 1].max().item()
            assert max(lp.top_logprobs[position].values()) == pytest.approx(best, abs=1e-3)
        assert "".join(lp.tokens[:len(ids)]) == text and choice.text.startswith(text)
        assert lp.text_offset[len(ids)] == len(text)


def test_max_tokens_zero_with_echo_scores_only(server, client):
    ids = _ids(server, PROMPTS[0])
    scored = client.completions.create(model=MODEL, prompt=[ids, ids[:4]], max_tokens=0,
                                       echo=True, logprobs=0)
    assert scored.usage.completion_tokens == 0
    assert [c.finish_reason for c in scored.choices] == ["length", "length"]
    assert scored.choices[0].text == PROMPTS[0]
    assert [len(c.logprobs.token_logprobs) for c in scored.choices] == [len(ids), 4]
    assert scored.choices[0].logprobs.top_logprobs[1] == {}
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    assert refused.value.body["param"] == "max_tokens"


def test_stream_echo_carries_the_prompt_logprobs_first(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=3, echo=True,
                                      logprobs=1, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=3,
                                            echo=True, logprobs=1, temperature=0, stream=True))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert texts[0].startswith(PROMPTS[1]) and "".join(texts) == whole.choices[0].text
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs
                for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(whole.choices[0].logprobs.token_logprobs)
    offsets = [v for c in chunks if c.choices and c.choices[0].logprobs
               for v in c.choices[0].logprobs.text_offset]
    assert offsets == whole.choices[0].logprobs.text_offset


def test_vllm_prompt_logprobs_field(server, client):
    ids = _ids(server, PROMPTS[0])
    done = client.completions.create(model=MODEL, prompt=ids, max_tokens=1,
                                      extra_body={"prompt_logprobs": 1})
    field = done.choices[0].model_extra["prompt_logprobs"]
    assert field[0] is None and len(field) == len(ids)
    ranked = 0
    for token_id, position in zip(ids[1:], field[1:]):
        entry = position[str(token_id)]
        assert entry["logprob"] <= 0 and entry["rank"] in (1, None)
        # Itself, then the best; one entry when it is the best (rank 1).
        assert len(position) == (1 if entry["rank"] == 1 else 2)
        best = max(v["logprob"] for v in position.values())
        assert (entry["logprob"] == best) == (entry["rank"] == 1)
        ranked += entry["rank"] == 1
    assert 0 < ranked < len(ids) - 1  # the prompt has tokens the model expects, and others


def test_chat_prompt_logprobs_are_those_of_its_templated_prompt(server, client):
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                          temperature=0, extra_body={"prompt_logprobs": 0})
    field = chat.model_extra["prompt_logprobs"]
    ids = httpx.post(server.url + "/tokenize", json={"messages": messages},
                     timeout=30).json()["tokens"]
    assert len(field) == len(ids) and field[0] is None
    plain = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True,
                                       logprobs=0)
    assert [position[str(t)]["logprob"] for t, position in zip(ids[1:], field[1:])] == \
        pytest.approx(plain.choices[0].logprobs.token_logprobs[1:], abs=1e-5)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                       stream=True, extra_body={"prompt_logprobs": 0})
    assert refused.value.body["param"] == "prompt_logprobs"


def test_tokenizer_info(server):
    info = httpx.get(server.url + "/tokenizer_info", timeout=30).json()
    assert info["eos_token"] == "<|im_end|>" and info["eos_token_id"] == 2
    assert "<|im_start|>" in info["chat_template"] and info["model_max_length"] == 512


def _lm_eval_loglikelihoods(lm, requests, reference_model) -> list[float]:
    """transformers' loglikelihood of each (context, continuation), tokenized as lm-eval
    tokenizes them for the server."""
    scores = []
    for context, continuation in requests:
        context_ids, continuation_ids = lm._encode_pair(context, continuation)
        ids = context_ids + continuation_ids
        logprobs = _reference_logprobs(reference_model, ids)
        scores.append(sum(logprobs[i - 1, ids[i]].item()
                          for i in range(len(context_ids), len(ids))))
    return scores


def test_lm_eval_local_completions_scores_as_transformers(server, hf_reference, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed")
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(REPO)  # the tasks' data paths are relative to the repository
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    lm = get_model("local-completions")(
        model=MODEL, base_url=server.url + "/v1/completions", tokenizer_backend="remote",
        num_concurrent=2, max_retries=1)
    results = lm_eval.simple_evaluate(
        model=lm, tasks=["stallfree_tiny_mc", "stallfree_tiny_gen"], log_samples=True,
        task_manager=TaskManager(include_path=str(REPO / "tests" / "lm_eval")))
    samples = results["samples"]["stallfree_tiny_mc"]
    assert len(samples) == 10
    correct = []
    for sample in samples:
        requests = [tuple(args) for args in sample["arguments"].values()] \
            if isinstance(sample["arguments"], dict) else [tuple(a) for a in sample["arguments"]]
        ours = [resp[0][0] for resp in sample["resps"]]
        reference = _lm_eval_loglikelihoods(lm, requests, hf_reference)
        assert ours == pytest.approx(reference, abs=2e-3)
        correct.append(max(range(len(reference)), key=reference.__getitem__)
                       == sample["target"])
    assert results["results"]["stallfree_tiny_mc"]["acc,none"] == sum(correct) / len(correct)
    generations = results["samples"]["stallfree_tiny_gen"]
    assert len(generations) == 3
    for sample in generations:
        context, kwargs = sample["arguments"]["gen_args_0"].values() \
            if isinstance(sample["arguments"], dict) else sample["arguments"][0]
        assert sample["resps"][0][0] == _greedy_reference(lm, hf_reference, context, kwargs)
    json.dumps(results["results"])  # lm-eval's report is plain data


def _greedy_reference(lm, model, context: str, kwargs: dict) -> str:
    """transformers' greedy continuation, cut at the first stop string as lm-eval cuts it."""
    ids = lm.tok_encode(context)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=kwargs["max_gen_toks"],
                             do_sample=False)
    new = out[0, len(ids):].tolist()
    eos = lm.tokenizer.eos_token_id  # the server ends there and does not return it
    text = lm.tokenizer.decode(new[:new.index(eos)] if eos in new else new)
    for stop in kwargs["until"]:
        text = text.split(stop)[0]
    return text
