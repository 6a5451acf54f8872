"""Per-layer attention options: a sliding window and attention sinks, which every backend honours.

- ``sliding_window`` ``W``: a query at position ``p`` sees only the keys at positions ``(p - W, p]`` (the
  last ``W`` positions, itself included; transformers' ``sliding_window_overlay``, vLLM's window of ``W``).
  ``None``: every earlier key. gpt-oss alternates windowed and full layers; Mixtral may window all of them.
- ``sinks`` fp32 ``[Hq]``: one learned logit per query head that joins every softmax as an extra column with
  no value (gpt-oss): ``p_j = exp(s_j) / (exp(sink) + sum_k exp(s_k))``, so a head may attend to nothing.

Options are built by a layer on every call from its own parameters (never stored on a module: loading
replaces the parameter tensors); ``None`` means neither, and costs nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionOptions:
    sliding_window: int | None = None
    sinks: torch.Tensor | None = None

    def __post_init__(self) -> None:
        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"sliding_window must be a positive int or None, got {w!r}")
        if self.sinks is not None and self.sinks.dim() != 1:
            raise ValueError(f"sinks must be one logit per query head [Hq], got shape {tuple(self.sinks.shape)}")

    def check_heads(self, num_q_heads: int) -> None:
        if self.sinks is not None and self.sinks.shape[0] != num_q_heads:
            raise ValueError(f"{self.sinks.shape[0]} attention sinks for {num_q_heads} query heads")


def window_of(options: AttentionOptions | None) -> int | None:
    return None if options is None else options.sliding_window


def sinks_of(options: AttentionOptions | None) -> torch.Tensor | None:
    return None if options is None else options.sinks


def visible(key_pos: torch.Tensor, query_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Bool mask, True where a key at ``key_pos`` is visible from ``query_pos`` (broadcast): causal, windowed."""
    ok = key_pos <= query_pos
    if window is not None:
        ok = ok & (key_pos > query_pos - window)
    return ok


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None, head_shape: tuple[int, ...],
                       dtype: torch.dtype) -> torch.Tensor:
    """``softmax(scores, -1)`` in fp32 cast to ``dtype``; with sinks, each head's sink logit joins the softmax
    as one more column, then is dropped. ``head_shape`` places the ``[Hq]`` sinks in ``scores``' leading dims
    (e.g. ``(1, Hkv, G, 1)`` for scores ``[R, Hkv, G, S]``)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)
    col = sinks.to(torch.float32).view(head_shape).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat((scores.float(), col), dim=-1), dim=-1)
    return probs[..., :-1].to(dtype)
