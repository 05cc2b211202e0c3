"""Runs one scheduled iteration (a mixed batch of prefill chunks and decodes) on the model."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..model.attention import AttentionMetadata
from ..model.llama import LlamaForCausalLM, allocate_kv_cache
from ..model.config import ModelConfig
from ..scheduler.output import SchedulerOutput
from ..outputs import TokenLogprobs
from .sampler import Sampler, token_logprobs


@dataclass
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)  # request id -> new token
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # where requested


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, model_config: ModelConfig, num_blocks: int,
                 block_size: int, dtype: torch.dtype, device: torch.device, seed: int = 0) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.kv_cache = allocate_kv_cache(model_config, num_blocks, block_size, dtype, device)
        self.sampler = Sampler(seed)

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        """Computes every scheduled chunk in one forward pass; returns the sampled tokens."""
        if not output.chunks:
            return RunnerOutput()
        # The attention kernel wants prefill chunks first, then single-token decodes.
        chunks = sorted(output.chunks, key=lambda c: c.num_tokens == 1)
        token_ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        for chunk in chunks:
            token_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start, chunk.start + chunk.num_tokens))
            if chunk.samples:
                sample_rows.append(len(token_ids) - 1)
        metadata = AttentionMetadata.build(
            [(c.start, c.num_tokens, c.block_table) for c in chunks], self.block_size, self.device)
        hidden = self.model(
            torch.tensor(token_ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            metadata, self.kv_cache)
        sampling = [c for c in chunks if c.samples]
        if not sampling:
            return RunnerOutput()
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden[rows])
        requests = [c.request for c in sampling]
        tokens = self.sampler(logits, requests)
        logprobs = token_logprobs(logits, tokens, requests)
        return RunnerOutput({r.request_id: t for r, t in zip(requests, tokens)},
                            {requests[i].request_id: lp for i, lp in logprobs.items()})
