"""A hostile client against ``python -m runner serve``: one request must never stop the server, block its event loop,
write files it can aim, or get a 500 for a malformed body.

``HOSTILE`` is the table anyone can extend: a request (JSON or raw bytes), the status it must get and the field the
error must name. After every row the server is still up (``/health`` 200) and the next greedy request still equals
the offline ``LLM``. Rows beyond a plain request/answer (a huge prompt while ``/health`` is asked, profiles,
disconnects, half-sent headers) are tests of their own below. The engine-level half (non-finite logits end one
request, the rank goes on) runs offline on both step loops.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from runner import LLM, SamplingParams
from runner.entrypoints.benchserve.server_proc import ServerProcess, scrape
from runner.entrypoints.openai.errors import redact
from tests.fake_engine_client import FakeEngineClient
from tests.openai_harness import MODEL, ServerThread
from tiny_checkpoint import TinyCheckpoint

pytestmark = pytest.mark.slow
KEY = "test-key"
ENGINE = "--device cpu --max-num-seqs 8 --dist-timeout-s 30"
LIMITS = f"--api-key {KEY} --max-request-bytes 4000000 --header-timeout 1"
AUTH = {"Authorization": f"Bearer {KEY}"}
BIG = 2 ** 64

# (name, path, body: a JSON object or raw bytes, status, the field the error names or None)
HOSTILE: list[tuple[str, str, Any, int, str | None]] = [
    ("repetition_penalty that overflows float32", "/v1/completions",
     {"prompt": "hi", "max_tokens": 4, "repetition_penalty": 1e-300}, 400, "repetition_penalty"),
    ("repetition_penalty 5e-324 with top_k and top_p", "/v1/completions",
     {"prompt": "hi", "max_tokens": 4, "repetition_penalty": 5e-324, "top_k": 5, "top_p": 0.5}, 400,
     "repetition_penalty"),
    ("repetition_penalty far above any meaning", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "repetition_penalty": 1e300}, 400, "repetition_penalty"),
    ("seed beyond 64 bits", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "seed": BIG}, 400, "seed"),
    ("top_k beyond 64 bits", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "top_k": BIG}, 400, "top_k"),
    ("max_tokens beyond 64 bits", "/v1/completions", {"prompt": "hi", "max_tokens": BIG}, 400, "max_tokens"),
    ("lone surrogate in a prompt", "/v1/completions", {"prompt": "hi \ud800 there", "max_tokens": 2}, 400,
     "prompt"),
    ("lone surrogate in a prompt list", "/v1/completions", {"prompt": ["ok", "\udfff"], "max_tokens": 2}, 400,
     "prompt[1]"),
    ("lone surrogate in a chat message", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x\udc00"}]}, 400, "messages[0].content"),
    ("JSON nested 100,000 deep", "/v1/completions", b"{\"prompt\": " + b"[" * 100_000 + b"]" * 100_000 + b"}",
     400, None),
    ("too many stop strings", "/v1/completions", {"prompt": "hi", "n": 4, "temperature": 1.0,
                                                  "stop": ["x" * 10 + str(i) for i in range(1000)]}, 400, "stop"),
    ("a stop string of a megabyte", "/v1/completions", {"prompt": "hi", "stop": "y" * 1_000_000}, 400, "stop"),
    ("a body over --max-request-bytes", "/v1/completions", {"prompt": "z " * 2_500_000}, 413, None),
    ("a prompt too long to fit, refused before tokenizing", "/v1/completions",
     {"prompt": "The quick brown fox. " * 150_000}, 400, "prompt"),
    ("logprobs beyond the vocabulary", "/v1/completions", {"prompt": "hi", "logprobs": BIG}, 400, "logprobs"),
]


def encode(body: Any, model: str) -> bytes:
    if isinstance(body, bytes):
        return body
    return json.dumps({"model": model, **body}).encode()


@pytest.fixture(scope="module")
def profile_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("profiles")


@pytest.fixture(scope="module")
def server(tiny_chat_checkpoint: TinyCheckpoint, profile_root: Path) -> Iterator[ServerProcess]:
    srv = ServerProcess(str(tiny_chat_checkpoint.path), f"{ENGINE} {LIMITS} --profile-dir {profile_root}",
                        startup_timeout_s=300, name="hostile")
    srv.start()
    try:
        yield srv
    finally:
        code = srv.stop()
    assert code == 0, srv.log_tail(40)


@pytest.fixture(scope="module")
def offline(tiny_chat_checkpoint: TinyCheckpoint) -> Iterator[LLM]:
    llm = LLM(model=str(tiny_chat_checkpoint.path), device="cpu", max_num_seqs=8)
    yield llm
    llm.close()


def assert_still_serving(srv: ServerProcess, offline: LLM, model: str) -> None:
    """``/health`` 200, and a greedy completion equal to the offline engine's."""
    assert httpx.get(f"{srv.base_url}/health", timeout=30).status_code == 200
    c = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key=KEY, max_retries=0, timeout=120)
    got = c.completions.create(model=model, prompt="The quick brown fox", max_tokens=6, temperature=0,
                               extra_body={"return_token_ids": True}).choices[0].model_extra["token_ids"]
    want = offline.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert got == list(want[0].outputs[0].token_ids)


