"""A linear model of one iteration's time, refined online by recursive least squares.

time = fixed
     + per_prefill_token   * (new tokens of the multi-token chunks)
     + per_attention_pair  * (query-key pairs of those chunks: each new token attends to
                              the chunk's cached context and the new tokens before it)
     + per_decode          * (one-token chunks)
     + per_decode_context  * (tokens those one-token chunks attend to)

Chunks are split as the attention kernel runs them (`attention_plan.split_chunks`): every
one-token chunk is a decode. Pure Python, so the scheduler predicts with it (the SLO
budget) and the simulator shares it. The fit is recursive least squares with a
forgetting factor, so old iterations fade and the model follows drift (thermal, other
load on the machine); coefficients are clamped at zero when predicting, which keeps the
predicted time monotone in the tokens added (the budget search relies on it).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ..attention_plan import attends_as_decode

FEATURES = ("fixed", "prefill_token", "prefill_attention", "decode", "decode_context")
# Typical size of each feature: RLS and the least-squares seed work on features divided
# by these, so that no coefficient is 1e6 times another (which conditions P badly).
_SCALES = (1.0, 256.0, 256.0 * 512.0, 16.0, 16.0 * 512.0)
_N = len(FEATURES)
# The overrun's tail (measured / predicted time) is read from this many recent iterations
# that decoded, once at least OVERRUN_MIN_SAMPLES of them were seen, and re-read every
# OVERRUN_REFRESH (a sort of the window: ~0.1 ms).
OVERRUN_WINDOW, OVERRUN_MIN_SAMPLES, OVERRUN_REFRESH = 1000, 100, 25


def attention_pairs(num_tokens: int, cached: int) -> float:
    """Query-key pairs of a causal chunk of `num_tokens` after `cached` tokens."""
    return num_tokens * cached + num_tokens * (num_tokens + 1) / 2


@dataclass
class BatchFeatures:
    """The sums a batch's predicted time depends on; built up chunk by chunk."""

    prefill_tokens: int = 0
    prefill_attention: float = 0.0
    decodes: int = 0
    decode_context: int = 0

    def add_chunk(self, start: int, num_tokens: int) -> None:
        """A chunk of `num_tokens` new tokens at position `start` (tokens cached before)."""
        if attends_as_decode(num_tokens):  # the kernel's decode, whatever the scheduler calls it
            self.decodes += 1
            self.decode_context += start + 1
        else:
            self.prefill_tokens += num_tokens
            self.prefill_attention += attention_pairs(num_tokens, start)

    def with_chunk(self, start: int, num_tokens: int) -> BatchFeatures:
        out = BatchFeatures(self.prefill_tokens, self.prefill_attention, self.decodes,
                            self.decode_context)
        out.add_chunk(start, num_tokens)
        return out

    @classmethod
    def of_chunks(cls, chunks: Iterable[tuple[int, int]]) -> BatchFeatures:
        """From (start, num_tokens) per chunk."""
        out = cls()
        for start, num_tokens in chunks:
            out.add_chunk(start, num_tokens)
        return out

    @classmethod
    def of_shape(cls, prefills: Iterable[tuple[int, int]],
                 decode_contexts: Iterable[int]) -> BatchFeatures:
        """From an iteration record's (new tokens, cached) chunks and decode contexts."""
        out = cls()
        for num_tokens, cached in prefills:
            out.prefill_tokens += num_tokens
            out.prefill_attention += attention_pairs(num_tokens, cached)
        for context in decode_contexts:
            out.decodes += 1
            out.decode_context += context
        return out

    def vector(self) -> tuple[float, ...]:
        return (1.0, float(self.prefill_tokens), self.prefill_attention, float(self.decodes),
                float(self.decode_context))


