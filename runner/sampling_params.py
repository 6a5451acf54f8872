"""Per-request generation settings with vLLM's names, meanings and defaults (``vllm/sampling_params.py``).

Shared by every layer: the front ends build them (the OpenAI server from a request body), the engine client
reads the text-level ones (``n``, ``stop``, ``include_stop_str_in_output``, ``skip_special_tokens``), the
scheduler the stop conditions, the sampler the rest. A bad value raises :class:`SamplingParamsError` (a
``ValueError``) naming the field and the value, so the server can answer 400 naming the field.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS): dividing by ~0 only produces inf/NaN.
SAMPLING_EPS = 1e-5
# logit_bias values are clamped to this range, as in vLLM and OpenAI's API.
LOGIT_BIAS_LIMIT = 100.0
# The repetition penalty divides or multiplies logits by itself: beyond 100x either way no setting means anything
# more, and extreme values (1e-300 is 0 in float32) overflow float32 logits to inf.
REPETITION_PENALTY_RANGE = (0.01, 100.0)
# Integers travel to the engine as 64-bit values (vLLM bounds seed to torch.long's range the same way).
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# Stop strings are searched in every new piece of text of every sample: their number and length are bounded so
# that one request cannot make that search expensive (OpenAI's API allows 4).
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request carries (vLLM's enum): everything so far, only what is new since
    the previous one (streaming), or one output at the end (the offline ``LLM.generate``)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingParamsError(ValueError):
    """A bad sampling setting; ``field`` names it (``top_p``), so an HTTP front end can answer 400 naming it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _is_number(v: Any) -> bool:
    t = type(v)
    return t is float or t is int or (t is not bool and isinstance(v, (int, float)))


def _is_int(v: Any) -> bool:
    t = type(v)
    return t is int or (t is not bool and isinstance(v, int))


def wrap_int64(value: int) -> int:
    """``value`` modulo 2**64, as a signed 64-bit integer."""
    return (value - INT64_MIN) % (1 << 64) + INT64_MIN


def _check_int64(name: str, value: Any) -> None:
    if _is_int(value) and not INT64_MIN <= value <= INT64_MAX:
        raise SamplingParamsError(name, f"{name} must fit in 64 bits ([{INT64_MIN}, {INT64_MAX}]), got {value!r}")


def _check_range(name: str, value: Any, lo: float, hi: float, *, lo_open: bool = False) -> None:
    ok = _is_number(value) and math.isfinite(value) and (value > lo if lo_open else value >= lo) and value <= hi
    if not ok:
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise SamplingParamsError(name, f"{name} must be a number in {interval}, got {value!r}")


# vLLM's bound on n (its VLLM_MAX_N_SEQUENCES default).
MAX_N_SEQUENCES = 16384


