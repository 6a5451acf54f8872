"""What the OpenAI server's front end costs per streamed token, against the offline engine on the same prompts.

Workload: a small Qwen3-MoE chat checkpoint written by transformers (``tests/tiny_checkpoint.py``: hidden 64,
2 layers, 8 experts, a byte-level BPE tokenizer, float32), 256 prompts of 16 token ids, 64 output tokens each
(``ignore_eos``, greedy). Side by side, ``--repeats`` times, medians:

- ``offline``: ``LLM.generate`` on the 256 prompts in a process of its own (``OMP_NUM_THREADS=1``: one core);
- ``served``: ``python -m runner serve`` with ``--max-num-seqs 256``, 256 concurrent streamed completions from a
  load generator in a process of its own; output tok/s and its ratio to the offline run of the same repeat, the
  API-server process's CPU per streamed token (its own CPU, not its ranks'), the load generator's CPU per
  streamed token and share of a core, and the ranks' share of a core.

``--client``: the load generator's HTTP client. ``aiohttp`` (default) keeps a pool of connections, as a client
library does (the openai SDK's httpx pool, vLLM's ``benchmark_serving.py`` session): a warm-up of 256 one-token
requests opens them before the measured run, which then reuses them; it counts each read's chunks without
splitting lines. ``httpx`` opens a connection per request and reads line by line: the client of the earlier
figures in docs/benchmarks.md, kept so they can be compared. A client costs less per token the more chunks
each read finds, so its figure falls when it gets less CPU.

``--placement`` (with two cores or more; "first" and "last" are the first and last core this process may run on):

- ``rank-alone`` (default): the engine rank(s) alone on the first core; the API server(s) and the load generator
  together on the last;
- ``api-alone``: the API server(s) alone on the last core; the ranks and the load generator on the first;
- ``spread``: API server i on core i, the ranks and the load generator on the first;
- ``unpinned``: nothing pinned; where the scheduler puts three busy processes on two cores moves the figures
  from run to run (the API server's CPU per token depends on how many outputs each wake-up finds).

Why ``rank-alone`` is the default: ``LLM.generate`` is one process (``OMP_NUM_THREADS=1``) with a core to itself,
and the rank does the same engine work per token, so only a rank with a core of its own can match its rate; the
front end (API server and load generator) then shares the other core. With ``api-alone`` the load generator's
CPU comes out of the rank's core instead, which caps the served rate at ``1 / (1 + c x offline)`` of the
offline one (``c`` the load generator's CPU per token), whatever the API server costs. docs/benchmarks.md has
the measurements of both.
``--client`` and ``--placement`` take several values: each combination is served in turn within every repeat.

``--api-server-count N`` serves with N API-server processes (their CPU summed), placed as the API server is
(``--spread`` and ``--unpinned`` are short for ``--placement spread`` and ``--placement unpinned``).
``--direct-writes on off``: ``on`` (default) serves as the product does, the engine's output reader writing a
streamed response's running chunks itself while its handler waits (``EngineStreams.set_direct_format``); ``off``
serves from a server process that makes ``set_direct_format`` do nothing, so every output goes through the
handler's queue and the handler is the only writer of its response (a direct write there is reported in the
server's log and fails the run). Both: served in turn in every repeat, and the pairs where ``on`` cost less CPU
per token counted. One API server only (the API-server processes of ``--api-server-count`` start unpatched).
``--checkout DIR`` serves from another checkout of the project (an earlier commit): before/after on one machine;
``--against DIR`` serves both in turn within each repeat, which a machine shared with other jobs needs.
Writes ``benchmarks/results/api_server_<label>.csv`` (medians) and ``api_server_<label>__repeats.csv`` (every
repeat's figures). Usage: ``python benchmarks/bench_api_server.py [--repeats 3]
[--client aiohttp httpx] [--placement rank-alone api-alone]``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "tests"))

from common import RESULTS_DIR, write_csv  # noqa: E402

NUM_PROMPTS, PROMPT_LEN, OUTPUT_LEN = 256, 16, 64

OFFLINE = """
import json, random, sys, time
from runner import LLM, SamplingParams
model, n, plen, out = sys.argv[1], *map(int, sys.argv[2:5])
prompts = [[random.Random(i).randrange(3, 200) for _ in range(plen)] for i in range(n)]
llm = LLM(model=model, device="cpu", max_num_seqs=n)
params = SamplingParams(temperature=0, max_tokens=out, ignore_eos=True)
llm.generate(prompts[:8], params, use_tqdm=False)
t = time.perf_counter()
res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
wall = time.perf_counter() - t
print(json.dumps({"tok_s": sum(len(r.outputs[0].token_ids) for r in res) / wall}))
llm.close()
"""

LOAD = """
import asyncio, json, os, random, sys, time
client, base, model = sys.argv[1:4]
pids, ranks = ([int(p) for p in arg.split(",") if p] for arg in sys.argv[4:6])
n, plen, out = map(int, sys.argv[6:9])
def cpu(p):
    f = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
