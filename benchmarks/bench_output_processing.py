"""The engine client's output processing alone, per streamed token: what the API server does with each step's
engine-core outputs (``RequestTracker.process``: detokenization, stop strings, ``RequestOutput`` s, hand-over to
a sink that keeps nothing), with no server, socket or event loop around it, so its CPU is measured without the
noise of a shared machine's scheduling.

Workload: the tiny checkpoint's byte-level tokenizer (``tests/tiny_checkpoint.py``), 256 streamed (DELTA)
requests of 16 prompt ids, 64 steps of one token each; the tokens are drawn at random from the vocabulary (41 %
of it is part of a character, and about as many of a random model's greedy tokens), or with ``--whole`` only
from tokens that decode alone to whole characters (a trained model's text). Reports the process CPU
microseconds per token, the median of ``--repeats``. The runner imported is the one on ``PYTHONPATH`` (compare
checkouts with ``PYTHONPATH=<checkout> python benchmarks/bench_output_processing.py``).
"""
from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from tiny_checkpoint import build_tokenizer  # noqa: E402

from runner.core.requests import EngineCoreOutput  # noqa: E402
from runner.engine.simple_output import RequestTracker  # noqa: E402
from runner.engine.tokenizer import make_decoder  # noqa: E402
from runner.outputs import RequestOutput  # noqa: E402
from runner.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402

NUM_REQUESTS, PROMPT_LEN, STEPS = 256, 16, 64


class DiscardSink:
    """A request handler's buffer that keeps nothing."""

    def put(self, output: RequestOutput) -> None:
        pass

    def fail(self, exc: BaseException) -> None:
        pass

    def end(self) -> None:
        pass


def one_run(tokenizer, pool: list[int], seed: int) -> float:
    tracker = RequestTracker(tokenizer)
    engine_ids = iter(range(10**9))
    rng = random.Random(seed)
    for i in range(NUM_REQUESTS):
        params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        tracker.add(f"r{i}", None, [rng.randrange(3, 200) for _ in range(PROMPT_LEN)], params, DiscardSink(),
                    lambda: next(engine_ids))
    steps = [[EngineCoreOutput(i, [rng.choice(pool)], finish_reason="length" if t == STEPS - 1 else None)
              for i in range(NUM_REQUESTS)] for t in range(STEPS)]
    gc.collect()
    start = time.process_time()
    for outputs in steps:
        tracker.process(outputs, None)
    return (time.process_time() - start) / (NUM_REQUESTS * STEPS) * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--whole", action="store_true", help="only tokens that decode alone to whole characters")
    args = p.parse_args()
    tokenizer = build_tokenizer()
    decode = make_decoder(tokenizer, skip_special_tokens=True)
    pool = [t for t in range(4, len(tokenizer)) if not args.whole or "\ufffd" not in decode([t])]
    runs = [one_run(tokenizer, pool, seed) for seed in range(args.repeats)]
    print(f"output processing: {statistics.median(runs):.2f} us per token (median of {args.repeats}; "
          f"{'whole-character' if args.whole else 'random'} tokens)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
