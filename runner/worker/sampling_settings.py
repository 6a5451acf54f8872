"""Requests' sampling settings as numpy arrays, a row per request, written once when the request arrives.

A request's :class:`~runner.sampling_params.SamplingParams`, seed and prompt length are fixed for its life, so
the sampler does not read them again every step. :class:`SamplingSettings` holds them as one numpy array per
setting (vLLM V1's persistent batch keeps temperature, top-p, top-k and the penalties per row the same way:
``vllm/v1/worker/gpu_input_batch.py``). The model runner's sampler keeps one with a row per request *slot*
(the slot a request holds from admission to its end, ``runner/core/slots.py``); a row is written when its
request's first chunk reaches the sampler and read by every later step through a gather over the step's slots.
So a step's sampling metadata is built with numpy over the batch: no Python per request, no per-request object.

``flags`` says, one bit per stage, which stages a row needs (:data:`RANDOM` for a row that draws,
:data:`TEMPERATURE` for a temperature other than 1, and so on). OR-ing a step's flags tells which stages
run at all, so a step of greedy rows costs one gather and one reduction before the argmax. Settings that do
not fit a number per row -- the stop tokens ``min_tokens`` holds back, a ``logit_bias`` -- are kept per row as
small arrays, validated against the vocabulary once, and concatenated per step only for the rows that use them.

A table built for one call (a batch of rows given by hand: tests, benchmarks, batches built from
``ScheduledChunk`` objects) is the same class with a row per batch row.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from runner.sampling_params import SamplingParams, SamplingParamsError
from runner.worker.sampling_noise import seed_hash

# One bit per stage a row needs (``SamplingSettings.flags``).
RANDOM = 1 << 0  # draws (temperature > 0); without it the row takes the argmax
TEMPERATURE = 1 << 1  # draws with a temperature other than 1
MIN_P = 1 << 2
TOP_K = 1 << 3  # 0 < top_k < vocab
TOP_P = 1 << 4  # top_p < 1
PENALTIES = 1 << 5  # repetition, frequency or presence penalty
LOGPROBS = 1 << 6
MIN_TOKENS = 1 << 7  # min_tokens > 0 (its stop tokens are masked while the outputs are fewer)
LOGIT_BIAS = 1 << 8

_MIN_ROWS = 64
_EMPTY = np.zeros(0, dtype=np.int64)


class SamplingSettings:
    """Per-row sampling settings (module docstring). ``owner[row]`` is the request id that wrote the row (-1:
    none yet); the model runner's sampler compares it with the step's request ids to find rows to (re)write."""

    def __init__(self, vocab_size: int, eos_token_ids: Iterable[int] = (), num_rows: int = 0) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.num_rows = 0
        self.owner = np.zeros(0, dtype=np.int64)
        self.flags = np.zeros(0, dtype=np.uint16)
        self.temperature = np.zeros(0)  # float64 throughout: rounded to float32 once, when copied to the device
        self.min_p = np.zeros(0)
        self.top_k = np.zeros(0, dtype=np.int64)
        self.top_p_floor = np.zeros(0)  # 1 - top_p; -1 without top-p
        self.repetition = np.zeros(0)
        self.frequency = np.zeros(0)
        self.presence = np.zeros(0)
        self.logprobs = np.zeros(0, dtype=np.int64)  # top-N asked (at most the vocabulary)
        self.min_tokens = np.zeros(0, dtype=np.int64)
        self.seed_hash = np.zeros(0, dtype=np.uint64)  # sampling_noise.seed_hash(seed)
        self.prompt_len = np.zeros(0, dtype=np.int64)
        self.stop_tokens: list[np.ndarray] = []  # per row: the tokens min_tokens holds back (sorted)
        self.bias: list[tuple[np.ndarray, np.ndarray] | None] = []  # per row: (token ids, values) of logit_bias
        self.num_penalty_rows = 0  # rows whose request uses a penalty: while 0, no step needs to look for one
        self._resize(num_rows)

    _ARRAYS = ("owner", "flags", "temperature", "min_p", "top_k", "top_p_floor", "repetition", "frequency",
               "presence", "logprobs", "min_tokens", "seed_hash", "prompt_len")
    _EMPTY_ROW = dict(owner=-1, temperature=1.0, top_p_floor=-1.0, repetition=1.0)

    def ensure_rows(self, num_rows: int) -> None:
        """Room for rows ``0 .. num_rows - 1`` (new rows empty; grows by doubling, keeps what is there)."""
        if num_rows > self.num_rows:
            self._resize(max(num_rows, 2 * self.num_rows, _MIN_ROWS))

    def _resize(self, size: int) -> None:
        for name in self._ARRAYS:
            old = getattr(self, name)
            new = np.full(size, self._EMPTY_ROW.get(name, 0), dtype=old.dtype)
            new[:self.num_rows] = old
            setattr(self, name, new)
        self.stop_tokens += [_EMPTY] * (size - self.num_rows)
        self.bias += [None] * (size - self.num_rows)
        self.num_rows = size

    def set(self, row: int, params: SamplingParams, seed: int, prompt_len: int = 0, owner: int = -1) -> None:
        """Write one request's settings into ``row`` (once per request: Python over its parameters).

        Raises :class:`SamplingParamsError` naming ``logit_bias`` when it names a token outside the vocabulary."""
        vocab = self.vocab_size
        flags = 0
        temperature, min_p, top_k, floor = 1.0, 0.0, 0, -1.0
        if not params.greedy:
            flags |= RANDOM
            temperature = params.temperature
            if temperature != 1.0:
                flags |= TEMPERATURE
            if params.min_p > 0.0:
                flags |= MIN_P
                min_p = params.min_p
            if 0 < params.top_k < vocab:
                flags |= TOP_K
                top_k = params.top_k
            if params.top_p < 1.0:
                flags |= TOP_P
                floor = 1.0 - params.top_p
        if params.uses_penalties:
            flags |= PENALTIES
        if params.logprobs is not None:
            flags |= LOGPROBS
        stops = _EMPTY
        if params.min_tokens:
            flags |= MIN_TOKENS
            stops = np.array(sorted(t for t in self.eos_token_ids | params.all_stop_token_ids
                                    | set(params.stop_token_ids or ()) if t < vocab), dtype=np.int64)
        bias = None
        if params.logit_bias:
            bad = [t for t in params.logit_bias if not 0 <= t < vocab]
            if bad:
                raise SamplingParamsError("logit_bias", f"logit_bias names token id {bad[0]}, outside the "
                                                        f"vocabulary [0, {vocab})")
            flags |= LOGIT_BIAS
            bias = (np.fromiter(params.logit_bias.keys(), dtype=np.int64, count=len(params.logit_bias)),
                    np.fromiter(params.logit_bias.values(), dtype=np.float64, count=len(params.logit_bias)))
        self.num_penalty_rows += bool(flags & PENALTIES) - bool(self.flags[row] & PENALTIES)
        self.owner[row] = owner
        self.flags[row] = flags
        self.temperature[row] = temperature
        self.min_p[row] = min_p
        self.top_k[row] = top_k
        self.top_p_floor[row] = floor
        self.repetition[row] = params.repetition_penalty
        self.frequency[row] = params.frequency_penalty
        self.presence[row] = params.presence_penalty
        self.logprobs[row] = min(params.logprobs, vocab) if params.logprobs is not None else 0
        self.min_tokens[row] = params.min_tokens
        self.seed_hash[row] = seed_hash(seed)
        self.prompt_len[row] = prompt_len
        self.stop_tokens[row] = stops
        self.bias[row] = bias

    @classmethod
    def of_rows(cls, params: Sequence[SamplingParams], seeds: Sequence[int], prompt_lens: Sequence[int],
                vocab_size: int, eos_token_ids: Iterable[int] = ()) -> SamplingSettings:
        """A table for one batch given by hand: row ``i`` from ``params[i]``, ``seeds[i]``, ``prompt_lens[i]``."""
        table = cls(vocab_size, eos_token_ids, len(params))
        for i, (p, seed, prompt_len) in enumerate(zip(params, seeds, prompt_lens, strict=True)):
            table.set(i, p, seed, prompt_len)
        return table