def _scaled(x: Sequence[float]) -> list[float]:
    return [v / s for v, s in zip(x, _SCALES)]


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """a x = b by Gaussian elimination with partial pivoting (a is small and SPD here)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if abs(m[col][col]) < 1e-300:
            continue
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in reversed(range(n)):
        if abs(m[r][r]) >= 1e-300:
            x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


# A lone chunk within this share of the lowest time per token measured counts as efficient:
# about what repeated start-up measurements of one size differ by.
EFFICIENT_TOLERANCE = 0.01


def efficient_chunk(seconds_per_chunk: dict[int, float],
                    tolerance: float = EFFICIENT_TOLERANCE) -> int:
    """The most new tokens of a lone chunk whose time per token is within `tolerance` of
    the lowest among the measured sizes (chunk size -> seconds).

    Up to that size the machine computes as fast per token as it can, and a larger
    iteration spreads what every iteration pays besides (its decodes, the scheduling,
    the handling of outputs) over more tokens. Past it a token costs more, and the same
    work takes longer. Among sizes that cost alike (a CPU: 256-768 tokens within 3%),
    the smallest once halved a served capacity on this project's CPU.
    """
    if not seconds_per_chunk:
        raise ValueError("efficient_chunk needs at least one measured chunk size")
    per_token = {n: t / n for n, t in seconds_per_chunk.items() if n > 0}
    best = min(per_token.values())
    return max(n for n, v in per_token.items() if v <= best * (1 + tolerance))


def fit_least_squares(samples: Sequence[tuple[Sequence[float], float]],
                      ridge: float = 1e-6) -> tuple[float, ...]:
    """Non-negative coefficients (natural units) fitting (feature vector, seconds) samples.

    Ordinary least squares on scaled features with a little ridge (so features the
    samples never vary stay at zero), refitted without any coefficient that came out
    negative: a negative cost per token would make the budget search meaningless.
    """
    active = list(range(_N))
    coef = [0.0] * _N
    while active:
        rows = [(_scaled(x), y) for x, y in samples]
        a = [[sum(r[i] * r[j] for r, _ in rows) + (ridge if i == j else 0.0) for j in active]
             for i in active]
        b = [sum(r[i] * y for r, y in rows) for i in active]
        sol = _solve(a, b)
        if all(v >= 0 for v in sol):
            coef = [0.0] * _N
            for i, v in zip(active, sol):
                coef[i] = v
            break
        active = [i for i, v in zip(active, sol) if v >= 0]
    return tuple(c / s for c, s in zip(coef, _SCALES))


@dataclass
class OnlineCost:
    """The model, seeded with coefficients (natural units: seconds per feature unit).

    `observe` refines it by recursive least squares with forgetting factor `forget`:
    an iteration `k` steps old weighs forget**k, so about 1 / (1 - forget) recent
    iterations shape it. `prior_weight`: how many typical iterations the seed counts
    as (RLS's starting covariance is its inverse); small, so the machine's own
    iterations soon outweigh a seed from another machine or from a short calibration.
    """

    coefficients: tuple[float, ...]
    # Most tokens per iteration worth computing (`efficient_chunk`); None: no cap.
    efficient_tokens: int | None = None
    forget: float = 0.999
    prior_weight: float = 10.0
    num_observed: int = field(default=0, init=False)
    _overruns: deque = field(default_factory=lambda: deque(maxlen=OVERRUN_WINDOW),
                             init=False, repr=False)
    _sorted_overruns: list[float] = field(default_factory=list, init=False, repr=False)
    _unsorted: int = field(default=0, init=False, repr=False)  # overruns since the sort

    def __post_init__(self) -> None:
        if len(self.coefficients) != _N:
            raise ValueError(f"expected {_N} coefficients ({', '.join(FEATURES)}), "
                             f"got {len(self.coefficients)}")
        self._theta = [c * s for c, s in zip(self.coefficients, _SCALES)]
        # Covariance in scaled units, capped at its start so that directions the
        # iterations never excite (e.g. no prefill for a while) cannot wind up.
        self._p0 = 1.0 / self.prior_weight
        self._p = [[self._p0 if i == j else 0.0 for j in range(_N)] for i in range(_N)]

    def predict(self, features: BatchFeatures) -> float:
        return sum(max(0.0, t) * v for t, v in zip(self._theta, _scaled(features.vector())))

    def observe(self, features: BatchFeatures, seconds: float) -> None:
        """One measured iteration: the RLS update of the coefficients, and its overrun of
        the prediction (for `overrun`) where it decoded."""
        predicted = self.predict(features)
        if features.decodes and predicted > 0:
            self._overruns.append(seconds / predicted)
            self._unsorted += 1
        x = _scaled(features.vector())
        px = [sum(self._p[i][j] * x[j] for j in range(_N)) for i in range(_N)]
        denom = self.forget + sum(x[i] * px[i] for i in range(_N))
        gain = [v / denom for v in px]
        error = seconds - sum(t * v for t, v in zip(self._theta, x))
        self._theta = [t + g * error for t, g in zip(self._theta, gain)]
        self._p = [[(self._p[i][j] - gain[i] * px[j]) / self.forget for j in range(_N)]
                   for i in range(_N)]
        trace = sum(self._p[i][i] for i in range(_N))
        if trace > _N * self._p0:
            self._p = [[v * _N * self._p0 / trace for v in row] for row in self._p]
        self.coefficients = tuple(t / s for t, s in zip(self._theta, _SCALES))
        self.num_observed += 1

    def overrun(self, quantile: float) -> float | None:
        """That quantile of measured / predicted time over the recent iterations that
        decoded (the time between a request's tokens is such an iteration); None until
        OVERRUN_MIN_SAMPLES were seen."""
        if len(self._overruns) < OVERRUN_MIN_SAMPLES:
            return None
        if not self._sorted_overruns or self._unsorted >= OVERRUN_REFRESH:
            self._sorted_overruns, self._unsorted = sorted(self._overruns), 0
        ordered = self._sorted_overruns
        return ordered[min(len(ordered) - 1, int(quantile * len(ordered)))]

    def describe(self) -> dict[str, float]:
        return dict(zip(FEATURES, self.coefficients)) | {
            "efficient_tokens": self.efficient_tokens}
