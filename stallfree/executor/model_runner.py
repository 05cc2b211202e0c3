"""Runs one scheduled iteration (a mixed batch of prefill chunks and decodes) on the model."""
from __future__ import annotations

from typing import Protocol

import torch

from ..attention_plan import attends_as_decode
from ..model.attention import AttentionMetadata, GatherWorkspace
from ..model.config import ModelConfig
from ..model.decoder import CausalLM, allocate_kv_cache
from ..scheduler.output import SchedulerOutput
from .base import RunnerOutput
from .prompt_logprobs import prompt_logprobs
from .sampler import Sampler, token_logprobs


class StagePipe(Protocol):
    """Hidden states between pipeline stages (see stallfree/distributed/pipe.py)."""

    def recv(self, num_tokens: int) -> torch.Tensor: ...

    def send(self, hidden: torch.Tensor) -> None: ...


class ModelRunner:
    """Executes batches on one model (or one rank's shard of it) and its KV cache.

    Under pipeline parallelism a stage other than the first takes its input from
    `pipe` instead of the embedding, and a stage other than the last hands its
    output on and samples nothing. Under tensor parallelism only TP rank 0 of
    the last stage samples; the others take part in the logits all-gather.
    """

    def __init__(self, model: CausalLM, model_config: ModelConfig, num_blocks: int,
                 block_size: int, dtype: torch.dtype, device: torch.device, seed: int = 0,
                 pipe: StagePipe | None = None) -> None:
        """`dtype`: the KV cache's (the model's, or int8 for the quantized layout of
        model/kv_quant.py)."""
        self.model = model
        self.shard = model.shard
        self.block_size = block_size
        self.device = device
        self.pipe = pipe
        # One block past those the scheduler hands out stays zero: padded decode rows
        # read it (see clean_kv_blocks).
        self.kv_cache = allocate_kv_cache(model_config, num_blocks + 1, block_size, dtype,
                                          device, self.shard)
        self.null_block = num_blocks
        self.workspace = GatherWorkspace()
        self.sampler = Sampler(seed, model.kernels)

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        """Computes every scheduled chunk in one forward pass; returns the sampled tokens."""
        if not output.chunks:
            return RunnerOutput()
        # The attention kernel wants prefill chunks first, then single-token decodes.
        chunks = sorted(output.chunks, key=lambda c: attends_as_decode(c.num_tokens))
        token_ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        offsets: list[int] = []
        for chunk in chunks:
            offsets.append(len(token_ids))
            token_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start, chunk.start + chunk.num_tokens))
            if chunk.samples:
                sample_rows.append(len(token_ids) - 1)
        seqs = [(c.start, c.num_tokens, c.block_table) for c in chunks]
        clean_kv_blocks(self.kv_cache, seqs, self.block_size)
        metadata = AttentionMetadata.build(seqs, self.block_size, self.device, self.workspace,
                                           pad_block=self.null_block)
        hidden_in = None if self.shard.is_first_stage else self.pipe.recv(len(token_ids))
        hidden = self.model(
            torch.tensor(token_ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            metadata, self.kv_cache, hidden_in)
        if not self.shard.is_last_stage:
            self.pipe.send(hidden)
            return RunnerOutput()
        scored = prompt_logprobs(self.model, hidden, chunks, offsets, self.shard.tp_rank == 0)
        sampling = [c for c in chunks if c.samples]
        if not sampling:
            if self.device.type == "cuda":  # the iteration ends with its kernels, not their launch
                torch.cuda.synchronize(self.device)
            return RunnerOutput(prompt_logprobs=scored)
        if len(sample_rows) < len(token_ids):  # else each chunk is one row, and it samples
            hidden = hidden[torch.tensor(sample_rows, dtype=torch.long, device=self.device)]
        logits = self.model.compute_logits(hidden)
        if self.shard.tp_rank != 0:
            return RunnerOutput()
        requests = [c.request for c in sampling]
        try:
            tokens = self.sampler(logits, requests, output.token_bitmask, output.bitmask_rows)
            logprobs = token_logprobs(logits, tokens, requests)
        except Exception:  # noqa: BLE001 - find the request(s) at fault, sample the rest
            result = self._sample_one_by_one(logits, requests, output)
        else:
            result = RunnerOutput({r.request_id: t for r, t in zip(requests, tokens)},
                                  {requests[i].request_id: lp for i, lp in logprobs.items()})
        result.prompt_logprobs = scored
        return result

    def _sample_one_by_one(self, logits: torch.Tensor, requests: list,
                           output: SchedulerOutput) -> RunnerOutput:
        """After the batch's sampling raised: each request alone, so that an error of one
        (its parameters, its logits processing) fails that request only."""
        result = RunnerOutput()
        for row, request in enumerate(requests):
            rid = request.request_id
            try:
                token = self.sampler(logits[row:row + 1], [request], output.token_bitmask,
                                     output.bitmask_rows)[0]
                logprobs = token_logprobs(logits[row:row + 1], [token], [request])
            except Exception as exc:  # noqa: BLE001 - this request's failure, reported back
                result.failed[rid] = f"sampling failed: {type(exc).__name__}: {exc}"
                continue
            result.sampled[rid] = token
            if 0 in logprobs:
                result.logprobs[rid] = logprobs[0]
        return result


def clean_kv_blocks(kv_cache: torch.Tensor, seqs: list[tuple[int, int, list[int]]],
                    block_size: int) -> None:
    """Zeroes each chunk's last block when the chunk starts it and leaves part of it unwritten.

    Attention masks a sequence's slots past its length, but a masked key still enters
    the product (0 x NaN is NaN): a NaN its previous owner left there would poison
    every later token. Blocks a chunk fills completely are overwritten anyway, and a
    block begun by an earlier chunk has only this request's data. (Zero bytes read as zeros
    in an int8 cache too: values 0, scale 0.0.)
    """
    for start, num_tokens, table in seqs:
        end = start + num_tokens
        last = (end - 1) // block_size
        if end % block_size and last * block_size >= start:
            # A view per block: an index_put of the batch's blocks took ~6x as long.
            kv_cache[:, :, table[last]].zero_()
