"""``python -m runner bench-serve`` against a real server it starts: a few seconds of load, then its reported
counts are checked against what the server itself counted and what the workload asked for (no timing)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from runner.entrypoints.benchserve.http_client import RequestResult
from runner.entrypoints.benchserve.metrics import compute_metrics
from runner.entrypoints.benchserve.workload import arrival_offsets, prefix_repetition_requests, random_requests

pytestmark = pytest.mark.slow


def test_bench_serve_counts_equal_what_the_server_sent(tmp_path: Path) -> None:
    """Run with `vllm bench serve`'s flags; its --save-result JSON has vLLM's keys and the server's counts."""
    out, results, logs = tmp_path / "bench.json", tmp_path / "results", tmp_path / "logs"
    cmd = [sys.executable, "-m", "runner", "bench-serve", "tiny-qwen3-moe", "--server-args",
           f"--device cpu --max-num-seqs 8 --cache-dir {tmp_path}", "--dataset-name", "random", "--num-prompts", "12",
           "--random-input-len", "9", "--random-output-len", "7", "--random-range-ratio", "0", "--ignore-eos",
           "--backend", "vllm", "--max-concurrency", "6", "--request-rate", "50", "--percentile-metrics",
           "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(results),
           "--server-log-dir", str(logs), "--output-json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Output token throughput (tok/s)" in proc.stdout and "P50 E2EL (ms)" in proc.stdout
    run = json.loads(out.read_text())["runs"][0]["metrics"]
    assert (run["completed"], run["failed"]) == (12, 0)
    assert run["total_input_tokens"] == 12 * 9 == run["server_prompt_tokens"]
    assert run["total_output_tokens"] == 12 * 7 == run["server_generation_tokens"]
    assert run["total_chunks"] == 12 * 7  # one streamed chunk per token with this engine
    assert run["engine_steps"] >= 7
    (saved,) = results.iterdir()
    assert saved.name.startswith("vllm-50.0qps-concurrency6-tiny-qwen3-moe-") and saved.suffix == ".json"
    result = json.loads(saved.read_text())
    assert set(VLLM_RESULT_KEYS) <= set(result)
    assert {f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "std", "p50",
                                                                                  "p99")} <= set(result)
    assert (result["backend"], result["model_id"], result["num_prompts"], result["request_rate"],
            result["max_concurrency"]) == ("vllm", "tiny-qwen3-moe", 12, 50.0, 6)
    assert (result["completed"], result["total_input_tokens"], result["total_output_tokens"]) == (12, 108, 84)
    assert 1 <= result["max_concurrent_requests"] <= 6 and "input_lens" not in result  # not --save-detailed
    (log,) = logs.iterdir()  # kept where asked, and named
    assert f"server: log kept at {log}" in proc.stderr and log.stat().st_size > 0


def test_compare_prefix_caching_counts_the_cached_tokens_of_each_cold_run(tmp_path: Path) -> None:
    """vLLM's prefix_repetition dataset, one request at a time: in every run of the caching server, each prefix's
    first request computes it and the others find its whole blocks (the cache emptied before each run); the
    server without caching finds nothing."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "runner", "bench-serve", "tiny-qwen3-moe", "--server-args",
           f"--device cpu --max-num-seqs 4 --cache-dir {tmp_path}", "--compare", "prefix-caching",
           "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "64",
           "--prefix-repetition-suffix-len", "16", "--prefix-repetition-num-prefixes", "2",
           "--prefix-repetition-output-len", "4", "--num-prompts", "8", "--max-concurrency", "1", "--repeats", "2",
           "--ignore-eos", "--output-json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "caching off vs caching on" in proc.stdout and "Prefix cache hit rate (%)" in proc.stdout
    runs = json.loads(out.read_text())["runs"]
    assert sorted((r["server"], r["repeat"]) for r in runs) == [("caching off", 0), ("caching off", 1),
                                                                ("caching on", 0), ("caching on", 1)]
    for r in runs:
        m = r["metrics"]
        assert (m["completed"], m["server_prompt_tokens"]) == (8, 8 * 80)
        if r["server"] == "caching on":  # 2 prefixes x 3 later requests x 4 whole blocks of 16
            assert (m["prefix_cache_queries"], m["prefix_cache_hits"]) == (8 * 80, 2 * 3 * 64)
        else:
            assert m["prefix_cache_hits"] == 0


def test_every_run_of_a_started_server_starts_from_an_empty_prefix_cache(tmp_path: Path) -> None:
    """The same 40-token prompts (two whole blocks of 16) in every repeat: with caching on (the default) each run
    still computes them all, the cache emptied before it, so repeats measure cold prompts alike."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "runner", "bench-serve", "tiny-qwen3-moe", "--server-args",
           f"--device cpu --max-num-seqs 4 --cache-dir {tmp_path}", "--dataset-name", "random", "--num-prompts", "4",
           "--random-input-len", "40", "--random-output-len", "2", "--random-range-ratio", "0", "--ignore-eos",
           "--max-concurrency", "1", "--repeats", "2", "--output-json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert [(r["repeat"], r["metrics"]["completed"], r["metrics"]["prefix_cache_queries"],
             r["metrics"]["prefix_cache_hits"]) for r in runs] == [(0, 4, 4 * 40, 0), (1, 4, 4 * 40, 0)]


