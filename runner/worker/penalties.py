"""Repetition, frequency and presence penalties, and the per-request token counts they read.

Definitions (vLLM's ``apply_penalties``, ``vllm/model_executor/layers/utils.py``):

- repetition (transformers' ``RepetitionPenaltyLogitsProcessor``, CTRL): every token seen in the prompt *or* the
  output so far has its logit divided by the penalty when positive, multiplied by it otherwise;
- frequency and presence (OpenAI): ``logit - frequency * count - presence * (count > 0)`` where ``count`` is
  how often the token occurs in the *output* so far.

**The counts live on the forward side, per request slot.** With the overlap loop, step N+1 is scheduled before
step N's token is known (its input is a placeholder that the forward side resolves), so the host cannot hand
the sampler the output so far. But every output token is an input of the next step, so
:class:`PenaltyState` keeps a ``[slots, vocab]`` count tensor of output tokens and a mask of the tokens seen
in the prompt or the output, on the device, updated from each step's *resolved* input tokens: positions at
or past the prompt length count as outputs, earlier ones are the prompt. A chunk starting at position 0
(admission, or recompute after a preemption) resets its slot first. At sampling time a slot's counts are
then exactly the request's outputs so far. The tensors are allocated when the first request with a penalty
arrives and grow with the highest slot used. A step's inputs are recorded with numpy over the requests that
use penalties (:meth:`PenaltyState.record`); a step in which none does costs the model runner one check.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from runner.attention.kv_cache import host_to_device
from runner.core.scheduler_output import ScheduledChunk

_MIN_SLOTS = 8
#: A step's input ids on the device (placeholders resolved) and the positions in them of the tokens recorded.
DeviceTokens = tuple[torch.Tensor, np.ndarray]


class PenaltyState:
    """Output-token counts (float32: exact below 2**24, and no conversion when a penalty multiplies them) and
    the tokens seen in prompt or output (bool, what the repetition penalty reads), per request slot."""

    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.counts: torch.Tensor | None = None  # [slots, vocab] float32: output tokens so far
        self.seen: torch.Tensor | None = None  # [slots, vocab] bool: token occurs in the prompt or the output

    @property
    def num_slots(self) -> int:
        return 0 if self.counts is None else self.counts.shape[0]

    def ensure_slots(self, num_slots: int) -> None:
        """Room for slots ``0 .. num_slots - 1`` (rows of new slots start empty)."""
        if num_slots <= self.num_slots:
            return
        size = max(_MIN_SLOTS, self.num_slots * 2, num_slots)
        counts = torch.zeros(size, self.vocab_size, dtype=torch.float32, device=self.device)
        seen = torch.zeros(size, self.vocab_size, dtype=torch.bool, device=self.device)
        if self.counts is not None and self.seen is not None:
            counts[:self.num_slots] = self.counts
            seen[:self.num_slots] = self.seen
        self.counts, self.seen = counts, seen

    def record_inputs(self, chunks: Sequence[ScheduledChunk]) -> None:
        """Add the input tokens (placeholders already resolved) of the chunks whose requests use penalties
        (a batch of chunks given by hand: :meth:`record` on their arrays)."""
        chunks = [c for c in chunks if c.sampling.uses_penalties]
        if not chunks:
            return
        self.record(np.array([c.req_id for c in chunks], dtype=np.int64),
                    np.array([c.slot for c in chunks], dtype=np.int64),
                    np.array([c.num_computed_tokens for c in chunks], dtype=np.int64),
                    np.array([len(c.token_ids) for c in chunks], dtype=np.int64),
                    np.array([c.num_prompt_tokens for c in chunks], dtype=np.int64),
                    np.array([t for c in chunks for t in c.token_ids], dtype=np.int64))

    def record(self, req_ids: np.ndarray, slots: np.ndarray, starts: np.ndarray, lens: np.ndarray,
               prompt_lens: np.ndarray, token_ids: np.ndarray, on_device: DeviceTokens | None = None) -> None:
        """Add one step's input tokens of requests that use penalties, as arrays over those requests (numpy,
        no Python per request): request ``i`` (``req_ids[i]``, in slot ``slots[i]``, prompt of
        ``prompt_lens[i]`` tokens) computes ``lens[i]`` tokens from position ``starts[i]``; ``token_ids`` holds
        them all, request after request. Positions below the prompt length are prompt, the others outputs; a
        request whose chunk starts at position 0 has its slot reset first.

        ``on_device``: the step's input ids on the device with placeholders resolved there, and where these
        tokens are in them; the counts then read the tokens from it (``token_ids`` may hold placeholders)."""
        if not len(slots):
            return
        if slots.min() < 0:
            k = int(np.argmax(slots < 0))
            raise ValueError(f"request {int(req_ids[k])} uses penalties but its chunk has no slot "
                             f"(slot={int(slots[k])}): penalty counts are kept per request slot")
        if len(token_ids) != int(lens.sum()):
            raise ValueError(f"penalty state: {len(token_ids)} token ids for chunks of {int(lens.sum())} tokens")
        bad = token_ids >= self.vocab_size
        if on_device is None:  # otherwise a negative id is a placeholder, resolved in the device's copy
            bad |= token_ids < 0
        if bad.any():
            raise ValueError(f"penalty state: input token {int(token_ids[np.argmax(bad)])} is outside the "
                             f"vocabulary [0, {self.vocab_size}) (an unresolved placeholder?)")
        resets = slots[starts == 0]
        offset = np.arange(len(token_ids)) - np.repeat(np.cumsum(lens) - lens, lens)  # index inside its chunk
        token_slots = np.repeat(slots, lens)
        prompt = np.repeat(starts, lens) + offset < np.repeat(prompt_lens, lens)
        n_r, n_p = len(resets), int(prompt.sum())
        n_o = len(token_ids) - n_p
        if not (n_r or len(token_ids)):
            return
        self.ensure_slots(1 + int(slots.max()))
        output = ~prompt
        # Token values: the ids themselves, or (on_device) their positions in the device's input ids.
        values = token_ids if on_device is None else on_device[1]
        packed = host_to_device(torch.from_numpy(np.concatenate(
            (resets, token_slots[prompt], values[prompt], token_slots[output], values[output]))), self.device)
        assert self.counts is not None and self.seen is not None
        if n_r:
            rows = packed[:n_r]
            self.counts.index_fill_(0, rows, 0.0)
            self.seen.index_fill_(0, rows, False)
        true = torch.ones((), dtype=torch.bool, device=self.device)
        if n_p:
            p = packed[n_r:n_r + 2 * n_p]
            p_tokens = p[n_p:] if on_device is None else on_device[0].index_select(0, p[n_p:])
            self.seen.index_put_((p[:n_p], p_tokens), true)
        if n_o:
            o = packed[n_r + 2 * n_p:]
            o_tokens = o[n_o:] if on_device is None else on_device[0].index_select(0, o[n_o:])
            self.counts.index_put_((o[:n_o], o_tokens), torch.ones((), device=self.device), accumulate=True)
            self.seen.index_put_((o[:n_o], o_tokens), true)


def apply_penalties_(logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor | None,
                     repetition: torch.Tensor | None, frequency: torch.Tensor | None,
                     presence: torch.Tensor | None) -> torch.Tensor:
    """Penalise ``logits`` ``[rows, vocab]`` in place. ``counts`` (float32) are those rows' output-token counts,
    ``seen`` their prompt-or-output tokens (needed with ``repetition``); each penalty ``[rows]`` float32, None
    when no row uses it."""
    if repetition is not None:
        if seen is None:
            raise ValueError("the repetition penalty needs the rows' seen tokens")
        penalty = torch.where(seen, repetition.unsqueeze(1), 1.0)
        torch.where(logits > 0, logits / penalty, logits * penalty, out=logits)
    if frequency is not None:
        logits.addcmul_(counts, frequency.unsqueeze(1), value=-1.0)
    if presence is not None:
        torch.where(counts > 0, logits - presence.unsqueeze(1), logits, out=logits)
    return logits
