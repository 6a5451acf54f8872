"""SIGTERM and SIGINT sent to a server process (``openai_server_main.py``, ``run_server`` over the test double):
new requests get 503 on connections still accepted, running requests finish within ``--shutdown-timeout`` or end
with finish_reason "abort", and the process exits 0 (uvicorn alone would die by the signal it re-raises)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fake_engine_client import expected_text, make_tokenizer
from openai_harness import sse_events
from test_openai_lifecycle import Background, wait_until

ROOT = Path(__file__).resolve().parents[1]
MAIN = ROOT / "tests" / "openai_server_main.py"
MODEL = "sig-model"


class ServerProcess:
    def __init__(self, *flags: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, str(MAIN), "--model", MODEL, "--port", "0", *flags],
                                     stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
        self.log: list[str] = []
        self.port: int | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        wait_until(lambda: self.port is not None or self.proc.poll() is not None, "the server to listen", 60)
        assert self.port is not None, "".join(self.log)
        self.url: str = f"http://127.0.0.1:{self.port}"

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:  # keep reading, so the pipe never fills
            self.log.append(line)
            found = re.search(rf"Serving {MODEL} on http://127\.0\.0\.1:(\d+)", line)
            if found:
                self.port = int(found.group(1))

    def wait(self, timeout_s: float = 60) -> int:
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"the server did not exit within {timeout_s} s:\n{''.join(self.log)}") from None
        self._reader.join(10)
        return code

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def num_running(http: httpx.Client) -> float:
    families = text_string_to_metric_families(http.get("/metrics").text)
    return sum(s.value for f in families if f.name == "ubatch:num_requests_running" for s in f.samples)


def stream_body(max_tokens: int) -> dict:
    return {"model": MODEL, "prompt": "drain me", "max_tokens": max_tokens, "stream": True}


def wait_streaming(url: str) -> tuple[Background, threading.Event]:
    """A streamed request in the background, and an event set once its first chunk arrived."""
    first = threading.Event()

    def run() -> list:
        events = []
        with (
            httpx.Client(base_url=url, timeout=60) as http,
            http.stream("POST", "/v1/completions", json=stream_body(200)) as r,
        ):
            for line in r.iter_lines():
                if line:
                    events.append(line)
                    first.set()
        return events

    return Background(run), first


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_drains_running_requests_then_exits_0(sig: signal.Signals) -> None:
    # 200 tokens at 20 ms: the request outlives the checks below by seconds
    with ServerProcess("--token-delay-s", "0.02", "--shutdown-timeout", "120") as server:
        stream, first = wait_streaming(server.url)
        assert first.wait(30)
        server.proc.send_signal(sig)
        with httpx.Client(base_url=server.url, timeout=30) as http:
            wait_until(lambda: http.get("/health").status_code == 503, "the drain to start")
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": "late"})
            assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
        events = [line.removeprefix("data: ") for line in stream.result(60)]
        assert server.wait() == 0
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]"
    assert "".join(c["choices"][0]["text"] for c in chunks) == \
        expected_text(make_tokenizer()("drain me")["input_ids"], 0, None, 200)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    log = "".join(server.log)
    assert f"{sig.name}: taking no new requests; 1 running request(s)" in log
    assert "Server stopped (exit status 0)" in log


@pytest.mark.slow
def test_shutdown_timeout_aborts_then_exits_0() -> None:
    with ServerProcess("--token-delay-s", "0.05", "--shutdown-timeout", "0.5") as server:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            stream = Background(lambda: sse_events(http.post("/v1/completions", json=stream_body(200))))
            wait_until(lambda: num_running(http) == 1, "the request to run")
            server.proc.send_signal(signal.SIGTERM)
            events = stream.result(60)
        assert server.wait() == 0
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "abort"
    assert 0 < len("".join(e["choices"][0]["text"] for e in events[:-1])) < 200
    assert "Aborting 1 request(s) still running" in "".join(server.log)


@pytest.mark.slow
def test_no_signal_no_exit_and_added_routes_need_the_key() -> None:
    """Control for the tests above: the server keeps serving until told. A route added by ``configure_app``
    works and needs the API key."""
    with ServerProcess("--api-key", "k") as server:
        with httpx.Client(base_url=server.url, timeout=30, headers={"Authorization": "Bearer k"}) as http:
            assert http.post("/echo", json={"a": 1}).json() == {"echo": {"a": 1}}
            assert httpx.post(server.url + "/echo", json={}).status_code == 401
            for _ in range(3):
                assert http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}).status_code \
                    == 200
        assert server.proc.poll() is None
        server.proc.send_signal(signal.SIGTERM)
        assert server.wait() == 0
