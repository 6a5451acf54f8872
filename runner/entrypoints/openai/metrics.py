"""Prometheus metrics with vLLM's names, types and buckets (``vllm/v1/metrics/loggers.py``,
``PrometheusStatLogger``) under the ``ubatch:`` prefix, plus the DBO ones no one else exports.

:class:`ServerMetrics` is the :class:`~runner.engine.protocol.MetricsSink` the engine client reports to
(tokens, timings, finished requests), on a registry of its own, so that several servers can live in one
process (the tests start many). The engine-wide figures (requests running and waiting and KV-cache usage per
DP rank, engine steps, ubatched steps, the share of all-to-all time hidden behind compute) are read from the
latest :class:`~runner.engine.protocol.EngineStats` when scraped: ``on_engine_stats`` stores them (the
``/metrics`` route passes the engine's current ones before ``render``). vLLM's prefix-cache counters
(``prefix_cache_queries``, ``prefix_cache_hits``: prompt tokens, per DP rank) are among them: each rank counts
its own, so they come from the stats too, not from events.

Every series carries ``model_name`` (the first served name); the per-rank gauges also carry ``engine`` (the DP
rank), as vLLM's do, so ``sum(ubatch:num_requests_running)`` is the server's total.

With several API-server processes (``--api-server-count``, ``PROMETHEUS_MULTIPROC_DIR`` set by their parent),
counters and histograms live in prometheus_client's per-process files and ``render`` sums those of every
process; the engine-wide figures come from this process's latest stats (every rank reports to every API
server), and ``ubatch:api_server_requests`` counts the requests each API server finished.
"""
from __future__ import annotations

import os
from collections import Counter as Tally
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from runner.engine.protocol import EngineStats
from runner.outputs import RequestOutput

PREFIX = "ubatch:"

# vLLM's buckets (PrometheusStatLogger).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0]
# The finish reasons vLLM labels ``request_success`` with (its FinishReason), plus "error" (a request the engine
# could not run, ``runner.outputs.CompletionOutput``).
FINISH_REASONS = ("stop", "length", "abort", "error")


def observe_repeated(histogram: Histogram, value: float, count: int) -> None:
    """``histogram.observe(value)`` ``count`` times, as one update of its sum and of the bucket ``value`` falls
    in (its first upper bound >= ``value``): the same counts, and the same sum but for float rounding. A step's
    inter-token gaps are mostly one value (the requests' previous tokens came in the same step), and
    prometheus_client observes one value at a time. ``histogram`` is a labelled child (one series); this reads
    its ``_sum``, ``_buckets`` and ``_upper_bounds``, which ``observe`` uses (``tests/test_openai_metrics.py``
    checks that both render the same text)."""
    histogram._sum.inc(value * count)
    for bound, bucket in zip(histogram._upper_bounds, histogram._buckets, strict=True):
        if value <= bound:
            bucket.inc(count)
            return


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return buckets
            buckets.append(m * scale)
        scale *= 10


class ServerMetrics:
    """A ``MetricsSink`` exporting Prometheus text (``render``)."""

    def __init__(self, model_name: str, max_model_len: int, api_server: int | None = None) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.latest_stats = EngineStats()
        reg, labels, name = self.registry, ["model_name"], model_name

        def histogram(metric: str, doc: str, buckets: list[float] | list[int]) -> Histogram:
            return Histogram(PREFIX + metric, doc, labels, buckets=buckets, registry=reg)

        def counter(metric: str, doc: str) -> Counter:
            return Counter(PREFIX + metric, doc, labels, registry=reg)

        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS).labels(name)
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS).labels(name)
        self.e2e = histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS).labels(name)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Number of prefill tokens processed.",
                                               build_1_2_5_buckets(max_model_len)).labels(name)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Number of generation tokens processed.",
                                                   build_1_2_5_buckets(max_model_len)).labels(name)
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.").labels(name)
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.").labels(name)
        self.left_mid_body = counter("client_left_mid_body", "Requests whose client disconnected before their "
                                     "body arrived.").labels(name)
        self._success = Counter(PREFIX + "request_success", "Count of successfully processed requests.",
                                labels + ["finished_reason"], registry=reg)
        # every series present from the start, at 0; the children kept, as a label lookup costs more than an inc
        self._success_by_reason = {reason: self._success.labels(name, reason) for reason in FINISH_REASONS}
        self._per_api_server = None if api_server is None else Counter(
            PREFIX + "api_server_requests", "Requests finished by each API-server process (--api-server-count).",
            labels + ["api_server"], registry=reg).labels(name, str(api_server))
        self._export = reg
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # one of several API-server processes: sum them all
            self._export = CollectorRegistry()
            multiprocess.MultiProcessCollector(self._export)
        self._export.register(_EngineStatsCollector(self))

    # ---- MetricsSink ---------------------------------------------------------------------------------------
    def on_request_finished(self, output: RequestOutput, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        """One finished request (its final output, every sample with its finish reason): each sample counts
        once under its reason (vLLM runs n samples as n requests); latency from arrival to the end when the
        engine recorded the end."""
        for sample in output.outputs:
            reason = sample.finish_reason
            if reason is not None:
                counter = self._success_by_reason.get(reason)
                (counter if counter is not None else self._success.labels(self.model_name, reason)).inc()
        if self._per_api_server is not None:
            self._per_api_server.inc()
        m = output.metrics
        if m is not None and m.finished_time is not None:
            self.e2e.observe(max(0.0, m.finished_time - m.arrival_time))
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_generation_tokens)

    def on_tokens(self, num_new_tokens: int, ttft_s: float | None, itl_s: list[float]) -> None:
        """Equal gaps (a step's, mostly) are observed together (:func:`observe_repeated`)."""
        if num_new_tokens:
            self.generation_tokens.inc(num_new_tokens)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if len(itl_s) == 1:
            self.itl.observe(itl_s[0])
        elif itl_s:
            itl = self.itl
            for gap, count in Tally(itl_s).items():
                observe_repeated(itl, gap, count)

    def on_prompt_tokens(self, num_tokens: int) -> None:
        self.prompt_tokens.inc(num_tokens)

    def on_engine_stats(self, stats: EngineStats) -> None:
        self.latest_stats = stats

    # ---- export ------------------------------------------------------------------------------------------
    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self._export)