VLLM_RESULT_KEYS = ("date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
                    "request_rate", "burstiness", "max_concurrency", "duration", "completed", "failed",
                    "total_input_tokens", "total_output_tokens", "request_throughput", "request_goodput",
                    "output_throughput", "total_token_throughput", "max_output_tokens_per_s",
                    "max_concurrent_requests")


def test_eos_is_honoured_unless_ignore_eos() -> None:
    from runner.entrypoints.benchserve.http_client import completion_body
    from runner.entrypoints.benchserve.workload import BenchRequest

    req = BenchRequest([1, 2], 5)
    assert completion_body("m", req, ignore_eos=False)["ignore_eos"] is False
    assert completion_body("m", req, ignore_eos=True)["ignore_eos"] is True
    assert completion_body("m", req, ignore_eos=False)["max_tokens"] == 5


def test_vllm_result_from_known_requests() -> None:
    from runner.entrypoints.benchserve.vllm_result import RunSettings, result_filename, vllm_result

    results = [RequestResult(True, 10, 5, 5, 0.1, [0.02] * 4, 0.18, start_time=100.0, text="abcde"),
               RequestResult(True, 8, 1, 1, 0.3, [], 0.3, start_time=100.1),
               RequestResult(False, error="HTTP 503: full", start_time=100.2)]
    settings = RunSettings("openai", None, "/models/m", "/models/m", 3, float("inf"), 1.0, None)
    r = vllm_result(settings, results, 2.0, ["ttft", "tpot", "e2el"], [50.0, 99.0, 99.9], detailed=True)
    assert set(VLLM_RESULT_KEYS) <= set(r)
    assert (r["completed"], r["failed"], r["total_input_tokens"], r["total_output_tokens"]) == (2, 1, 18, 6)
    assert (r["request_throughput"], r["output_throughput"], r["total_token_throughput"]) == (1.0, 3.0, 12.0)
    assert r["request_rate"] == "inf" and r["max_concurrent_requests"] == 2 and r["max_output_tokens_per_s"] == 6
    assert round(r["mean_tpot_ms"], 6) == 20.0 and round(r["median_ttft_ms"], 6) == 200.0  # TPOT: > 1 token only
    assert {"p50_ttft_ms", "p99_ttft_ms", "p99.9_e2el_ms", "std_e2el_ms"} <= set(r) and "mean_itl_ms" not in r
    assert r["output_lens"] == [5, 1, 0] and r["errors"] == ["", "", "HTTP 503: full"]
    assert r["generated_texts"][0] == "abcde" and r["itls"][0] == [0.02] * 4
    assert result_filename(settings, "20260101-000000") == "openai-infqps-m-20260101-000000.json"


def test_server_log_is_removed_or_kept_and_named(tmp_path: Path) -> None:
    from runner.entrypoints.benchserve.server_proc import ServerProcess

    removed = ServerProcess("m", name="dbo off")
    assert Path(removed.log_path).exists() and "ubatch-bench-dbo-off-" in removed.log_path
    assert removed.finish_log(keep=False) is None and not Path(removed.log_path).exists()
    kept = ServerProcess("m", log_dir=str(tmp_path))
    assert kept.finish_log(keep=True) == kept.log_path and Path(kept.log_path).parent == tmp_path


@pytest.mark.parametrize("argv, message", [
    (["--dataset-name", "sharegpt"], "argument --dataset-name: invalid choice: 'sharegpt'"),
    (["--backend", "openai-chat"], "argument --backend: invalid choice: 'openai-chat'"),
    (["--percentile-metrics", "ttft,goodput"], "argument --percentile-metrics: 'ttft,goodput': expected a "
                                               "comma-separated list of ttft, tpot, itl, e2el"),
    (["--metric-percentiles", "50,101"], "argument --metric-percentiles: '50,101': percentile 101 is outside"),
    (["--random-range-ratio", "1"], "argument --random-range-ratio: must lie in [0, 1), got 1.0"),
    (["--input-len", "0"], "argument --random-input-len: must be >= 1, got 0"),
    (["--compare", "dbo", "--result-filename", "r.json"], "argument --result-filename: this benchmark makes 2 runs"),
    (["--compare", "prefix-cache"], "argument --compare: invalid choice: 'prefix-cache'"),
    (["--dataset-name", "prefix_repetition", "--num-prompts", "10", "--prefix-repetition-num-prefixes", "3"],
     "argument --num-prompts: must be a multiple of --prefix-repetition-num-prefixes (3) with --dataset-name "
     "prefix_repetition, got 10"),
    (["--prefix-repetition-num-prefixes", "0"], "argument --prefix-repetition-num-prefixes: must be >= 1, got 0"),
    (["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "0", "--prefix-repetition-suffix-len",
      "0"], "argument --prefix-repetition-suffix-len: prompts of no tokens"),
])
def test_bad_bench_serve_flags_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    from runner.entrypoints.cli import main

    with pytest.raises(SystemExit) as info:
        main(["bench-serve", "tiny-qwen3-moe", *argv])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_workload_and_metrics_definitions() -> None:
    reqs = random_requests(5, 10, 4, vocab_size=50, range_ratio=0.5, seed=1)
    assert [len(r.prompt_token_ids) for r in reqs] == [len(r.prompt_token_ids) for r in
                                                        random_requests(5, 10, 4, 50, range_ratio=0.5, seed=1)]
    assert all(5 <= len(r.prompt_token_ids) <= 15 and 2 <= r.output_len <= 6 for r in reqs)
    assert arrival_offsets(3, float("inf")) == [0.0, 0.0, 0.0]
    gaps = arrival_offsets(2000, 100.0, seed=0)
    assert gaps == sorted(gaps) and 15 < gaps[-1] < 25  # mean gap 10 ms
    with pytest.raises(ValueError, match="request_rate must be > 0"):
        arrival_offsets(3, 0.0)
    results = [RequestResult(True, 10, 5, 5, 0.1, [0.02] * 4, 0.18), RequestResult(False, error="HTTP 503: full")]
    m = compute_metrics(results, 2.0)
    assert (m.completed, m.failed, m.total_output_tokens, m.errors) == (1, 1, 5, ("HTTP 503: full",))
    assert m.output_throughput == 2.5 and round(m.tpot_ms["mean"], 6) == 20.0  # (0.18 - 0.1) / (5 - 1)


