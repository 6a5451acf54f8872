"""The sampler's logits transforms, each over a whole batch of rows with per-row settings as device tensors.

Each one equals transformers' processor for the same setting (``tests/test_sampling_ops.py`` compares them on
batches that mix settings): ``MinNewTokensLengthLogitsProcessor`` (min_tokens), ``TemperatureLogitsWarper``,
``MinPLogitsWarper``, ``TopKLogitsWarper`` and ``TopPLogitsWarper`` (their ``min_tokens_to_keep=1``). Rows
with top-k (and maybe top-p) sort only their largest logits, at least :data:`TOP_K_WIDTH` of them; rows with
top-p alone sort the vocabulary, as vLLM's ``apply_top_k_top_p`` (``vllm/v1/sample/ops/topk_topp_sampler.py``).
Every transform works in place on float32 logits and uses no operation whose output shape depends on data, so
none makes the host wait for the device.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

NEG_INF = float("-inf")
#: How many of each row's largest logits top-k gathers at least (capped by the vocabulary): a step whose top-k are
#: at most this many gathers exactly this many, the fixed shape a decode graph's top-k head computes with
#: (``runner/worker/cuda_graphs.py``), so its rows get the same thresholds eagerly and in the head.
TOP_K_WIDTH = 64


def on_rows_(x: torch.Tensor, rows: torch.Tensor | None, fn: Callable[[torch.Tensor], object]) -> torch.Tensor:
    """Apply the in-place ``fn`` to ``x[rows]`` (all of ``x`` when ``rows`` is None) and write the rows back."""
    if rows is None:
        fn(x)
        return x
    sub = x.index_select(0, rows)
    fn(sub)
    return x.index_copy_(0, rows, sub)


def mask_tokens_(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``logits[rows[i], tokens[i]] = -inf``: the stop tokens of rows still below ``min_tokens``."""
    return logits.index_put_((rows, tokens), torch.full((), NEG_INF, device=logits.device))


def add_logit_bias_(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor,
                    values: torch.Tensor) -> torch.Tensor:
    """``logits[rows[i], tokens[i]] += values[i]`` (OpenAI's ``logit_bias``; a row names a token once)."""
    return logits.index_put_((rows, tokens), values, accumulate=True)


def apply_temperature_(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Divide each row by its temperature (> 0: greedy rows never get here)."""
    return logits.div_(temperature.unsqueeze(1))


def apply_min_p_(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the row's largest (the top token always stays)."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill_(probs < threshold, NEG_INF)


def apply_top_k_(logits: torch.Tensor, top_k: torch.Tensor, width: int,
                 top_p_floor: torch.Tensor | None = None) -> torch.Tensor:
    """Keep each row's ``top_k`` largest logits (ties with the k-th kept), then, where ``top_p_floor`` (``1 -
    top_p``, ``-1`` for off) is given, the smallest set of those whose probability reaches ``top_p``.

    ``top_k`` ``[rows]`` int64 in ``[1, width]``. Only the ``width`` largest logits are gathered and sorted
    (``topk``), not the vocabulary: top-p after top-k needs only the tokens top-k kept, and the softmax over them
    equals the softmax over the row with every other token removed. The result is a per-row threshold, applied to
    the whole row.
    """
    return logits.masked_fill_(logits < _top_k_threshold(logits, top_k, width, top_p_floor), NEG_INF)


def apply_top_k_where_(logits: torch.Tensor, top_k: torch.Tensor, width: int,
                       top_p_floor: torch.Tensor) -> torch.Tensor:
    """:func:`apply_top_k_` on the rows whose ``top_k`` is positive, with the same threshold; a row whose ``top_k``
    is 0 is left as it is. Every row is computed, so the shapes do not depend on which rows use top-k (a graph
    head's). A row with ``top_p_floor`` ``-1`` gets top-k's threshold exactly, as if none was given."""
    return logits.masked_fill_(logits < top_k_cut(logits.topk(width, dim=-1).values, top_k, top_p_floor), NEG_INF)


def top_k_cut(top: torch.Tensor, top_k: torch.Tensor, top_p_floor: torch.Tensor) -> torch.Tensor:
    """:func:`apply_top_k_where_`'s threshold ``[rows, 1]`` from each row's largest logits in descending order
    (:func:`top_k_threshold_of`, overwritten): top-k's (and top-p's within it) where ``top_k`` is positive, ``-inf``
    (nothing removed) where it is 0."""
    kth = top_k_threshold_of(top, top_k.clamp_min(1), top_p_floor)
    return torch.where(top_k.unsqueeze(1) > 0, kth, NEG_INF)


def _top_k_threshold(logits: torch.Tensor, top_k: torch.Tensor, width: int,
                     top_p_floor: torch.Tensor | None) -> torch.Tensor:
    """Each row's smallest logit to keep, ``[rows, 1]`` (:func:`apply_top_k_`)."""
    return top_k_threshold_of(logits.topk(width, dim=-1).values, top_k, top_p_floor)


