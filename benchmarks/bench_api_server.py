"""What the OpenAI server's front end costs per streamed token, against the offline engine on the same prompts.

Workload: a small Qwen3-MoE chat checkpoint written by transformers (``tests/tiny_checkpoint.py``: hidden 64,
2 layers, 8 experts, a byte-level BPE tokenizer, float32), 256 prompts of 16 token ids, 64 output tokens each
(``ignore_eos``, greedy). Side by side, ``--repeats`` times, medians:

- ``offline``: ``LLM.generate`` on the 256 prompts in a process of its own;
- ``served``: ``python -m runner serve`` with ``--max-num-seqs 256``, 256 concurrent streamed completions from
  an ``httpx`` client in a process of its own; output tok/s, the API-server process's CPU seconds per streamed
  token (its own CPU, not its ranks'), and the load generator's CPU share (it must not be the bottleneck).
  With two cores or more the API server runs alone on the last core and its ranks share the first with the
  load generator: unpinned, where the scheduler puts three busy processes on two cores changes both figures by
  up to 1.8x from run to run (the API server's CPU per token depends on how many outputs each wake-up finds).

``--api-server-count N`` serves with N API-server processes (their CPU summed); pinned, they share the API
server's core, and ``--spread`` gives API server i core i instead (so with 2 cores the second shares the
first core with the rank and the load generator); ``--unpinned`` leaves placement to the scheduler.
``--checkout DIR`` serves from another checkout of the project (an earlier commit): before/after on one machine;
``--against DIR`` serves both in turn within each repeat, which a machine shared with other jobs needs.
Writes ``benchmarks/results/api_server_<label>.csv``. Usage: ``python benchmarks/bench_api_server.py [--repeats 3]``.
"""
from __future__ import annotations

import argparse
import json
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
import asyncio, json, os, random, sys, time, httpx
base, model, pids, (n, plen, out) = sys.argv[1], sys.argv[2], [int(p) for p in sys.argv[3].split(",")], map(int, sys.argv[4:7])
def cpu(p):
    f = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
async def one(h, i):
    body = {"model": model, "prompt": [random.Random(i).randrange(3, 200) for _ in range(plen)], "max_tokens": out,
            "ignore_eos": True, "temperature": 0, "stream": True}
    chunks = 0
    async with h.stream("POST", f"{base}/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            chunks += line.startswith("data: {")
    return chunks
async def main():
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as h:  # warm-up on connections of its own
        await asyncio.gather(*[one(h, i) for i in range(8)])
    async with httpx.AsyncClient(timeout=600, limits=limits) as h:
        server0, self0, t0 = sum(map(cpu, pids)), time.process_time(), time.perf_counter()
        chunks = sum(await asyncio.gather(*[one(h, i) for i in range(n)]))
        wall = time.perf_counter() - t0
        server, me = sum(map(cpu, pids)) - server0, time.process_time() - self0
    tokens = n * out
    print(json.dumps({"tok_s": tokens / wall, "api_us_per_token": server / tokens * 1e6,
                      "client_cpu_share": me / wall, "chunks": chunks, "tokens": tokens}))
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


def served(model: str, checkout: Path, api_servers: int = 1, placement: str = "pinned") -> dict[str, Any]:
    from runner.entrypoints.benchserve.server_proc import ServerProcess, free_port

    flags = f" --api-server-count {api_servers}" if api_servers > 1 else ""
    srv = ServerProcess(model, f"--device cpu --max-num-seqs {NUM_PROMPTS} --uvicorn-log-level warning{flags}",
                        startup_timeout_s=600, name="api-bench")
    srv.port = free_port()
    srv.base_url = f"http://127.0.0.1:{srv.port}"
    srv.cmd[srv.cmd.index("--port") + 1] = str(srv.port)
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
        load = [sys.executable, "-c", LOAD, srv.base_url, model, ",".join(map(str, front)), str(NUM_PROMPTS),
                str(PROMPT_LEN), str(OUTPUT_LEN)]
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) >= 2 and placement != "unpinned":
            # the API server(s) on the last core; the ranks (and an idle parent) and the load generator on the
            # first; --spread: API server i on core i
            for child in children(srv.proc.pid):
                pin(child, {cores[0]})
            pin(srv.proc.pid, {cores[0] if api_servers > 1 else cores[-1]})
            for i, pid in enumerate(front):
                pin(pid, {cores[i % len(cores)] if placement == "spread" else cores[-1]})
            load = ["taskset", "-c", str(cores[0]), *load]
        out = subprocess.run(load, capture_output=True, text=True, timeout=1200)
        if out.returncode:
            raise RuntimeError(f"load run failed:\n{out.stderr[-3000:]}")
        result = last_json(out.stdout)
        if result["chunks"] < result["tokens"]:
            raise RuntimeError(f"the server streamed {result['chunks']} chunks for {result['tokens']} tokens")
        return result
    finally:
        srv.stop()


def medians(runs: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, float]:
    med = {
        "offline_tok_s": statistics.median(o["tok_s"] for o, _ in runs),
        "served_tok_s": statistics.median(s["tok_s"] for _, s in runs),
        "api_us_per_token": statistics.median(s["api_us_per_token"] for _, s in runs),
        "client_cpu_share": statistics.median(s["client_cpu_share"] for _, s in runs),
    }
    med["served_over_offline"] = med["served_tok_s"] / med["offline_tok_s"]
    return med


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
    where = p.add_mutually_exclusive_group()
    where.add_argument("--spread", action="store_const", const="spread", dest="placement", default="pinned",
                       help="API server i on core i (default: every API server on the last core)")
    where.add_argument("--unpinned", action="store_const", const="unpinned", dest="placement",
                       help="pin nothing")
    args = p.parse_args()
    from tiny_checkpoint import write_checkpoint

    checkouts = [(args.label, args.checkout.resolve())]
    if args.against is not None:
        checkouts.insert(0, (args.against_label, args.against.resolve()))
    runs: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = {label: [] for label, _ in checkouts}
    with tempfile.TemporaryDirectory(prefix="ubatch-api-bench-") as tmp:
        model = str(Path(tmp) / "chat-qwen3-moe")
        write_checkpoint(Path(model))
        for rep in range(args.repeats):  # offline and served alternate, so machine drift falls on both
            off = offline(model, args.checkout.resolve())
            for label, checkout in checkouts:
                srv = served(model, checkout, args.api_server_count, args.placement)
                runs[label].append((off, srv))
                print(f"repeat {rep} {label}: offline {off['tok_s']:.0f} tok/s, served {srv['tok_s']:.0f} tok/s, "
                      f"API server {srv['api_us_per_token']:.1f} us/token, client CPU {srv['client_cpu_share']:.0%}")
    rows = []
    for label, _ in checkouts:
        med = medians(runs[label])
        print(f"| {label} | {med['offline_tok_s']:.0f} | {med['served_tok_s']:.0f} | "
              f"{med['served_over_offline']:.2f}x | {med['api_us_per_token']:.1f} | {med['client_cpu_share']:.0%} |")
        rows.append({"label": label, "repeats": args.repeats, **med})
        if med["client_cpu_share"] > 0.8:
            print(f"warning ({label}): the load generator used more than 80% of a core: it may be what limits the "
                  "served rate")
    slug = "".join(c if c.isalnum() else "_" for c in args.label).strip("_")
    write_csv(rows, RESULTS_DIR / f"api_server_{slug}.csv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
