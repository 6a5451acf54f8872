"""The batched sampler: one token per row over the whole step, on the model's device, with vLLM V1's options and
order.

Every stage runs over the rows that use it at once and is skipped when none does (a step of greedy rows with no
other option is the argmax alone, with no metadata built); the only wait for the device is one read of the
results. Settings live in a per-slot table (``sampling_settings.py``), so a step is read as
arrays; a draw's uniform is a function of (seed, output index) (``sampling_noise.py``), so a row's token does
not depend on its batch, DP rank or DBO. Where the fused tails are on (CUDA), every draw is the fused kernel's
(``fused_draw.py``), eager or in a graph head. Design: docs/design_notes.md, "Model runner", "Sampler".
"""
from __future__ import annotations

import enum
import functools
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from runner.core.logprob_rows import LogprobRows, StepLogprobs
from runner.core.scheduler_output import ScheduledChunk, SchedulerOutput
from runner.sampling_params import SamplingParams
from runner.worker import sampling_ops as ops
from runner.worker.event_wait import EventWaiter
from runner.worker.fused_draw import fused_draw as draw_fused
from runner.worker.penalties import PenaltyState, apply_penalties_
from runner.worker.sampling_metadata import SamplingMetadata, SamplingRow, build_sampling_metadata, settings_of_rows
from runner.worker.sampling_noise import INVALID_TOKEN, draw_by_inverse_cdf_, row_uniforms
from runner.worker.sampling_settings import PENALTIES, RANDOM, TEMPERATURE, TOP_K, TOP_P, SamplingSettings


def request_seed(params: SamplingParams, default_seed: int) -> int:
    """The seed of a request's draws: ``params.seed`` if set, else ``default_seed`` (the engine derives it from
    the run seed and the request, so unseeded runs are reproducible too)."""
    return params.seed if params.seed is not None else default_seed


@dataclass
class SamplerOutput:
    """``token_ids[i]`` for row ``i``; ``logprobs`` the rows that asked for log-probabilities (None when none
    did; ``logprobs[i]`` is row ``i``'s, or None)."""

    token_ids: list[int]
    logprobs: StepLogprobs | None = None


class SamplingHead(enum.Enum):
    """The samplings a decode graph's heads compute (``runner/worker/cuda_graphs.py``), by the rows' settings; a row
    that draws does so from its staged settings (:meth:`Sampler.draw_inputs`).

    - ``GREEDY``: every row greedy with no other option, the argmax of the raw logits.
    - ``DRAW``: every row greedy or drawing with at most a temperature (the OpenAI API's defaults).
    - ``TOP_K``: every row greedy or drawing with a temperature and top-k of at most ``TOP_K_WIDTH``, each with or
      without top-p (a checkpoint's ``generation_config`` such as Qwen3's: 0.6, top-k 20, top-p 0.95).
    - ``TOP_P``: every row greedy or drawing with a temperature and maybe top-p without top-k, which sorts its row
      of the vocabulary (Llama 3's: 0.6, top-p 0.9).

    None of them takes min-p, a top-k above ``TOP_K_WIDTH``, penalties, a logit bias, ``min_tokens`` or logprobs,
    nor a step that mixes top-k rows with rows of top-p alone (rare: a checkpoint's defaults give every request the
    same; a head for both would run top-k's stages in every Llama step): such a step samples eagerly."""

    GREEDY = "greedy"
    DRAW = "draw"
    TOP_K = "top_k"
    TOP_P = "top_p"


#: the flags a row of a ``DRAW`` head's step may have, and of a ``TOP_K`` or ``TOP_P`` head's
_DRAW_FLAGS = RANDOM | TEMPERATURE
_TOP_K_FLAGS = _DRAW_FLAGS | TOP_K | TOP_P
#: what :meth:`Sampler.draw_inputs` stages as a greedy row's uniform (any negative value: the head takes its argmax)
GREEDY_UNIFORM = -1.0
#: the columns of :meth:`Sampler.draw_inputs`, in order, with what a row that uses none of them stages (temperature 1,
#: top-k 0 and top-p floor -1 leave its logits as they are; the uniform marks it greedy)
DRAW_COLUMNS = {"temperature": 1.0, "uniform": GREEDY_UNIFORM, "top_k": 0.0, "top_p_floor": -1.0}