def body(i, tokens=out):
    return {"model": model, "prompt": [random.Random(i).randrange(3, 200) for _ in range(plen)], "max_tokens": tokens,
            "ignore_eos": True, "temperature": 0, "stream": True}
SESSION = None
async def with_aiohttp(count, tokens=out):  # a pool of connections; the chunks of each read counted at once
    import aiohttp
    global SESSION
    if SESSION is None:
        SESSION = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=n),
                                        timeout=aiohttp.ClientTimeout(total=600))
    async def one(s, i):
        chunks, tail = 0, b""
        async with s.post(f"{base}/v1/completions", json=body(i, tokens)) as r:
            r.raise_for_status()
            async for data in r.content.iter_any():
                data = tail + data
                chunks += data.count(b"data: {")
                tail = data[-6:]  # too short to hold a whole marker: none is counted twice
        return chunks
    return sum(await asyncio.gather(*[one(SESSION, i) for i in range(count)]))
async def with_httpx(count):
    import httpx
    async def one(h, i):
        chunks = 0
        async with h.stream("POST", f"{base}/v1/completions", json=body(i)) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                chunks += line.startswith("data: {")
        return chunks
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as h:
        return sum(await asyncio.gather(*[one(h, i) for i in range(count)]))
async def main():
    run = {"aiohttp": with_aiohttp, "httpx": with_httpx}[client]
    if client == "aiohttp":
        await run(n, 1)  # warm-up: opens the pool's n connections
    else:
        await run(8)  # warm-up (and the client's imports), on connections of its own
    server0, ranks0, self0, t0 = sum(map(cpu, pids)), sum(map(cpu, ranks)), time.process_time(), time.perf_counter()
    chunks = await run(n)
    wall = time.perf_counter() - t0
    server, rank, me = sum(map(cpu, pids)) - server0, sum(map(cpu, ranks)) - ranks0, time.process_time() - self0
    tokens = n * out
    print(json.dumps({"tok_s": tokens / wall, "api_us_per_token": server / tokens * 1e6,
                      "client_us_per_token": me / tokens * 1e6, "client_cpu_share": me / wall,
                      "rank_cpu_share": rank / wall, "chunks": chunks, "tokens": tokens}))
    if SESSION is not None:
        await SESSION.close()
asyncio.run(main())
"""


def env_for(checkout: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1"}


def last_json(text: str) -> dict[str, Any]:
    return json.loads([line for line in text.splitlines() if line.startswith("{")][-1])


def offline(model: str, checkout: Path) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", OFFLINE, model, str(NUM_PROMPTS), str(PROMPT_LEN), str(OUTPUT_LEN)],
                         cwd=checkout, env=env_for(checkout), capture_output=True, text=True, timeout=1200)
    if out.returncode:
        raise RuntimeError(f"offline run failed:\n{out.stderr[-3000:]}")
    return last_json(out.stdout)


def pin(pid: int, cores: set[int]) -> None:
    """Every thread of process ``pid`` to ``cores``."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cores)


