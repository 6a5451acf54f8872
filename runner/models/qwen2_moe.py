"""Qwen2-MoE (``Qwen2MoeForCausalLM``): the standard decoder with QKV bias, a sigmoid-gated shared expert
beside the routed ones, and ``decoder_sparse_step`` / ``mlp_only_layers`` choosing the MoE layers (all set in
``Qwen2MoeConfig``); its checkpoint names are the HF ones used by the standard decoder."""
from __future__ import annotations

from runner.models.standard import StandardCausalLM


class Qwen2MoeForCausalLM(StandardCausalLM):
    pass
