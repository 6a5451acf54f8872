"""What goes into one DP rank's engine core and what comes out of it, per request (vLLM's ``EngineCoreRequest``
and ``EngineCoreOutput``).

Requests arrive as token ids: tokenization, detokenization, stop strings and ``n > 1`` fan-out belong to the
engine client (``runner/engine/``), never to a rank's step loop. The same types serve the offline ``LLM``
(in-process) and the server (over ZeroMQ), so both run the same engine core.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import overload

import msgspec
import numpy as np

from runner.core.logprob_rows import LogprobRows, LogprobTokens
from runner.sampling_params import SamplingParams


@dataclass
class EngineCoreRequest:
    """One sequence to generate. ``request_id`` is unique among the core's live requests (the client maps its
    own ids onto these). ``default_seed`` seeds a random request whose ``sampling_params.seed`` is None, so
    an unseeded request's tokens still depend only on the request, never on its batch or rank."""

    request_id: int
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    default_seed: int = 0
    arrival_time: float = 0.0


class EngineCoreOutput(msgspec.Struct, array_like=True, gc=False):
    """What one step added to a request: its new tokens (at most one per step today), their log-probabilities
    when asked for, and, when it finished, why. ``finish_reason`` is vLLM's: "stop" (EOS or a stop token,
    named by ``stop_reason``), "length", "abort", or "error" (``error`` says what was wrong).

    One type in process and on the rank -> client link: a msgspec struct encoded as a msgpack array of its values
    without the fields' names (a map with every name is about ten times the bytes, and slower to decode;
    docs/benchmarks.md has the figures). No reference cycle can pass through one, so the garbage collector does
    not track them (``gc=False``)."""

    request_id: int
    new_token_ids: list[int] = []
    new_logprobs: LogprobRows | None = None  # a row per new token
    finish_reason: str | None = None
    stop_reason: int | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    # vLLM's prompt_logprobs, as the prefill computes them: entries for prompt tokens prompt_logprobs_start ..
    new_prompt_logprobs: LogprobRows | None = None
    prompt_logprobs_start: int = 0
    # vLLM's num_cached_tokens: prompt tokens whose KV came from the prefix cache when the request was first
    # scheduled (0 with caching off), on the first output made after that; None on the others, and for a request
    # that never ran (refused when added)
    num_cached_tokens: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


_NO_IDS = np.zeros(0, dtype=np.int64)


class EngineCoreOutputs(Sequence[EngineCoreOutput]):
    """What a rank's steps produced since the last take, in three parts: the *plain tokens* of running requests
    as two int64 arrays, ``request_ids[i]`` got ``token_ids[i]`` (no log-probabilities, no finish, not the
    request's first output: the steady decode's bulk); the same for running requests that asked for
    log-probabilities, a :class:`LogprobTokens` of arrays per step (:attr:`logprob_tokens`); then
    :attr:`outputs`, one struct per request for everything else (a request that finished, or has its first
    output, or prompt log-probabilities).

    The engine core builds the arrays with numpy, so a step of N running requests costs no Python per request
    on the rank side; they cross the process boundary as byte strings (``messages.Outputs``) and the front
    reads them in one loop. Order: a request's array tokens come before its struct (the engine core appends a
    later step's token to a request's struct once it has one), so the arrays are read first.

    As a sequence it gives every output as a struct, the array tokens first (one struct each, made on access):
    for readers that want structs (tests, tools); the front's hot path reads the arrays."""

    __slots__ = ("request_ids", "token_ids", "logprob_tokens", "outputs")

    def __init__(self, outputs: Sequence[EngineCoreOutput] = (), request_ids: np.ndarray = _NO_IDS,
                 token_ids: np.ndarray = _NO_IDS, logprob_tokens: Sequence[LogprobTokens] = ()) -> None:
        if len(request_ids) != len(token_ids):
            raise ValueError(f"{len(request_ids)} request ids for {len(token_ids)} plain tokens")
        self.request_ids, self.token_ids = request_ids, token_ids
        self.logprob_tokens = list(logprob_tokens)
        self.outputs = list(outputs)

    @property
    def num_new_tokens(self) -> int:
        """The new tokens of every output (the array ones and those in structs)."""
        return self._num_array_tokens() + sum(len(out.new_token_ids) for out in self.outputs)

    def _num_array_tokens(self) -> int:
        return len(self.request_ids) + sum(len(block) for block in self.logprob_tokens)

    def array_request_ids(self) -> list[int]:
        """The request of each array token (one new token each), plain ones first: what counts tokens per
        request (metrics) reads, without making structs."""
        ids = self.request_ids.tolist()
        for block in self.logprob_tokens:
            ids += block.ids().tolist()
        return ids

    def __len__(self) -> int:
        return self._num_array_tokens() + len(self.outputs)

    @overload
    def __getitem__(self, index: int) -> EngineCoreOutput: ...

    @overload
    def __getitem__(self, index: slice) -> list[EngineCoreOutput]: ...

    def __getitem__(self, index: int | slice) -> EngineCoreOutput | list[EngineCoreOutput]:
        if isinstance(index, slice):
            return list(self)[index]
        i = index + len(self) if index < 0 else index
        if not 0 <= i < len(self):
            raise IndexError(f"output {index} of {len(self)}")
        if i < len(self.request_ids):
            return EngineCoreOutput(int(self.request_ids[i]), [int(self.token_ids[i])])
        n = self._num_array_tokens()
        return list(self._array_outputs())[i] if i < n else self.outputs[i - n]

    def __iter__(self) -> Iterator[EngineCoreOutput]:
        yield from self._array_outputs()
        yield from self.outputs

    def _array_outputs(self) -> Iterator[EngineCoreOutput]:
        for rid, token in zip(self.request_ids.tolist(), self.token_ids.tolist(), strict=True):
            yield EngineCoreOutput(rid, [token])
        for block in self.logprob_tokens:
            for j, rid in enumerate(block.ids().tolist()):
                row = block.row(j)
                yield EngineCoreOutput(rid, row.ids().tolist(), row)

    def __repr__(self) -> str:
        return (f"EngineCoreOutputs({len(self.request_ids)} plain tokens, "
                f"{sum(len(b) for b in self.logprob_tokens)} with log-probabilities, {self.outputs!r})")


def default_seed(seed: int, index: int) -> int:
    """The seed of the ``index``-th engine request an engine client makes under ``cfg.seed`` = ``seed``: an
    unseeded random request's tokens then depend only on its prompt and this number, never on its rank or batch."""
    return seed * 1_000_003 + index