@dataclass
class StepRows:
    """The rows of one step that sample, as :func:`build_sampling_metadata` reads them: settings row
    ``rows[i]`` of ``settings``, penalty slot ``slots[i]``, output index ``output_index[i]``; ``picks`` are
    their positions in the step (None: every request of the step samples, in order)."""

    settings: SamplingSettings
    rows: np.ndarray
    slots: np.ndarray
    output_index: np.ndarray
    picks: np.ndarray | None

    def __len__(self) -> int:
        return len(self.rows)

    @functools.cached_property
    def only_greedy(self) -> bool:
        """Whether every row is greedy with no other option (no penalty, bias, ``min_tokens`` or logprobs): its
        tokens are then the raw logits' argmax, which the decode graphs' greedy head computes too
        (``runner/worker/cuda_graphs.py``)."""
        return self.sampling_head is SamplingHead.GREEDY

    @functools.cached_property
    def sampling_head(self) -> SamplingHead | None:
        """The head that samples these rows as the sampler would (:class:`SamplingHead`), or None: no head does."""
        flags = self.settings.flags[self.rows]
        used = int(np.bitwise_or.reduce(flags)) if len(flags) else 0
        if not used:
            return SamplingHead.GREEDY
        if not used & ~_DRAW_FLAGS:
            return SamplingHead.DRAW
        if used & ~_TOP_K_FLAGS:
            return None
        if not used & TOP_K:  # top-p alone sorts the row
            return SamplingHead.TOP_P
        if np.any((flags & (TOP_K | TOP_P)) == TOP_P) or self.settings.top_k[self.rows].max() > ops.TOP_K_WIDTH:
            return None
        return SamplingHead.TOP_K


