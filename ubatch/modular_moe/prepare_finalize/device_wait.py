"""A GPU kernel that waits a given number of nanoseconds of wall-clock time: the emulated link's transfer.

``torch.cuda._sleep`` counts SM clock cycles, so its duration follows the clock: an H200 idles at 345 MHz
and runs at 1980 MHz under load, and a sleep calibrated at one clock lasts 5.7x longer or shorter at the
other. This kernel instead spins on ``%globaltimer``, the GPU's nanosecond clock, which does not change
with the SM clock, so a modelled transfer takes the same time on an idle GPU, a busy one, eagerly and in a
replayed CUDA graph (the count is an argument baked into the capture, as the cycles were).

One program of one warp, compiled with the count unspecialised (one binary for every duration). Triton is
imported on first use; :func:`prepare` compiles it before any capture (a compile inside a CUDA-graph
capture would load a module mid-capture).
"""
from __future__ import annotations

from typing import Any

from ubatch.triton_runtime import import_triton, kernels_per_mode

KERNEL_NAME = "link_wait_kernel"  # what a profiler trace calls it (benchmarks find the link's time by it)


@kernels_per_mode
def _load_kernel() -> Any:
    """Decorate the kernel (once: ``kernels_per_mode``; it only runs compiled, on a GPU)."""
    triton, tl = import_triton("the emulated link on a GPU")

    @triton.jit(do_not_specialize=["ns"])
    def link_wait_kernel(ns):
        start = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                          pack=1)
        now = start
        while now - start < ns:
            now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                            pack=1)

    return link_wait_kernel


def wait_ns(ns: int) -> None:
    """Enqueue a wait of ``ns`` nanoseconds (at least 1) on the current CUDA stream."""
    if ns < 1:
        raise ValueError(f"a device wait must last at least 1 ns, got {ns}")
    _load_kernel()[(1,)](int(ns), num_warps=1)


def prepare() -> None:
    """Compile and load the kernel now (a 1 ns wait on the current stream), outside any capture."""
    wait_ns(1)
