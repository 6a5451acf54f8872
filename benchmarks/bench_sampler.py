"""What sampling costs per decode step: greedy only against every option on, alone and inside the engine's step.

Parts: ``sampler`` (the batched sampler alone on ``[rows, vocab]`` logits as the engine hands it a decode step),
``draw`` (this sampler's inverse CDF against vLLM's exponential race) and ``engine`` (``ModelRunner.step`` with
the sampler's share measured apart). Modes: ``greedy``, ``random`` (temperature only) and ``all`` (every
stage). Usage: ``python benchmarks/bench_sampler.py [--rows 64 256 1024] [--vocab 151936] [--repeats 3]
[--parts sampler draw engine]``; CSV to ``benchmarks/results/sampler.csv``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import torch

from common import RESULTS_DIR, write_csv
from runner.attention.kv_cache import BlockRows
from runner.core.scheduler import Request
from runner.core.scheduler_output import SchedulerOutput
from runner.sampling_params import SamplingParams

MODES = ("greedy", "random", "all")
PROMPT_LEN = 32  # tokens of history each row's penalty counts start from (sampler part)
EOS = 2
MODEL = "bench-qwen3-moe-120m"  # the engine benchmark's model (runner.models.loader.BENCH_MODELS)


def params_for(mode: str, vocab: int) -> SamplingParams:
    if mode == "greedy":
        return SamplingParams(temperature=0.0, max_tokens=4096, ignore_eos=True)
    if mode == "random":
        return SamplingParams(temperature=0.8, max_tokens=4096, ignore_eos=True)
    return SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                          frequency_penalty=0.2, presence_penalty=0.2, min_tokens=4000, max_tokens=4096,
                          stop_token_ids=[vocab - 1], logit_bias={3: 1.0, 5: -2.0, 7: 0.5, 11: 3.0}, logprobs=5)


def median_time(fn: Callable[[], Any], repeats: int, setup: Callable[[], Any] | None = None) -> float:
    times = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def step_of(reqs: list[Request], start: int, tokens: list[list[int]], step_id: int) -> SchedulerOutput:
    """A step as the scheduler hands it over: request ``i`` in slot ``i`` computes ``tokens[i]`` from position
    ``start`` (the whole prompt at 0, one token later) and samples; its one KV block is block ``i``."""
    n = len(reqs)
    return SchedulerOutput.from_arrays(
        req_ids=np.arange(n, dtype=np.int64), slots=np.arange(n, dtype=np.int64),
        num_computed=np.full(n, start, dtype=np.int64), query_lens=np.array([len(t) for t in tokens], dtype=np.int64),
        sample=np.ones(n, dtype=bool), token_ids=np.array([t for ts in tokens for t in ts], dtype=np.int64),
        blocks=BlockRows.from_lists([[i] for i in range(n)]), requests=[r.snapshot for r in reqs], finished_req_ids=[],
        step_id=step_id)


def requests_for(params: SamplingParams, prompts: list[list[int]]) -> list[Request]:
    return [Request(i, p, params, seed=i) for i, p in enumerate(prompts)]


def bench_sampler(rows: int, vocab: int, repeats: int) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    base_logits = torch.randn(rows, vocab, generator=g) * 3
    return [sampler_row(mode, base_logits, g, repeats) for mode in MODES]


def sampler_row(mode: str, base_logits: torch.Tensor, g: torch.Generator, repeats: int) -> dict[str, Any]:
    """One decode step's sampling in ``mode``, over ``base_logits`` (rows x vocab) and a fresh history drawn
    from ``g``."""
    from runner.worker.sampler import Sampler

    rows, vocab = base_logits.shape
    params = params_for(mode, vocab)
    sampler = Sampler(vocab, "cpu", eos_token_ids=[EOS])
    history = torch.randint(0, vocab, (rows, PROMPT_LEN), generator=g).tolist()
    reqs = requests_for(params, [h[:PROMPT_LEN // 2] for h in history])
    sampler.prepare(step_of(reqs, 0, history, 0))  # settings written; a prompt and outputs counted
    position = [PROMPT_LEN]
    logits = [base_logits]
    steps: list[SchedulerOutput] = []

    def setup() -> None:
        logits[0] = base_logits.clone()  # the sampler works in place
        p = position[0]
        steps[:] = [step_of(reqs, p, [[h[p % PROMPT_LEN]] for h in history], p)]

    def step() -> None:
        sampler.sample_step(logits[0], sampler.prepare(steps[0]))
        position[0] += 1

    setup()
    step()  # warm-up
    return {"part": "sampler", "rows": rows, "vocab": vocab, "mode": mode,
            "sample_s": round(median_time(step, repeats, setup), 5)}


def bench_draw(rows: int, vocab: int, repeats: int) -> list[dict[str, Any]]:
    """The draw alone, from the same logits: this sampler's inverse CDF (one uniform per row) against the
    exponential race vLLM's ``random_sample`` runs (``probs / Exp(1)`` noise over every token, then an argmax;
    a counter-based Gumbel-max costs a hash per token on top of the same passes)."""
    from runner.worker.sampling_noise import draw_by_inverse_cdf_

    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(1)) * 3
    uniforms = torch.rand(rows)
    work = [logits]

    def setup() -> None:
        work[0] = logits.clone()

    def race() -> None:
        probs = work[0].softmax(dim=-1)
        probs.div_(torch.empty_like(probs).exponential_()).argmax(dim=-1)

    out = []
    for name, fn in (("inverse_cdf", lambda: draw_by_inverse_cdf_(work[0], uniforms)), ("exponential_race", race)):
        out.append({"part": "draw", "rows": rows, "vocab": vocab, "mode": name,
                    "sample_s": round(median_time(fn, repeats, setup), 5)})
    return out


def bench_engine(rows_list: list[int], repeats: int) -> list[dict[str, Any]]:
    from runner.config import make_config
    from runner.worker.model_runner import ModelRunner

    top = max(rows_list)
    cfg = make_config(model=MODEL, cache_dir=tempfile.mkdtemp(prefix="bench-sampler-"), device="cpu",
                      max_num_seqs=top, max_num_batched_tokens=2 * top, num_kv_blocks=top + 1, block_size=16,
                      max_model_len=64, enforce_eager=True)
    runner = ModelRunner(cfg)
    vocab = runner.vocab_size
    spent: list[float] = []  # the sampler's calls inside a step (its penalty counts, then the sampling)

    def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            t0 = time.perf_counter()
            result = fn(*args)
            spent.append(time.perf_counter() - t0)
            return result
        return call

    runner.sampler.prepare = timed(runner.sampler.prepare)  # type: ignore[method-assign]
    # the model runner launches its sampling (the read of its results comes with the step's result)
    runner.sampler.launch_step = timed(runner.sampler.launch_step)  # type: ignore[method-assign]
    out = []
    try:
        for rows in rows_list:
            for mode in MODES:
                params = params_for(mode, vocab)
                prompt = [[(7 * i + 3) % vocab, (11 * i + 5) % vocab] for i in range(rows)]
                reqs = requests_for(params, prompt)
                runner.step(step_of(reqs, 0, prompt, 0))  # prefill
                steps, samples = [], []
                for k in range(repeats + 1):  # the first decode step is a warm-up
                    sched = step_of(reqs, 2 + k, [[(i + k) % vocab] for i in range(rows)], k + 1)
                    spent.clear()
                    t0 = time.perf_counter()
                    runner.step(sched)
                    if k:
                        steps.append(time.perf_counter() - t0)
                        samples.append(sum(spent))
                step_s, sample_s = statistics.median(steps), statistics.median(samples)
                out.append({"part": "engine", "rows": rows, "vocab": vocab, "mode": mode,
                            "sample_s": round(sample_s, 5), "step_s": round(step_s, 5),
                            "sample_pct_of_step": round(100 * sample_s / step_s, 1)})
    finally:
        runner.close()
    return out


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'part':8}{'rows':>6}{'vocab':>8}  {'mode':18}{'sample ms':>11}{'step ms':>10}{'sample %':>10}")
    for r in rows:
        step = f"{1e3 * r['step_s']:10.1f}{r['sample_pct_of_step']:10.1f}" if "step_s" in r else ""
        print(f"{r['part']:8}{r['rows']:6d}{r['vocab']:8d}  {r['mode']:18}{1e3 * r['sample_s']:11.2f}{step}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256, 1024], help="rows per decode step (default: "
                                                                                   "%(default)s)")
    ap.add_argument("--vocab", type=int, default=151936, help="vocabulary of the sampler part (default: %(default)s,"
                                                               " Qwen3's)")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per case; medians (default: %(default)s)")
    ap.add_argument("--parts", nargs="+", choices=("sampler", "draw", "engine"), default=["sampler", "draw", "engine"],
                    help="what to measure (default: %(default)s)")
    ap.add_argument("--output-csv", default=str(RESULTS_DIR / "sampler.csv"), help="default: %(default)s")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    if "sampler" in args.parts:
        for n in args.rows:
            rows += bench_sampler(n, args.vocab, args.repeats)
    if "draw" in args.parts:
        for n in args.rows:
            rows += bench_draw(n, args.vocab, args.repeats)
    if "engine" in args.parts:
        rows += bench_engine(args.rows, args.repeats)
    print_table(rows)
    engine = [r for r in rows if r["part"] == "engine"]
    if engine:
        shares = {m: [r["sample_pct_of_step"] for r in engine if r["mode"] == m] for m in MODES}
        print(f"sampler's share of a decode step ({MODEL}, {', '.join(str(n) for n in args.rows)} rows): " +
              ", ".join(f"{m} {min(v):g}-{max(v):g} %" for m, v in shares.items()))
    fields = ("part", "rows", "vocab", "mode", "sample_s", "step_s", "sample_pct_of_step")
    write_csv([{f: r.get(f, "") for f in fields} for r in rows], args.output_csv)


if __name__ == "__main__":
    main()