class Sampler:
    """One rank's sampler: the EOS ids ``min_tokens`` holds back, the requests' settings a row per request slot
    (``settings``, written once per request) and the per-slot penalty state (on ``device``)."""

    def __init__(self, vocab_size: int, device: torch.device | str, eos_token_ids: Iterable[int] = (),
                 fused_draw: bool = False) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.fused_draw = fused_draw  # draw with the fused kernel (draw_rows), as the graph heads then do
        self.penalties = PenaltyState(vocab_size, self.device)
        self.settings = SamplingSettings(vocab_size, self.eos_token_ids)
        # Seconds spent in read_back, the step's one wait for the device: the step loop subtracts it from the
        # forward side's busy time to tell the host's own work from waiting on the GPU (LoopStats.read_wait_s).
        self.read_back_s = 0.0
        self._waiter: EventWaiter | None = None  # CUDA: waits for the copies of sampled ids (event_wait.py)

    def wait_for_copy(self, event: torch.cuda.Event, timeout_s: float | None) -> None:
        """Wait for a step's copy of sampled ids to the host (its ``event``), at most ``timeout_s``."""
        if self._waiter is None:
            self._waiter = EventWaiter(self.device)
        self._waiter.wait(event, timeout_s)

    def close(self) -> None:
        """Stop the thread that waits for copies (if one was started)."""
        if self._waiter is not None:
            self._waiter.close()
            self._waiter = None

    # ---- a step of the engine -----------------------------------------------------------------------------
    def prepare(self, sched: SchedulerOutput, input_ids: torch.Tensor | None = None) -> StepRows:
        """Read one step: write the settings of requests new to their slot, feed the inputs of requests with
        penalties to their counts, and return the rows that sample. Numpy over the step's arrays; Python runs
        per request only for requests whose first chunk this is.

        ``input_ids``: the step's ``num_tokens`` input ids on the device, placeholders resolved there (the
        model runner's steps: ``sched`` may then hold placeholders); without it ``sched``'s ids must be real.

        A step built by hand from ``ScheduledChunk`` objects (tests, stand-ins; slots and prompt lengths may be
        missing) gets a table of its own, a row per chunk."""
        n = sched.num_reqs
        if sched.hand_built:
            chunks = sched.chunks
            settings = SamplingSettings.of_rows([c.sampling for c in chunks], [c.seed for c in chunks],
                                                [c.num_prompt_tokens for c in chunks], self.vocab_size,
                                                self.eos_token_ids)
            rows = np.arange(n)
        else:
            settings, rows = self.settings, sched.slots
            self._admit(sched)
        prompt_lens = settings.prompt_len[rows]
        if settings.num_penalty_rows:
            uses = settings.flags[rows] & PENALTIES
            if uses.any():
                j = np.flatnonzero(uses)
                lens = sched.query_lens
                spans = np.repeat(uses.astype(bool), lens)  # the tokens of those requests
                self.penalties.record(sched.req_ids[j], sched.slots[j], sched.num_computed[j], lens[j],
                                      prompt_lens[j], sched.token_ids[spans],
                                      None if input_ids is None else (input_ids, np.flatnonzero(spans)))
        output_index = sched.num_computed + sched.query_lens - prompt_lens
        if n and sched.sample.all():
            return StepRows(settings, rows, sched.slots, output_index, None)
        picks = np.flatnonzero(sched.sample)
        return StepRows(settings, rows[picks], sched.slots[picks], output_index[picks], picks)

    def _admit(self, sched: SchedulerOutput) -> None:
        """Write the settings row of every request of ``sched`` whose slot does not hold them yet: its first
        chunk (position 0: admission, or recompute after a preemption) or a slot another request wrote."""
        if not sched.num_reqs:
            return
        slots = sched.slots
        if slots.min() < 0:
            k = int(np.argmax(slots < 0))
            raise ValueError(f"request {int(sched.req_ids[k])} has no slot (slot={int(slots[k])}): a scheduled "
                             "step's requests keep their sampling settings per request slot")
        top = int(slots.max())
        if top >= self.settings.num_rows:
            self.settings.ensure_rows(top + 1)
        stale = self.settings.owner[slots] != sched.req_ids
        if not sched.is_uniform_decode:  # otherwise no chunk starts at position 0
            stale |= sched.num_computed == 0
        fresh = np.flatnonzero(stale)
        for i in fresh.tolist() if len(fresh) else ():
            req = sched.requests[i]
            self.settings.set(int(slots[i]), req.sampling, req.seed, len(req.prompt_token_ids),
                              int(sched.req_ids[i]))

    def sample_step(self, logits: torch.Tensor, step: StepRows) -> SamplerOutput:
        """One token per row of ``step`` from ``logits`` ``[len(step), vocab]`` (modified in place)."""
        if not len(step):
            self._check(logits, 0)
            return SamplerOutput([])
        _, pending = self.launch_step(logits, step)
        return pending.result()

    def launch_step(self, logits: torch.Tensor, step: StepRows) -> tuple[torch.Tensor, PendingSample]:
        """Sample one token per row of ``step`` (at least one) on the device without waiting for it: the
        sampled-id tensor (for the next step's placeholders) and the pending read of the results."""
        self._check(logits, len(step))
        if step.only_greedy:  # the argmax alone, in the logits' dtype (a float32 copy has the same)
            sampled = greedy_rows(logits)
            return sampled, self.launch_read(sampled)
        meta = build_sampling_metadata(step.settings, step.rows, step.slots, step.output_index, self.device)
        sampled, lp = sample_on_device(logits, meta, self.penalties, self.fused_draw)
        return sampled, PendingSample(self, meta, start_read(sampled, lp), lp is not None)

    def launch_read(self, sampled: torch.Tensor) -> PendingSample:
        """The pending read of tokens already sampled on the device (``sampled``, one per row, no logprobs): a
        graph head's."""
        return PendingSample(self, None, start_read(sampled, None), False)

    @staticmethod
    def draw_inputs(step: StepRows) -> np.ndarray:
        """What the heads that draw read for ``step``'s rows: ``[rows, 4]`` float32 in the order of
        :data:`DRAW_COLUMNS`, each row's temperature (1 for a greedy row), its draw's uniform (:data:`GREEDY_UNIFORM`
        for a greedy row), its top-k (0: none; exact in float32) and its ``1 - top_p`` (-1: none), the values
        :func:`build_sampling_metadata` gives the eager sampler, rounded to float32 the same way."""
        settings, rows = step.settings, step.rows
        uniforms = row_uniforms(settings.seed_hash[rows], step.output_index)
        columns = {"temperature": settings.temperature[rows],
                   "uniform": np.where(settings.flags[rows] & RANDOM, uniforms, GREEDY_UNIFORM),
                   "top_k": settings.top_k[rows], "top_p_floor": settings.top_p_floor[rows]}
        return np.stack([columns[name] for name in DRAW_COLUMNS], axis=1).astype(np.float32)

    # ---- rows given by hand -------------------------------------------------------------------------------
    def record_inputs(self, chunks: Sequence[ScheduledChunk]) -> None:
        """Feed the resolved input tokens of chunks given by hand to the penalty counts (before sampling)."""
        self.penalties.record_inputs(chunks)

    def metadata(self, rows: Sequence[SamplingRow]) -> SamplingMetadata:
        return build_sampling_metadata(*settings_of_rows(rows, self.vocab_size, self.eos_token_ids), self.device)

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """One token per row of ``logits`` ``[len(rows), vocab]`` (modified in place)."""
        self._check(logits, len(rows))
        if not rows:
            return SamplerOutput([])
        meta = self.metadata(rows)
        return self._read_back(meta, *sample_on_device(logits, meta, self.penalties, self.fused_draw))

    def _read_back(self, meta: SamplingMetadata, sampled: torch.Tensor,
                   lp: tuple[torch.Tensor, ...] | None) -> SamplerOutput:
        t0 = time.perf_counter()
        try:
            return read_back(meta, sampled, lp)
        finally:
            self.read_back_s += time.perf_counter() - t0

    def _check(self, logits: torch.Tensor, num_rows: int) -> None:
        if logits.dim() != 2 or logits.shape[1] != self.vocab_size:
            raise ValueError(f"logits must be [num_rows, {self.vocab_size}], got shape {tuple(logits.shape)}")
        if logits.shape[0] != num_rows:
            raise ValueError(f"got {logits.shape[0]} logit rows but {num_rows} rows to sample")


