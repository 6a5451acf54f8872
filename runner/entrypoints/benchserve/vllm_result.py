"""One run's result in ``vllm bench serve --save-result``'s JSON shape, so scripts that read vLLM's result files
read these too: the run's settings (``date``, ``backend``, ``model_id``, ``num_prompts``, ``request_rate``, ...),
its counts and throughputs, and ``mean_/median_/std_/pNN_<metric>_ms`` for each ``--percentile-metrics`` metric
at each ``--metric-percentiles`` percentile; with ``--save-detailed``, the per-request lists.

Definitions are vLLM's (``vllm/benchmarks/serve.py``): TPOT = (latency - TTFT) / (output tokens - 1) per request
with more than one token; ITL = every gap between streamed chunks; ``max_output_tokens_per_s`` is the busiest
one-second bucket of token arrivals; ``max_concurrent_requests`` the most requests in flight at once.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # the HTTP client (aiohttp) is imported only where requests are sent
    from runner.entrypoints.benchserve.http_client import RequestResult

PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILE_METRICS = "ttft,tpot,itl"  # vLLM's default for generative models
DEFAULT_METRIC_PERCENTILES = "99"
DETAILED_FIELDS = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors")


def parse_percentile_metrics(text: str) -> list[str]:
    """``--percentile-metrics``: a comma-separated subset of ttft, tpot, itl, e2el (ValueError naming a bad one)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in PERCENTILE_METRICS]
    if bad or not names:
        raise ValueError(f"{text!r}: expected a comma-separated list of {', '.join(PERCENTILE_METRICS)}")
    return names


def parse_metric_percentiles(text: str) -> list[float]:
    """``--metric-percentiles``: comma-separated numbers in [0, 100] (ValueError naming a bad one)."""
    try:
        values = [float(p) for p in text.split(",")]
    except ValueError:
        raise ValueError(f"{text!r}: expected comma-separated percentiles, e.g. 50,90,99") from None
    bad = [p for p in values if not 0 <= p <= 100]
    if bad:
        raise ValueError(f"{text!r}: percentile {bad[0]:g} is outside [0, 100]")
    return values


@dataclass(frozen=True)
class RunSettings:
    """What ``vllm bench serve`` records about the run beside its measurements."""

    backend: str
    label: str | None
    model_id: str
    tokenizer_id: str
    num_prompts: int
    request_rate: float
    burstiness: float
    max_concurrency: int | None


def _percentile_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def _peaks(done: Sequence[RequestResult]) -> tuple[float, int]:
    """(most tokens arriving in one second, most requests in flight at once) over the successful requests."""
    if not done:
        return 0.0, 0
    t0 = min(r.start_time for r in done)
    buckets = np.zeros(int(math.ceil(max(r.start_time + r.latency_s for r in done) - t0)) + 1)
    for r in done:
        t = r.start_time + r.ttft_s
        times = [t]
        for gap in r.itl_s:
            t += gap
            times.append(t)
        for t in times:
            buckets[min(int(t - t0), len(buckets) - 1)] += 1
    events = sorted([(r.start_time, 1) for r in done] + [(r.start_time + r.latency_s, -1) for r in done])
    in_flight = peak = 0
    for _, delta in events:
        in_flight += delta
        peak = max(peak, in_flight)
    return float(buckets.max()), peak


def vllm_result(settings: RunSettings, results: Sequence[RequestResult], duration_s: float, metrics: Sequence[str],
                percentiles: Sequence[float], detailed: bool = False) -> dict[str, Any]:
    """The result JSON of one run (module docstring)."""
    done = [r for r in results if r.ok]
    output_lens = [r.output_tokens if r.ok else 0 for r in results]
    total_input, total_output = sum(r.prompt_tokens for r in done), sum(output_lens)
    values = {"ttft": [r.ttft_s for r in done], "e2el": [r.latency_s for r in done],
              "tpot": [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in done if r.output_tokens > 1],
              "itl": [gap for r in done for gap in r.itl_s]}
    peak_tokens, peak_requests = _peaks(done)
    rate = settings.request_rate
    out: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": settings.backend,
        "backend": settings.backend, "label": settings.label, "model_id": settings.model_id,
        "tokenizer_id": settings.tokenizer_id, "num_prompts": settings.num_prompts,
        "request_rate": rate if rate < math.inf else "inf", "burstiness": settings.burstiness,
        "max_concurrency": settings.max_concurrency, "duration": duration_s, "completed": len(done),
        "failed": len(results) - len(done), "total_input_tokens": total_input, "total_output_tokens": total_output,
        "request_throughput": len(done) / duration_s, "request_goodput": None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "max_output_tokens_per_s": peak_tokens, "max_concurrent_requests": peak_requests,
    }
    if detailed:
        out.update(input_lens=[r.prompt_tokens for r in results], output_lens=output_lens,
                   start_times=[r.start_time for r in results], ttfts=[r.ttft_s for r in results],
                   itls=[r.itl_s for r in results], generated_texts=[r.text for r in results],
                   errors=[r.error for r in results])
    for name in metrics:
        ms = np.asarray(values[name] or [0.0]) * 1000.0
        out[f"mean_{name}_ms"] = float(ms.mean())
        out[f"median_{name}_ms"] = float(np.median(ms))
        out[f"std_{name}_ms"] = float(ms.std())
        for p in percentiles:
            out[f"p{_percentile_word(p)}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def result_filename(settings: RunSettings, date: str) -> str:
    """vLLM's default name: ``{label}-{rate}qps[-concurrency{N}]-{model basename}-{date}.json``."""
    concurrency = f"-concurrency{settings.max_concurrency}" if settings.max_concurrency is not None else ""
    label = settings.label or settings.backend
    return f"{label}-{settings.request_rate}qps{concurrency}-{Path(settings.model_id).name}-{date}.json"
