"""``GET /metrics``: vLLM's metric names under ``ubatch:``, with the values the requests imply (the double reports
to the server's ``ServerMetrics`` as the engine client does), and the DBO figures from ``EngineStats``."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from fake_engine_client import FakeEngineClient, make_tokenizer
from openai_harness import MODEL, ServerThread
from runner.engine.async_llm import _rank_stats
from runner.engine.protocol import EngineStats, RankStats
from runner.entrypoints.openai.metrics import ServerMetrics
from runner.outputs import CompletionOutput, RequestMetrics, RequestOutput
from test_openai_lifecycle import Background, wait_until


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(got: dict, name: str, **labels: str) -> float:
    return got[(name, tuple(sorted({"model_name": MODEL, **labels}.items())))]


def test_metrics_after_requests() -> None:
    engine = FakeEngineClient(num_ranks=2)
    with ServerThread(engine) as srv:
        c = srv.client()
        c.completions.create(model=MODEL, prompt=["one", "two!"], max_tokens=3)  # 2 requests, 3 tokens each
        c.completions.create(model=MODEL, prompt="three", max_tokens=4, n=2, seed=1)  # 1 request, 2 x 4 tokens
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                  stop=["zzz"], stream=True)  # 1 request, 5 tokens
        with srv.http() as http:
            r = http.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    got = samples(r.text)
    tok = make_tokenizer()
    chat_len = len(tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"])
    prompt_tokens = 3 + 4 + 5 + chat_len
    assert value(got, "ubatch:prompt_tokens_total") == prompt_tokens
    assert value(got, "ubatch:generation_tokens_total") == 2 * 3 + 2 * 4 + 5
    assert value(got, "ubatch:request_success_total", finished_reason="length") == 5  # samples
    assert value(got, "ubatch:request_success_total", finished_reason="abort") == 0
    assert value(got, "ubatch:time_to_first_token_seconds_count") == 4  # requests
    assert value(got, "ubatch:e2e_request_latency_seconds_count") == 4
    assert value(got, "ubatch:request_prompt_tokens_sum") == prompt_tokens
    # one gap per token after a request's first step: 2 + 3 (x2 samples) + 4, counted per token
    assert value(got, "ubatch:inter_token_latency_seconds_count") == 2 * 2 + 3 * 2 + 4
    for rank in ("0", "1"):
        assert value(got, "ubatch:num_requests_running", engine=rank) == 0
        assert value(got, "ubatch:num_requests_waiting", engine=rank) == 0
        assert value(got, "ubatch:kv_cache_usage_perc", engine=rank) == 0
    steps = value(got, "ubatch:engine_steps_total")
    assert steps == engine._steps > 0
    assert value(got, "ubatch:dbo_ubatched_steps_total") == steps // 2
    assert value(got, "ubatch:dbo_comm_hidden_ratio") == 0.75  # the double: 1 of 4 units of comm exposed


def test_running_requests_show_in_the_gauges() -> None:
    engine = FakeEngineClient(token_delay_s=0.02, num_ranks=2)
    with ServerThread(engine, shutdown_timeout_s=0.1) as srv, srv.http() as http:
        background = [Background(lambda: srv.client().completions.create(model=MODEL, prompt="x", max_tokens=200))
                      for _ in range(3)]
        wait_until(lambda: len(engine.running) == 3, "three requests to run")
        got = samples(http.get("/metrics").text)
        assert [value(got, "ubatch:num_requests_running", engine=r) for r in ("0", "1")] == [2, 1]
        assert value(got, "ubatch:kv_cache_usage_perc", engine="0") > 0
    for b in background:
        assert b.result().choices[0].finish_reason == "abort"


def test_separate_registries_and_no_ratio_before_any_all_to_all() -> None:
    a, b = ServerMetrics("a", 100), ServerMetrics("b", 100)
    a.on_prompt_tokens(5)
    a.on_engine_stats(EngineStats(ranks=[RankStats(num_steps=3)]))
    a.on_request_finished(RequestOutput("r", None, [1], [CompletionOutput(0, "x", [2], finish_reason="stop"),
                                                         CompletionOutput(1, "y", [3], finish_reason="length")],
                                        True, metrics=RequestMetrics(10.0, 10.5, 11.0, 12.0)), 1, 2)
    got_a, got_b = samples(a.render().decode()), samples(b.render().decode())
    key = ("ubatch:prompt_tokens_total", (("model_name", "a"),))
    assert got_a[key] == 5 and got_b[("ubatch:prompt_tokens_total", (("model_name", "b"),))] == 0
    assert got_a[("ubatch:engine_steps_total", (("model_name", "a"),))] == 3
    assert got_a[("ubatch:e2e_request_latency_seconds_sum", (("model_name", "a"),))] == 2.0
    assert got_a[("ubatch:request_success_total", (("finished_reason", "stop"), ("model_name", "a")))] == 1
    assert got_a[("ubatch:request_success_total", (("finished_reason", "length"), ("model_name", "a")))] == 1
    assert not any(name == "ubatch:dbo_comm_hidden_ratio" for name, _ in got_a)


def test_the_dbo_cost_model_decision_per_bucket() -> None:
    """A gauge per (rank, bucket): DBO on (1) or off (0), and the measured speed-up; none before a bucket ran
    both ways. The figures come from the rank's stats message as the engine client decodes it."""
    from runner.core.messages import ENCODER, OUTPUT_DECODER, CoreStats, DBOBucketStat, Outputs

    sent = Outputs(0, [], CoreStats(dbo_buckets=[DBOBucketStat("decode 256-511 tok replayed", False, 0.57),
                                                 DBOBucketStat("prefill 512-1023 tok eager", True, 1.4)]))
    got_msg = OUTPUT_DECODER.decode(ENCODER.encode(sent))
    assert isinstance(got_msg, Outputs)
    rank0 = _rank_stats(got_msg.stats)
    m = ServerMetrics(MODEL, 100)
    m.on_engine_stats(EngineStats(ranks=[rank0, RankStats()]))
    got = samples(m.render().decode())
    decode, prefill = "decode 256-511 tok replayed", "prefill 512-1023 tok eager"
    assert value(got, "ubatch:dbo_cost_model_enabled", engine="0", bucket=decode) == 0
    assert value(got, "ubatch:dbo_cost_model_speedup", engine="0", bucket=decode) == 0.57
    assert value(got, "ubatch:dbo_cost_model_enabled", engine="0", bucket=prefill) == 1
    assert value(got, "ubatch:dbo_cost_model_speedup", engine="0", bucket=prefill) == 1.4
    assert sum(name == "ubatch:dbo_cost_model_enabled" for name, _ in got) == 2  # rank 1 has measured nothing
    m.on_engine_stats(EngineStats(ranks=[RankStats()]))
    assert not any(name.startswith("ubatch:dbo_cost_model") for name, _ in samples(m.render().decode()))


