"""Mixtral (``MixtralForCausalLM``): the standard decoder with every layer routed, softmax then top-k
renormalised, experts of ``intermediate_size``.

Hub checkpoints, and what transformers 5 ``save_pretrained`` writes, name the MoE block ``block_sparse_moe``
and each expert's projections ``w1`` (gate), ``w3`` (up), ``w2`` (down); the aliases map them to the HF
in-memory names, which load too (fused ``mlp.experts.gate_up_proj`` / ``down_proj`` included).
"""
from __future__ import annotations

from runner.models.standard import StandardCausalLM

_EXPERT = r"^(model\.layers\.\d+\.mlp\.experts\.\d+)\."


class MixtralForCausalLM(StandardCausalLM):
    checkpoint_aliases = (
        (r"^(model\.layers\.\d+)\.block_sparse_moe\.", r"\1.mlp."),
        (_EXPERT + r"w1\.(weight|weight_scale_inv|weight_scale)$", r"\1.gate_proj.\2"),  # with FP8 scales
        (_EXPERT + r"w3\.(weight|weight_scale_inv|weight_scale)$", r"\1.up_proj.\2"),
        (_EXPERT + r"w2\.(weight|weight_scale_inv|weight_scale)$", r"\1.down_proj.\2"),
    )
