"""Per-request log-probabilities in vLLM's shape (``vllm/v1/engine/logprobs.py``): for each generated token, a
dict from token id to :class:`~runner.outputs.Logprob` holding the sampled token (with its rank) and the
``logprobs`` most likely tokens (ranks 1..N), and the running sum of the sampled tokens' log-probabilities.

Each token's text is that token decoded alone (``decode([id])``, special tokens kept), as vLLM reports it: a
byte-level piece of a multi-byte character shows as U+FFFD there, while the output text never does.
"""
from __future__ import annotations

from collections.abc import Sequence

from runner.core.logprob_rows import LogprobRows
from runner.engine.tokenizer import Tokenizer, make_decoder
from runner.outputs import Logprob, PromptLogprobs, SampleLogprobs


class TokenTexts:
    """Single tokens' texts as vLLM's log-probabilities report them (``decode([id])``, special tokens kept),
    each decoded once: ``cache`` is shared by every request of an output processor (a token's text alone
    depends only on its id). No tokenizer: every text is None."""

    def __init__(self, tokenizer: Tokenizer, cache: dict[int, str]) -> None:
        self._decode = None if tokenizer is None else make_decoder(tokenizer, skip_special_tokens=False)
        self._cache = cache

    def __call__(self, token: int) -> str | None:
        if self._decode is None:
            return None
        text = self._cache.get(token)
        if text is None:
            text = self._cache[token] = self._decode([token])
        return text


def _position(texts: TokenTexts, token: int, logprob: float, rank: int, top_ids: Sequence[int],
              top_logprobs: Sequence[float]) -> dict[int, Logprob]:
    """vLLM's dict for one position: the token with its rank, then the alternatives by rank (the token keeps
    its entry where it is one of them)."""
    position = {token: Logprob(logprob, rank, texts(token))}
    for r, (tid, lp) in enumerate(zip(top_ids, top_logprobs, strict=True), start=1):
        if tid not in position:
            position[tid] = Logprob(lp, r, texts(tid))
    return position


class LogprobsState:
    """``num_logprobs`` None: the request asked for none (``logprobs`` and ``cumulative_logprob`` stay None)."""

    def __init__(self, texts: TokenTexts, num_logprobs: int | None) -> None:
        self._texts = texts
        self.num_logprobs = num_logprobs
        self.logprobs: SampleLogprobs | None = None if num_logprobs is None else []
        self.cumulative_logprob: float | None = None if num_logprobs is None else 0.0

    def update(self, token_ids: Sequence[int], rows: LogprobRows | None) -> str | None:
        """Add one entry per new token; returns why the engine's rows do not fit the tokens, or None."""
        if self.logprobs is None or not token_ids:
            return None
        if rows is None or len(rows) != len(token_ids):
            got = 0 if rows is None else len(rows)
            return (f"logprobs={self.num_logprobs} was asked for, but the engine core returned log-probabilities "
                    f"for {got} of {len(token_ids)} new tokens (the model runner does not compute them)")
        ids, logprobs, ranks, top_ids, top_lps = rows.lists()
        for token, entry_id in zip(token_ids, ids, strict=True):
            if entry_id != token:
                return f"the engine core's log-probabilities are for token {entry_id}, not the sampled {token}"
        for row in zip(ids, logprobs, ranks, top_ids, top_lps, strict=True):
            self.add(*row)
        return None

    def add(self, token: int, logprob: float, rank: int, top_ids: Sequence[int], top_logprobs: Sequence[float]) -> None:
        """One new token's entry (its top alternatives cut to the request's ``logprobs``)."""
        assert self.logprobs is not None and self.cumulative_logprob is not None  # asked for
        n = self.num_logprobs
        self.logprobs.append(_position(self._texts, token, logprob, rank, top_ids[:n], top_logprobs[:n]))
        self.cumulative_logprob += logprob


class PromptLogprobsState:
    """vLLM's ``RequestOutput.prompt_logprobs`` of one request: None for the first prompt token, then for each
    later one a dict holding it (with its rank) and the ``num_logprobs`` most likely tokens at its position,
    joined from the prefill chunks' rows by position (a chunk recomputed after a preemption adds nothing).
    ``num_logprobs`` None: the request asked for none (``prompt_logprobs`` stays None)."""

    def __init__(self, texts: TokenTexts, num_logprobs: int | None, prompt_len: int) -> None:
        self._texts = texts
        self.num_logprobs = num_logprobs
        self.prompt_len = prompt_len
        self.prompt_logprobs: PromptLogprobs | None = None if num_logprobs is None else [None]

    def update(self, start: int, rows: LogprobRows | None) -> str | None:
        """Add the rows for prompt tokens ``start ..``; returns why they do not fit, or None."""
        if not rows:
            return None
        if self.prompt_logprobs is None:
            return "the engine core returned prompt log-probabilities that were not asked for"
        have = len(self.prompt_logprobs)
        if start > have:
            return f"the engine core's prompt log-probabilities skip prompt tokens {have} to {start - 1}"
        if have > start:  # a chunk recomputed after a preemption: only the positions not yet joined
            rows = rows.take(slice(have - start, None))
        n, texts = self.num_logprobs, self._texts
        for token, logprob, rank, top_ids, top_lps in zip(*rows.lists(), strict=True):
            self.prompt_logprobs.append(_position(texts, token, logprob, rank, top_ids[:n], top_lps[:n]))
        return None

    @property
    def complete(self) -> bool:
        return self.prompt_logprobs is None or len(self.prompt_logprobs) >= self.prompt_len