def test_prefix_repetition_workload() -> None:
    reqs = prefix_repetition_requests(6, 5, 3, 2, 4, vocab_size=50, seed=1)
    assert reqs == prefix_repetition_requests(6, 5, 3, 2, 4, vocab_size=50, seed=1)  # the seed fixes it
    assert all(len(r.prompt_token_ids) == 8 and r.output_len == 4 for r in reqs)
    prefixes = [tuple(r.prompt_token_ids[:5]) for r in reqs]
    assert sorted(prefixes.count(p) for p in set(prefixes)) == [3, 3]  # two prefixes, three prompts each
    assert len({tuple(r.prompt_token_ids) for r in reqs}) == 6  # every suffix drawn afresh
    assert prefixes != sorted(prefixes, key=prefixes.index)  # shuffled: one prefix's prompts do not all lead
    with pytest.raises(ValueError, match=r"num_prompts \(7\) must be a multiple of num_prefixes \(2\)"):
        prefix_repetition_requests(7, 5, 3, 2, 4, vocab_size=50)


def test_prefix_cache_figures_of_a_run() -> None:
    m = compute_metrics([RequestResult(True, 10, 5, 5, 0.1, [0.02] * 4, 0.18)], 1.0)
    assert m.prefix_cache_hit_rate is None and m.prompt_tokens_computed is None  # no counters read
    m.server_prompt_tokens, m.prefix_cache_queries, m.prefix_cache_hits = 1000.0, 1000.0, 750.0
    assert m.prefix_cache_hit_rate == 0.75 and m.prompt_tokens_computed == 250.0
    m.prefix_cache_queries, m.prefix_cache_hits = 0.0, 0.0  # caching off: nothing looked up
    assert m.prefix_cache_hit_rate is None and m.prompt_tokens_computed == 1000.0


def test_send_completion_reads_the_stream_and_names_failures() -> None:
    """The client against a stand-in server: SSE lines split across writes, an HTTP error, a silent server."""
    import asyncio

    import aiohttp
    from aiohttp import web

    from runner.entrypoints.benchserve.http_client import send_completion
    from runner.entrypoints.benchserve.workload import BenchRequest

    async def stream(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for piece in ("a", "é", "c"):
            line = json.dumps({"choices": [{"text": piece}]})
            await resp.write(f"data: {line[:5]}".encode())  # a line split in two writes
            await resp.write(f"{line[5:]}\n\n".encode())
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        return resp

    async def full(request: web.Request) -> web.Response:
        return web.Response(status=503, text="queue full")

    async def silent(request: web.Request) -> web.Response:
        await asyncio.sleep(2)  # past the client's 0.5 s; the server's cleanup waits for it
        return web.Response(text="late")

    async def main() -> list[RequestResult]:
        app = web.Application()
        app.router.add_post("/stream", stream)
        app.router.add_post("/full", full)
        app.router.add_post("/silent", silent)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            async with aiohttp.ClientSession() as client:
                return [await send_completion(client, f"http://127.0.0.1:{port}/{path}", "m", BenchRequest([1, 2], 3),
                                              timeout_s=0.5) for path in ("stream", "full", "silent")]
        finally:
            await runner.cleanup()

    ok, full_result, silent_result = asyncio.run(main())
    assert (ok.ok, ok.text, ok.chunks, ok.prompt_tokens, ok.output_tokens, len(ok.itl_s)) == (True, "aéc", 3, 2, 3, 2)
    assert (full_result.ok, full_result.error) == (False, "HTTP 503: queue full")
    assert not silent_result.ok and silent_result.error.endswith("(limit 0.5 s per wait)"), silent_result.error
    assert "TimeoutError" in silent_result.error.split(":")[0], silent_result.error