class _EngineStatsCollector(Collector):
    """The figures that come as the engine's latest totals, not as events."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        stats, name = self.metrics.latest_stats, self.metrics.model_name
        running = GaugeMetricFamily(PREFIX + "num_requests_running", "Number of requests in model execution batches.",
                                    labels=["model_name", "engine"])
        waiting = GaugeMetricFamily(PREFIX + "num_requests_waiting", "Number of requests waiting to be processed.",
                                    labels=["model_name", "engine"])
        kv = GaugeMetricFamily(PREFIX + "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                               labels=["model_name", "engine"])
        # vLLM's prefix-cache counters: prompt tokens looked up in the cache and, of those, found there (per rank,
        # cumulative since the rank started; hits / queries is the hit rate over any window)
        queries = CounterMetricFamily(PREFIX + "prefix_cache_queries", "Prefix cache queries, in terms of number of "
                                      "queried tokens.", labels=["model_name", "engine"])
        hits = CounterMetricFamily(PREFIX + "prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                                   "tokens.", labels=["model_name", "engine"])
        for rank, r in enumerate(stats.ranks):
            running.add_metric([name, str(rank)], r.num_running)
            waiting.add_metric([name, str(rank)], r.num_waiting)
            kv.add_metric([name, str(rank)], r.kv_cache_usage)
            queries.add_metric([name, str(rank)], r.prefix_cache_queries)
            hits.add_metric([name, str(rank)], r.prefix_cache_hits)
        yield from (running, waiting, kv, queries, hits)
        steps = CounterMetricFamily(PREFIX + "engine_steps", "Engine steps run with work on some DP rank (the ranks "
                                    "step together; dummy steps of idle ranks included).", labels=["model_name"])
        steps.add_metric([name], stats.num_steps)
        ubatched = CounterMetricFamily(PREFIX + "dbo_ubatched_steps", "Engine steps run as two dual-batch-overlap "
                                       "micro-batches.", labels=["model_name"])
        ubatched.add_metric([name], stats.num_ubatched_steps)
        yield from (steps, ubatched)
        hidden = stats.comm_hidden_fraction
        if hidden is not None:  # no all-to-all measured yet (no MoE step ran, or no link): no sample
            ratio = GaugeMetricFamily(PREFIX + "dbo_comm_hidden_ratio", "Share of all-to-all time hidden behind "
                                      "compute (1 - exposed / total), over all DP ranks.", labels=["model_name"])
            ratio.add_metric([name], hidden)
            yield ratio
        buckets = [(rank, bucket, on_speedup) for rank, r in enumerate(stats.ranks)
                   for bucket, on_speedup in sorted(r.dbo_buckets.items())]
        if buckets:  # the measured DBO cost model has run some bucket both ways
            on = GaugeMetricFamily(PREFIX + "dbo_cost_model_enabled", "1 where the measured DBO cost model runs this "
                                   "bucket of steps with DBO, 0 where without.",
                                   labels=["model_name", "engine", "bucket"])
            speedup = GaugeMetricFamily(PREFIX + "dbo_cost_model_speedup", "The DBO cost model's measured speed-up "
                                        "of DBO in this bucket (time per token without DBO / with it, from each "
                                        "side's fastest recent step).", labels=["model_name", "engine", "bucket"])
            for rank, bucket, (dbo_on, measured) in buckets:
                on.add_metric([name, str(rank), bucket], 1.0 if dbo_on else 0.0)
                speedup.add_metric([name, str(rank), bucket], measured)
            yield from (on, speedup)
