"""One step's sampling settings as per-row device tensors, built on the host with numpy over the batch.

The sampler works on the rows that sample in a step. Their settings live in a :class:`SamplingSettings` table
(a row per request slot in the engine, written when the request arrived); :func:`build_sampling_metadata`
gathers the step's rows from it with numpy, one stage at a time and only for the stages the step's OR-ed
flags say some row needs, packs everything into one int64 and one float32 host array, copies each to the
device once through pinned memory (``host_to_device``, as the attention metadata) and slices it into
per-stage views. A stage that no row uses gets None and is skipped; a stage that only some rows use carries
the index of those rows, so a row whose settings are all off costs nothing beyond the batched argmax (greedy)
or draw (random). Python runs per row only for the rows that need per-row data: ``min_tokens`` stop tokens
(while the row is below ``min_tokens``) and ``logit_bias`` entries (concatenated), and the logprob rows'
counts.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from runner.attention.kv_cache import host_to_device
from runner.sampling_params import SamplingParams
from runner.worker.sampling_noise import row_uniforms
from runner.worker.sampling_ops import TOP_K_WIDTH
from runner.worker.sampling_settings import (
    LOGIT_BIAS,
    LOGPROBS,
    MIN_P,
    MIN_TOKENS,
    PENALTIES,
    RANDOM,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    SamplingSettings,
)


class SamplingRow(Protocol):
    """What the sampler reads of a row: a ``ScheduledChunk`` is one."""

    sampling: SamplingParams
    seed: int
    slot: int

    @property
    def output_index(self) -> int: ...


@dataclass
class RowSpec:
    """A row given by hand (tests, benchmarks, reference generation): its settings, seed, output index and
    penalty slot."""

    sampling: SamplingParams
    seed: int = 0
    output_index: int = 0
    slot: int = -1


@dataclass
class SamplingMetadata:
    """Per-row settings of one step's ``num_rows`` sampled rows, on the device.

    Row subsets are index tensors into the batch (``*_rows``) or, for the warpers, into the random rows; None
    means "all of them". A setting tensor that is None means no row in its subset uses it.
    """

    num_rows: int
    num_random: int  # rows that draw (temperature > 0); the others take the argmax
    random_rows: torch.Tensor | None  # [num_random] batch rows that draw; None: every row draws
    uniforms: torch.Tensor | None  # [num_random] float32: each draw's uniform, from (seed, output index)
    temperature: torch.Tensor | None  # [num_random] float32; None: all 1.0
    min_p_rows: torch.Tensor | None  # indices into the random rows
    min_p: torch.Tensor | None
    top_k_rows: torch.Tensor | None  # indices into the random rows with top-k (and maybe top-p)
    top_k: torch.Tensor | None  # int64 in [1, vocab)
    top_k_width: int  # how many of each row's largest logits top-k gathers: the largest k, at least TOP_K_WIDTH
    top_k_p_floor: torch.Tensor | None  # their 1 - top_p (-1: no top-p); None: none of them has top-p
    top_p_rows: torch.Tensor | None  # indices into the random rows with top-p and no top-k
    top_p_floor: torch.Tensor | None  # float32: 1 - top_p
    stop_mask: tuple[torch.Tensor, torch.Tensor] | None  # (rows, tokens) masked while below min_tokens
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, tokens, values)
    penalty_rows: torch.Tensor | None  # batch rows with a penalty
    penalty_slots: torch.Tensor | None  # their request slots (rows of the penalty state)
    repetition: torch.Tensor | None
    frequency: torch.Tensor | None
    presence: torch.Tensor | None
    logprob_rows: torch.Tensor | None  # batch rows that asked for logprobs
    logprob_row_ids: list[int]  # the same, on the host
    num_logprobs: list[int]  # top-N asked per logprob row
    max_logprobs: int

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.logprob_row_ids)

    @property
    def has_penalties(self) -> bool:
        return self.penalty_slots is not None


class _Pack:
    """Host arrays packed into one int64 and one float32 array, one pinned copy each, then sliced by name."""

    def __init__(self) -> None:
        self._ints: list[np.ndarray] = []
        self._floats: list[np.ndarray] = []
        self._num_ints = self._num_floats = 0
        self._spans: dict[str, tuple[bool, int, int]] = {}

    def ints(self, name: str, values: np.ndarray) -> None:
        self._spans[name] = (True, self._num_ints, len(values))
        self._ints.append(values)
        self._num_ints += len(values)

    def floats(self, name: str, values: np.ndarray) -> None:
        self._spans[name] = (False, self._num_floats, len(values))
        self._floats.append(values)
        self._num_floats += len(values)

    def to_device(self, device: torch.device) -> dict[str, torch.Tensor]:
        ints = _one_copy(self._ints, np.int64, device)
        floats = _one_copy(self._floats, np.float32, device)
        views = {}
        for name, (is_int, start, n) in self._spans.items():
            src = ints if is_int else floats
            assert src is not None
            views[name] = src[start:start + n]
        return views


def _one_copy(parts: list[np.ndarray], dtype: type, device: torch.device) -> torch.Tensor | None:
    if not parts:
        return None
    host: np.ndarray = np.concatenate(parts).astype(dtype, copy=False) if len(parts) > 1 else parts[0].astype(dtype)
    return host_to_device(torch.from_numpy(host), device)


def _subset(pack: _Pack, name: str, rows: np.ndarray, total: int) -> None:
    """Pack ``rows`` as an index unless it is every row (then the stage runs on the whole tensor)."""
    if len(rows) != total:
        pack.ints(name, rows)


def build_sampling_metadata(settings: SamplingSettings, rows: np.ndarray, slots: np.ndarray,
                            output_index: np.ndarray, device: torch.device | str) -> SamplingMetadata:
    """The metadata of a step whose sampled row ``i`` (logits row ``i``) has its settings in ``settings``'s
    row ``rows[i]``, its penalty counts in request slot ``slots[i]`` and samples its ``output_index[i]``-th
    output (0: its first), which picks the draw's uniform and says whether ``min_tokens`` still applies."""
    device = torch.device(device)
    n = len(rows)
    flags = settings.flags[rows]
    used = int(np.bitwise_or.reduce(flags)) if n else 0
    pack = _Pack()
    num_random, top_k_width = 0, 0
    if used & RANDOM:
        r = np.flatnonzero(flags & RANDOM)
        num_random = len(r)
        r_rows, r_flags = rows[r], flags[r]
        _subset(pack, "random_rows", r, n)
        pack.floats("uniforms", row_uniforms(settings.seed_hash[r_rows], output_index[r]))
        if used & TEMPERATURE:
            pack.floats("temperature", settings.temperature[r_rows])
        if used & MIN_P:
            j = np.flatnonzero(r_flags & MIN_P)
            _subset(pack, "min_p_rows", j, num_random)
            pack.floats("min_p", settings.min_p[r_rows[j]])
        if used & TOP_K:
            j = np.flatnonzero(r_flags & TOP_K)
            top_k = settings.top_k[r_rows[j]]
            top_k_width = max(int(top_k.max()), min(TOP_K_WIDTH, settings.vocab_size))
            _subset(pack, "top_k_rows", j, num_random)
            pack.ints("top_k", top_k)
            if np.any(r_flags[j] & TOP_P):
                pack.floats("top_k_p_floor", settings.top_p_floor[r_rows[j]])
        if used & TOP_P:
            j = np.flatnonzero((r_flags & (TOP_P | TOP_K)) == TOP_P)  # top-p without top-k
            if len(j):
                _subset(pack, "top_p_rows", j, num_random)
                pack.floats("top_p_floor", settings.top_p_floor[r_rows[j]])
    stop_mask = bias = False
    if used & MIN_TOKENS:
        j = np.flatnonzero(flags & MIN_TOKENS)
        j = j[output_index[j] < settings.min_tokens[rows[j]]]  # still below min_tokens
        stop_mask = _ragged(pack, "stop", j, [settings.stop_tokens[t] for t in rows[j].tolist()])
    if used & LOGIT_BIAS:
        j = np.flatnonzero(flags & LOGIT_BIAS)
        entries = [settings.bias[t] for t in rows[j].tolist()]
        bias = _ragged(pack, "bias", j, [e[0] for e in entries])
        if bias:
            pack.floats("bias_vals", np.concatenate([e[1] for e in entries]))
    if used & PENALTIES:
        j = np.flatnonzero(flags & PENALTIES)
        pen_slots = slots[j]
        if pen_slots.min() < 0:
            k = int(j[np.argmax(pen_slots < 0)])
            raise ValueError(f"row {k} uses penalties but has no request slot (slot={int(slots[k])})")
        _subset(pack, "penalty_rows", j, n)
        pack.ints("penalty_slots", pen_slots)
        pen_rows = rows[j]
        for name, values, off in (("repetition", settings.repetition, 1.0), ("frequency", settings.frequency, 0.0),
                                  ("presence", settings.presence, 0.0)):
            v = values[pen_rows]
            if np.any(v != off):
                pack.floats(name, v)
    lp_rows: list[int] = []
    lp_n: list[int] = []
    if used & LOGPROBS:
        j = np.flatnonzero(flags & LOGPROBS)
        _subset(pack, "logprob_rows", j, n)
        lp_rows, lp_n = j.tolist(), settings.logprobs[rows[j]].tolist()
    v = pack.to_device(device)
    return SamplingMetadata(
        num_rows=n, num_random=num_random, random_rows=v.get("random_rows"), uniforms=v.get("uniforms"),
        temperature=v.get("temperature"), min_p_rows=v.get("min_p_rows"), min_p=v.get("min_p"),
        top_k_rows=v.get("top_k_rows"), top_k=v.get("top_k"), top_k_width=top_k_width,
        top_k_p_floor=v.get("top_k_p_floor"), top_p_rows=v.get("top_p_rows"), top_p_floor=v.get("top_p_floor"),
        stop_mask=(v["stop_rows"], v["stop_toks"]) if stop_mask else None,
        bias=(v["bias_rows"], v["bias_toks"], v["bias_vals"]) if bias else None,
        penalty_rows=v.get("penalty_rows"), penalty_slots=v.get("penalty_slots"), repetition=v.get("repetition"),
        frequency=v.get("frequency"), presence=v.get("presence"), logprob_rows=v.get("logprob_rows"),
        logprob_row_ids=lp_rows, num_logprobs=lp_n, max_logprobs=max(lp_n, default=0))


