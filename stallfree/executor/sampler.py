"""Turns a batch of logits into one token per request, honouring each request's params."""
from __future__ import annotations

import torch

from ..model.kernel_table import KernelTable, ensure
from ..outputs import TokenLogprobs
from ..request import Request

# The largest temperature that divides as asked: float32 (the logits' type) holds no more,
# and an infinite one turns every logit into 0 and a masked -inf into NaN, which the
# inverse CDF then reads as allowed. Beyond it the distribution is already uniform.
_MAX_TEMPERATURE = torch.finfo(torch.float32).max
_SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, step) pairs over the 64-bit seed space


def _step_seed(seed: int, step: int) -> int:
    # A fresh generator per (seed, output index) makes a seeded request's tokens
    # independent of what else shares its batch and of preemption/recompute.
    return (seed * _SEED_MIX + step) % (2**63 - 1)


class Sampler:
    def __init__(self, seed: int = 0, kernels: KernelTable | None = None) -> None:
        """`kernels`: the model's table, whose argmax greedy rows take (None: the defaults)."""
        self.seed = seed
        self.kernels = ensure(kernels)
        self._generators: dict[torch.device, torch.Generator] = {}

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, requests: list[Request],
                 bitmask: torch.Tensor | None = None,
                 bitmask_rows: dict[str, int] | None = None) -> list[int]:
        """`bitmask` (structured outputs): row `bitmask_rows[id]` holds the tokens request
        `id` may take next; requests without a row are not constrained."""
        bitmask_rows = bitmask_rows or {}
        # Rows edited in place, in a copy: the caller's logits stay the raw ones.
        edited = [row for row, req in enumerate(requests) if _edits_logits(req)]
        logits = logits.float().clone() if edited or bitmask_rows else logits.float()
        for row in edited:
            req = requests[row]
            _apply_penalties(logits[row], req)
            # A grammar decides when its output may end: min_tokens would fight it.
            if req.request_id not in bitmask_rows:
                _block_early_stop(logits[row], req)
        if bitmask_rows:
            _apply_bitmask(logits, requests, bitmask, bitmask_rows)
        tokens = argmax_rows(logits, self.kernels.argmax.kernel)
        # Chosen in Python: an all-greedy batch (the common one) then runs no tensor op
        # beyond the argmax, each ~10 us of a batch-1 step on the caches it finds cold.
        random_rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            tokens[rows] = self._sample(logits[rows], [requests[i] for i in random_rows])
        return tokens.tolist()

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        params = [r.sampling_params for r in requests]
        device = logits.device
        temps = torch.tensor([min(p.temperature, _MAX_TEMPERATURE) for p in params],
                             device=device).unsqueeze(1)
        logits = logits / temps
        logits = _filter_top_k_top_p(logits, params)
        probs = logits.softmax(dim=-1)
        if any(p.min_p > 0 for p in params):  # asked of the host: no read back from a GPU
            min_ps = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)
            keep = probs >= min_ps * probs.max(dim=-1, keepdim=True).values
            probs = torch.where(keep, probs, torch.zeros_like(probs))
        # Inverse CDF: one uniform draw per row, found in the row's cumulative sums. An
        # exponential race (torch.multinomial does one) draws a number per vocabulary
        # entry on one thread: 12 ms a step at 32 rows of a 49K vocabulary. Rows without
        # a seed share one generator; a seeded row owns one per (seed, output index).
        uniform = torch.empty(len(params), 1, dtype=torch.float64, device=device)
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if unseeded:
            draws = torch.rand(len(unseeded), 1, dtype=torch.float64, device=device,
                               generator=self._shared_generator(device))
            uniform[torch.tensor(unseeded, device=device)] = draws
        for row, (req, p) in enumerate(zip(requests, params)):
            if p.seed is not None:
                gen = torch.Generator(device=device).manual_seed(
                    _step_seed(p.seed, req.num_output_tokens))
                uniform[row] = torch.rand(1, dtype=torch.float64, device=device, generator=gen)
        return sample_inverse_cdf(probs, uniform)


def argmax_rows(logits: torch.Tensor, kernel: bool | None = None) -> torch.Tensor:
    """logits.argmax(dim=-1) for [rows, vocab] logits; in the CPU kernel of
    csrc/argmax_rows.cpp where `kernel` (the table's argmax; None: the default table's) and
    the logits allow: torch's CPU argmax took 0.5-1 ms of a 32-row decode step (49K
    vocabulary, 2-core EPYC)."""
    if kernel is None:
        kernel = ensure(None).argmax.kernel
    if (kernel and logits.device.type == "cpu" and logits.dtype == torch.float32
            and logits.dim() == 2 and logits.shape[1] > 0 and logits.is_contiguous()):
        return torch.ops.stallfree.argmax_rows(logits)
    return logits.argmax(dim=-1)