def wait_idle(srv: ServerProcess) -> dict[str, float]:
    names = ("ubatch:num_requests_running", "ubatch:kv_cache_usage_perc", "ubatch:num_requests_waiting")
    deadline = time.monotonic() + 30
    m: dict[str, float] = {}
    while time.monotonic() < deadline:
        m = scrape(srv.base_url, names)
        if all(m.get(n, 0.0) == 0.0 for n in names):
            break
        time.sleep(0.2)
    return m


def test_every_hostile_request_is_a_4xx_naming_its_field_and_the_server_goes_on(
        server: ServerProcess, offline: LLM, tiny_chat_checkpoint: TinyCheckpoint) -> None:
    model = str(tiny_chat_checkpoint.path)
    for name, path, body, status, param in HOSTILE:
        resp = httpx.post(server.base_url + path, content=encode(body, model),
                          headers={**AUTH, "Content-Type": "application/json"}, timeout=60)
        assert resp.status_code == status, (name, resp.text[:300])
        err = resp.json()["error"]
        assert err["code"] == status and err["message"], name
        if param is not None:
            assert err["param"] == param, (name, err)
        assert not re.search(r"(^|\s)/\w+/", err["message"]), (name, err["message"])  # no paths in error bodies
        assert httpx.get(f"{server.base_url}/health", timeout=30).status_code == 200, name
    assert_still_serving(server, offline, model)
    m = wait_idle(server)
    assert all(v == 0.0 for v in m.values()), m


