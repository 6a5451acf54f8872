"""The checks a prompt must pass before it runs: the scheduler's (a request that fails them ends in error), and
the offline ``LLM``'s and the CLI's, which raise or refuse a ``--prompts-file`` before any rank starts."""
from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import TypeGuard

from runner.sampling_params import SamplingParams


def is_token_id(value: object) -> TypeGuard[numbers.Integral]:
    """An integer token id: ``int``, a numpy or other ``numbers.Integral`` integer, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def prompt_token_problem(prompt: object, vocab_size: int, max_model_len: int) -> str | None:
    """Why these prompt ids cannot run, or None: not a list of ids, empty, an id outside the vocabulary, or
    prompt + 1 generated token over ``max_model_len``."""
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
        return f"must be a list of token ids, got {type(prompt).__name__}"
    if not prompt:
        return "the prompt is empty: at least one token is needed"
    for position, t in enumerate(prompt):
        if not is_token_id(t):
            return f"the token at position {position} is {t!r}, not an integer token id"
        if not 0 <= int(t) < vocab_size:
            return f"token id {t} at position {position} is outside the vocabulary [0, {vocab_size})"
    if len(prompt) + 1 > max_model_len:
        return (f"the prompt has {len(prompt)} tokens but max_model_len is {max_model_len}: prompt + 1 generated "
                f"token must fit (prompt length <= {max_model_len - 1})")
    return None


def prompt_problem(prompt: object, params: SamplingParams, vocab_size: int, max_model_len: int) -> str | None:
    """Why this prompt cannot run offline, or None: the server's checks (empty, a token id outside the
    vocabulary, prompt + 1 generated token over ``max_model_len``, a sampling token id outside the vocabulary).
    ``max_tokens`` past ``max_model_len`` is no error offline: generation stops there (vLLM's LLM alike)."""
    problem = prompt_token_problem(prompt, vocab_size, max_model_len)
    if problem is not None:
        return problem
    try:
        params.check_vocab(vocab_size)
    except ValueError as e:
        return str(e)
    return None


def max_tokens_problem(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> str | None:
    """Why ``max_tokens`` cannot be generated after this prompt, or None: the server refuses what would run past
    ``max_model_len`` (vLLM's API server alike); the offline front ends stop generating there instead."""
    if num_prompt_tokens + max_tokens <= max_model_len:
        return None
    return (f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {num_prompt_tokens + max_tokens} "
            f"exceeds max_model_len {max_model_len}")
