"""DP=2 real processes: the phase-aware all-to-all and both DP ubatch rules give exactly the DBO-off tokens.

One launch runs every engine variant over every workload (launches are the expensive part). Each variant
also reports what it actually did -- ubatched steps, which all-to-all layouts its MoE layers used -- so an
equality cannot pass because the feature never ran.
"""
from __future__ import annotations

from typing import Any

import pytest

from devices import device_for
from runner.distributed.launch import launch

# one rank's results: (variant, workload) -> tokens and step counts; (variant, "layouts") -> the layouts used
Results = dict[tuple[str, str], Any]
BASE: dict[str, Any] = dict(
    model="tiny-qwen3-moe", data_parallel_size=2, enable_expert_parallel=True,
    dbo_decode_token_threshold=2, dbo_prefill_token_threshold=8, max_num_batched_tokens=64, max_num_seqs=3,
    dbo_cost_model="off", dist_timeout_s=60.0,  # DBO wherever the thresholds and the DP rule allow
    device=device_for(2))
VARIANTS: dict[str, dict[str, Any]] = {
    "ll-off": dict(all2all_backend="torch_ll", enable_dbo=False),
    "ht-off": dict(all2all_backend="torch_ht", enable_dbo=False),
    "auto-off": dict(all2all_backend="auto", enable_dbo=False),
    "ll-dbo": dict(all2all_backend="torch_ll", enable_dbo=True),
    "ht-dbo": dict(all2all_backend="torch_ht", enable_dbo=True),
    "auto-dbo": dict(all2all_backend="auto", enable_dbo=True),  # the default rule: sglang
    "auto-dbo-vllm": dict(all2all_backend="auto", enable_dbo=True, dbo_dp_rule="vllm"),
}


def _prompts(lengths: list[int], salt: int) -> list[list[int]]:
    return [[(salt * 97 + 13 * i + 31 * j) % 509 for j in range(n)] for i, n in enumerate(lengths)]


# Prompt i runs on rank i % 2. name -> (prompts, max_tokens per prompt)
WORKLOADS = {
    # prefill steps, then decodes with 2-3 sequences per rank (the decode threshold is 2)
    "prefill+decode": (_prompts([9, 14, 5, 12, 7, 10], 1), [6] * 6),
    # three seats per rank and staggered lengths: waiting prompts are prefilled into steps where the running
    # ones decode, on one rank while the other rank decodes only (mixed within and across ranks)
    "mixed prefill and decode": (_prompts([9, 4, 6, 11, 5, 7, 8, 3, 10, 6], 5), [3, 9, 5, 2, 8, 4, 6, 7, 2, 5]),
    # rank 1's requests end after 2 tokens while rank 0 keeps decoding 3 sequences: rank 1 is idle
    "idle rank": (_prompts([6, 4, 7, 6, 5, 8], 2), [12, 2, 12, 2, 12, 2]),
    # rank 0 decodes 3 sequences, rank 1 only 1 (under the threshold) for most steps
    "one rank under the threshold": (_prompts([5, 6, 7, 6, 5, 4], 3), [10, 10, 10, 2, 10, 2]),
    # one sequence per rank: both under the threshold, nobody ubatches under either rule
    "all under the threshold": (_prompts([4, 5], 4), [6, 6]),
}


def run_variants() -> Results:
    """Rank body: every workload under every variant; tokens, ubatched steps and the layouts each used."""
    from runner.entrypoints.llm import LLM
    from runner.sampling_params import SamplingParams
    from ubatch.modular_moe.layer import FusedMoE

    out: Results = {}
    for variant, settings in VARIANTS.items():
        llm = LLM(**BASE, **settings)
        try:
            for name, (prompts, max_tokens) in WORKLOADS.items():
                outs = llm.generate(prompts, [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens],
                                    use_tqdm=False)
                assert llm.last_stats is not None
                out[(variant, name)] = {"tokens": [o.outputs[0].token_ids for o in outs],
                                        "ubatched": llm.last_stats.num_ubatched_steps,
                                        "steps": llm.last_stats.num_steps}
            layers = [m for m in llm.model_runner.model.modules() if isinstance(m, FusedMoE)]
            out[(variant, "layouts")] = sorted(set().union(*(m._kernels for m in layers)))
        finally:
            llm.close()
    return out


@pytest.fixture(scope="module")
def results() -> list[Results]:
    return launch(run_variants, 2, timeout_s=240, device=device_for(2))


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_every_variant_gives_the_dbo_off_tokens(results: list[Results], workload: str) -> None:
    reference = results[0][("ll-off", workload)]["tokens"]
    assert len(reference) == len(WORKLOADS[workload][0]) and all(reference)
    for variant in VARIANTS:
        assert results[0][(variant, workload)]["tokens"] == reference, f"{variant} differs on {workload}"


def test_the_phase_aware_backend_used_both_layouts(results: list[Results]) -> None:
    for rank in (0, 1):
        assert results[rank][("auto-dbo", "layouts")] == ["torch_ht", "torch_ll"]
        assert results[rank][("auto-off", "layouts")] == ["torch_ht", "torch_ll"]
        assert results[rank][("ll-dbo", "layouts")] == ["torch_ll"]
        assert results[rank][("ht-dbo", "layouts")] == ["torch_ht"]


def test_dbo_ran_where_each_rule_says(results: list[Results]) -> None:
    r0 = results[0]
    for variant in ("ll-dbo", "ht-dbo", "auto-dbo", "auto-dbo-vllm"):
        assert r0[(variant, "prefill+decode")]["ubatched"] > 0
    for variant in ("ll-off", "ht-off", "auto-off"):
        assert all(r0[(variant, w)]["ubatched"] == 0 for w in WORKLOADS)
    for workload in ("idle rank", "one rank under the threshold"):
        sglang, vllm = r0[("auto-dbo", workload)], r0[("auto-dbo-vllm", workload)]
        assert sglang["steps"] == vllm["steps"]
        # SGLang's rule keeps overlapping while rank 1 idles or runs a small batch; vLLM's stops.
        assert sglang["ubatched"] > vllm["ubatched"], (workload, sglang, vllm)
    for variant in ("auto-dbo", "auto-dbo-vllm"):
        assert r0[(variant, "all under the threshold")]["ubatched"] == 0
