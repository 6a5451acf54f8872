"""Log-probabilities in each API's format, from the engine's per-token ``dict[token_id, Logprob]`` (the sampled
token and the top ``logprobs`` alternatives, vLLM's ``SampleLogprobs``).

Completions (vLLM ``_create_completion_logprobs``): ``tokens``, ``token_logprobs``, ``top_logprobs`` (the top N
by rank, and the sampled token, as OpenAI's legacy API: up to N + 1 entries) and ``text_offset`` (where each
token starts in the choice's text; a stream continues from the text already sent). Chat (vLLM
``_create_chat_logprobs``): ``content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]``,
``top_logprobs`` the N most likely tokens in rank order. ``-inf`` becomes -9999.0, the number OpenAI uses.
"""
from __future__ import annotations

from typing import Any, Callable

from runner.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    CompletionLogProbs,
)
from runner.outputs import Logprob, SampleLogprobs

MIN_LOGPROB = -9999.0


def token_text_fn(tokenizer: Any) -> Callable[[int, Logprob], str]:
    """A token's text: the engine's ``decoded_token``, else the tokenizer's decoding of it alone, else
    ``token_id:<id>`` (vLLM's ``return_tokens_as_token_ids`` spelling) for a model served without a tokenizer."""

    def text(token_id: int, lp: Logprob) -> str:
        if lp.decoded_token is not None:
            return lp.decoded_token
        if tokenizer is not None:
            return tokenizer.decode([token_id])
        return f"token_id:{token_id}"

    return text


def _value(lp: Logprob) -> float:
    return max(lp.logprob, MIN_LOGPROB)


def _top(step: dict[int, Logprob], n: int) -> list[tuple[int, Logprob]]:
    ranked = [(t, lp) for t, lp in step.items() if lp.rank is not None and lp.rank <= n]
    return sorted(ranked, key=lambda item: item[1].rank)  # type: ignore[arg-type, return-value]


def _step_of(steps: SampleLogprobs, i: int, token_id: int) -> dict[int, Logprob]:
    if i >= len(steps):
        raise RuntimeError(f"the engine returned logprobs for {len(steps)} token(s) but generated token {i} too")
    step = steps[i]
    if token_id not in step:
        raise RuntimeError(f"the engine's logprobs for generated token {i} lack the sampled token {token_id}")
    return step


def completion_logprobs(token_ids: list[int], steps: SampleLogprobs, num_top: int, text: Callable[[int, Logprob], str],
                        initial_offset: int = 0) -> CompletionLogProbs:
    out = CompletionLogProbs()
    offset = initial_offset
    for i, token_id in enumerate(token_ids):
        step = _step_of(steps, i, token_id)
        token = text(token_id, step[token_id])
        out.tokens.append(token)
        out.token_logprobs.append(_value(step[token_id]))
        top = {text(t, lp): _value(lp) for t, lp in _top(step, num_top)}
        top.setdefault(token, _value(step[token_id]))
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(token)
    return out


def chat_logprobs(token_ids: list[int], steps: SampleLogprobs, num_top: int,
                  text: Callable[[int, Logprob], str]) -> ChatCompletionLogProbs:
    content = []
    for i, token_id in enumerate(token_ids):
        step = _step_of(steps, i, token_id)
        token = text(token_id, step[token_id])
        top = [ChatCompletionLogProb(token=(t_text := text(t, lp)), logprob=_value(lp), bytes=_bytes(t_text))
               for t, lp in _top(step, num_top)]
        content.append(ChatCompletionLogProbsContent(token=token, logprob=_value(step[token_id]), bytes=_bytes(token),
                                                     top_logprobs=top))
    return ChatCompletionLogProbs(content=content)


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))