def top_k_threshold_of(top: torch.Tensor, top_k: torch.Tensor, top_p_floor: torch.Tensor | None) -> torch.Tensor:
    """:func:`_top_k_threshold` from each row's ``width`` largest logits, in descending order (overwritten).

    Dividing a row by a positive temperature keeps its order (rounding is monotone), so the largest logits of
    ``logits / t`` are those of ``logits``, divided: a graph head gathers before it divides, and gets the
    threshold the eager sampler gets from the divided row."""
    kth = top.gather(1, (top_k - 1).unsqueeze(1))
    if top_p_floor is not None:
        ascending = top.masked_fill_(top < kth, NEG_INF).flip(-1)
        drop = ascending.softmax(dim=-1).cumsum_(dim=-1) <= top_p_floor.unsqueeze(1)
        drop[:, -1] = False
        kth = torch.maximum(kth, ascending.masked_fill_(drop, float("inf")).amin(dim=-1, keepdim=True))
    return kth


def apply_top_p_(logits: torch.Tensor, top_p_floor: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of each row's largest logits whose probability reaches ``top_p``: as in
    transformers, a token goes when the probability of the tokens at or below it (ascending order) is at most
    ``top_p_floor = 1 - top_p`` (``-1``: off for that row), and the most likely token always stays. One sort of
    the row (vLLM's ``apply_top_k_top_p`` for rows without top-k), stable: tokens of equal logits go or stay by
    their ids, whichever rows the batch holds."""
    sorted_logits, order = logits.sort(dim=-1, descending=False, stable=True)
    drop = sorted_logits.softmax(dim=-1).cumsum_(dim=-1) <= top_p_floor.unsqueeze(1)
    drop[:, -1] = False
    return logits.masked_fill_(drop.scatter(1, order, drop), NEG_INF)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, int64 (the first index on ties; a NaN counts as the largest, as in ``torch.argmax``).

    On the CPU it is numpy's ``argmax`` over a view of the same memory: torch's CPU argmax over the last
    dimension does not vectorise and costs several times as much on ``[rows, vocab]`` logits (the greedy rows
    of ``docs/benchmarks.md``'s sampler section, before and after, in its recorded host-time section), while
    numpy's returns the same indices (``tests/test_sampling_ops.py``). On any other device ``torch.argmax``,
    so the step stays tensor work on that device (``tests/test_sampling_state.py``, ``test_cuda_*``)."""
    if logits.device.type == "cpu":
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def greedy_tokens(logits: torch.Tensor, invalid: int) -> torch.Tensor:
    """Each row's argmax (as :func:`argmax_rows`), or ``invalid`` where the row's largest logit is not finite (a
    NaN counts as the largest, so the value at the argmax is non-finite exactly when the row's maximum is). Any
    floating dtype: the result is that of the logits cast to float32, which is exact.

    On the CPU numpy over the logits' memory: the argmax, the value at it and the check. Elsewhere
    :func:`greedy_tokens_torch`: four kernels, the maximum and its index from one reduction (``torch.max``
    returns ``torch.argmax``'s index, the first on ties), then :func:`finite` and the pick."""
    if logits.device.type != "cpu":
        return greedy_tokens_torch(logits, invalid)
    x = (logits.float() if logits.dtype == torch.bfloat16 else logits).numpy()  # numpy has no bfloat16
    ids = x.argmax(axis=-1)
    best = np.take_along_axis(x, ids[:, None], axis=1)[:, 0]
    ids[~np.isfinite(best)] = invalid
    return torch.from_numpy(ids)


def greedy_tokens_torch(logits: torch.Tensor, invalid: int) -> torch.Tensor:
    """:func:`greedy_tokens` as tensor work on the logits' device."""
    return max_and_greedy(logits, invalid)[1]


def max_and_greedy(logits: torch.Tensor, invalid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's largest logit (NaN where the row holds one) and :func:`greedy_tokens_torch`'s token, from one
    reduction: a graph head's greedy pick and its draw's peak."""
    best, ids = logits.max(dim=-1)
    return best, torch.where(finite(best), ids, invalid)


def finite(x: torch.Tensor) -> torch.Tensor:
    """``torch.isfinite(x)`` for floating ``x`` as two kernels, ``|x| < inf`` (False for NaN and both infinities):
    ``torch.isfinite`` is four (``x == x`` and ``|x| != inf``, multiplied)."""
    return x.abs() < float("inf")


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """vLLM's default ``raw_logprobs``: ``log_softmax`` of the model's logits before any processing (no
    penalty, bias, temperature or truncation), in float32."""
    return torch.log_softmax(logits, dim=-1, dtype=torch.float32)


def token_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's log-probability of ``token_ids[row]`` and its rank: how many tokens are at least as likely
    (1 = the most likely; ties count against it, as vLLM's ``batched_count_greater_than``)."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    return chosen.squeeze(1), (logprobs >= chosen).sum(dim=-1)