def children(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out + [g for c in out for g in children(c)]


def api_server_pids(srv: Any, count: int) -> list[int]:
    """The processes that serve HTTP: the server itself, or its ``count`` API servers (from its log)."""
    if count == 1:
        return [srv.proc.pid]
    deadline = time.monotonic() + 120
    while f"with {count} API server processes" not in srv.log_tail(400) and time.monotonic() < deadline:
        time.sleep(0.2)
    pids = [int(p) for p in re.findall(r"API server \d+ pid (\d+)", srv.log_tail(400))]
    if len(pids) != count:
        raise RuntimeError(f"found {len(pids)} API servers, not {count}, in the server's log:\n{srv.log_tail()}")
    return pids


#: a direct write in a server with ``--direct-writes off``: the log line that fails the run
DIRECT_WRITE_MARK = "bench_api_server: a direct write in a handler-only server"

# The engine's output reader never writes a chunk itself: no stream gets a direct format, so ``EngineStreams``
# queues every output for its handler (``_direct_open`` stays False); a direct write all the same is reported.
HANDLER_ONLY_PATCH = f"""
import sys
from runner.entrypoints.openai.engine_streams import EngineStreams
def no_direct_format(self, format):
    pass
def reported_direct_write(self, i, output):
    print({DIRECT_WRITE_MARK!r}, file=sys.stderr, flush=True)
    self._push(i, output)
EngineStreams.set_direct_format = no_direct_format
EngineStreams._write_directly = reported_direct_write
"""
# ``python -m runner`` with that patch
HANDLER_ONLY_SERVER = HANDLER_ONLY_PATCH + """
from runner.entrypoints.cli import main
sys.exit(main())
"""

PLACEMENTS = ("rank-alone", "api-alone", "spread", "unpinned")
DIRECT_WRITES = ("on", "off")
CLIENTS = ("aiohttp", "httpx")


def place(placement: str, server_pid: int, front: list[int], cores: list[int]) -> list[str]:
    """Pin the server's processes for ``placement`` (see the module docstring); the ``taskset`` prefix that puts
    the load generator where that placement wants it (none when nothing is pinned)."""
    if len(cores) < 2 or placement == "unpinned":
        return []
    first, last = cores[0], cores[-1]
    for child in children(server_pid):  # the ranks (and the API servers, re-pinned below)
        pin(child, {first})
    where = [cores[i % len(cores)] for i in range(len(front))] if placement == "spread" else [last] * len(front)
    pin(server_pid, {where[0]} if front == [server_pid] else {first})  # else an idle parent
    for pid, core in zip(front, where, strict=True):
        pin(pid, {core})
    return ["taskset", "-c", str(last if placement == "rank-alone" else first)]


def served(model: str, checkout: Path, api_servers: int, placement: str, client: str,
           direct_writes: bool = True) -> dict[str, Any]:
    from runner.entrypoints.benchserve.server_proc import ServerProcess, free_port

    flags = f" --api-server-count {api_servers}" if api_servers > 1 else ""
    srv = ServerProcess(model, f"--device cpu --max-num-seqs {NUM_PROMPTS} --uvicorn-log-level warning{flags}",
                        startup_timeout_s=600, name="api-bench")
    srv.port = free_port()
    srv.base_url = f"http://127.0.0.1:{srv.port}"
    srv.cmd[srv.cmd.index("--port") + 1] = str(srv.port)
    if not direct_writes:  # [python, -m, runner, serve, ...] -> [python, -c, HANDLER_ONLY_SERVER, serve, ...]
        srv.cmd[1:3] = ["-c", HANDLER_ONLY_SERVER]
    old_env, old_cwd = dict(os.environ), os.getcwd()
    os.environ.update(env_for(checkout))
    os.chdir(checkout)
    try:
        srv.start()
    finally:
        os.environ.clear()
        os.environ.update(old_env)
        os.chdir(old_cwd)
    try:
        assert srv.proc is not None
        front = api_server_pids(srv, api_servers)
        ranks = [pid for pid in children(srv.proc.pid) if pid not in front]
        load = [sys.executable, "-c", LOAD, client, srv.base_url, model, ",".join(map(str, front)),
                ",".join(map(str, ranks)), str(NUM_PROMPTS), str(PROMPT_LEN), str(OUTPUT_LEN)]
        load = place(placement, srv.proc.pid, front, sorted(os.sched_getaffinity(0))) + load
        out = subprocess.run(load, capture_output=True, text=True, timeout=1200)
        if out.returncode:
            raise RuntimeError(f"load run failed:\n{out.stderr[-3000:]}")
        result = last_json(out.stdout)
        if result["chunks"] < result["tokens"]:
            raise RuntimeError(f"the server streamed {result['chunks']} chunks for {result['tokens']} tokens")
        if not direct_writes and DIRECT_WRITE_MARK in Path(srv.log_path).read_text(errors="replace"):
            raise RuntimeError(f"the engine's output reader wrote a chunk with --direct-writes off:\n{srv.log_tail()}")
        return result
    finally:
        srv.stop()


#: the CSV's name of each figure a served run reports, and the load generator's name for it
FIGURES = {"served_tok_s": "tok_s", "api_us_per_token": "api_us_per_token",
           "client_us_per_token": "client_us_per_token", "client_cpu_share": "client_cpu_share",
           "rank_cpu_share": "rank_cpu_share"}


def medians(runs: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, float]:
    med = {"offline_tok_s": statistics.median(o["tok_s"] for o, _ in runs)}
    med.update({name: statistics.median(s[key] for _, s in runs) for name, key in FIGURES.items()})
    # each repeat's ratio, then their median: a shared machine's load moves a repeat's offline and served alike
    med["served_over_offline"] = statistics.median(s["tok_s"] / o["tok_s"] for o, s in runs)
    return med


def direct_writes_pairs(on: list[tuple[dict[str, Any], dict[str, Any]]],
                        off: list[tuple[dict[str, Any], dict[str, Any]]]) -> str:
    """Direct writes against the handler alone, repeat by repeat: the medians' ratio of API-server CPU per token
    and the pairs where direct writes cost less."""
    on_us, off_us = ([s["api_us_per_token"] for _, s in runs] for runs in (on, off))
    # the same number of clock ticks can differ in the last bits (each figure is a difference of two sums)
    equal = sum(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(on_us, off_us, strict=True))
    lower = sum(a < b and not math.isclose(a, b, rel_tol=1e-9) for a, b in zip(on_us, off_us, strict=True))
    return (f"API server CPU per token, direct writes on / off: {statistics.median(on_us):.2f} / "
            f"{statistics.median(off_us):.2f} us ({statistics.median(on_us) / statistics.median(off_us):.3f}x), "
            f"on lower in {lower} of {len(on_us)} pairs ({equal} equal)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--checkout", type=Path, default=ROOT, help="the project checkout that serves (default: this one)")
    p.add_argument("--label", default="this checkout", help="the label of this run's rows in the CSV")
    p.add_argument("--against", type=Path, default=None,
                   help="another checkout served in turn with --checkout in every repeat (before/after on a shared "
                        "machine: the other jobs' load then falls on both alike)")
    p.add_argument("--against-label", default="against", help="the label of --against's rows")
    p.add_argument("--api-server-count", type=int, default=1, help="API-server processes (serve's flag)")
    p.add_argument("--client", nargs="+", choices=CLIENTS, default=["aiohttp"],
                   help="the load generator's HTTP client; several: served in turn in every repeat (default aiohttp)")
    p.add_argument("--direct-writes", nargs="+", choices=DIRECT_WRITES, default=["on"],
                   help="on: the engine's output reader writes a streamed response's running chunks (the product); "
                        "off: the handler is the only writer; both: served in turn in every repeat (default on)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--placement", nargs="+", choices=PLACEMENTS, default=["rank-alone"],
                       help="where the processes run; several: served in turn in every repeat (default rank-alone)")
    where.add_argument("--spread", action="store_const", const=["spread"], dest="placement",
                       help="the same as --placement spread")
    where.add_argument("--unpinned", action="store_const", const=["unpinned"], dest="placement",
                       help="the same as --placement unpinned")
    args = p.parse_args()
    if args.repeats < 1 or args.api_server_count < 1:
        p.error(f"--repeats and --api-server-count must be >= 1, got {args.repeats} and {args.api_server_count}")
    if "off" in args.direct_writes and args.api_server_count > 1:
        p.error(f"--direct-writes off serves with one API server, got --api-server-count {args.api_server_count}")
    from tiny_checkpoint import write_checkpoint

    checkouts = [(args.label, args.checkout.resolve())]
    if args.against is not None:
        checkouts.insert(0, (args.against_label, args.against.resolve()))
    settings = [(label, checkout, client, placement, direct) for label, checkout in checkouts
                for client in dict.fromkeys(args.client) for placement in dict.fromkeys(args.placement)
                for direct in dict.fromkeys(args.direct_writes)]
    runs: dict[tuple[str, str, str, str], list[tuple[dict[str, Any], dict[str, Any]]]] = {
        (label, client, placement, direct): [] for label, _, client, placement, direct in settings}
    repeat_rows = []
    with tempfile.TemporaryDirectory(prefix="ubatch-api-bench-") as tmp:
        model = str(Path(tmp) / "chat-qwen3-moe")
        write_checkpoint(Path(model))
        for rep in range(args.repeats):  # offline and every setting in turn, so machine drift falls on all
            off = offline(model, args.checkout.resolve())
            first = rep % len(settings)  # each repeat starts with the next setting: none is always the first
            for label, checkout, client, placement, direct in settings[first:] + settings[:first]:
                srv = served(model, checkout, args.api_server_count, placement, client, direct == "on")
                runs[(label, client, placement, direct)].append((off, srv))
                repeat_rows.append({"repeat": rep, "label": label, "client": client, "placement": placement,
                                    "direct_writes": direct, "offline_tok_s": off["tok_s"],
                                    **{name: srv[key] for name, key in FIGURES.items()}})
                print(f"repeat {rep} {label}, {client}, {placement}, direct writes {direct}: offline "
                      f"{off['tok_s']:.0f} tok/s, served {srv['tok_s']:.0f} tok/s ({srv['tok_s'] / off['tok_s']:.2f}x; "
                      f"the machine's load average {os.getloadavg()[0]:.1f}), API server "
                      f"{srv['api_us_per_token']:.1f} us/token, load generator "
                      f"{srv['client_us_per_token']:.1f} us/token ({srv['client_cpu_share']:.0%} of a core), ranks "
                      f"{srv['rank_cpu_share']:.0%} of a core")
    rows = []
    print("| checkout | client | placement | direct writes | offline tok/s | served tok/s | served / offline | "
          "API server CPU per streamed token | load generator CPU per streamed token | load generator CPU | "
          "ranks' CPU |")
    for (label, client, placement, direct), pairs in runs.items():
        med = medians(pairs)
        print(f"| {label} | {client} | {placement} | {direct} | {med['offline_tok_s']:.0f} | "
              f"{med['served_tok_s']:.0f} | {med['served_over_offline']:.2f}x | {med['api_us_per_token']:.1f} µs | "
              f"{med['client_us_per_token']:.1f} µs | {med['client_cpu_share']:.0%} of a core | "
              f"{med['rank_cpu_share']:.0%} of a core |")
        rows.append({"label": label, "client": client, "placement": placement, "direct_writes": direct,
                     "api_server_count": args.api_server_count, "repeats": args.repeats, **med})
        if med["client_cpu_share"] > 0.8:
            print(f"warning ({label}, {client}, {placement}, direct writes {direct}): the load generator used more "
                  "than 80% of a core: it may be what limits the served rate")
    slug = "".join(c if c.isalnum() else "_" for c in args.label).strip("_")
    for label, client, placement in dict.fromkeys((label, client, placement) for label, client, placement, _ in runs):
        if (label, client, placement, "off") in runs and (label, client, placement, "on") in runs:
            on_runs, off_runs = runs[(label, client, placement, "on")], runs[(label, client, placement, "off")]
            print(f"{label}, {client}, {placement}: {direct_writes_pairs(on_runs, off_runs)}")
    write_csv(rows, RESULTS_DIR / f"api_server_{slug}.csv")
    write_csv(repeat_rows, RESULTS_DIR / f"api_server_{slug}__repeats.csv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
