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
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from fake_engine_client import FakeEngineClient
from openai_extra import extra_fields
from openai_harness import MODEL, ServerThread
from runner import LLM, SamplingParams
from runner.entrypoints.benchserve.server_proc import ServerProcess, scrape
from runner.entrypoints.openai.errors import redact
from runner.entrypoints.openai.limits import ServerLimits
from runner.entrypoints.openai.tokenization import add_tokenization_routes
from tiny_checkpoint import TinyCheckpoint

pytestmark = pytest.mark.slow
KEY = "test-key"
ENGINE = "--device cpu --max-num-seqs 8 --dist-timeout-s 30"
LIMITS = f"--api-key {KEY} --max-request-bytes 4000000 --header-timeout 1 --body-timeout 1 --body-total-timeout 3 " \
         "--limit-concurrency 16"
MAX_N = 4 * 8  # --max-n's default: 4 x --max-num-seqs
MAX_MODEL_LEN = 512  # the tiny checkpoint's
CHAT_MESSAGES = [{"role": "user", "content": "hello"}]
PLAIN_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
HUGE_TEMPLATE = "{{ 'a' * 30000000 }}"
ENDLESS_TEMPLATE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
INT_5000_DIGITS = b"1" + b"0" * 5000
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
    # a request's own chat template, without --trust-request-chat-template
    ("a chat template in chat_template_kwargs", "/v1/chat/completions",
     {"messages": CHAT_MESSAGES, "chat_template_kwargs": {"chat_template": PLAIN_TEMPLATE}}, 400,
     "chat_template_kwargs.chat_template"),
    ("a top-level chat template", "/v1/chat/completions", {"messages": CHAT_MESSAGES, "chat_template": HUGE_TEMPLATE},
     400, "chat_template"),
    ("a chat template in /tokenize's chat_template_kwargs", "/tokenize",
     {"messages": CHAT_MESSAGES, "chat_template_kwargs": {"chat_template": HUGE_TEMPLATE}}, 400,
     "chat_template_kwargs.chat_template"),
    ("a top-level chat template on /tokenize", "/tokenize",
     {"messages": CHAT_MESSAGES, "chat_template": PLAIN_TEMPLATE}, 400, "chat_template"),
    # n and prompts x n
    ("n far beyond --max-n", "/v1/completions", {"prompt": "hi", "n": 200_000, "temperature": 1.0}, 400, "n"),
    ("n on a chat beyond --max-n", "/v1/chat/completions",
     {"messages": CHAT_MESSAGES, "n": MAX_N + 1, "temperature": 1.0}, 400, "n"),
    ("prompts x n beyond --max-n", "/v1/completions", {"prompt": ["a b"] * 8, "n": 8, "temperature": 1.0}, 400, "n"),
    ("more prompts than vLLM's 1024", "/v1/completions", {"prompt": ["a"] * 1025}, 400, "prompt"),
    # /tokenize and /detokenize have the completions' bounds
    ("/tokenize of a prompt too long to fit", "/tokenize", {"prompt": "The quick brown fox. " * 150_000}, 400,
     "prompt"),
    ("/detokenize of more ids than a context holds", "/detokenize", {"tokens": [5] * (MAX_MODEL_LEN + 1)}, 400,
     "tokens"),
    ("/tokenize of a body over --max-request-bytes", "/tokenize", {"prompt": "z " * 2_500_000}, 413, None),
    # integers Python will not convert
    ("a JSON integer over 4300 digits", "/v1/completions", b'{"prompt": "hi", "max_tokens": ' + INT_5000_DIGITS + b"}",
     400, None),
    ("a JSON integer over 4300 digits on /tokenize", "/tokenize",
     b'{"messages": [], "add_special_tokens": ' + INT_5000_DIGITS + b"}", 400, None),
    ("a JSON integer over 4300 digits on /detokenize", "/detokenize", b'{"tokens": [' + INT_5000_DIGITS + b"]}", 400,
     None),
    # the model path in no error body
    ("a model this server does not serve", "/v1/completions", {"prompt": "hi", "model": "other"}, 404, "model"),
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
    got = extra_fields(c.completions.create(model=model, prompt="The quick brown fox", max_tokens=6, temperature=0,
                                            extra_body={"return_token_ids": True}).choices[0])["token_ids"]
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
        assert model not in resp.text, (name, resp.text[:300])  # not even the served path
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
        async with (
            httpx.AsyncClient(timeout=120) as h,
            h.stream("POST", f"{server.base_url}/v1/completions", json=body, headers=AUTH) as resp,
        ):
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


