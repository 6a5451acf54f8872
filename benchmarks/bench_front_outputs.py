"""The offline front end's CPU per request per step: ``LLM.generate`` over an engine client that replays outputs.

What the process that calls ``LLM.generate`` does with each step's outputs when the engine core runs elsewhere
(``OutputProcessor.process_outputs`` and the LLM's own per-step callback), with no engine: the client hands
every request one token per step, as a decode step of the real engine would, and finishes them at
``max_tokens``. Greedy FINAL_ONLY requests (the offline ``LLM``'s), token ids only (the near-null model of
``bench_host_overhead.py``: no tokenizer). CPU µs per request per step of this thread: a call of
``--tokens + 1`` tokens less a call of 1 token, over the ``--tokens`` extra steps and the requests; the median
of ``--repeats``.

``--compare BEFORE AFTER``: run this script with ``PYTHONPATH=BEFORE`` and ``PYTHONPATH=AFTER`` in turn,
``--rounds`` times each, alternately (the machine's drift hits both alike), and print both medians side by
side. Otherwise the runner imported is the one on ``PYTHONPATH``. Usage: ``python
benchmarks/bench_front_outputs.py [--requests 256 1024] [--tokens 64] [--repeats 5]`` or ``... --compare
/work/main . [--rounds 3]``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODEL_DIR_ENV = "UBATCH_BENCH_FRONT_MODEL"


class ReplayClient:
    """An ``EngineCoreClient`` without an engine: one token per request per step until ``max_tokens``."""

    def __init__(self, vocab_size: int, max_model_len: int) -> None:
        self._vocab, self._len = vocab_size, max_model_len
        self._pending: list[Any] = []

    @property
    def core_info(self) -> Any:
        from runner.core.messages import CoreInfo

        return CoreInfo(0, self._len, self._vocab, 0, 16, [], "float32", "torch")

    @property
    def max_model_len(self) -> int:
        return self._len

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def runner(self) -> None:
        return None

    @property
    def forward_thread_id(self) -> None:
        return None

    def prepare(self, cfg: Any) -> None:
        pass

    def add_request(self, request: Any) -> None:
        self._pending.append(request)

    def abort_requests(self, request_ids: list[int], message: str) -> None:
        raise AssertionError(f"no request stops early here ({message}: {request_ids})")

    def reset_prefix_cache(self) -> bool:
        raise AssertionError("this benchmark never resets a prefix cache (there is no engine)")

    def run(self, on_outputs: Any, *, trace: bool = False) -> Any:
        from runner.core.requests import EngineCoreOutput
        from runner.engine.engine_core_client import RunReport

        pending, self._pending = self._pending, []
        steps = max(r.sampling_params.max_tokens for r in pending)
        for k in range(steps):
            on_outputs([EngineCoreOutput(r.request_id, [(r.request_id + k) % self._vocab],
                                         finish_reason="length" if k + 1 == r.sampling_params.max_tokens else None)
                        for r in pending if k < r.sampling_params.max_tokens])
        return RunReport(num_steps=steps)

    def close(self) -> None:
        pass


def cpu_per_request_step(model_dir: str, requests: int, tokens: int, repeats: int) -> float:
    from runner.entrypoints.llm import LLM
    from runner.sampling_params import SamplingParams

    client = ReplayClient(64, tokens + 16)
    llm = LLM(model=model_dir, engine_client=client, max_num_seqs=requests, max_model_len=tokens + 16)
    prompts = [[i % 64] for i in range(requests)]

    def call(n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t0 = time.thread_time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        spent = time.thread_time() - t0
        if any(len(o.outputs[0].token_ids) != n for o in outs):
            raise RuntimeError(f"a request did not get its {n} tokens")
        return spent

    call(2)  # warm-up
    per = [(call(tokens + 1) - call(1)) / tokens / requests for _ in range(repeats)]
    llm.close()
    return 1e6 * statistics.median(per)


def measure(requests: list[int], tokens: int, repeats: int) -> dict[int, float]:
    model_dir = os.environ.get(MODEL_DIR_ENV)
    if model_dir:
        return {n: cpu_per_request_step(model_dir, n, tokens, repeats) for n in requests}
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_host_overhead import MODEL
    from runner.models.loader import resolve_model_path

    with tempfile.TemporaryDirectory(prefix="ubatch-bench-front-") as cache_dir:
        model_dir = str(resolve_model_path(MODEL, cache_dir))
        return {n: cpu_per_request_step(model_dir, n, tokens, repeats) for n in requests}


def compare(before: str, after: str, rounds: int, args: argparse.Namespace) -> None:
    """Alternate child runs with each checkout first on PYTHONPATH; the built model directory is shared."""
    child = [sys.executable, __file__, "--json", "--tokens", str(args.tokens), "--repeats", str(args.repeats),
             "--requests", *map(str, args.requests)]
    got: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="ubatch-bench-front-") as cache_dir:
        env = dict(os.environ, PYTHONPATH=os.path.abspath(after))
        build = ("import sys; sys.path.insert(0, 'benchmarks'); from bench_host_overhead import MODEL; "
                 "from runner.models.loader import resolve_model_path; "
                 f"print(resolve_model_path(MODEL, {cache_dir!r}))")
        model_dir = subprocess.run([sys.executable, "-c", build], env=env, cwd=Path(__file__).resolve().parents[1],
                                   check=True, capture_output=True, text=True, timeout=300).stdout.strip()
        for _ in range(rounds):
            for name, path in (("before", before), ("after", after)):
                env = dict(os.environ, PYTHONPATH=os.path.abspath(path), **{MODEL_DIR_ENV: model_dir})
                out = subprocess.run(child, env=env, check=True, capture_output=True, text=True, timeout=900)
                got[name].append({k: float(v) for k, v in json.loads(out.stdout.splitlines()[-1]).items()})
    print(f"front CPU µs per request per step (median of {rounds} alternating runs, each the median of "
          f"{args.repeats}); before: {before}, after: {after}")
    print(f"{'requests':>9} | {'before':>8} | {'after':>8} | {'after/before':>12}")
    for n in args.requests:
        b = statistics.median(r[str(n)] for r in got["before"])
        a = statistics.median(r[str(n)] for r in got["after"])
        print(f"{n:>9} | {b:>8.3f} | {a:>8.3f} | {a / b:>12.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="two checkouts, run alternately")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true", help="print the figures as one JSON line (for --compare)")
    args = p.parse_args()
    for name in ("tokens", "repeats", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if any(n < 1 for n in args.requests):
        p.error(f"--requests must all be >= 1, got {args.requests}")
    if args.compare:
        compare(args.compare[0], args.compare[1], args.rounds, args)
        return
    figures = measure(args.requests, args.tokens, args.repeats)
    if args.json:
        print(json.dumps(figures))
        return
    print("front CPU µs per request per step (median of repeats)")
    for n, us in figures.items():
        print(f"{n:>6} requests: {us:.3f}")


if __name__ == "__main__":
    main()
