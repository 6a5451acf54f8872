"""Small random checkpoints of the standard decoder families, written by transformers with each family's own
features switched on (projection biases, shared expert gate, q/k norms, clip_qkv, dense layers among MoE ones),
for the parity tests against transformers (``test_models_standard.py``, ``test_serve_standard.py``).

transformers initialises biases to zero and norm weights to one; :func:`make_hf` draws them at random, so a
bias or a norm that our model dropped or misplaced changes the logits.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              initializer_range=0.1, max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=None,
              bos_token_id=None, pad_token_id=None)
MOE = dict(num_experts_per_tok=2)

# name -> (transformers config class, model class, kwargs)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {**COMMON, **MOE, "num_local_experts": 8, "intermediate_size": 32, "sliding_window": None}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  {**COMMON, **MOE, "num_experts": 8, "moe_intermediate_size": 32, "intermediate_size": 96,
                   "shared_expert_intermediate_size": 48, "decoder_sparse_step": 1, "mlp_only_layers": [1],
                   "norm_topk_prob": False}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              {**COMMON, **MOE, "num_experts": 8, "intermediate_size": 32, "norm_topk_prob": False,
               "clip_qkv": 1.5, "attention_bias": True}),
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              {**COMMON, "intermediate_size": 96, "attention_bias": True, "mlp_bias": True, "head_dim": 24}),
    # Llama 3's RoPE scaling, with an original context short enough that every frequency band is hit
    "llama-rope3": ("LlamaConfig", "LlamaForCausalLM",
                    {**COMMON, "intermediate_size": 96, "rope_parameters": {
                        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {**COMMON, "intermediate_size": 96}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              {**COMMON, "intermediate_size": 96, "head_dim": 24, "attention_bias": True}),
}
MOE_FAMILIES = ("mixtral", "qwen2_moe", "olmoe")
DENSE_FAMILIES = ("llama", "llama-rope3", "qwen2", "qwen3")
#: layers whose MLP is routed, as the configs above say (Qwen2-MoE's layer 1 is in mlp_only_layers)
MOE_LAYERS = {"mixtral": 3, "qwen2_moe": 2, "olmoe": 3}


def make_hf(family: str, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    import transformers

    cfg_name, model_name, kwargs = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_name)(**{**kwargs, **overrides}, attn_implementation="eager")
    model = getattr(transformers, model_name)(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
    return model
