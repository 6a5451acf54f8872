"""A model runner stand-in that checks the scheduler's bookkeeping while it "generates".

Its "KV cache" stores token ids in the slots the scheduler's block tables point at, and its "model" reads a
request's whole history back *from those slots*: a wrong block table, a block shared by two live requests or
a wrong position therefore changes the output, which the tests compare with :func:`reference_generate` (the
same function applied to the true history). Logits are a deterministic function of the history and go
through the real sampler, one batched call per step read from the step's arrays as the model runner reads it
(``Sampler.prepare``: settings a row per request slot, penalty counts per slot from the resolved inputs), while
the reference samples each request alone from settings given by hand and counts its history from scratch at
every token, so a settings row or penalty slot that is not written, reset or fed right changes the tokens.
"""
from __future__ import annotations

import zlib
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

from future_token_map import FutureTokenMap
from runner.core.overlap_loop import ForwardExecutor, LoopStats, OnResults, StepLauncher, make_step_loop
from runner.core.runner_output import ModelRunnerOutput, PendingStep
from runner.core.runner_protocol import ModelRunnerProtocol
from runner.core.scheduler import Scheduler
from runner.core.scheduler_output import SchedulerOutput
from runner.sampling_params import SamplingParams
from runner.worker.dbo_step_timing import MeasuredDBO
from runner.worker.sampler import Sampler, request_seed
from runner.worker.sampling_metadata import RowSpec
from ubatch import trace


def logits_for(history: Sequence[int], vocab_size: int) -> torch.Tensor:
    seed = zlib.crc32(bytes(str(list(history)), "ascii"))
    return torch.randn(vocab_size, generator=torch.Generator().manual_seed(seed)) * 3.0


def set_penalty_counts(sampler: Sampler, slot: int, prompt: Sequence[int], outputs: Sequence[int]) -> None:
    """Write one slot's penalty state from scratch: output-token counts, tokens seen in prompt or output."""
    sampler.penalties.ensure_slots(slot + 1)
    counts, seen = sampler.penalties.counts, sampler.penalties.seen
    assert counts is not None and seen is not None
    counts[slot] = torch.bincount(torch.tensor(list(outputs), dtype=torch.int64), minlength=sampler.vocab_size)
    seen[slot] = torch.bincount(torch.tensor(list(prompt) + list(outputs), dtype=torch.int64),
                                minlength=sampler.vocab_size) > 0


def reference_generate(prompt: list[int], params: SamplingParams, vocab_size: int, seed: int,
                       eos: Collection[int] = frozenset(), max_model_len: int = 10**9) -> tuple[list[int], str]:
    """One request alone, token by token, its penalty counts rebuilt from its history before every draw."""
    assert params.max_tokens is not None, "the reference needs max_tokens set"
    sampler = Sampler(vocab_size, "cpu", eos)
    history, out = list(prompt), list[int]()
    while True:
        if params.uses_penalties:
            set_penalty_counts(sampler, 0, prompt, out)
        row = RowSpec(params, request_seed(params, seed), output_index=len(out), slot=0)
        tok = sampler.sample(logits_for(history, vocab_size)[None], [row]).token_ids[0]
        out.append(tok)
        history.append(tok)
        if (not params.ignore_eos and tok in eos) or tok in (params.stop_token_ids or []):
            return out, "stop"
        if len(out) >= params.max_tokens or len(history) >= max_model_len:
            return out, "length"


def forward_step(runner: FakeRunner, future_map: FutureTokenMap, out: SchedulerOutput) -> ModelRunnerOutput | None:
    """The forward side of one step of a runner that computes on the host: resolve ``out``'s placeholders from
    ``future_map``, run it, store what it sampled under each request's slot for the next step."""
    with trace.region("resolve", "step", track="step"):
        resolved = future_map.resolve(out)
    output = runner.step(resolved)
    with trace.region("store", "step", track="step"):
        if output is not None and output.sampled_token_ids:
            future_map.store_sampled(out, output.sampled_token_ids)
    return output


