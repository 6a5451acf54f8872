"""A per-row sampling-metadata builder, a plain loop reading each row's ``SamplingParams``, kept as a test reference.

``runner/worker/sampling_metadata.py`` builds a step's metadata with numpy from the per-slot settings table
(``runner/worker/sampling_settings.py``); the tests check it against this loop on any batch.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from runner.attention.kv_cache import host_to_device
from runner.sampling_params import SamplingParamsError
from runner.worker.sampling_metadata import SamplingMetadata, SamplingRow
from runner.worker.sampling_noise import row_uniform
from runner.worker.sampling_ops import TOP_K_WIDTH


class _Pack:
    """Host lists packed into one int64 and one float32 tensor, one pinned copy each, then sliced by name."""

    def __init__(self) -> None:
        self._ints: list[int] = []
        self._floats: list[float] = []
        self._spans: dict[str, tuple[bool, int, int]] = {}
        self.views: dict[str, torch.Tensor] = {}

    def ints(self, name: str, values: Sequence[int]) -> None:
        self._spans[name] = (True, len(self._ints), len(values))
        self._ints.extend(values)

    def floats(self, name: str, values: Sequence[float]) -> None:
        self._spans[name] = (False, len(self._floats), len(values))
        self._floats.extend(values)

    def to_device(self, device: torch.device) -> dict[str, torch.Tensor]:
        ints = host_to_device(torch.tensor(self._ints, dtype=torch.int64), device) if self._ints else None
        floats = host_to_device(torch.tensor(self._floats, dtype=torch.float32), device) if self._floats else None
        for name, (is_int, start, n) in self._spans.items():
            src = ints if is_int else floats
            assert src is not None
            self.views[name] = src[start:start + n]
        return self.views


def _subset(pack: _Pack, name: str, rows: list[int], total: int) -> None:
    """Pack ``rows`` as an index unless it is every row (then the stage runs on the whole tensor)."""
    if len(rows) != total:
        pack.ints(name, rows)


def reference_sampling_metadata(rows: Sequence[SamplingRow], vocab_size: int, device: torch.device | str,
                            eos_token_ids: Iterable[int] = ()) -> SamplingMetadata:
    """The step's metadata for ``rows`` (row ``i`` is logits row ``i``). ``eos_token_ids`` are the model's EOS
    ids, masked with each row's stop tokens while it has fewer than ``min_tokens`` outputs."""
    device = torch.device(device)
    eos = frozenset(eos_token_ids)
    random_rows: list[int] = []
    uniforms: list[float] = []
    temps: list[float] = []
    minp_idx: list[int] = []
    minp: list[float] = []
    k_idx: list[int] = []
    top_k: list[int] = []
    k_floor: list[float] = []
    p_idx: list[int] = []
    p_floor: list[float] = []
    stop_rows: list[int] = []
    stop_toks: list[int] = []
    bias_rows: list[int] = []
    bias_toks: list[int] = []
    bias_vals: list[float] = []
    pen_rows: list[int] = []
    pen_slots: list[int] = []
    rep: list[float] = []
    freq: list[float] = []
    pres: list[float] = []
    lp_rows: list[int] = []
    lp_n: list[int] = []
    for i, r in enumerate(rows):
        p = r.sampling
        if not p.greedy:
            j = len(random_rows)
            random_rows.append(i)
            uniforms.append(row_uniform(r.seed, r.output_index))
            temps.append(p.temperature)
            if p.min_p > 0.0:
                minp_idx.append(j)
                minp.append(p.min_p)
            floor = 1.0 - p.top_p if p.top_p < 1.0 else -1.0
            if 0 < p.top_k < vocab_size:
                k_idx.append(j)
                top_k.append(p.top_k)
                k_floor.append(floor)
            elif p.top_p < 1.0:
                p_idx.append(j)
                p_floor.append(floor)
        if p.min_tokens and r.output_index < p.min_tokens:
            assert p.stop_token_ids is not None  # SamplingParams made it a list
            stops = sorted(t for t in eos | p.all_stop_token_ids | set(p.stop_token_ids) if t < vocab_size)
            stop_rows += [i] * len(stops)
            stop_toks += stops
        if p.logit_bias:
            for tok, val in p.logit_bias.items():
                if not 0 <= tok < vocab_size:
                    raise SamplingParamsError("logit_bias", f"logit_bias names token id {tok}, outside the "
                                                            f"vocabulary [0, {vocab_size})")
                bias_rows.append(i)
                bias_toks.append(tok)
                bias_vals.append(val)
        if p.uses_penalties:
            if r.slot < 0:
                raise ValueError(f"row {i} uses penalties but has no request slot (slot={r.slot})")
            pen_rows.append(i)
            pen_slots.append(r.slot)
            rep.append(p.repetition_penalty)
            freq.append(p.frequency_penalty)
            pres.append(p.presence_penalty)
        if p.logprobs is not None:
            lp_rows.append(i)
            lp_n.append(min(p.logprobs, vocab_size))

    n, nr = len(rows), len(random_rows)
    pack = _Pack()
    if nr:
        _subset(pack, "random_rows", random_rows, n)
        pack.floats("uniforms", uniforms)
        if any(t != 1.0 for t in temps):
            pack.floats("temperature", temps)
        if minp:
            _subset(pack, "min_p_rows", minp_idx, nr)
            pack.floats("min_p", minp)
        if k_idx:
            _subset(pack, "top_k_rows", k_idx, nr)
            pack.ints("top_k", top_k)
            if any(f >= 0.0 for f in k_floor):
                pack.floats("top_k_p_floor", k_floor)
        if p_idx:
            _subset(pack, "top_p_rows", p_idx, nr)
            pack.floats("top_p_floor", p_floor)
    if stop_rows:
        pack.ints("stop_rows", stop_rows)
        pack.ints("stop_toks", stop_toks)
    if bias_rows:
        pack.ints("bias_rows", bias_rows)
        pack.ints("bias_toks", bias_toks)
        pack.floats("bias_vals", bias_vals)
    if pen_rows:
        _subset(pack, "penalty_rows", pen_rows, n)
        pack.ints("penalty_slots", pen_slots)
        for name, values, off in (("repetition", rep, 1.0), ("frequency", freq, 0.0), ("presence", pres, 0.0)):
            if any(v != off for v in values):
                pack.floats(name, values)
    if lp_rows:
        _subset(pack, "logprob_rows", lp_rows, n)
    v = pack.to_device(device)
    return SamplingMetadata(
        num_rows=n, num_random=nr, random_rows=v.get("random_rows"), uniforms=v.get("uniforms"),
        temperature=v.get("temperature"), min_p_rows=v.get("min_p_rows"), min_p=v.get("min_p"),
        top_k_rows=v.get("top_k_rows"), top_k=v.get("top_k"),
        top_k_width=max(*top_k, min(TOP_K_WIDTH, vocab_size)) if top_k else 0,
        top_k_p_floor=v.get("top_k_p_floor"), top_p_rows=v.get("top_p_rows"), top_p_floor=v.get("top_p_floor"),
        stop_mask=(v["stop_rows"], v["stop_toks"]) if stop_rows else None,
        bias=(v["bias_rows"], v["bias_toks"], v["bias_vals"]) if bias_rows else None,
        penalty_rows=v.get("penalty_rows"), penalty_slots=v.get("penalty_slots"), repetition=v.get("repetition"),
        frequency=v.get("frequency"), presence=v.get("presence"), logprob_rows=v.get("logprob_rows"),
        logprob_row_ids=lp_rows, num_logprobs=lp_n, max_logprobs=max(lp_n, default=0))