def test_profile_routes_exist_only_with_profile_dir(trusting: ServerProcess) -> None:
    # the trusted-template server below was started without --profile-dir
    assert httpx.post(f"{trusting.base_url}/start_profile", timeout=30).status_code == 404
    assert httpx.post(f"{trusting.base_url}/stop_profile", timeout=30).status_code == 404


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


# ---- the second round (issue 49): templates, bodies, shapes, limits ----------------------------------------------
def host_port(srv: ServerProcess) -> tuple[str, int]:
    host, port = srv.base_url.removeprefix("http://").split(":")
    return host, int(port)


def request_head(path: str, length: int, content_type: str = "application/json") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def read_response(sock: socket.socket) -> tuple[int, dict[str, Any]]:
    """The status and JSON body of one response on ``sock`` (which the server may close after it)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection before answering: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection mid-response"
        body += chunk
    return int(head.split()[1]), json.loads(body[:length])


def assert_openai_error(status: int, body: dict[str, Any], want: int) -> dict[str, Any]:
    assert status == want, body
    err = body["error"]
    assert err["code"] == want and err["message"] and err["type"], body
    return err


def test_posts_need_json_and_every_error_is_openai_shaped(server: ServerProcess) -> None:
    """415 for a body that is not application/json (vLLM's check: a web page cannot send a cross-site "simple"
    request); 404 and 405 in OpenAI's shape."""
    url = server.base_url
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        for headers in ({"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"}, {}):
            r = httpx.post(url + path, content=b'{"prompt": "hi"}', headers={**AUTH, **headers}, timeout=30)
            assert_openai_error(r.status_code, r.json(), 415)
    r = httpx.get(f"{url}/nowhere", headers=AUTH, timeout=30)
    assert assert_openai_error(r.status_code, r.json(), 404)["type"] == "NotFoundError"
    r = httpx.get(f"{url}/v1/completions", headers=AUTH, timeout=30)
    assert assert_openai_error(r.status_code, r.json(), 405)["message"] == "Method Not Allowed"
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers={
        **AUTH, "Content-Type": "application/json; charset=utf-8"}, timeout=60).status_code == 200


def test_slow_bodies_get_408_and_stalled_connections_do_not_block_health(
        server: ServerProcess, offline: LLM, tiny_chat_checkpoint: TinyCheckpoint) -> None:
    """A body that stops (--body-timeout 1) or trickles (--body-total-timeout 3) gets 408 and its connection is
    closed; 40 stalled bodies, more than --limit-concurrency 16, leave /health and completions answering."""
    addr = host_port(server)
    with socket.create_connection(addr, timeout=30) as stalled:
        stalled.sendall(request_head("/v1/completions", 100) + b'{"prompt"')
        status, body = read_response(stalled)
        assert "--body-timeout" in assert_openai_error(status, body, 408)["message"]
        assert stalled.recv(1024) == b""  # closed after the answer
    with socket.create_connection(addr, timeout=30) as trickle:
        trickle.sendall(request_head("/v1/completions", 100))
        answer: list[tuple[int, dict[str, Any]]] = []
        reader = threading.Thread(target=lambda: answer.append(read_response(trickle)))
        reader.start()
        for _ in range(60):  # a byte every 0.2 s: never 1 s apart, but 3 s in all
            if answer or not reader.is_alive():
                break
            try:
                trickle.sendall(b" ")
            except OSError:
                break
            time.sleep(0.2)
        reader.join(30)
        assert answer, "no answer to a trickling body"
        assert "--body-total-timeout" in assert_openai_error(*answer[0], 408)["message"]
    stalls = [socket.create_connection(addr, timeout=30) for _ in range(40)]
    try:
        for sock in stalls:
            sock.sendall(request_head("/v1/completions", 1000) + b"{")
        assert httpx.get(f"{server.base_url}/health", timeout=30).status_code == 200
        assert_still_serving(server, offline, str(tiny_chat_checkpoint.path))
    finally:
        for sock in stalls:
            sock.close()


def test_clients_leaving_mid_body_are_counted_and_log_no_traceback(server: ServerProcess) -> None:
    addr = host_port(server)
    counter = "ubatch:client_left_mid_body_total"
    before = scrape(server.base_url, (counter,))[counter]
    for _ in range(20):
        with socket.create_connection(addr, timeout=30) as sock:
            sock.sendall(request_head("/v1/completions", 1000) + b'{"prompt": ')
            time.sleep(0.2)  # the route is reading the body when the client leaves
    wait_for(lambda: scrape(server.base_url, (counter,))[counter] - before == 20, "20 clients counted as left")
    log = server.log_tail(2000)
    assert "Traceback" not in log and "ClientDisconnect" not in log, log[-3000:]