class FakeRunner:
    """A :class:`~runner.core.runner_protocol.ModelRunnerProtocol` whose steps compute on the host: one rank, no
    device of its own, no DBO cost model, no emulated link. :meth:`launch` resolves placeholders from its own
    host future-token map and computes the step at once (a ready :class:`PendingStep`); :meth:`step` computes
    a step whose inputs are real tokens (subclasses override it to watch or gate steps)."""

    rank, world_size = 0, 1
    device: torch.device | None = None
    num_ubatched_steps = 0
    cost_model: MeasuredDBO | None = None

    def __init__(self, vocab_size: int = 64, block_size: int = 4, num_kv_blocks: int = 64,
                 max_model_len: int = 256, eos_token_ids: Sequence[int] = ()) -> None:
        self.vocab_size, self.block_size, self.num_kv_blocks = vocab_size, block_size, num_kv_blocks
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.sampler = Sampler(vocab_size, "cpu", self.eos_token_ids)
        self.cache = [-1] * (num_kv_blocks * block_size)
        self.num_steps = 0
        self.steps: list[SchedulerOutput] = []
        self.future_map = FutureTokenMap(1)  # grows to the slots the scheduler names

    @property
    def num_placeholders_resolved(self) -> int:
        return self.future_map.num_resolved

    def launch(self, sched: SchedulerOutput) -> PendingStep | None:
        output = forward_step(self, self.future_map, sched)
        return None if output is None else PendingStep.ready(output)

    def step(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        if not sched.chunks:
            return None
        self.steps.append(sched)
        self.num_steps += 1
        # Requests may share blocks of a cached prefix, which they only read; a block written in this step must be
        # its writer's alone.
        holders: dict[int, set[int]] = {}
        for c in sched.chunks:
            for b in c.block_ids:
                holders.setdefault(b, set()).add(c.req_id)
        for c in sched.chunks:
            first, last = c.num_computed_tokens // self.block_size, (c.num_computed_tokens + len(c.token_ids) - 1) \
                // self.block_size
            for b in c.block_ids[first:last + 1]:
                assert holders[b] == {c.req_id}, f"block {b} written by {c.req_id} is shared with {holders[b]}"
        rows = self.sampler.prepare(sched)  # as the model runner: settings per slot, penalty inputs recorded
        picks, logits = [], []
        for i, c in enumerate(sched.chunks):
            end = c.num_computed_tokens + len(c.token_ids)
            assert len(c.block_ids) * self.block_size >= end, "not enough blocks for the chunk"
            for j, tok in enumerate(c.token_ids):
                self.cache[self._slot(c.block_ids, c.num_computed_tokens + j)] = tok
            if c.sample:
                picks.append(i)
                logits.append(logits_for([self.cache[self._slot(c.block_ids, p)] for p in range(end)],
                                         self.vocab_size))
        results: list[int | None] = [None] * len(sched.chunks)
        if picks:
            assert (rows.picks.tolist() if rows.picks is not None else list(range(len(sched.chunks)))) == picks
            out = self.sampler.sample_step(torch.stack(logits), rows)
            for i, tok in zip(picks, out.token_ids, strict=True):
                results[i] = tok
        return ModelRunnerOutput(results)

    def link_times(self) -> tuple[float, float] | None:
        return None

    def close(self) -> None:
        pass

    def _slot(self, blocks: list[int], pos: int) -> int:
        return blocks[pos // self.block_size] * self.block_size + pos % self.block_size


def run_wave(sched: Any, runner: Any, overlap: bool, before_launch: Any = None) -> None:
    """Run ``sched``'s steps on ``runner`` to the end of the wave, with the overlap loop's forward thread when
    ``overlap`` (closed afterwards), else the synchronous loop."""
    executor = ForwardExecutor() if overlap else None
    try:
        run_steps(sched, runner, executor=executor, before_launch=before_launch)
    finally:
        if executor is not None:
            executor.close()


def run_steps(sched: Scheduler, runner: ModelRunnerProtocol, *, executor: StepLauncher | None = None,
              consecutive_prefill_overlap: bool = True, before_launch: Callable[[int], None] | None = None,
              on_results: OnResults | None = None, step_timeout_s: float | None = None) -> LoopStats:
    """Step ``sched`` until no DP rank has work (:func:`make_step_loop`'s arguments); returns the loop's stats."""
    loop = make_step_loop(sched, runner, executor=executor, consecutive_prefill_overlap=consecutive_prefill_overlap,
                          before_launch=before_launch, on_results=on_results, step_timeout_s=step_timeout_s)
    try:
        while loop.step():
            pass
    finally:
        stats = loop.finish()
    return stats
