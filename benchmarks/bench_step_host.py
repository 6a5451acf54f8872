"""The step thread's host work per decode step, this tree against a baseline commit, side by side in one run.

What limits a GPU whose step the host cannot feed: the model runner's launch of a step (DP vote, inputs,
placeholder resolve, sampler launch), measured on the emulated device (``--emulate-device``) so the device's
time costs no CPU, with the null-cost model of ``bench_host_overhead.py`` (its forward is left out of every
figure). Per steady decode step of ``--requests`` requests, on the overlap loop (the default with a device):

- ``cpu_ms``: the step thread's CPU time in ``ModelRunner.launch`` (``time.thread_time``), the forward excluded;
- ``wall_ms``: the same launch's wall time, which also counts the waits for the GIL held by the CPU thread
  (what ``LoopStats.forward_busy_s`` sees);
- ``ops``: torch operations dispatched by one launch outside the forward (a separate counted wave): on a GPU
  each one that is not a view is a kernel or copy launch, the host's fixed cost per op;
- ``forward_ms``: the null-cost model's forward per step (CPU time; real work at launch on the CPU, left out of
  the figures above);
- ``loop_ms``: the step loop's wall time per step (with the forward, and whatever else the machine runs).

The baseline (``--baseline``, a git revision) is exported with ``git archive`` and both trees run in child
processes, alternately, ``--repeats`` times; figures are medians. The tokens of both trees are compared. Each
``--sampling`` is measured in turn (``common.SAMPLING_SETTINGS``): every request greedy (``greedy``), drawing at
temperature 1 (``draw``), or with a checkpoint's ``generation_config``: Qwen3's temperature 0.6, top-k 20, top-p
0.95 (``qwen3``), Llama 3's temperature 0.6, top-p 0.9 (``llama3``).
``--graphs`` compares instead, in this tree, decode graphs (the eager stand-in, each replay counted as one launch
and left out of the CPU figures as the forward is) whose steps sample eagerly against the same graphs sampling in
their heads (``cuda_graphs.sampling_heads``): the ``ops`` column is what a head saves a GPU's step thread in
launches.
On a CPU the gain understates a GPU's: there a host-to-device copy and a pinned staging buffer cost nothing,
and an op costs its dispatch, not a kernel launch. Usage: ``python benchmarks/bench_step_host.py [--baseline
REV | --graphs] [--sampling greedy draw qwen3 llama3] [--requests 256] [--device-ms 3] [--decode-tokens 32]
[--repeats 5] [--output CSV]``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# this benchmark reads the in-process engine (its runner, core or loop statistics): the engine core stays here
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
EDGE = 2  # launches left out at each end of a wave


def measure(requests: int, device_ms: float, decode_tokens: int, cache_dir: str,
            graphs: str = "none", sampling: str = "greedy") -> dict[str, Any]:
    """One child's figures for the tree first on ``sys.path`` (see ``child``); ``graphs``: none, or decode graphs
    on the eager stand-in whose steps sample eagerly (``eager-sampling``) or in their heads (``head``); every
    request samples with ``common.SAMPLING_SETTINGS[sampling]``."""
    import random
    import threading
    import time

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from bench_host_overhead import MODEL, PROMPT_LEN
    from common import SAMPLING_SETTINGS
    from runner.core.engine_core import EngineCore
    from runner.core.requests import EngineCoreRequest
    from runner.entrypoints.llm import LLM
    from runner.sampling_params import SamplingParams
    from runner.worker import model_runner

    torch.set_num_threads(1)
    llm = LLM(model=MODEL, cache_dir=cache_dir, device="cpu", max_num_seqs=requests,
              max_num_batched_tokens=max(512, requests * PROMPT_LEN), max_model_len=PROMPT_LEN + decode_tokens + 8,
              emulate_device=f"step_us={1e3 * device_ms:g}")
    core = EngineCore(llm.cfg, llm.runner)
    runner = llm.runner
    assert isinstance(runner, model_runner.ModelRunner)
    model = runner.model
    local = threading.local()
    if graphs != "none":
        install_stand_in_graphs(runner, local, head=graphs == "head")

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if not getattr(local, "in_forward", False):
                self.count += 1
            return func(*args, **(kwargs or {}))

    forward, launch = model.forward, model_runner.ModelRunner.launch
    cpu: list[float] = []
    wall: list[float] = []
    fwd: list[float] = []
    ops: list[int] = []
    state = {"count_ops": False}

    def timed_forward(*args: Any, **kwargs: Any) -> Any:
        was, local.in_forward = getattr(local, "in_forward", False), True
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return forward(*args, **kwargs)
        finally:
            local.fwd_wall += time.perf_counter() - t0
            local.fwd_cpu += time.thread_time() - c0
            local.in_forward = was

    def timed_launch(self: Any, sched: Any) -> Any:
        local.fwd_wall = local.fwd_cpu = 0.0
        decode = sched.num_reqs == requests and sched.is_uniform_decode
        if state["count_ops"] and decode:
            local.replays = 0
            with Ops() as mode:
                out = launch(self, sched)
            ops.append(mode.count + local.replays)  # a graph replay: one launch
            return out
        t0, c0 = time.perf_counter(), time.thread_time()
        out = launch(self, sched)
        if decode:
            wall.append(time.perf_counter() - t0 - local.fwd_wall)
            cpu.append(time.thread_time() - c0 - local.fwd_cpu)
            fwd.append(local.fwd_cpu)
        return out

    model.forward = timed_forward  # type: ignore[method-assign]
    model_runner.ModelRunner.launch = timed_launch  # type: ignore[method-assign]
    rng = random.Random(11)
    prompts = [[rng.randrange(runner.vocab_size) for _ in range(PROMPT_LEN)] for _ in range(requests)]

    def wave(n: int) -> tuple[list[list[int]], float, int]:
        temperature, top_k, top_p = SAMPLING_SETTINGS[sampling]
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=n, ignore_eos=True)
        for i, p in enumerate(prompts):
            core.add_request(EngineCoreRequest(i, p, params))
        tokens: dict[int, list[int]] = {i: [] for i in range(requests)}
        calls = []
        while True:
            t0 = time.perf_counter()
            step = core.step()
            calls.append((t0, time.perf_counter()))
            for o in step.outputs:
                tokens[o.request_id].extend(o.new_token_ids)
            if not step.running:
                break
        sel = calls[EDGE:n - EDGE]
        return [tokens[i] for i in range(requests)], (sel[-1][1] - sel[0][0]) / len(sel), len(sel)

    try:
        wave(8)  # warm-up: first-call costs
        cpu.clear()
        wall.clear()
        fwd.clear()
        tokens, loop_s, steps = wave(decode_tokens)
        steady = slice(EDGE, len(cpu) - EDGE)
        state["count_ops"] = True
        wave(8)
    finally:
        model_runner.ModelRunner.launch = launch  # type: ignore[method-assign]
        core.close()
        llm.close()
    return {"cpu_ms": 1e3 * statistics.median(cpu[steady]), "wall_ms": 1e3 * statistics.median(wall[steady]),
            "ops": statistics.median(ops), "forward_ms": 1e3 * statistics.median(fwd[steady]), "loop_ms": 1e3 * loop_s,
            "steps": steps, "tokens": tokens}


def install_stand_in_graphs(runner: Any, local: Any, head: bool) -> None:
    """Capture ``runner``'s decode graph ladder on the eager stand-in (with or without its heads) and install it; a
    replay runs with ``local.in_forward`` set, counted as one op (on a GPU it is one launch), its time left out of
    the launch's as the forward's is."""
    import time

    from cudagraph.backends import EagerReplayBackend
    from runner.worker.cuda_graphs import make_graph_runner

    class OneLaunch(EagerReplayBackend):
        def replay(self, graph: Any) -> None:
            local.replays = getattr(local, "replays", 0) + 1
            was, local.in_forward = getattr(local, "in_forward", False), True
            wall, cpu = local.fwd_wall, local.fwd_cpu  # the replay's time replaces its forward's
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                super().replay(graph)
            finally:
                local.in_forward = was
                local.fwd_wall = wall + time.perf_counter() - t0
                local.fwd_cpu = cpu + time.thread_time() - c0

    graph_runner = make_graph_runner(runner, backend=OneLaunch(), num_warmups=0, progress=False)
    if not head:
        graph_runner.heads = {}
    graph_runner.capture()
    runner.graph_runner = graph_runner


def child(tree: str, args: argparse.Namespace, graphs: str = "none", sampling: str = "greedy") -> dict[str, Any]:
    """Run :func:`measure` in a fresh interpreter that imports ``runner`` from ``tree``."""
    code = ("import json, sys; sys.path[:0] = [sys.argv[1], sys.argv[1] + '/benchmarks', sys.argv[2]]; "
            "import bench_step_host as b; "
            "print('RESULT ' + json.dumps(b.measure(int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]), "
            "sys.argv[6], *sys.argv[7:])))")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": tree}
    with tempfile.TemporaryDirectory(prefix="ubatch-bench-step-host-") as cache:
        # a baseline's measure() may not take them
        modes = ([] if graphs == "none" and sampling == "greedy" else [graphs]) + \
            ([] if sampling == "greedy" else [sampling])
        proc = subprocess.run([sys.executable, "-c", code, tree, str(HERE.parent), str(args.requests),
                               str(args.device_ms), str(args.decode_tokens), cache, *modes],
                              env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"the measurement in {tree} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def export(revision: str, into: str) -> str:
    """The tree of ``revision`` (of this repository) written under ``into``; its full commit id."""
    sha = subprocess.run(["git", "rev-parse", "--verify", f"{revision}^{{commit}}"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.strip()
    archive = subprocess.run(["git", "archive", sha], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return sha


def main() -> None:
    sys.path.insert(0, str(HERE.parent))
    from common import RESULTS_DIR, SAMPLING_SETTINGS, write_csv

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", default="main", help="git revision to compare with (default: main)")
    p.add_argument("--graphs", action="store_true",
                   help="compare, in this tree, stand-in decode graphs sampling eagerly and in their heads")
    p.add_argument("--sampling", choices=list(SAMPLING_SETTINGS), nargs="+", default=["greedy"],
                   help="every request's sampling, one measurement each")
    p.add_argument("--requests", type=int, default=256, help="decode requests running together")
    p.add_argument("--device-ms", type=float, default=3.0, help="emulated device time per step")
    p.add_argument("--decode-tokens", type=int, default=32, help="output tokens per request")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--output", default=None, help="CSV (default: results/step_host.csv, step_host_graphs.csv)")
    args = p.parse_args()
    args.output = args.output or str(RESULTS_DIR / ("step_host_graphs.csv" if args.graphs else "step_host.csv"))
    if args.decode_tokens < 4 * EDGE + 4:
        raise SystemExit(f"--decode-tokens must be at least {4 * EDGE + 4}")
    with tempfile.TemporaryDirectory(prefix="ubatch-baseline-") as base:
        if args.graphs:
            trees = {"graphs, eager sampling": (str(ROOT), "eager-sampling"), "graphs, head": (str(ROOT), "head")}
        else:
            sha = export(args.baseline, base)
            trees = {f"baseline {args.baseline} ({sha[:7]})": (base, "none"), "this tree": (str(ROOT), "none")}
        rows = []
        for sampling in args.sampling:
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
            for _ in range(args.repeats):
                for name, (tree, graphs) in trees.items():
                    runs[name].append(child(tree, args, graphs, sampling))
            reference = next(iter(runs.values()))[0]["tokens"]
            same = all(r["tokens"] == reference for rs in runs.values() for r in rs)
            rows += [{"tree": name, "sampling": sampling, "requests": args.requests, "device_ms": args.device_ms,
                      **{k: round(statistics.median(r[k] for r in rs), 3)
                         for k in ("cpu_ms", "wall_ms", "ops", "forward_ms", "loop_ms")},
                      "steps": rs[0]["steps"], "same_tokens": same, "repeats": args.repeats}
                     for name, rs in runs.items()]
    print("per steady decode step, medians of the repeats: step thread CPU and wall ms in the launch (forward "
          "excluded), torch ops per launch, the forward's CPU ms and the loop's wall ms per step")
    print(f"{'tree':<28} {'sampling':<8} {'cpu_ms':>7} {'wall_ms':>8} {'ops':>5} {'forward_ms':>10} {'loop_ms':>8}  "
          "same tokens")
    for r in rows:
        print(f"{r['tree']:<28} {r['sampling']:<8} {r['cpu_ms']:>7.3f} {r['wall_ms']:>8.3f} {r['ops']:>5g} "
              f"{r['forward_ms']:>10.3f} {r['loop_ms']:>8.3f}  {'yes' if r['same_tokens'] else 'NO'}")
    write_csv(rows, args.output)


if __name__ == "__main__":
    main()