def test_an_early_413_is_read_by_the_client_sending_its_body(server: ServerProcess) -> None:
    """A 10 MB body over --max-request-bytes, sent over 3 s (past the 1 s --header-timeout): the server answers
    413 at once, reads and drops the rest, and the client reads the 413 instead of a reset."""
    chunk = b"x" * (1 << 20)
    with socket.create_connection(host_port(server), timeout=30) as sock:
        sock.sendall(request_head("/v1/completions", 10 * len(chunk)))
        for _ in range(10):
            sock.sendall(chunk)
            time.sleep(0.3)
        status, body = read_response(sock)
    assert "--max-request-bytes" in assert_openai_error(status, body, 413)["message"]


def test_vllm_sampling_and_logprob_bytes(server: ServerProcess, tiny_chat_checkpoint: TinyCheckpoint,
                                         offline: LLM) -> None:
    """temperature 3.0 is accepted (vLLM takes any >= 0), offline too; a sampled token that is one byte of a
    UTF-8 character has that byte as its logprob ``bytes``, not U+FFFD's."""
    model = str(tiny_chat_checkpoint.path)
    r = httpx.post(f"{server.base_url}/v1/chat/completions", headers=AUTH, timeout=60, json={
        "model": model, "messages": CHAT_MESSAGES, "temperature": 3.0, "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert SamplingParams(temperature=3.0).temperature == 3.0
    byte_token = offline.get_tokenizer().convert_tokens_to_ids("\u00e2")  # byte 0xE2, GPT-2's byte alphabet
    r = httpx.post(f"{server.base_url}/v1/chat/completions", headers=AUTH, timeout=60, json={
        "model": model, "messages": CHAT_MESSAGES, "temperature": 0, "max_tokens": 1, "logprobs": True,
        "logit_bias": {str(byte_token): 100}, "return_token_ids": True})
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == [byte_token]
    (entry,) = choice["logprobs"]["content"]
    assert (entry["token"], entry["bytes"]) == ("\ufffd", [0xE2])


def test_offline_max_tokens_past_the_context_stops_at_it(offline: LLM) -> None:
    """vLLM's LLM: max_tokens beyond max_model_len is no error; generation stops where the context ends."""
    prompt = "The quick brown fox"
    (out,) = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=10**9, ignore_eos=True),
                              use_tqdm=False)
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == MAX_MODEL_LEN
    assert out.outputs[0].finish_reason == "length"


def test_generation_routes_at_their_limit_leave_health_and_metrics_answering() -> None:
    """--limit-concurrency 2 with two streams running: a third generation request gets an OpenAI-shaped 503 with
    Retry-After, /health, /metrics and /version answer, and the slots come back when the streams end."""
    limits = ServerLimits(limit_concurrency=2)
    srv = ServerThread(FakeEngineClient(token_delay_s=0.05), limits=limits)
    add_tokenization_routes(srv.app)
    with srv:
        async def run() -> None:
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as h:
                body = {"model": MODEL, "prompt": "hi", "max_tokens": 100, "stream": True}
                async with h.stream("POST", "/v1/completions", json=body) as one, \
                        h.stream("POST", "/v1/completions", json=body) as two:
                    assert one.status_code == two.status_code == 200
                    third = await h.post("/tokenize", json={"prompt": "hi"})
                    assert_openai_error(third.status_code, third.json(), 503)
                    assert third.headers["Retry-After"] == "1"
                    for path in ("/health", "/metrics", "/version"):
                        assert (await h.get(path)).status_code == 200
                for _ in range(300):  # the slots come back once the server has seen both clients leave
                    again = await h.post("/tokenize", json={"prompt": "hi"})
                    if again.status_code != 503:
                        break
                    await asyncio.sleep(0.1)
                assert again.status_code == 200, again.text

        asyncio.run(run())


def test_an_unexpected_exception_is_an_openai_shaped_500() -> None:
    with ServerThread() as srv:
        async def broken() -> None:
            raise RuntimeError("a bug at /tmp/secret/place.py")

        srv.app.add_api_route("/broken", broken)
        r = httpx.get(f"{srv.url}/broken", timeout=30)
        err = assert_openai_error(r.status_code, r.json(), 500)
        assert "RuntimeError" in err["message"] and "secret" not in err["message"]