@dataclass
class SamplingParams:
    """vLLM's sampling parameters (OpenAI's completion fields, plus ``top_k``, ``min_p``, ``repetition_penalty``,
    ``min_tokens``). ``temperature=0`` is greedy (exact argmax, whatever else is in the batch)."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len (resolved by the engine client per request)
    min_tokens: int = 0
    logprobs: int | None = None  # the sampled token's log-probability plus the top N (OpenAI style)
    # vLLM's: each prompt token's log-probability (after the first) plus the top N at its position; None: none
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # EOS ids of the model (and of generation_config.json) that min_tokens must hold back; set by the engine.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise SamplingParamsError("n", f"n must be an integer >= 1, got {self.n!r}")
        if self.n > MAX_N_SEQUENCES:
            raise SamplingParamsError("n", f"n must be at most {MAX_N_SEQUENCES} (vLLM's VLLM_MAX_N_SEQUENCES "
                                           f"default), got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            _check_range(name, getattr(self, name), -2.0, 2.0)
        _check_range("repetition_penalty", self.repetition_penalty, *REPETITION_PENALTY_RANGE)
        for name in ("n", "top_k", "max_tokens", "min_tokens", "logprobs"):
            _check_int64(name, getattr(self, name))
        if not (_is_number(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0):
            raise SamplingParamsError("temperature", f"temperature must be a finite number >= 0 (vLLM's range), "
                                                     f"got {self.temperature!r}")
        _check_range("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        if not _is_int(self.top_k) or self.top_k < -1:
            raise SamplingParamsError("top_k", f"top_k must be an integer >= 1, or 0 / -1 for off; got {self.top_k!r}")
        if self.top_k == -1:
            self.top_k = 0
        _check_range("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None and not _is_int(self.seed):
            raise SamplingParamsError("seed", f"seed must be an integer or None, got {self.seed!r}")
        if self.seed == -1:  # vLLM and OpenAI clients use -1 for "no seed"
            self.seed = None
        if self.seed is not None:  # draws read a seed modulo 2**64: kept as that residue, so it travels as 64 bits
            self.seed = wrap_int64(self.seed)
        self.stop = self._stop_strings(self.stop)
        self.stop_token_ids = self._token_ids("stop_token_ids", self.stop_token_ids)
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                     "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(name, f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise SamplingParamsError("max_tokens", f"max_tokens must be an integer >= 1 (or None), "
                                                    f"got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise SamplingParamsError("min_tokens", f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError("min_tokens", f"min_tokens ({self.min_tokens}) must not exceed max_tokens "
                                                    f"({self.max_tokens})")
        if self.logprobs is True:
            self.logprobs = 1
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise SamplingParamsError("logprobs", f"logprobs must be an integer >= 0 (how many top alternatives "
                                                  f"to return) or None, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs) or self.prompt_logprobs < 0):
            raise SamplingParamsError("prompt_logprobs",
                                      f"prompt_logprobs must be an integer >= 0 (how many top alternatives to "
                                      f"return) or None, got {self.prompt_logprobs!r}")
        self.logit_bias = self._logit_bias(self.logit_bias)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise SamplingParamsError("output_kind", f"output_kind must be a RequestOutputKind, "
                                                     f"got {self.output_kind!r}")
        if self.greedy:
            if self.n > 1:
                raise SamplingParamsError("n", f"n must be 1 with greedy sampling (temperature 0), got {self.n}: "
                                               "the n outputs would be identical")
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0  # no effect on an argmax (vLLM does the same)
        self.all_stop_token_ids = set(self.all_stop_token_ids) | set(self.stop_token_ids)

    # ---- validation helpers ------------------------------------------------------------------------------
    @staticmethod
    def _stop_strings(stop: Any) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise SamplingParamsError("stop", f"stop must be a string or a list of strings, got {stop!r}")
        if any(s == "" for s in stop):
            raise SamplingParamsError("stop", "stop must not contain an empty string")
        if len(stop) > MAX_STOP_STRINGS:
            raise SamplingParamsError("stop", f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
        longest = max(stop, key=len, default="")
        if len(longest) > MAX_STOP_STRING_CHARS:
            raise SamplingParamsError("stop", f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters, "
                                              f"got one of {len(longest)}")
        return list(dict.fromkeys(stop))

    @staticmethod
    def _token_ids(name: str, ids: Any) -> list[int]:
        if ids is None:
            return []
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise SamplingParamsError(name, f"{name} must be a list of token ids, got {ids!r}")
        ids = list(ids)
        bad = [t for t in ids if not _is_int(t) or not 0 <= t <= INT64_MAX]
        if bad:
            raise SamplingParamsError(name, f"{name} must be non-negative integers, got {bad[0]!r}")
        return list(dict.fromkeys(ids))

    @staticmethod
    def _logit_bias(bias: Any) -> dict[int, float] | None:
        if bias is None:
            return None
        if not isinstance(bias, dict):
            raise SamplingParamsError("logit_bias", f"logit_bias must map token ids to numbers, got {bias!r}")
        out: dict[int, float] = {}
        for key, value in bias.items():
            try:  # JSON object keys are strings: "50256" is token 50256, as in OpenAI's API
                token = int(key) if not isinstance(key, bool) else None
            except (TypeError, ValueError):
                token = None
            if token is None or not 0 <= token <= INT64_MAX:
                raise SamplingParamsError("logit_bias", f"logit_bias key {key!r} is not a token id")
            if not _is_number(value) or not math.isfinite(value):
                raise SamplingParamsError("logit_bias", f"logit_bias[{key!r}] must be a finite number, got {value!r}")
            out[token] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, float(value)))
        return out

    # ---- what the engine asks ----------------------------------------------------------------------------
    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def output_text_buffer_length(self) -> int:
        """Characters a stream holds back so that a stop string, once complete, can still be cut out."""
        return max((len(s) for s in self.stop), default=1) - 1 if self.stop and not self.include_stop_str_in_output \
            else 0

    def clone(self) -> SamplingParams:
        """A copy that shares nothing mutable with this one: its lists, dict and set are copied (their items, token
        ids, biases and stop strings, are immutable), without ``copy.deepcopy``'s walk over every item."""
        out = object.__new__(type(self))  # the fields as they are: no __post_init__ again
        out.__dict__.update({name: value.copy() if isinstance(value, (list, dict, set)) else value
                             for name, value in self.__dict__.items()})
        return out

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids named here must exist in the model's vocabulary (checked when a request arrives)."""
        for name, ids in (("stop_token_ids", self.stop_token_ids or []), ("logit_bias", list(self.logit_bias or ()))):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise SamplingParamsError(name, f"{name} names token id {bad[0]}, outside the vocabulary "
                                                f"[0, {vocab_size})")
        if self.logprobs is not None and self.logprobs > vocab_size:
            raise SamplingParamsError("logprobs", f"logprobs asks for {self.logprobs} alternatives, more than the "
                                                  f"vocabulary's {vocab_size} tokens")
