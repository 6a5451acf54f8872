"""vLLM's ``prompt_logprobs``: for a request that asks, each prompt token's log-probability given the tokens
before it, computed from the prefill's hidden states (the row at position ``p`` predicts prompt token
``p + 1``), chunk by chunk as the prompt is prefilled.

Values are ``log_softmax`` of the model's logits before any processing, in float32 (vLLM's ``raw_logprobs``,
the same as the sampled tokens' logprobs), with the token's rank and the ``prompt_logprobs`` most likely tokens
at that position. Only steps with a prefill look here; a step whose requests ask for none costs one pass over
its request list.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from runner.core.logprob_rows import LogprobRows
from runner.core.runner_output import PromptLogprobs
from runner.core.scheduler_output import SchedulerOutput
from runner.worker import sampling_ops as ops


def _targets(sched: SchedulerOutput) -> list[tuple[int, int, int, list[int], int]]:
    """(request index, first hidden row, first target index, target token ids, top n) per chunk that asks."""
    if not sched.has_prefill or sched.hand_built:  # hand-built batches carry no prompts
        return []
    out = []
    row = 0
    for i, (req, computed, length) in enumerate(zip(sched.requests, sched.num_computed.tolist(),
                                                    sched.query_lens.tolist(), strict=True)):
        top_n = req.sampling.prompt_logprobs
        if top_n is not None:
            prompt = req.prompt_token_ids
            end = min(computed + length, len(prompt) - 1)  # positions computed .. end-1 predict a prompt token
            if end > computed:
                out.append((i, row, computed + 1, list(prompt[computed + 1:end + 1]), top_n))
        row += length
    return out


def prompt_logprobs(sched: SchedulerOutput, hidden: torch.Tensor,
                    compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> list[PromptLogprobs | None] | None:
    """One entry per request of the step (None where it asked for none or computed no prompt position);
    None when no request of the step asked."""
    targets = _targets(sched)
    if not targets:
        return None
    out: list[PromptLogprobs | None] = [None] * sched.num_reqs
    for i, row, start, ids, top_n in targets:
        rows = torch.from_numpy(np.arange(row, row + len(ids), dtype=np.int64)).to(hidden.device)
        lp = ops.raw_logprobs(compute_logits(hidden.index_select(0, rows)))
        chosen = torch.tensor(ids, dtype=torch.int64, device=hidden.device)
        logprob, rank = ops.token_logprobs(lp, chosen)
        if top_n:
            top = lp.topk(top_n, dim=-1)
            top_ids, top_lps = top.indices.cpu().numpy(), top.values.cpu().numpy()
        else:
            top_ids, top_lps = np.zeros((len(ids), 0), np.int64), np.zeros((len(ids), 0), np.float64)
        out[i] = PromptLogprobs(start, LogprobRows.of(np.array(ids, dtype=np.int64), logprob.cpu().numpy(),
                                                      rank.cpu().numpy(), top_ids, top_lps))
    return out