def test_tokenize_runs_off_the_event_loop() -> None:
    """While /tokenize's prompt is tokenized, /health answers and /detokenize is served."""
    engine = FakeEngineClient()
    tokenizer = engine.tokenizer = GatedTokenizer(engine.tokenizer)
    srv = ServerThread(engine)
    add_tokenization_routes(srv.app)
    with srv:
        async def run() -> list[str]:
            order: list[str] = []
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as h:
                async def slow() -> None:
                    resp = await h.post("/tokenize", json={"model": MODEL, "prompt": "a long prompt"})
                    assert resp.status_code == 200, resp.text
                    order.append("tokenized")

                async def others() -> None:
                    await asyncio.get_running_loop().run_in_executor(None, tokenizer.entered.wait, 60)
                    assert (await h.get("/health")).status_code == 200
                    order.append("health")
                    tokenizer.gate.set()

                await asyncio.gather(slow(), others())
            return order

        assert asyncio.run(run()) == ["health", "tokenized"]


# ---- requests' own chat templates, with --trust-request-chat-template --------------------------------------------
@pytest.fixture(scope="module")
def trusting(tiny_chat_checkpoint: TinyCheckpoint) -> Iterator[ServerProcess]:
    srv = ServerProcess(str(tiny_chat_checkpoint.path), f"{ENGINE} --trust-request-chat-template "
                        "--chat-template-timeout 3 --shutdown-timeout 2", startup_timeout_s=300, name="trusting")
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def children_of(pid: int) -> set[int]:
    kids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.add(int(entry))
    return kids


def wait_for(condition: Any, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout_s:g} s for {what}"
        time.sleep(0.1)


def test_a_trusted_template_renders_and_is_bounded(trusting: ServerProcess, offline: LLM,
                                                   tiny_chat_checkpoint: TinyCheckpoint) -> None:
    """A request's template renders like the checkpoint's would; one rendering more than any prompt could hold,
    or running past --chat-template-timeout, gets 400 naming the field, while /health answers."""
    url, model = trusting.base_url, str(tiny_chat_checkpoint.path)
    r = httpx.post(f"{url}/tokenize", timeout=60, json={"model": model, "messages": CHAT_MESSAGES,
                                                         "chat_template": PLAIN_TEMPLATE})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == offline.get_tokenizer()("<user>hello", add_special_tokens=False)["input_ids"]
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": model, "messages": CHAT_MESSAGES, "max_tokens": 2,
        "chat_template_kwargs": {"chat_template": PLAIN_TEMPLATE}})
    assert r.status_code == 200, r.text
    r = httpx.post(f"{url}/tokenize", timeout=60, json={"messages": CHAT_MESSAGES,
                                                         "chat_template_kwargs": {"chat_template": HUGE_TEMPLATE}})
    err = assert_openai_error(r.status_code, r.json(), 400)
    assert err["param"] == "chat_template_kwargs.chat_template" and "characters" in err["message"], err
    answers: list[httpx.Response] = []
    endless = threading.Thread(target=lambda: answers.append(httpx.post(
        f"{url}/v1/chat/completions", timeout=60,
        json={"model": model, "messages": CHAT_MESSAGES, "chat_template": ENDLESS_TEMPLATE})))
    endless.start()
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    endless.join(60)
    err = assert_openai_error(answers[0].status_code, answers[0].json(), 400)
    assert err["param"] == "chat_template" and "--chat-template-timeout" in err["message"], err
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200


def test_a_disconnect_ends_a_trusted_template_and_sigterm_ends_the_server(trusting: ServerProcess) -> None:
    """A client that leaves while its template renders ends the render (its child process is gone); SIGTERM while
    one renders ends the server within --shutdown-timeout plus a few seconds."""
    assert trusting.proc is not None
    pid = trusting.proc.pid
    idle = children_of(pid)
    body = json.dumps({"messages": CHAT_MESSAGES, "chat_template": ENDLESS_TEMPLATE}).encode()
    with socket.create_connection(host_port(trusting), timeout=30) as sock:
        sock.sendall(request_head("/v1/chat/completions", len(body)) + body)
        wait_for(lambda: len(children_of(pid) - idle) == 1, "the render's child process")
    wait_for(lambda: not children_of(pid) - idle, "the render's child to end after the client left", 5.0)
    sock = socket.create_connection(host_port(trusting), timeout=30)
    try:
        sock.sendall(request_head("/v1/chat/completions", len(body)) + body)
        wait_for(lambda: len(children_of(pid) - idle) == 1, "the render's child process")
        trusting.proc.send_signal(signal.SIGTERM)
        assert trusting.proc.wait(2 + 28) == 0  # --shutdown-timeout, uvicorn's 10 s task grace, the ranks' stop
    finally:
        sock.close()
