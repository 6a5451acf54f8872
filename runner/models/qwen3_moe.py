"""Qwen3-MoE (``Qwen3MoeForCausalLM``): the standard decoder (``runner/models/standard.py``) with per-head q/k
RMSNorm before RoPE and routed experts where ``decoder_sparse_step`` / ``mlp_only_layers`` say (all set in
``Qwen3MoeConfig``); its checkpoint names are the HF ones used by the standard decoder."""
from __future__ import annotations

from runner.models.standard import StandardCausalLM


class Qwen3MoeForCausalLM(StandardCausalLM):
    pass
