"""Server-side scheduling delay from a Prometheus `/metrics` page, for any server that has one.

stallfree and vLLM both export `<prefix>:request_queue_time_seconds`, a
histogram of arrival -> first scheduled, with the same buckets (one edge at
exactly 2.0 s). Scraping it before and after a run and subtracting gives the
run's own histogram. From it:

- `frac_le_2s`: the share of requests that waited <= 2 s. The capacity
  criterion "median scheduling delay <= 2 s" holds exactly when this is
  >= 0.5, with no estimation, because 2.0 is a bucket edge.
- `median_upper_s`: the upper edge of the bucket holding the median (a bound),
  and `median_s`, an estimate by linear interpolation inside that bucket (as
  Prometheus' histogram_quantile does; coarse buckets make it rough).
- `mean_s`: exact (sum / count).

A request is observed when it finishes, so the scrape after the run must wait
until the server has finished them all (the client has by then).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import httpx

QUEUE_METRIC_SUFFIX = ":request_queue_time_seconds"
_SAMPLE = re.compile(r'^([a-zA-Z_:][\w:]*)(?:\{([^}]*)\})?\s+(\S+)')
_LE = re.compile(r'le="([^"]+)"')


@dataclass
class Histogram:
    buckets: dict[float, float]  # upper edge -> cumulative count (summed over label sets)
    sum: float
    count: float

    def minus(self, before: Histogram) -> Histogram:
        return Histogram({le: c - before.buckets.get(le, 0.0) for le, c in self.buckets.items()},
                         self.sum - before.sum, self.count - before.count)

    def fraction_le(self, edge: float) -> float | None:
        """Share of observations <= the largest bucket edge <= `edge` (exact at an edge)."""
        if self.count <= 0:
            return None
        edges = [le for le in self.buckets if le <= edge]
        return self.buckets[max(edges)] / self.count if edges else 0.0

    def quantile(self, q: float) -> float | None:
        if self.count <= 0:
            return None
        rank = q * self.count
        lower_edge, lower_count = 0.0, 0.0
        for le in sorted(self.buckets):
            c = self.buckets[le]
            if c >= rank:
                if math.isinf(le):
                    return lower_edge  # beyond the last finite edge: its edge is a lower bound
                width = c - lower_count
                frac = (rank - lower_count) / width if width > 0 else 1.0
                return lower_edge + (le - lower_edge) * frac
            lower_edge, lower_count = le, c
        return lower_edge

    def upper_edge(self, q: float) -> float | None:
        """The upper edge of the bucket holding quantile q."""
        if self.count <= 0:
            return None
        return next((le for le in sorted(self.buckets) if self.buckets[le] >= q * self.count),
                    None)

    def summary(self) -> dict[str, float | None]:
        return {"count": self.count, "mean_s": self.sum / self.count if self.count else None,
                "median_s": self.quantile(0.5), "median_upper_s": self.upper_edge(0.5),
                "frac_le_2s": self.fraction_le(2.0)}


def parse_histogram(text: str, suffix: str = QUEUE_METRIC_SUFFIX) -> Histogram | None:
    """The histogram whose name ends with `suffix` (any prefix), summed over label sets."""
    buckets: dict[float, float] = {}
    total = count = 0.0
    found = False
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name.endswith(suffix + "_bucket"):
            le = _LE.search(labels)
            if le:
                edge = float(le.group(1))  # "+Inf" parses to inf
                buckets[edge] = buckets.get(edge, 0.0) + value
                found = True
        elif name.endswith(suffix + "_sum"):
            total += value
        elif name.endswith(suffix + "_count"):
            count += value
    return Histogram(buckets, total, count) if found else None


def scrape_queue_time(base_url: str, api_key: str | None = None,
                      timeout: float = 10.0) -> Histogram | None:
    """The server's queue-time histogram now; None if it has no such metric (or no /metrics)."""
    url = base_url.rstrip("/")
    url = url.removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(url + "/metrics", headers=headers, timeout=timeout, trust_env=False)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    return parse_histogram(resp.text)
