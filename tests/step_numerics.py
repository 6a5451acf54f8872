"""How closely two runs of one forward step must agree, by what differs between them and the dtype.

- The same kernels on the same shapes (an eager fallback against the eager step, the same inputs): bit-equal
  on every device. A tolerance there would hide a real bug (a stale buffer, a wrong row).
- Different kernels or shapes (a graph replay against the eager step): the graph's decode metadata is
  ``max_blocks`` wide where the eager step's is as wide as its longest request, and the Triton decode kernel
  picks its split-KV count from that width; a padded step runs its GEMMs on more rows. Only the order of the
  sums changes, so each result moves by a few units in the last place, compounded over the layers:
  :data:`STEP_ULPS` units of the dtype's epsilon. That bound is meaningful in float32 only (1.5e-5, where a
  wrong row or stale metadata moves results by O(1)); in 16-bit every layer rounds its output, the two runs
  drift by tenths (0.02-0.04 between bf16 replay and eager on an H200), and no tolerance both passes and
  catches a bug, so such comparisons run the model in float32 (``dtype="float32"``) on every device.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

#: Units of the dtype's epsilon two reduction orders of one float32 step may differ by (relative and absolute);
#: the replay tests see at most about 12 on CPU.
STEP_ULPS = 128


def step_tolerance(dtype: torch.dtype) -> float:
    """``rtol = atol`` for two runs of one step through different kernels or shapes, computed in ``dtype``."""
    if dtype != torch.float32:
        raise ValueError(f"a step computed in {dtype} rounds every layer's output, so runs through different "
                         "kernels drift apart by more than any tolerance that still catches a bug: compare in "
                         "float32 (run the model with dtype='float32')")
    return STEP_ULPS * torch.finfo(dtype).eps


def assert_bit_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """The same kernels on the same shapes and inputs: every element equal, dtype and shape too."""
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=lambda m: f"{what} not bit-equal: {m}")


def assert_steps_close(actual: torch.Tensor, expected: torch.Tensor, what: str = "",
                       tol: float | None = None) -> None:
    """Different kernels or shapes: within :func:`step_tolerance` of the outputs' dtype, or ``tol`` if given."""
    tol = step_tolerance(expected.dtype) if tol is None else tol

    def msg(m: str) -> str:
        return f"{what}: {m}" if what else m

    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol, msg=msg)


def prefixed(where: str) -> Callable[[str], str]:
    """``torch.testing.assert_close``'s ``msg``: its own message, prefixed with ``where`` the comparison ran."""
    return lambda message: f"{where}: {message}"