def _ragged(pack: _Pack, name: str, rows: np.ndarray, tokens: list[np.ndarray]) -> bool:
    """Pack ``{name}_rows`` (each of ``rows`` repeated once per token of its list) and ``{name}_toks``; False
    (nothing packed) when there are no tokens at all."""
    lens = np.fromiter((len(t) for t in tokens), dtype=np.int64, count=len(tokens))
    if not lens.sum():
        return False
    pack.ints(f"{name}_rows", np.repeat(rows, lens))
    pack.ints(f"{name}_toks", np.concatenate(tokens))
    return True


def settings_of_rows(rows: Sequence[SamplingRow], vocab_size: int, eos_token_ids: Iterable[int] = ()
                     ) -> tuple[SamplingSettings, np.ndarray, np.ndarray, np.ndarray]:
    """A batch of rows given by hand as :func:`build_sampling_metadata`'s arguments: a table with a row per
    batch row, its row indices, the rows' penalty slots and their output indices."""
    table = SamplingSettings.of_rows([r.sampling for r in rows], [r.seed for r in rows], [0] * len(rows),
                                     vocab_size, eos_token_ids)
    return (table, np.arange(len(rows)), np.array([r.slot for r in rows], dtype=np.int64),
            np.array([r.output_index for r in rows], dtype=np.int64))
