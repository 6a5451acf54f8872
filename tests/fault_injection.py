"""Inject a fault into a real ``python -m runner`` run, without any test hook in production code.

    python tests/fault_injection.py RANK STEP ACTION -- generate -dp 2 ...

runs the CLI unchanged, except that each rank process (the engine-core process the CLI starts,
``runner.core.engine_core_proc.run_engine_core``) first wraps the engine core's ``make_step_loop`` so that its
``before_launch`` hook (a parameter the step loop has anyway) also fires the fault: on rank ``RANK``
(``all``: every rank), before step ``STEP``, it prints ``fault: rank R step S ACTION`` to stderr, then

- ``SIGKILL`` / ``SIGSTOP`` / any signal name: sends that signal to its own process;
- ``hold:PATH``: waits until PATH exists (the test's go-ahead), keeping the rank busy for as long as the test
  needs it to be (to read its sockets, or to signal the parent mid-run).

The wrapped rank body travels to the spawned ranks as a ``functools.partial`` of this module's function, which
they import by name (spawned children get the parent's ``sys.path``, whose first entry is this directory).
"""
from __future__ import annotations

import functools
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

HOLD_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Fault:
    rank: int | None  # None: every rank
    step: int
    action: str

    def fire(self, rank: int, step: int) -> None:
        sys.stderr.write(f"fault: rank {rank} step {step} {self.action}\n")  # one write: ranks share the pipe
        sys.stderr.flush()
        if self.action.startswith("hold:"):
            path = self.action[len("hold:"):]
            deadline = time.monotonic() + HOLD_TIMEOUT_S
            while not os.path.exists(path):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"fault_injection: rank {rank} waited {HOLD_TIMEOUT_S:.0f} s for the test to "
                                       f"create {path}")
                time.sleep(0.05)
            return
        os.kill(os.getpid(), signal.Signals[self.action])


def run_engine_core_with_fault(fault: Fault, *args: Any) -> None:
    """``runner.core.engine_core_proc.run_engine_core`` with ``fault`` wired into the engine loop's
    ``before_launch`` hook."""
    import runner.core.engine_core as engine_core
    from runner.core.engine_core_proc import run_engine_core

    rank = int(os.environ.get("RANK", "0"))
    original = engine_core.make_step_loop

    def make_step_loop(*args: Any, before_launch: Any = None, **kwargs: Any) -> Any:
        def hook(step: int) -> None:
            if before_launch is not None:
                before_launch(step)
            if step == fault.step and fault.rank in (None, rank):
                fault.fire(rank, step)

        return original(*args, before_launch=hook, **kwargs)

    engine_core.make_step_loop = make_step_loop
    run_engine_core(*args)


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[3] != "--":
        raise SystemExit("usage: fault_injection.py RANK|all STEP ACTION -- <python -m runner arguments>")
    rank, step, action = argv[0], int(argv[1]), argv[2]
    import runner.core.engine_core_proc
    import runner.entrypoints.cli

    fault = Fault(None if rank == "all" else int(rank), step, action)
    # what the engine client hands to every rank process it starts
    runner.core.engine_core_proc.run_engine_core = functools.partial(run_engine_core_with_fault, fault)
    return runner.entrypoints.cli.main(argv[4:])


if __name__ == "__main__":
    from fault_injection import main as importable_main  # so the partial pickles as fault_injection.*, not __main__

    sys.exit(importable_main(sys.argv[1:]))
