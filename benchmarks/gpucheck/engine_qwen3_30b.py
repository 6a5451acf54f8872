"""The optional ``engine_qwen3_30b`` part: the engine on a Qwen3-30B-A3B-shaped model with random weights.

Qwen3-30B-A3B (48 layers, 128 experts of 768 of which 8 per token, hidden 2048, 32 query and 4 KV heads of 128,
vocabulary 151,936) is 61 GB in bf16: too much to write as a checkpoint in the check's time. So the part writes
its ``config.json`` alone (the shape of ``bench_gpu.QWEN3_30B_A3B`` plus the fields of the published config the
engine reads) and runs ``gpucheck.engine_run`` on it with ``--load-format dummy``: the engine draws the weights
on the GPU. The workload is the ``engine`` part's (256 prompts x 128 new tokens, greedy, default flags), so its
output tok/s compares with vLLM's published figures for this model, per layer as ``bench_gpu``'s ``qwen3-30b``
section times it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench_gpu import QWEN3_30B_A3B

NAME = "qwen3-30b-a3b-shape"
# Qwen/Qwen3-30B-A3B's config.json, the fields the engine reads (the shape itself is QWEN3_30B_A3B's)
CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "torch_dtype": "bfloat16",
    "vocab_size": 151936, "intermediate_size": 6144, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "tie_word_embeddings": False, "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645,
    **QWEN3_30B_A3B,
}


def write_config(parent: Path) -> Path:
    """``parent/NAME/config.json``; returns the directory (a model directory the engine loads with
    ``load_format='dummy'``)."""
    path = parent / NAME
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(CONFIG, indent=2))
    return path