def test_equal_gaps_observed_together_render_as_one_by_one() -> None:
    """A step's gaps come in one ``on_tokens`` call, equal ones observed together: the histograms render the
    same counts in every bucket (and the same sum, but for rounding) as the gaps observed one by one."""
    gaps = [0.02] * 5 + [0.3] * 2 + [0.02, 7.0, 0.01, 1e6]
    together, one_by_one = ServerMetrics(MODEL, 100), ServerMetrics(MODEL, 100)
    together.on_tokens(len(gaps) + 1, 0.5, gaps)
    together.on_tokens(1, None, [0.04])
    one_by_one.on_tokens(0, 0.5, [])
    for gap in gaps + [0.04]:
        one_by_one.on_tokens(1, None, [gap])
    one_by_one.on_tokens(1, None, [])
    got, want = samples(together.render().decode()), samples(one_by_one.render().decode())
    assert got.keys() == want.keys()
    for key, expected in want.items():
        if key[0] == "ubatch:inter_token_latency_seconds_sum":
            assert abs(got[key] - expected) <= 1e-9 * expected, key
        elif not key[0].endswith("_created"):
            assert got[key] == expected, key
    assert value(got, "ubatch:inter_token_latency_seconds_count") == len(gaps) + 1
    assert value(got, "ubatch:inter_token_latency_seconds_bucket", le="0.025") == 7  # six of 0.02, one of 0.01
    assert value(got, "ubatch:inter_token_latency_seconds_bucket", le="+Inf") == len(gaps) + 1
    assert value(got, "ubatch:generation_tokens_total") == len(gaps) + 2