def sample_on_device(logits: torch.Tensor, meta: SamplingMetadata, penalties: PenaltyState | None = None,
                     fused: bool = False) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """The sampled ids ``[rows]`` and, when asked, the logprob tensors (sampled logprob, rank, top ids, top
    logprobs over the logprob rows); nothing is read back here. ``fused``: draw with the fused kernel
    (:func:`draw_rows`)."""
    lp = None
    if meta.wants_logprobs:
        lp = ops.raw_logprobs(logits if meta.logprob_rows is None else logits.index_select(0, meta.logprob_rows))
    x = logits if logits.dtype == torch.float32 else logits.float()
    if meta.stop_mask is not None:
        ops.mask_tokens_(x, *meta.stop_mask)
    if meta.bias is not None:
        ops.add_logit_bias_(x, *meta.bias)
    if meta.has_penalties:
        if penalties is None or penalties.counts is None or penalties.seen is None:
            raise RuntimeError("rows use penalties but the sampler has no penalty counts (record_inputs was not "
                               "called for their steps)")
        slots = meta.penalty_slots
        assert slots is not None
        counts = penalties.counts.index_select(0, slots)
        seen = penalties.seen.index_select(0, slots) if meta.repetition is not None else None
        ops.on_rows_(x, meta.penalty_rows, lambda sub: apply_penalties_(
            sub, counts, seen, meta.repetition, meta.frequency, meta.presence))
    sampled = None if meta.num_random == meta.num_rows else greedy_rows(x)
    if meta.num_random:
        xr = x if meta.random_rows is None else x.index_select(0, meta.random_rows)
        if meta.temperature is not None:
            ops.apply_temperature_(xr, meta.temperature)
        min_p, top_k, top_p_floor = meta.min_p, meta.top_k, meta.top_p_floor
        if min_p is not None:
            ops.on_rows_(xr, meta.min_p_rows, lambda sub: ops.apply_min_p_(sub, min_p))
        if top_k is not None:
            ops.on_rows_(xr, meta.top_k_rows,
                         lambda sub: ops.apply_top_k_(sub, top_k, meta.top_k_width, meta.top_k_p_floor))
        if top_p_floor is not None:
            ops.on_rows_(xr, meta.top_p_rows, lambda sub: ops.apply_top_p_(sub, top_p_floor))
        assert meta.uniforms is not None
        drawn = draw_rows(xr, meta.uniforms, fused)
        if sampled is None:
            sampled = drawn
        else:  # some rows greedy: the random ones are a subset, named by random_rows
            assert meta.random_rows is not None
            sampled = sampled.index_copy_(0, meta.random_rows, drawn)
    assert sampled is not None
    if lp is None:
        return sampled, None
    chosen = sampled if meta.logprob_rows is None else sampled.index_select(0, meta.logprob_rows)
    logprob, rank = ops.token_logprobs(lp, chosen)
    top = lp.topk(meta.max_logprobs, dim=-1) if meta.max_logprobs else None
    return sampled, (logprob, rank, *((top.indices, top.values) if top is not None else ()))


