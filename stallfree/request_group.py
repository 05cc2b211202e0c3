"""A caller's request: n sequences sampled from one prompt, and their text so far."""
from __future__ import annotations

import dataclasses
from typing import Any

from .detokenizer import IncrementalDetokenizer
from .outputs import CompletionOutput, PromptLogprobs, RequestOutput, StepOutput, TokenLogprobs
from .request import Request, RequestStatus
from .sampling_params import SamplingParams


class RequestGroup:
    """The n child sequences of one request (child i of "r" is "r#i" when n > 1).

    A request is finished when its last sequence is: this is the one place that rule
    lives, for the offline API and the server alike.
    """

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, arrival_time: float, tokenizer: Any,
                 eos_token_ids: frozenset[int] | set[int]) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.arrival_time = arrival_time
        self.children: list[Request] = []
        for i in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = dataclasses.replace(params, seed=params.seed + i)
            if i > 0 and params.prompt_logprobs is not None:
                # The prompt is scored once, by the first sequence; the others may then
                # share its prompt's KV from the prefix cache.
                child_params = dataclasses.replace(child_params, prompt_logprobs=None)
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            self.children.append(Request(child_id, prompt_token_ids, child_params, arrival_time,
                                         eos_token_ids=eos_token_ids))
        self.detokenizers = [IncrementalDetokenizer(tokenizer, params.stop,
                                                    params.include_stop_str_in_output,
                                                    params.skip_special_tokens)
                             for _ in self.children]
        self.stop_hit = [False] * params.n
        self.logprobs: list[list[TokenLogprobs]] = [[] for _ in self.children]
        # Position p's entry once computed (the first stays None); None when not asked for.
        self.prompt_logprobs: list[TokenLogprobs | None] | None = (
            None if params.prompt_logprobs is None else [None] * len(prompt_token_ids))
        self._prompt_logprobs_sent = False

    @property
    def is_finished(self) -> bool:
        return all(c.is_finished for c in self.children)

    def append(self, index: int, token: int, logprobs: TokenLogprobs | None) -> tuple[str, bool]:
        """Adds child `index`'s new token; returns its new text and whether a stop string
        has just ended it (the caller then finishes the child in the scheduler)."""
        delta, hit = "", False
        detokenizer = self.detokenizers[index]
        child = self.children[index]
        if not self.stop_hit[index] and not _stop_token_left_out(child, token):
            # As stop tokens, stop strings count once min_tokens tokens exist (this one
            # included: the scheduler has appended it already).
            delta, hit = detokenizer.append(
                token, child.num_output_tokens >= child.sampling_params.min_tokens)
            self.stop_hit[index] = hit
        if logprobs is not None:
            self.logprobs[index].append(logprobs)
        return delta, hit

    def add_prompt_logprobs(self, scored: PromptLogprobs) -> None:
        """Records a chunk's prompt logprobs. A recompute after preemption computes the
        same positions again: the first values stay."""
        table = self.prompt_logprobs
        if table is None:
            return
        for position, entry in enumerate(scored.entries, scored.first):
            if 0 < position < len(table) and table[position] is None:
                table[position] = entry

    def step_output(self, index: int, token: int | None, delta: str,
                    logprobs: TokenLogprobs | None) -> StepOutput:
        """Child `index`'s new token (None: none, the prompt was all it asked for)."""
        child = self.children[index]
        if child.is_finished:
            delta += self.detokenizers[index].flush()
        # The prompt's logprobs ride on the request's first output: the prompt is complete
        # by then, and a stream can show them before the first token.
        prompt = None
        if self.prompt_logprobs is not None and not self._prompt_logprobs_sent:
            prompt, self._prompt_logprobs_sent = list(self.prompt_logprobs), True
        return StepOutput(self.request_id, index, [] if token is None else [token], delta,
                          child.finish_reason,
                          None if logprobs is None else [logprobs], prompt)

    def output(self) -> RequestOutput:
        outputs = [CompletionOutput(i, detok.text, list(child.output_token_ids),
                                    child.finish_reason, list(child.token_times),
                                    child.num_preemptions,
                                    list(self.logprobs[i])
                                    if child.sampling_params.logprobs is not None else None)
                   for i, (child, detok) in enumerate(zip(self.children, self.detokenizers))]
        first = [c.first_scheduled_time for c in self.children if c.first_scheduled_time]
        # The prompt is counted once (usage), so are its cached tokens: the first sequence's
        # (with n > 1 the others share its blocks).
        cached = self.children[0].num_cached_tokens or 0
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs,
                             self.arrival_time, min(first) if first else None, cached,
                             None if self.prompt_logprobs is None else list(self.prompt_logprobs))


def _stop_token_left_out(child: Request, token: int) -> bool:
    """Whether `token` just ended `child` as a stop token (EOS or stop_token_ids) whose text
    is left out, as vLLM leaves it out: with special tokens kept, EOS's text ("</s>",
    "<|eot_id|>") would otherwise end every reply. With them skipped an EOS has no text
    anyway, and a stop_token_ids token keeps its text as it always has here."""
    params = child.sampling_params
    if params.skip_special_tokens or params.include_stop_str_in_output:
        return False
    # The scheduler has appended the token and finished the child before it is emitted.
    if child.status is not RequestStatus.FINISHED_STOPPED:
        return False
    return token in params.stop_token_ids or (not params.ignore_eos
                                              and token in child.eos_token_ids)
