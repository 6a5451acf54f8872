"""OLMoE (``OlmoeForCausalLM``): the standard decoder with q/k RMSNorm over the whole projection, the optional
``clip_qkv`` clamp and no top-k renormalisation by default (all set in ``OlmoeConfig``)."""
from __future__ import annotations

from runner.models.standard import StandardCausalLM


class OlmoeForCausalLM(StandardCausalLM):
    pass
