"""``auto`` with a backend-choice table: one experts backend per token-count bucket, chosen per call.

Each call runs the member its token count's bucket names (:mod:`.backend_choice`). The count is a shape, known
on the host, so choosing costs no sync and a CUDA graph captures one member per captured size (each ubatch
under DBO chooses by its own count). It is counted as the tuner counts it, and as the Triton tables are looked
up: the rows of the contiguous layout ``[M, H]`` (tokens before top-k, what ``benchmarks/tune_moe.py``'s
problems have), the capacity (rows per expert) of the masked ``[E, cap, H]`` one. The tables are measured on
the contiguous layout; the masked capacity is a fixed buffer size, so a masked layer runs one member always.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from ubatch.fp8 import Fp8Tensor
from ubatch.modular_moe.experts.backend_choice import BackendChoiceTable
from ubatch.modular_moe.experts.base import ExpertWeight, MoEExperts
from ubatch.modular_moe.types import ExpertMLPExtras, ExpertTokens

__all__ = ["BucketedExperts", "call_tokens"]


def call_tokens(tokens: ExpertTokens) -> int:
    """The token count a call is bucketed by: contiguous rows, or the masked layout's capacity."""
    return tokens.hidden.shape[1] if tokens.layout == "masked" else tokens.hidden.shape[0]


class BucketedExperts(MoEExperts):
    """Dispatches each call to the member its token count's bucket names.

    Capability flags are the intersection of the members' (what every member can do, whichever one runs);
    :meth:`run` delegates to the member's ``run``, so each member's own FP8-weight handling applies (Triton
    dequantises in its kernels, ``grouped_mm`` dequantises the weights first).
    """

    name = "auto"

    def __init__(self, table: BackendChoiceTable, members: Mapping[str, MoEExperts]) -> None:
        if set(members) != set(table.backends):
            raise ValueError(f"{table.path} runs backends {list(table.backends)}, got members {sorted(members)}")
        self.table = table
        self.members = dict(members)
        ordered = [self.members[name] for name in table.backends]
        self.supported_layouts = tuple(
            layout for layout in ordered[0].supported_layouts if all(layout in m.supported_layouts for m in ordered))
        self.supports_extras = all(m.supports_extras for m in ordered)
        self.supports_fp8_weights = all(m.supports_fp8_weights for m in ordered)
        self.accepts_fp8_activations = all(m.accepts_fp8_activations for m in ordered)
        self._by_count: dict[int, MoEExperts] = {}

    @classmethod
    def from_table(cls, table: BackendChoiceTable) -> BucketedExperts:
        """One instance of each backend the table names (``triton`` needs Triton: a clear error without it)."""
        from ubatch.modular_moe.experts import make_experts

        return cls(table, {name: make_experts(name) for name in table.backends})

    def member_for(self, num_tokens: int) -> MoEExperts:
        """The member a call with ``num_tokens`` tokens runs (cached per count: a graph's sizes are few)."""
        member = self._by_count.get(num_tokens)
        if member is None:
            member = self._by_count[num_tokens] = self.members[self.table.lookup(num_tokens)]
        return member

    def check_extras(self, extras: ExpertMLPExtras | None) -> None:
        """Refuse biases / the clamped SwiGLU when a member lacks them, naming the table and the member."""
        if extras is None:
            return
        for name, member in self.members.items():
            if not member.supports_extras:
                raise ValueError(
                    f"experts backend auto: {self.table.path} runs {name!r} at token counts "
                    f"{self.table.buckets_of(name)}, which does not implement expert biases or the clamped SwiGLU "
                    "(gpt-oss); use --experts-backend grouped_mm or torch, or a table that chooses grouped_mm only")

    def wants_power_of_two_scales(self, device: torch.device) -> bool:
        return any(m.wants_power_of_two_scales(device) for m in self.members.values())

    def run(self, tokens: ExpertTokens, w13: ExpertWeight, w2: ExpertWeight,
            extras: ExpertMLPExtras | None = None) -> torch.Tensor:
        if tokens.is_fp8 and not self.accepts_fp8_activations:
            raise TypeError("experts backend 'auto' (bucketed) does not take FP8 activations; dispatch bf16 tokens")
        self.check_extras(extras)
        return self.member_for(call_tokens(tokens)).run(tokens, w13, w2, extras)

    def apply(self, tokens: ExpertTokens, w13: torch.Tensor, w2: torch.Tensor,
              extras: ExpertMLPExtras | None = None) -> torch.Tensor:
        self.check_extras(extras)
        return self.member_for(call_tokens(tokens)).apply(tokens, w13, w2, extras)

    def apply_fp8(self, tokens: ExpertTokens, w13: Fp8Tensor, w2: Fp8Tensor,
                  extras: ExpertMLPExtras | None = None) -> torch.Tensor:
        return self.member_for(call_tokens(tokens)).apply_fp8(tokens, w13, w2, extras)
