"""Per-request log-probabilities in vLLM's shape (``vllm/v1/engine/logprobs.py``): for each generated token, a
dict from token id to :class:`~runner.outputs.Logprob` holding the sampled token (with its rank) and the
``logprobs`` most likely tokens (ranks 1..N), and the running sum of the sampled tokens' log-probabilities.

Each token's text is that token decoded alone (``decode([id])``, special tokens kept), as vLLM reports it: a
byte-level piece of a multi-byte character shows as U+FFFD there, while the output text never does.
"""
from __future__ import annotations

from collections.abc import Sequence

from runner.core.runner_output import TokenLogprobs
from runner.engine.tokenizer import Tokenizer, make_decoder
from runner.outputs import Logprob, PromptLogprobs, SampleLogprobs


class LogprobsState:
    """``num_logprobs`` None: the request asked for none (``logprobs`` and ``cumulative_logprob`` stay None)."""

    def __init__(self, tokenizer: Tokenizer, num_logprobs: int | None) -> None:
        self._decode = None if tokenizer is None or num_logprobs is None else \
            make_decoder(tokenizer, skip_special_tokens=False)
        self.num_logprobs = num_logprobs
        self.logprobs: SampleLogprobs | None = None if num_logprobs is None else []
        self.cumulative_logprob: float | None = None if num_logprobs is None else 0.0

    def update(self, token_ids: Sequence[int], entries: Sequence[TokenLogprobs | None] | None) -> str | None:
        """Add one entry per new token; returns why the engine's entries do not fit the tokens, or None."""
        if self.logprobs is None or not token_ids:
            return None
        if entries is None or len(entries) != len(token_ids) or any(e is None for e in entries):
            got = 0 if entries is None else sum(e is not None for e in entries)
            return (f"logprobs={self.num_logprobs} was asked for, but the engine core returned log-probabilities "
                    f"for {got} of {len(token_ids)} new tokens (the model runner does not compute them)")
        for token, entry in zip(token_ids, entries, strict=True):  # lengths checked above
            assert entry is not None  # checked above
            if entry.token_id != token:
                return f"the engine core's log-probabilities are for token {entry.token_id}, not the sampled {token}"
            position = {token: Logprob(entry.logprob, entry.rank, self._text(token))}
            for rank, (tid, lp) in enumerate(zip(entry.top_token_ids[:self.num_logprobs],
                                                 entry.top_logprobs[:self.num_logprobs], strict=True), start=1):
                position.setdefault(tid, Logprob(lp, rank, self._text(tid)))
            self.logprobs.append(position)
            assert self.cumulative_logprob is not None  # set with logprobs
            self.cumulative_logprob += entry.logprob
        return None

    def _text(self, token: int) -> str | None:
        return None if self._decode is None else self._decode([token])


class PromptLogprobsState:
    """vLLM's ``RequestOutput.prompt_logprobs`` of one request: None for the first prompt token, then for each
    later one a dict holding it (with its rank) and the ``num_logprobs`` most likely tokens at its position,
    joined from the prefill chunks' entries by position (a chunk recomputed after a preemption adds nothing).
    ``num_logprobs`` None: the request asked for none (``prompt_logprobs`` stays None)."""

    def __init__(self, tokenizer: Tokenizer, num_logprobs: int | None, prompt_len: int) -> None:
        self._decode = None if tokenizer is None or num_logprobs is None else \
            make_decoder(tokenizer, skip_special_tokens=False)
        self.num_logprobs = num_logprobs
        self.prompt_len = prompt_len
        self.prompt_logprobs: PromptLogprobs | None = None if num_logprobs is None else [None]

    def update(self, start: int, entries: Sequence[TokenLogprobs] | None) -> str | None:
        """Add the entries for prompt tokens ``start ..``; returns why they do not fit, or None."""
        if not entries:
            return None
        if self.prompt_logprobs is None:
            return "the engine core returned prompt log-probabilities that were not asked for"
        have = len(self.prompt_logprobs)
        if start > have:
            return f"the engine core's prompt log-probabilities skip prompt tokens {have} to {start - 1}"
        for entry in entries[have - start:]:
            position = {entry.token_id: Logprob(entry.logprob, entry.rank, self._text(entry.token_id))}
            for rank, (tid, lp) in enumerate(zip(entry.top_token_ids[:self.num_logprobs],
                                                 entry.top_logprobs[:self.num_logprobs], strict=True), start=1):
                position.setdefault(tid, Logprob(lp, rank, self._text(tid)))
            self.prompt_logprobs.append(position)
        return None

    @property
    def complete(self) -> bool:
        return self.prompt_logprobs is None or len(self.prompt_logprobs) >= self.prompt_len

    def _text(self, token: int) -> str | None:
        return None if self._decode is None else self._decode([token])
