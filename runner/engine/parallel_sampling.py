"""``n > 1``: one request, n samples, as a parent with n child engine requests (vLLM's
``vllm/v1/engine/parallel_sampling.py``).

Each child is an ordinary engine request with ``n=1``. Seeds, as in vLLM: a seeded request's child ``k`` gets
``seed + k``. An unseeded child ``k`` gets the caller's default seed plus ``k * CHILD_SEED_STRIDE`` (vLLM leaves
unseeded children to the engine's global RNG; here every request has its own generator, so the children need
different seeds to differ). The stride is odd in its low 32 bits, the only bits torch's CPU generator (a
Mersenne Twister) takes from a seed, so the children's streams differ, and a child never takes the default seed
of a nearby request (``default_seed + j`` for small ``j``).
With FINAL_ONLY the parent collects the n final outputs and reports them together; when streaming, each
child's outputs go out as they come, each ``CompletionOutput`` carrying its ``index``.
"""
from __future__ import annotations

import copy

from runner.outputs import CompletionOutput
from runner.sampling_params import RequestOutputKind, SamplingParams, wrap_int64

CHILD_SEED_STRIDE = 0x9E3779B97F4A7C15  # 2**64 / the golden ratio: odd, and far from small multiples in its low bits


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The sampling parameters of child ``index`` (a copy; ``params`` is not modified)."""
    child = copy.copy(params)
    child.n = 1
    if params.seed is not None:  # wraps within 64 bits: the draws read the seed modulo 2**64 anyway
        child.seed = wrap_int64(params.seed + index)
    return child


def child_default_seed(default_seed: int, index: int) -> int:
    return (default_seed + index * CHILD_SEED_STRIDE) & 0xFFFF_FFFF_FFFF_FFFF


class ParentRequest:
    """The n children of one request: which are still running, and (FINAL_ONLY) their final outputs."""

    def __init__(self, request_id: str, params: SamplingParams, child_engine_ids: list[int]) -> None:
        self.request_id = request_id
        self.n = params.n
        self.output_kind = params.output_kind
        self.running = set(child_engine_ids)
        self.final: list[CompletionOutput | None] = [None] * self.n
        self.error: str | None = None  # the first child's error, reported as the request's

    def get_outputs(self, engine_request_id: int, output: CompletionOutput) -> tuple[list[CompletionOutput], bool]:
        """(the outputs to report now, whether the whole request finished) after a child's new output."""
        if output.finished():
            self.running.discard(engine_request_id)
        finished = not self.running
        if self.output_kind != RequestOutputKind.FINAL_ONLY:
            return [output], finished
        self.final[output.index] = output
        return ([o for o in self.final if o is not None] if finished else []), finished
