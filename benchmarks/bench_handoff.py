"""Per-handoff cost of the ping-pong: ubatch's wrapper vs a vLLM-style Event pair vs generators.

All mechanisms are measured side by side in one run, idle and with the other core kept busy by a separate
process, as medians of repeated runs. A handoff is one ``dbo_yield``: control passes from one ubatch to
the other. Usage: ``python benchmarks/bench_handoff.py [--handoffs 20000] [--repeats 7]``.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import write_csv
from ubatch import UBatchConfig, UBatchSlice, UBatchWrapper, dbo_yield, set_forward_context


def wrapper_handoffs(n: int, executor: str = "greenlet") -> float:
    """The project's handoff exactly as UBatchWrapper runs it (default executor: greenlet)."""
    yields = n // 2

    def model(x: torch.Tensor) -> torch.Tensor:
        for _ in range(yields):
            dbo_yield()
        return x

    w = UBatchWrapper(model, UBatchConfig(executor=executor))
    x = torch.zeros(2)
    slices = [UBatchSlice(slice(0, 1), slice(0, 1)), UBatchSlice(slice(1, 2), slice(1, 2))]
    with set_forward_context(ubatch_slices=slices):
        w(x)  # warm the threads
        t0 = time.perf_counter()
        w(x)
        dt = time.perf_counter() - t0
    w.close()
    return dt / (2 * yields)


def event_pair_handoffs(n: int) -> float:
    """vLLM's UBatchContext handoff: set the other's Event, wait on our own, clear it."""
    events = [threading.Event(), threading.Event()]
    rounds = n // 2

    def body(me: int) -> None:
        other = 1 - me
        for _ in range(rounds):
            events[me].wait()
            events[me].clear()
            events[other].set()

    threads = [threading.Thread(target=body, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    events[0].set()
    for t in threads:
        t.join()
    return (time.perf_counter() - t0) / (2 * rounds)


def lock_pair_handoffs(n: int) -> float:
    """The raw primitive under the wrapper: a Lock per thread used as a binary semaphore."""
    locks = [threading.Lock(), threading.Lock()]
    for lock in locks:
        lock.acquire()
    rounds = n // 2

    def body(me: int) -> None:
        other = 1 - me
        for _ in range(rounds):
            locks[me].acquire()
            locks[other].release()

    threads = [threading.Thread(target=body, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    locks[0].release()
    for t in threads:
        t.join()
    return (time.perf_counter() - t0) / (2 * rounds)


def generator_handoffs(n: int) -> float:
    """SGLang TBO style: one thread advances two generators alternately."""
    rounds = n // 2

    def gen() -> Iterator[None]:
        for _ in range(rounds):
            yield

    gens = [gen(), gen()]
    t0 = time.perf_counter()
    for _ in range(rounds):
        next(gens[0])
        next(gens[1])
    return (time.perf_counter() - t0) / (2 * rounds)


MECHANISMS: dict[str, Callable[[int], float]] = {
    "ubatch wrapper (default: greenlet)": wrapper_handoffs,
    "ubatch wrapper (executor=threads)": lambda n: wrapper_handoffs(n, "threads"),
    "Event pair (vLLM style)": event_pair_handoffs,
    "Lock pair (raw)": lock_pair_handoffs,
    "generators, one thread": generator_handoffs,
}


def _spin() -> None:
    while True:
        pass


def measure(handoffs: int, repeats: int) -> dict[str, float]:
    out = {}
    for name, fn in MECHANISMS.items():
        fn(min(handoffs, 1000))  # warm-up
        out[name] = statistics.median(fn(handoffs) for _ in range(repeats)) * 1e6
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--handoffs", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--csv", default=str(Path(__file__).parent / "results" / "handoff.csv"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = {"idle": measure(args.handoffs, args.repeats)}
    busy = mp.get_context("spawn").Process(target=_spin, daemon=True)
    busy.start()
    try:
        time.sleep(0.5)
        results["other core busy"] = measure(args.handoffs, args.repeats)
    finally:
        busy.terminate()
    baseline = "Event pair (vLLM style)"
    print(f"machine: {os.cpu_count()} cores, torch {torch.__version__}; median of {args.repeats} runs x "
          f"{args.handoffs} handoffs")
    header = f"{'mechanism':36s} | {'condition':15s} | {'us/handoff':>10s} | {'Event pair / this':>17s}"
    print(header + "\n" + "-" * len(header))
    rows = []
    for cond, res in results.items():
        for name, us in res.items():
            ratio = res[baseline] / us
            rows.append({"mechanism": name, "condition": cond, "us_per_handoff": round(us, 3),
                         "event_pair_over_this": round(ratio, 2)})
            print(f"{name:36s} | {cond:15s} | {us:10.2f} | {ratio:16.1f}x")
    write_csv(rows, args.csv)


if __name__ == "__main__":
    main()