def test_a_64_bit_seed_with_n_samples_wraps_instead_of_failing(server: ServerProcess,
                                                               tiny_chat_checkpoint: TinyCheckpoint) -> None:
    body = {"model": str(tiny_chat_checkpoint.path), "prompt": "hi", "max_tokens": 3, "n": 2, "temperature": 1.0,
            "seed": 2 ** 63 - 1}
    first = httpx.post(f"{server.base_url}/v1/completions", json=body, headers=AUTH, timeout=60)
    again = httpx.post(f"{server.base_url}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert first.status_code == 200, first.text
    assert [c["text"] for c in first.json()["choices"]] == [c["text"] for c in again.json()["choices"]]


class GatedTokenizer:
    """A tokenizer whose encoding waits until the test opens its gate: a prompt that takes long to tokenize."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.entered = threading.Event()
        self.gate = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __call__(self, text: str, **kwargs: Any) -> Any:
        self.entered.set()
        assert self.gate.wait(60), "the test never opened the gate"
        return self.inner(text, **kwargs)


def test_health_and_other_streams_go_on_while_a_prompt_is_tokenized() -> None:
    """Tokenization runs off the event loop: while one prompt is being tokenized, ``/health`` answers and a
    request given as token ids is served."""
    engine = FakeEngineClient()
    tokenizer = engine.tokenizer = GatedTokenizer(engine.tokenizer)
    with ServerThread(engine) as srv:
        async def run() -> list[str]:
            order: list[str] = []
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as h:
                async def slow() -> None:
                    resp = await h.post("/v1/completions", json={"model": MODEL, "prompt": "a long prompt",
                                                                 "max_tokens": 2})
                    assert resp.status_code == 200, resp.text
                    order.append("tokenized prompt")

                async def others() -> None:
                    await asyncio.get_running_loop().run_in_executor(None, tokenizer.entered.wait, 60)
                    assert (await h.get("/health")).status_code == 200
                    order.append("health")
                    resp = await h.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6], "max_tokens": 2})
                    assert resp.status_code == 200, resp.text
                    order.append("token-id prompt")
                    tokenizer.gate.set()

                await asyncio.gather(slow(), others())
            return order

        assert asyncio.run(run()) == ["health", "token-id prompt", "tokenized prompt"]


def test_aborted_requests_are_counted_under_abort(server: ServerProcess,
                                                  tiny_chat_checkpoint: TinyCheckpoint) -> None:
    label = 'finished_reason="abort"'

    def aborted() -> float:
        text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("ubatch:request_success_total") and label in line)

    before = aborted()
    body = {"model": str(tiny_chat_checkpoint.path), "prompt": "Hello", "max_tokens": 200, "ignore_eos": True,
            "temperature": 0, "stream": True}

    async def drop_after_two_chunks() -> None:
        async with httpx.AsyncClient(timeout=120) as h:
            async with h.stream("POST", f"{server.base_url}/v1/completions", json=body, headers=AUTH) as resp:
                chunks = 0
                async for line in resp.aiter_lines():
                    chunks += line.startswith("data: {")
                    if chunks >= 2:
                        return

    async def run() -> None:
        await asyncio.gather(*[drop_after_two_chunks() for _ in range(5)])

    asyncio.run(run())
    assert wait_idle(server).get("ubatch:num_requests_running", 0.0) == 0.0
    assert aborted() - before == 5


def test_half_sent_headers_are_dropped_after_the_header_timeout(server: ServerProcess) -> None:
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as slow:
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
        assert slow.recv(1024) == b""  # the server closed it (--header-timeout 1); a timeout here fails the test
    assert httpx.get(f"{server.base_url}/health", timeout=30).status_code == 200


def test_profiles_go_to_a_private_directory_and_never_follow_a_link(server: ServerProcess,
                                                                     profile_root: Path) -> None:
    url = server.base_url
    assert httpx.post(f"{url}/stop_profile", headers=AUTH, timeout=30).status_code == 409  # nothing recording
    assert httpx.post(f"{url}/start_profile", timeout=30).status_code == 401  # the key guards it
    assert httpx.post(f"{url}/start_profile", headers=AUTH, timeout=30).status_code == 200
    assert httpx.post(f"{url}/start_profile", headers=AUTH, timeout=30).status_code == 409  # one at a time
    (private,) = list(profile_root.iterdir())
    assert private.is_dir() and (private.stat().st_mode & 0o777) == 0o700
    victim = profile_root / "victim.txt"
    victim.write_text("keep me")
    now = int(time.time())
    for t in range(now - 1, now + 60):  # the next file's name, for any second of the clock: planted links
        os.symlink(victim, private / f"profile-1-{t}.json")

    async def two_stops() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as h:
            return list(await asyncio.gather(h.post("/stop_profile", headers=AUTH),
                                             h.post("/stop_profile", headers=AUTH)))

    statuses = sorted(r.status_code for r in asyncio.run(two_stops()))
    assert statuses == [200, 409]
    assert victim.read_text() == "keep me"  # the planted link was not followed


def test_profile_routes_exist_only_with_profile_dir(tiny_chat_checkpoint: TinyCheckpoint) -> None:
    with ServerProcess(str(tiny_chat_checkpoint.path), ENGINE, startup_timeout_s=300, name="noprof") as srv:
        assert httpx.post(f"{srv.base_url}/start_profile", timeout=30).status_code == 404
        assert httpx.post(f"{srv.base_url}/stop_profile", timeout=30).status_code == 404


def test_redact_drops_source_locations_and_paths() -> None:
    msg = "rank 1: RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed " \
          "by peer [127.0.0.1]:4000, see /tmp/x/log.txt"
    assert redact(msg) == "rank 1: RuntimeError: Connection closed by peer [127.0.0.1]:4000, see <path>"


# ---- the engine: non-finite logits end one request, the rank goes on --------------------------------------------
@pytest.mark.parametrize("loop", ["sync", "overlap"])
def test_non_finite_logits_end_only_their_request(tiny_chat_checkpoint: TinyCheckpoint, loop: str) -> None:
    """A penalty set past validation (as a model overflow would) makes one request's logits infinite: it ends with
    finish_reason "error", the others in the same steps equal a run without it, and the engine goes on."""
    llm = LLM(model=str(tiny_chat_checkpoint.path), device="cpu", max_num_seqs=8,
              disable_overlap_schedule=loop == "sync")
    try:
        prompts = ["The quick brown fox", "Hello world! How are", "One, two, three"]
        greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        for temperature in (0.0, 0.8):
            bad = SamplingParams(temperature=temperature, max_tokens=8, ignore_eos=True)
            bad.repetition_penalty = 1e-300  # 0 in float32: the seen tokens' logits become inf
            outs = llm.generate(prompts + ["Caf\u00e9 cr\u00e8me"], [greedy] * 3 + [bad], use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs[:3]] == want
            assert outs[3].outputs[0].finish_reason == "error" and outs[3].outputs[0].token_ids == []
            assert "not finite" in (outs[3].error or "")
        again = llm.generate(prompts, greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == want
    finally:
        llm.close()
