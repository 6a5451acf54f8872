"""Log-probabilities in each API's format, from the engine's per-token ``dict[token_id, Logprob]`` (the sampled
token and the top ``logprobs`` alternatives, vLLM's ``SampleLogprobs``).

Completions (vLLM ``_create_completion_logprobs``): ``tokens``, ``token_logprobs``, ``top_logprobs`` (the top N
by rank, and the sampled token, as OpenAI's legacy API: up to N + 1 entries) and ``text_offset`` (where each
token starts in the choice's text; a stream continues from the text already sent). Chat (vLLM
``_create_chat_logprobs``): ``content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]``,
``top_logprobs`` the N most likely tokens in rank order, ``bytes`` the token's own bytes (OpenAI's meaning): for
a token that holds part of a UTF-8 character, whose text is U+FFFD, the bytes of its vocabulary entry
(``token_bytes_fn``). ``-inf`` becomes -9999.0, the number OpenAI uses.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from runner.engine.byte_level import byte_level_table
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


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte-fallback tokens


def token_bytes_fn(tokenizer: Any) -> Callable[[int, str], list[int]]:
    """A token's bytes, from its id and text: the text's UTF-8, unless the text is (or holds) U+FFFD, the
    decoding of a partial character; then the token's own bytes from the vocabulary (byte-level BPE, or a
    SentencePiece ``<0xNN>`` byte token), where the tokenizer has them."""
    table = byte_level_table(tokenizer) if tokenizer is not None else None

    def own_bytes(token_id: int) -> bytes | None:
        if table is not None:
            return table.get(token_id)
        if tokenizer is None:
            return None
        match = _BYTE_TOKEN.fullmatch(str(tokenizer.convert_ids_to_tokens(token_id)))
        return bytes([int(match.group(1), 16)]) if match else None

    def token_bytes(token_id: int, text: str) -> list[int]:
        if "\ufffd" in text:
            own = own_bytes(token_id)
            if own is not None:
                return list(own)
        return list(text.encode("utf-8", errors="replace"))

    return token_bytes


def _text_bytes(token_id: int, text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


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
                  text: Callable[[int, Logprob], str],
                  token_bytes: Callable[[int, str], list[int]] = _text_bytes) -> ChatCompletionLogProbs:
    content = []
    for i, token_id in enumerate(token_ids):
        step = _step_of(steps, i, token_id)
        token = text(token_id, step[token_id])
        top = [ChatCompletionLogProb(token=(t_text := text(t, lp)), logprob=_value(lp), bytes=token_bytes(t, t_text))
               for t, lp in _top(step, num_top)]
        content.append(ChatCompletionLogProbsContent(token=token, logprob=_value(step[token_id]),
                                                     bytes=token_bytes(token_id, token), top_logprobs=top))
    return ChatCompletionLogProbs(content=content)