def draw_rows(logits: torch.Tensor, uniforms: torch.Tensor, fused: bool) -> torch.Tensor:
    """Each row's draw from ``softmax(logits)`` by its uniform: the fused kernel where ``fused``
    (:func:`~runner.worker.fused_draw.fused_draw`, reads ``logits``), else the torch ops
    (:func:`~runner.worker.sampling_noise.draw_by_inverse_cdf_`, overwrites them). The two round differently, so
    one process draws every row one way."""
    return draw_fused(logits, uniforms) if fused else draw_by_inverse_cdf_(logits, uniforms)


def greedy_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, or ``INVALID_TOKEN`` where the row's largest logit is not finite
    (``sampling_ops.greedy_tokens``: the value at the argmax is read, so the check costs no pass over the
    vocabulary)."""
    return ops.greedy_tokens(logits, INVALID_TOKEN)


def read_back(meta: SamplingMetadata, sampled: torch.Tensor,
              lp: tuple[torch.Tensor, ...] | None) -> SamplerOutput:
    """The one host read of a step's sampling: the sampled ids, or, when some row asked for logprobs, every
    result packed into one float64 tensor (token ids and ranks are below 2**53, so exact), copied once."""
    if lp is None:
        return SamplerOutput(sampled.tolist())  # the step's only wait for the device
    return unpack(meta, _packed(sampled, lp).cpu().numpy())


def _packed(sampled: torch.Tensor, lp: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.cat([sampled.to(torch.float64), *(t.to(torch.float64).reshape(-1) for t in lp)])


@dataclass
class HostCopy:
    """A device tensor's copy on its way to the host: ``host`` (pinned on CUDA) is valid once ``event`` has
    completed (None: already valid, the CPU)."""

    host: torch.Tensor
    event: torch.cuda.Event | None


def start_read(sampled: torch.Tensor, lp: tuple[torch.Tensor, ...] | None) -> HostCopy:
    """Start copying a step's results (the sampled ids, or every result packed as in :func:`read_back`) to the
    host: on CUDA a ``non_blocking`` copy into pinned memory and an event after it; nothing waits here."""
    packed = sampled if lp is None else _packed(sampled, lp)
    if packed.device.type != "cuda":  # a copy too: ``sampled`` may be a graph's output, rewritten by its next replay
        return HostCopy(packed.clone() if lp is None else packed, None)
    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
    host.copy_(packed, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return HostCopy(host, event)


class PendingSample:
    """The sampling of a launched step; :meth:`result` waits for its copy and reads it (once)."""

    def __init__(self, sampler: Sampler, meta: SamplingMetadata | None, copy: HostCopy, has_logprobs: bool) -> None:
        if has_logprobs and meta is None:
            raise ValueError("a sampling with logprobs needs its metadata to unpack them")
        self.sampler, self.meta, self.copy, self.has_logprobs = sampler, meta, copy, has_logprobs

    def result(self, timeout_s: float | None = None) -> SamplerOutput:
        t0 = time.perf_counter()
        try:
            if self.copy.event is not None:
                self.sampler.wait_for_copy(self.copy.event, timeout_s)
            if self.meta is None or not self.has_logprobs:
                return SamplerOutput(self.copy.host.tolist())  # on the CPU, the step's wait for the forward
            return unpack(self.meta, self.copy.host.numpy())
        finally:
            self.sampler.read_back_s += time.perf_counter() - t0


def unpack(meta: SamplingMetadata, values: np.ndarray) -> SamplerOutput:
    """A :class:`SamplerOutput` from the packed float64 results of :func:`read_back` (sampled ids, then the
    logprob rows' logprob, rank, top ids and top logprobs), the logprob rows as arrays (numpy slices of the
    packed values, no Python per row)."""
    n = meta.num_rows
    ids = values[:n].astype(np.int64)
    num = len(meta.logprob_row_ids)
    k = meta.max_logprobs
    positions = np.array(meta.logprob_row_ids, dtype=np.int64)
    logprob, rank = values[n:n + num], values[n + num:n + 2 * num]
    top_ids, top_lps = values[n + 2 * num:n + 2 * num + num * k], values[n + 2 * num + num * k:]
    rows = LogprobRows.of(ids[positions], logprob, rank.astype(np.int64), top_ids.astype(np.int64).reshape(num, k),
                          top_lps.reshape(num, k))
    return SamplerOutput(ids.tolist(), StepLogprobs(positions, np.array(meta.num_logprobs, dtype=np.int64), rows, n))
