"""Make an unmodified transformers ``Qwen3MoeForCausalLM`` DBO-capable with one call, then run it as two ubatches.

``make_dbo_capable(model, parallel)`` replaces each sparse MoE block by a FusedMoE that takes over its gate
and expert weights (this rank's experts only); the yields are inside FusedMoE. ``UBatchWrapper`` with
``split_dim="batch"`` then runs transformers' own ``forward`` on each half of the batch, the two halves
handing control to each other at every all-to-all, and concatenates the ``logits`` of the ``ModelOutput``.
The cache is off (``use_cache=False``): each ubatch would build its own, and two caches cannot be merged.

Checked against the unpatched model, on one rank and on two expert-parallel ranks (threads, gloo,
``torch_ll``): DBO off and on. Run: ``python examples/wrap_transformers_model.py``.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
import transformers

from ubatch import UBatchConfig, UBatchWrapper, set_forward_context
from ubatch.integrations.transformers import make_dbo_capable
from ubatch.modular_moe.config import MoEParallelConfig
from ubatch.testing.thread_ranks import run_thread_ranks
from ubatch.wrapper import batch_ubatch_slices

BATCH, SEQ, WORLD = 4, 12, 2
CONFIG: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
    norm_topk_prob=True, attn_implementation="eager")


def inputs(rank: int) -> dict[str, torch.Tensor]:
    """A left-padded batch (its first sequence starts 3 tokens late), different on each rank."""
    g = torch.Generator().manual_seed(10 + rank)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[0, :3] = 0
    return {"input_ids": torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=g), "attention_mask": mask}


def logits(model: torch.nn.Module, batch: dict[str, torch.Tensor], dbo: bool) -> tuple[torch.Tensor, list[int]]:
    """transformers' forward, as one batch or as two ubatches of half the sequences each."""
    if not dbo:
        return model(**batch, use_cache=False).logits, []
    wrapper = UBatchWrapper(model, UBatchConfig(num_ubatches=2, split_dim="batch"))
    try:
        with set_forward_context(ubatch_slices=batch_ubatch_slices(BATCH, 2)):
            out = wrapper(**batch, use_cache=False)
        return out.logits, wrapper.last_yield_counts
    finally:
        wrapper.close()


def rank_main(rank: int, groups: list, reference: torch.nn.Module) -> dict:
    model = copy.deepcopy(reference)  # every rank starts from the same weights
    parallel = MoEParallelConfig(ep_rank=rank, ep_size=WORLD, all2all_backend="torch_ll", ep_groups=groups,
                                 max_dispatch_tokens_per_rank=BATCH * SEQ)
    make_dbo_capable(model, parallel)  # keeps experts [rank * 4, rank * 4 + 4)
    batch = inputs(rank)
    with torch.no_grad():
        off, _ = logits(model, batch, dbo=False)
        on, yields = logits(model, batch, dbo=True)
    return {"off": off, "on": on, "yields": yields}


def main() -> int:
    torch.manual_seed(0)
    reference = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**CONFIG)).eval()
    print(f"transformers {transformers.__version__}: Qwen3MoeForCausalLM, {CONFIG['num_hidden_layers']} MoE layers, "
          f"{CONFIG['num_experts']} experts top-{CONFIG['num_experts_per_tok']}, batch {BATCH} x {SEQ} tokens")
    with torch.no_grad():
        want = {r: reference(**inputs(r), use_cache=False).logits for r in range(WORLD)}

    one = make_dbo_capable(copy.deepcopy(reference))  # one rank: the experts stay local, no all-to-all
    with torch.no_grad():
        single = {dbo: logits(one, inputs(0), dbo) for dbo in (False, True)}
    ok = True
    for dbo, (got, yields) in single.items():
        diff = (got - want[0]).abs().max().item()
        ok &= diff <= 1e-5
        print(f"1 rank, DBO {'on ' if dbo else 'off'}: max |logits - unpatched| = {diff:.1e}"
              + (f", yields per ubatch = {yields}" if dbo else ""))

    results = run_thread_ranks(WORLD, lambda rank, groups: rank_main(rank, groups, reference), num_groups=2)
    for rank, res in enumerate(results):
        for mode in ("off", "on"):
            diff = (res[mode] - want[rank]).abs().max().item()
            ok &= diff <= 1e-5
            print(f"EP rank {rank}/{WORLD}, DBO {mode:<3}: max |logits - unpatched| = {diff:.1e}"
                  + (f", yields per ubatch = {res['yields']}" if mode == "on" else ""))
    print("logits match the unpatched model" if ok else "LOGITS DIFFER")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
