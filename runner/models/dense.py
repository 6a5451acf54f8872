"""Dense decoders (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``): the standard decoder with
a SwiGLU MLP in every layer. Llama's ``attention_bias`` / ``mlp_bias``, Qwen2's QKV bias and Qwen3's per-head
q/k RMSNorm are their configs' switches. No MoE layer: DBO has nothing to overlap on these models."""
from __future__ import annotations

from runner.models.standard import StandardCausalLM


class LlamaForCausalLM(StandardCausalLM):
    pass


class Qwen2ForCausalLM(StandardCausalLM):
    pass


class Qwen3ForCausalLM(StandardCausalLM):
    pass