def sample_inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Row i's token: the first whose cumulative probability exceeds uniform[i] (in [0, 1))
    of the row's total. Sums in float64, so small probabilities keep their weight; a token
    of probability 0 adds nothing to the sum and can never be the first to exceed it."""
    cdf = probs.double().cumsum(dim=-1)
    picked = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).flatten()
    return picked.clamp_(max=probs.shape[-1] - 1)  # u * total rounding up to the total


def _filter_top_k_top_p(logits: torch.Tensor, params: list) -> torch.Tensor:
    vocab = logits.shape[-1]
    top_ks = [p.top_k if p.top_k > 0 else vocab for p in params]
    top_ps = [p.top_p for p in params]
    if all(k >= vocab for k in top_ks) and all(p >= 1.0 for p in top_ps):
        return logits
    device = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device).unsqueeze(0)
    drop = ranks >= torch.tensor(top_ks, device=device).unsqueeze(1)
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Drop a token once the mass of strictly better tokens already reaches top_p;
    # the best token always survives.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= mass_before >= torch.tensor(top_ps, device=device).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _apply_bitmask(logits: torch.Tensor, requests: list[Request], bitmask: torch.Tensor,
                   bitmask_rows: dict[str, int]) -> None:
    """Disallowed tokens of the constrained rows to -inf; the other rows are untouched."""
    import xgrammar  # only batches with constrained requests need it

    pairs = [(i, bitmask_rows[r.request_id]) for i, r in enumerate(requests)
             if r.request_id in bitmask_rows]
    vocab = logits.shape[-1]
    if logits.device.type == "cpu":
        # Row by row on views: xgrammar's CPU kernel needs no gathered copy of either.
        for i, j in pairs:
            xgrammar.apply_token_bitmask_inplace(logits[i], bitmask[j], vocab_size=vocab)
        return
    # One kernel for the batch: the mask rows gathered, on the device, into logit order.
    device = logits.device
    masks = bitmask.to(device, non_blocking=True)
    aligned = masks.new_empty((len(requests), masks.shape[1]))
    aligned[torch.tensor([i for i, _ in pairs], device=device)] = \
        masks[torch.tensor([j for _, j in pairs], device=device)]
    xgrammar.apply_token_bitmask_inplace(logits, aligned, vocab_size=vocab,
                                         indices=[i for i, _ in pairs])


def _edits_logits(req: Request) -> bool:
    """Whether _apply_penalties or _block_early_stop will write into the request's row."""
    p = req.sampling_params
    return p.has_penalties or req.num_output_tokens < p.min_tokens


def _apply_penalties(row: torch.Tensor, req: Request) -> None:
    p = req.sampling_params
    if not p.has_penalties:
        return
    device = row.device
    if p.repetition_penalty != 1.0:
        # As in HF/CTRL: shrink positive logits, grow negative ones, prompt included.
        seen = torch.tensor(sorted(set(req.all_token_ids)), device=device, dtype=torch.long)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if req.output_token_ids and (p.presence_penalty or p.frequency_penalty):
        out = torch.tensor(req.output_token_ids, device=device, dtype=torch.long)
        counts = torch.bincount(out, minlength=row.shape[0]).to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def _block_early_stop(row: torch.Tensor, req: Request) -> None:
    p = req.sampling_params
    if req.num_output_tokens >= p.min_tokens:
        return
    stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(req.eos_token_ids))
    if stops:
        row[torch.tensor(sorted(stops), device=row.device)] = float("-inf")


def token_logprobs(logits: torch.Tensor, tokens: list[int],
                   requests: list[Request]) -> dict[int, TokenLogprobs]:
    """Row index -> log-probabilities of the sampled token and the top alternatives,
    for the rows whose request asked for them. Uses the raw model distribution."""
    rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
    if not rows:
        return {}
    most = max(requests[i].sampling_params.logprobs for i in rows)
    entries = rows_logprobs(logits[rows], [tokens[i] for i in rows], most)
    result = {}
    for entry, i in zip(entries, rows):
        entry.top = entry.top[:requests[i].sampling_params.logprobs]
        result[i] = entry
    return result


def rows_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprobs]:
    """Row i's log-probability of tokens[i] and the row's `top` most likely tokens, best
    first; the token's rank where it is among them. A rank beyond the top would take a
    comparison over the vocabulary, which costs more than the log-softmax itself."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs[torch.arange(len(tokens), device=logits.device),
                      torch.tensor(tokens, device=logits.device)].tolist()
    if top == 0:
        return [TokenLogprobs(t, c, []) for t, c in zip(tokens, chosen)]
    top_vals, top_ids = logprobs.topk(top, dim=-1)
    # To the host in one copy each, not one per row (each a wait on a GPU).
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    return [TokenLogprobs(t, c, list(zip(ids, vals)), ids.index(t) + 1 if t in ids else None)
            for t, c, ids, vals in zip(tokens, chosen, top_ids, top_vals)]
