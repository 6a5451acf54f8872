"""Summary statistics of a benchmark run, with vLLM's definitions (``vllm/benchmarks/serve.py``):
TPOT = (latency - TTFT) / (output tokens - 1) per request; ITL = every gap between streamed chunks."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from runner.entrypoints.benchserve.http_client import RequestResult

PERCENTILES = (50, 90, 99)


def _stats(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}
    arr = np.asarray(values) * 1000.0  # milliseconds
    return {"mean": float(arr.mean()), "median": float(np.percentile(arr, 50)), "p90": float(np.percentile(arr, 90)),
            "p99": float(np.percentile(arr, 99))}


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2el_ms: dict[str, float]
    ubatched_steps: float | None = None  # from the server's /metrics, over the run
    engine_steps: float | None = None
    server_prompt_tokens: float | None = None  # what the server counted (ubatch:prompt_tokens_total), over the run
    server_generation_tokens: float | None = None
    # the server's prefix-cache counters over the run (ubatch:prefix_cache_queries / _hits, prompt tokens)
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
    client_cpu_share: float | None = None  # the load generator's CPU seconds per second of the run (1.0: a core)
    total_chunks: int = 0  # streamed chunks that carried text
    errors: tuple[str, ...] = ()

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Cached prompt tokens per prompt token looked up; None when the server looked none up (caching off)."""
        if not self.prefix_cache_queries or self.prefix_cache_hits is None:
            return None
        return self.prefix_cache_hits / self.prefix_cache_queries

    @property
    def prompt_tokens_computed(self) -> float | None:
        """The prompt tokens the server computed: those it counted less those the prefix cache served."""
        if self.server_prompt_tokens is None:
            return None
        return self.server_prompt_tokens - (self.prefix_cache_hits or 0.0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def flat(self) -> dict[str, Any]:
        """One CSV row: the scalar fields and ``<metric>_<stat>_ms`` columns."""
        row = {k: v for k, v in asdict(self).items() if not isinstance(v, (dict, tuple))}
        for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            for stat, value in getattr(self, name).items():
                row[f"{name[:-3]}_{stat}_ms"] = round(value, 3)
        return row


def compute_metrics(results: Sequence[RequestResult], duration_s: float) -> BenchmarkMetrics:
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    tpots = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    return BenchmarkMetrics(
        completed=len(done), failed=len(results) - len(done), duration_s=duration_s,
        total_input_tokens=sum(r.prompt_tokens for r in done), total_output_tokens=out_tokens,
        request_throughput=len(done) / duration_s if duration_s > 0 else 0.0,
        input_throughput=sum(r.prompt_tokens for r in done) / duration_s if duration_s > 0 else 0.0,
        output_throughput=out_tokens / duration_s if duration_s > 0 else 0.0,
        total_chunks=sum(r.chunks for r in done), ttft_ms=_stats([r.ttft_s for r in done]), tpot_ms=_stats(tpots),
        itl_ms=_stats([g for r in done for g in r.itl_s]), e2el_ms=_stats([r.latency_s for r in done]),
        errors=tuple(sorted({r.error for r in results if not r.ok}))[:5])
