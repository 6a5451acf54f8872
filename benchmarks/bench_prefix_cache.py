"""Automatic prefix caching on and off, side by side, through the paths users take: offline ``LLM.generate``
and a served ``python -m runner serve`` (``bench-serve --compare prefix-caching`` for the one-shot loads, a
streaming multi-turn client over ``/v1/completions`` for the conversations).

Three loads, greedy, EOS ignored, on the built-in ``tiny-qwen3-moe`` (CPU):

- ``shared prefix``: 16 requests at once, each a 1,024-token system prompt shared by all then 64 tokens of its
  own, 128 new tokens;
- ``multi-turn``: 8 conversations of 4 turns; a turn's prompt is the previous prompt + the previous answer
  (32 tokens) + a new 64-token user message (the first: 256 tokens of its own); the conversations' turns run
  concurrently;
- ``0 % hit``: 16 unique 1,088-token prompts, 128 new tokens.

Each run starts from an empty cache (``reset_prefix_cache`` / ``POST /reset_prefix_cache``: the same prompts
run again would be all hits); the engines with and without caching are up together and their runs alternate;
figures are medians over ``--repeats``. Per run: the prompt tokens computed (the prompt less what the cache
served: ``num_cached_tokens`` offline, ``usage.prompt_tokens_details.cached_tokens`` for the conversations, the
``ubatch:prefix_cache_hits`` counter through bench-serve), the hit rate, the median TTFT, the output-token
throughput, and whether the generated tokens equal those without caching. Writes
``benchmarks/results/prefix_cache.csv`` (one row per path, load and side) and ``prefix_cache.png``.
Usage: ``python benchmarks/bench_prefix_cache.py [--repeats 3] [--only offline|served]``.

``--only miss-cpu`` measures instead what caching costs on the 0 % hit load in process CPU time, which other
processes' load does not inflate (``benchmarks/prefix_cache_miss_cpu.py``): ``--repeats`` alternating
``LLM.generate`` calls per side, both engines in this process, and one profiled call per side; it writes
``benchmarks/results/prefix_cache_miss_cpu.csv``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, write_csv

MODEL = "tiny-qwen3-moe"
VOCAB = 512
NUM_REQUESTS = 16
PREFIX_LEN, UNIQUE_LEN, OUTPUT_LEN = 1024, 64, 128
CONVERSATIONS, TURNS, FIRST_LEN, USER_LEN, ANSWER_LEN = 8, 4, 256, 64, 32
LOADS = ("shared prefix", "multi-turn", "0 % hit")
SIDES = ("off", "on")
# KV for every request of a load at once on both sides (the CPU default, 1,024 tokens a sequence, is short of the
# 1,216 of a one-shot request): caching changes the tokens computed, not which requests fit or are preempted
NUM_KV_BLOCKS = 2048
SERVER_ARGS = f"--device cpu --max-num-seqs {NUM_REQUESTS} --max-model-len 2048 --num-kv-blocks {NUM_KV_BLOCKS}"


@dataclass
class RunFigures:
    """One run of one load on one side."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttfts_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    wall_s: float = 0.0
    outputs: list[list[int]] = field(default_factory=list)  # generated ids per request, in order

    @property
    def computed(self) -> int:
        return self.prompt_tokens - self.cached_tokens


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def one_shot_prompts(load: str, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    if load == "shared prefix":
        prefix = tokens(rng, PREFIX_LEN)
        return [prefix + tokens(rng, UNIQUE_LEN) for _ in range(NUM_REQUESTS)]
    return [tokens(rng, PREFIX_LEN + UNIQUE_LEN) for _ in range(NUM_REQUESTS)]


def user_messages(seed: int) -> list[list[list[int]]]:
    """``[turn][conversation]``: the tokens each turn adds after the previous answer (turn 0: the first prompt)."""
    rng = random.Random(seed)
    return [[tokens(rng, FIRST_LEN if turn == 0 else USER_LEN) for _ in range(CONVERSATIONS)]
            for turn in range(TURNS)]


# ---- offline ------------------------------------------------------------------------------------------------
def offline_generate(llm: Any, prompts: list[list[int]], max_tokens: int, figures: RunFigures) -> list[list[int]]:
    from runner.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    figures.wall_s += time.perf_counter() - t0
    answers = []
    for o in outs:
        figures.prompt_tokens += len(o.prompt_token_ids)
        figures.cached_tokens += o.num_cached_tokens or 0
        figures.ttfts_s.append(o.metrics.first_token_time - o.metrics.arrival_time)
        figures.output_tokens += len(o.outputs[0].token_ids)
        answers.append(list(o.outputs[0].token_ids))
    figures.outputs += answers
    return answers


def offline_run(llm: Any, load: str, seed: int) -> RunFigures:
    figures = RunFigures()
    if load != "multi-turn":
        offline_generate(llm, one_shot_prompts(load, seed), OUTPUT_LEN, figures)
        return figures
    prompts: list[list[int]] = [[] for _ in range(CONVERSATIONS)]
    answers: list[list[int]] = [[] for _ in range(CONVERSATIONS)]
    for messages in user_messages(seed):
        prompts = [p + a + m for p, a, m in zip(prompts, answers, messages, strict=True)]
        answers = offline_generate(llm, prompts, ANSWER_LEN, figures)
    return figures


def run_offline(repeats: int) -> dict[tuple[str, str], list[RunFigures]]:
    llms = {side: make_offline_llm(side == "on") for side in SIDES}
    runs: dict[tuple[str, str], list[RunFigures]] = {}
    try:
        for llm in llms.values():  # warm-up: first-call costs
            offline_run(llm, "0 % hit", seed=999)
        for rep in range(repeats):
            for load in LOADS:
                for side, llm in llms.items():
                    if not llm.reset_prefix_cache():
                        raise RuntimeError(f"the {side} engine refused to reset its prefix cache between runs")
                    runs.setdefault((load, side), []).append(offline_run(llm, load, seed=rep))
                    progress(f"offline {load} caching {side} run {rep + 1}: {summary_line(runs[load, side][-1])}")
    finally:
        for llm in llms.values():
            llm.close()
    return runs


# ---- served ---------------------------------------------------------------------------------------------------
def bench_serve(load: str, repeats: int, out_dir: Path) -> dict[tuple[str, str], list[RunFigures]]:
    """``python -m runner bench-serve --compare prefix-caching`` on a one-shot load: its per-run figures."""
    if load == "shared prefix":
        dataset = ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(PREFIX_LEN),
                   "--prefix-repetition-suffix-len", str(UNIQUE_LEN), "--prefix-repetition-num-prefixes", "1",
                   "--prefix-repetition-output-len", str(OUTPUT_LEN)]
    else:
        dataset = ["--dataset-name", "random", "--random-input-len", str(PREFIX_LEN + UNIQUE_LEN),
                   "--random-output-len", str(OUTPUT_LEN)]
    out = out_dir / f"bench_serve_{load.replace(' ', '_').replace('%', 'pct')}.json"
    cmd = [sys.executable, "-m", "runner", "bench-serve", MODEL, "--server-args", SERVER_ARGS, "--compare",
           "prefix-caching", "--num-prompts", str(NUM_REQUESTS), "--ignore-eos", "--repeats", str(repeats),
           "--output-json", str(out), *dataset]
    print("served, " + load + ": python " + " ".join(cmd[1:]), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"bench-serve exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    runs: dict[tuple[str, str], list[RunFigures]] = {}
    for record in json.loads(out.read_text())["runs"]:
        m = record["metrics"]
        side = "on" if record["server"] == "caching on" else "off"
        figures = RunFigures(prompt_tokens=int(m["server_prompt_tokens"]), cached_tokens=int(m["prefix_cache_hits"]),
                             output_tokens=m["total_output_tokens"], wall_s=m["duration_s"])
        figures.ttfts_s = [m["ttft_ms"]["median"] / 1e3]  # bench-serve keeps the run's median
        runs.setdefault((load, side), []).append(figures)
        progress(f"served {load} caching {side} run {record['repeat'] + 1}: {summary_line(figures)}")
    return runs


async def stream_turn(session: Any, url: str, prompt: list[int], figures: RunFigures) -> list[int]:
    """One streamed greedy completion of ``prompt``: its answer's token ids; its TTFT and cached tokens noted."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": ANSWER_LEN, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    start = time.perf_counter()
    answer: list[int] = []
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.read())[:300]!r}")
        async for raw in resp.content:
            if not raw.startswith(b"data:") or raw.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(raw[len(b"data:"):])
            if chunk.get("usage"):
                usage = chunk["usage"]
                figures.prompt_tokens += usage["prompt_tokens"]
                figures.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
            for choice in chunk.get("choices") or ():
                if not answer and choice.get("token_ids"):
                    figures.ttfts_s.append(time.perf_counter() - start)
                answer += choice.get("token_ids") or []
    figures.output_tokens += len(answer)
    return answer


async def served_conversations(url: str, seed: int) -> RunFigures:
    import aiohttp

    figures = RunFigures()
    messages = user_messages(seed)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def conversation(c: int) -> list[list[int]]:
            prompt: list[int] = []
            answer: list[int] = []
            answers = []
            for turn in range(TURNS):
                prompt = prompt + answer + messages[turn][c]
                answer = await stream_turn(session, url, prompt, figures)
                answers.append(answer)
            return answers

        t0 = time.perf_counter()
        per_conversation = await asyncio.gather(*[conversation(c) for c in range(CONVERSATIONS)])
        figures.wall_s = time.perf_counter() - t0
    figures.outputs = [answer for turn in range(TURNS) for answer in (a[turn] for a in per_conversation)]
    return figures


def run_served_multi_turn(repeats: int) -> dict[tuple[str, str], list[RunFigures]]:
    from runner.entrypoints.benchserve.run import reset_prefix_cache
    from runner.entrypoints.benchserve.server_proc import ServerProcess

    servers = {side: ServerProcess(MODEL, f"{SERVER_ARGS} --enable-prompt-tokens-details "
                                          f"--{'' if side == 'on' else 'no-'}enable-prefix-caching",
                                   name=f"caching {side}") for side in SIDES}
    runs: dict[tuple[str, str], list[RunFigures]] = {}
    try:
        for srv in servers.values():
            srv.start()
        for srv in servers.values():  # warm-up
            asyncio.run(served_conversations(srv.base_url, seed=999))
        for rep in range(repeats):
            for side, srv in servers.items():
                reset_prefix_cache(srv.base_url)
                runs.setdefault(("multi-turn", side), []).append(asyncio.run(served_conversations(srv.base_url, rep)))
                progress(f"served multi-turn caching {side} run {rep + 1}: "
                         f"{summary_line(runs['multi-turn', side][-1])}")
    finally:
        codes = {side: srv.stop() for side, srv in servers.items()}
        for srv in servers.values():
            srv.finish_log(keep=any(code not in (0, None) for code in codes.values()))
    return runs


# ---- summary --------------------------------------------------------------------------------------------------
def progress(line: str) -> None:
    """Per-run figures, on stderr: stdout carries the table (benchmarks/report.py shows it)."""
    print(line, file=sys.stderr, flush=True)


COLUMNS = (("path", "path", "{}"), ("load", "load", "{}"), ("caching", "caching", "{}"),
           ("prompt tokens", "prompt_tokens", "{}"), ("computed", "prompt_tokens_computed", "{}"),
           ("computed vs off", "computed_vs_off", "{:.1%}"), ("hit rate", "hit_rate", "{:.1%}"),
           ("median TTFT ms", "median_ttft_ms", "{:.0f}"), ("TTFT off/this", "ttft_off_over_this", "{:.2f}x"),
           ("output tok/s", "output_tok_s", "{:.0f}"), ("tput vs off", "throughput_vs_off", "{:.3f}x"),
           ("same tokens", "same_tokens_as_off", "{}"))


def print_table(rows: list[dict[str, Any]], repeats: int) -> None:
    cells = [[fmt.format(r[key]) for _, key, fmt in COLUMNS] for r in rows]
    widths = [max(len(title), *(len(c[i]) for c in cells)) for i, (title, _, _) in enumerate(COLUMNS)]
    print(f"\nmedians of {repeats} runs, each from an empty cache")
    print("  ".join(title.ljust(w) for (title, _, _), w in zip(COLUMNS, widths, strict=True)))
    for c in cells:
        print("  ".join(v.ljust(w) for v, w in zip(c, widths, strict=True)))


def summary_line(f: RunFigures) -> str:
    return (f"{f.computed}/{f.prompt_tokens} prompt tokens computed, median TTFT "
            f"{1e3 * statistics.median(f.ttfts_s):.0f} ms, {f.output_tokens / f.wall_s:.0f} output tok/s")


def same_tokens(off: list[RunFigures], on: list[RunFigures]) -> str:
    """Whether every run with caching generated the tokens of the same run without ("n/a": not recorded)."""
    if not on[0].outputs:
        return "n/a"
    return "yes" if all(a.outputs == b.outputs for a, b in zip(off, on, strict=True)) else "no"


def rows_of(path: str, runs: dict[tuple[str, str], list[RunFigures]]) -> list[dict[str, Any]]:
    rows = []
    for load in LOADS:
        if (load, "off") not in runs:
            continue
        med: dict[str, dict[str, float]] = {}
        for side in SIDES:
            rs = runs[load, side]
            med[side] = {"prompt": statistics.median(r.prompt_tokens for r in rs),
                         "computed": statistics.median(r.computed for r in rs),
                         "ttft": statistics.median(1e3 * statistics.median(r.ttfts_s) for r in rs),
                         "tput": statistics.median(r.output_tokens / r.wall_s for r in rs)}
        for side in SIDES:
            m = med[side]
            rows.append({"path": path, "load": load, "caching": side, "repeats": len(runs[load, side]),
                         "prompt_tokens": int(m["prompt"]), "prompt_tokens_computed": int(m["computed"]),
                         "computed_vs_off": round(m["computed"] / med["off"]["computed"], 4),
                         "hit_rate": round(1 - m["computed"] / m["prompt"], 4),
                         "median_ttft_ms": round(m["ttft"], 1),
                         "ttft_off_over_this": round(med["off"]["ttft"] / m["ttft"], 2),
                         "output_tok_s": round(m["tput"], 1),
                         "throughput_vs_off": round(m["tput"] / med["off"]["tput"], 3),
                         "same_tokens_as_off": same_tokens(runs[load, "off"], runs[load, side]) if side == "on"
                         else "-"})
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    labels = [f"{r['path']}\n{r['load']}" for r in rows if r["caching"] == "off"]
    xs = range(len(labels))
    for ax, key, title in ((axes[0], "prompt_tokens_computed", "prompt tokens computed"),
                           (axes[1], "median_ttft_ms", "median TTFT (ms)")):
        for k, side in enumerate(SIDES):
            values = [r[key] for r in rows if r["caching"] == side]
            ax.bar([x + 0.4 * k for x in xs], values, width=0.4, label=f"caching {side}")
        ax.set_xticks([x + 0.2 for x in xs], labels, fontsize=7)
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def make_offline_llm(enable_prefix_caching: bool) -> Any:
    from runner.entrypoints.llm import LLM

    return LLM(model=MODEL, device="cpu", max_num_seqs=NUM_REQUESTS, max_model_len=2048,
               num_kv_blocks=NUM_KV_BLOCKS, enable_prefix_caching=enable_prefix_caching)


def run_miss_cpu(repeats: int, output: str) -> int:
    from prefix_cache_miss_cpu import measure, print_rows

    rows = measure(make_offline_llm, lambda seed: one_shot_prompts("0 % hit", seed), OUTPUT_LEN, repeats, progress)
    print_rows(rows)
    write_csv(rows, output)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", choices=["offline", "served", "miss-cpu"])
    p.add_argument("--output", help="CSV path (default: benchmarks/results/prefix_cache.csv, "
                                    "prefix_cache_miss_cpu.csv with --only miss-cpu)")
    p.add_argument("--plot", default=str(RESULTS_DIR / "prefix_cache.png"))
    args = p.parse_args()
    if args.repeats < 1:
        p.error(f"argument --repeats: must be >= 1, got {args.repeats}")
    if args.only == "miss-cpu":
        return run_miss_cpu(args.repeats, args.output or str(RESULTS_DIR / "prefix_cache_miss_cpu.csv"))
    args.output = args.output or str(RESULTS_DIR / "prefix_cache.csv")
    rows: list[dict[str, Any]] = []
    if args.only != "served":
        rows += rows_of("offline", run_offline(args.repeats))
    if args.only != "offline":
        with tempfile.TemporaryDirectory() as tmp:
            served = {**bench_serve("shared prefix", args.repeats, Path(tmp)),
                      **run_served_multi_turn(args.repeats), **bench_serve("0 % hit", args.repeats, Path(tmp))}
        rows += rows_of("served", served)
    print_table(rows, args.repeats)
    write_csv(rows, args.output)
    if args.plot:
        plot(rows, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
