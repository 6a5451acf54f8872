"""The engine client's output processing alone, per streamed token: what the API server does with each step's
engine-core outputs, with no server, socket or event loop around it, so its CPU is measured without the noise
of a shared machine's scheduling. Two paths are timed: ``tracker``, ``RequestTracker.process`` (detokenization,
stop strings, ``RequestOutput`` s, hand-over to a sink that keeps nothing); ``client``, all the server's client
does with a rank's message once received (``MPEngineClient._on_outputs``): the msgpack decode of the
``Outputs`` message as the rank encoded it (``CoreLoop._send_outputs``), the rank's stats, the tracker, and the
server's Prometheus metrics (``ServerMetrics``) as the metrics sink.

Workload: the tiny checkpoint's byte-level tokenizer (``tests/tiny_checkpoint.py``), 256 streamed (DELTA)
requests of 16 prompt ids, 64 steps of one token each; the tokens are drawn at random from the vocabulary (41 %
of it is part of a character, and about as many of a random model's greedy tokens), or with ``--whole`` only
from tokens that decode alone to whole characters (a trained model's text). Reports the process CPU
microseconds per token, the median of ``--repeats``, with the garbage collector tuned as in the API server
(``tune_gc``). The runner imported is the one on ``PYTHONPATH`` (compare checkouts with
``PYTHONPATH=<checkout> python benchmarks/bench_output_processing.py``).
"""
from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from discard_sink import DiscardSink
from runner.config import RunnerConfig
from runner.core.engine_core import tune_gc
from runner.core.engine_core_proc import CoreLoop
from runner.core.messages import OUTPUT_DECODER, CoreStats, Outputs
from runner.core.requests import EngineCoreOutput, EngineCoreOutputs
from runner.engine.async_llm import MPEngineClient
from runner.engine.mp_client import _Rank
from runner.engine.simple_output import RequestTracker
from runner.engine.tokenizer import make_decoder
from runner.entrypoints.openai.metrics import ServerMetrics
from runner.sampling_params import RequestOutputKind, SamplingParams
from tiny_checkpoint import build_tokenizer

NUM_REQUESTS, PROMPT_LEN, STEPS = 256, 16, 64


class RankSends:
    """What ``CoreLoop._send_outputs`` reads of its rank, so that the messages are encoded as a rank encodes
    them; ``sent`` keeps each message's bytes."""

    def __init__(self, engine_ids: range) -> None:
        self.rank = 0
        self.outs = [self]
        self.client_of = dict.fromkeys(engine_ids, 0)
        self._last_stats = [0.0]
        self.step = 0
        self.sent: list[bytes] = []

    def send(self, data: bytes) -> None:
        self.sent.append(data)

    def _stats(self) -> CoreStats:
        return CoreStats(NUM_REQUESTS, 0, 0.1 + self.step / STEPS, self.step, 0)


def engine_step(tokens: list[int], last: bool) -> EngineCoreOutputs:
    """One step's outputs as an engine core makes them: request ``i`` got ``tokens[i]``, as plain tokens, or as
    structs that finish every request (``last``)."""
    if last:
        return EngineCoreOutputs([EngineCoreOutput(i, [t], finish_reason="length") for i, t in enumerate(tokens)])
    return EngineCoreOutputs((), np.arange(len(tokens), dtype=np.int64), np.array(tokens, dtype=np.int64))


def one_run(tokenizer, pool: list[int], seed: int, path: str) -> float:
    """CPU microseconds per token of one pass over ``STEPS`` steps of ``NUM_REQUESTS`` requests along ``path``."""
    client = None
    if path == "client":  # the server's client, unstarted: its tracker, one rank without a socket, the metrics
        client = MPEngineClient(RunnerConfig(), tokenizer=tokenizer, metrics=ServerMetrics("bench", 4096))
        client._ranks.append(_Rank(None))
        tracker = client.tracker
    else:
        tracker = RequestTracker(tokenizer)
    engine_ids = iter(range(10**9))
    rng = random.Random(seed)
    for i in range(NUM_REQUESTS):
        params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        tracker.add(f"r{i}", None, [rng.randrange(3, 200) for _ in range(PROMPT_LEN)], params, DiscardSink(),
                    lambda: next(engine_ids))
        if client is not None:
            client._where[i] = 0
            client._ranks[0].outstanding += 1
    steps = [engine_step([rng.choice(pool) for _ in range(NUM_REQUESTS)], last=t == STEPS - 1) for t in range(STEPS)]
    if client is None:
        gc.collect()
        start = time.process_time()
        for outputs in steps:
            tracker.process(outputs, None)
        return (time.process_time() - start) / (NUM_REQUESTS * STEPS) * 1e6
    rank = RankSends(range(NUM_REQUESTS))
    for rank.step, outputs in enumerate(steps):
        CoreLoop._send_outputs(rank, outputs)  # type: ignore[arg-type]  # the fields it reads
    messages = rank.sent
    decode, on_outputs = OUTPUT_DECODER.decode, client._on_outputs
    gc.collect()
    start = time.process_time()
    for data in messages:
        message = decode(data)
        assert isinstance(message, Outputs), f"a rank's step sent {type(message).__name__}, not Outputs"
        on_outputs(message)
    elapsed = time.process_time() - start
    assert tracker.num_requests == 0 and client._ranks[0].outstanding == 0, "every request must have finished"
    return elapsed / (NUM_REQUESTS * STEPS) * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--whole", action="store_true", help="only tokens that decode alone to whole characters")
    p.add_argument("--path", choices=("tracker", "client", "both"), default="both",
                   help="what to time (module docstring); both: each in turn, alternating")
    args = p.parse_args()
    tokenizer = build_tokenizer()
    decode = make_decoder(tokenizer, skip_special_tokens=True)
    pool = [t for t in range(4, len(tokenizer)) if not args.whole or "\ufffd" not in decode([t])]
    tune_gc()  # the collector's settings of the API server (and of the engine cores)
    paths = ("tracker", "client") if args.path == "both" else (args.path,)
    runs: dict[str, list[float]] = {path: [] for path in paths}
    for seed in range(args.repeats):
        for path in paths:
            runs[path].append(one_run(tokenizer, pool, seed, path))
    kind = "whole-character" if args.whole else "random"
    for path in paths:
        print(f"output processing ({path}): {statistics.median(runs[path]):.2f} us per token "
              f"(median of {args.repeats}; {kind} tokens)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
