"""Sampling options end to end on a Qwen3-MoE checkpoint written by transformers, against transformers' own
``generate`` (fp32): greedy with ``repetition_penalty``, greedy with ``min_tokens`` (EOS held back), ``logprobs``
against ``log_softmax`` of its logits at every step, ``top_k=1`` at temperature 1 against greedy, and a seeded
request that samples the same tokens alone, in a mixed batch, with DBO, and on DP=2.

DBO off and on at DP 1 run in-process; DP=2 (two spawned ranks, DBO off and on) runs every workload in one
launch. DBO runs must report ubatched steps, so an equality cannot pass with DBO silently off.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from devices import device_for  # noqa: E402
from runner.distributed.launch import launch  # noqa: E402

CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
              norm_topk_prob=True, mlp_only_layers=[1], initializer_range=0.1, rope_theta=10000.0)
PROMPTS = [[5, 17, 99, 3, 42], [7, 8, 9, 10, 11, 12, 13], [200, 1, 33], [64, 64, 2, 190, 7, 7], [11, 250],
           [90, 91, 92, 93, 94, 95, 96, 97, 98]]
MAX_NEW = 12
MIN_TOKENS = 6
ENGINE: dict[str, Any] = dict(max_num_seqs=8, max_num_batched_tokens=64, block_size=4, dbo_decode_token_threshold=2,
                               dbo_prefill_token_threshold=4, dbo_cost_model="off", dist_timeout_s=60.0)


def hf_generate(hf: Any, prompt: list[int], **kwargs: Any) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0, **kwargs)
    return out[0, len(prompt):].tolist()


def truncate_at(tokens: list[int], eos: int) -> list[int]:
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, int]:
    """(transformers model, its checkpoint directory, the EOS id written into its config).

    The EOS id is a token that plain greedy generation emits among the first outputs of some prompt, so
    ``min_tokens`` has something to hold back."""
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**CONFIG, attn_implementation="eager")).eval()
    with torch.no_grad():
        plain = [hf_generate(hf, p, eos_token_id=None) for p in PROMPTS]
    eos = next(t[2] for t in plain if t[2] not in t[:2])
    hf.config.eos_token_id = eos
    hf.generation_config.eos_token_id = eos
    path = tmp_path_factory.mktemp("qwen3-eos")
    hf.save_pretrained(path)
    return hf, path, eos


@pytest.fixture(scope="module")
def references(checkpoint: tuple[Any, Path, int]) -> dict[str, list[list[int]]]:
    hf, _, eos = checkpoint
    with torch.no_grad():
        return {
            "greedy": [hf_generate(hf, p, eos_token_id=None) for p in PROMPTS],
            "repetition": [hf_generate(hf, p, eos_token_id=None, repetition_penalty=1.4) for p in PROMPTS],
            "min_tokens": [truncate_at(hf_generate(hf, p, eos_token_id=eos, min_new_tokens=MIN_TOKENS), eos)
                           for p in PROMPTS],
            "eos": [truncate_at(hf_generate(hf, p, eos_token_id=eos), eos) for p in PROMPTS],
        }


def run_workloads(path: str, **engine: Any) -> dict[str, Any]:
    """Every workload on one engine (one rank of it when DP > 1); tokens per prompt in input order and the
    number of ubatched steps. Module level: DP ranks run it after being spawned."""
    from runner.entrypoints.llm import LLM
    from runner.sampling_params import SamplingParams

    llm = LLM(model=path, **ENGINE, **engine)

    def seeded() -> SamplingParams:
        return SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=MAX_NEW, ignore_eos=True)

    results: dict[str, Any] = {}
    try:
        def gen(name: str, prompts: list[list[int]], params: Any) -> None:
            outs = llm.generate(prompts, params, use_tqdm=False)
            results[name] = [list(o.outputs[0].token_ids) for o in outs]
            assert llm.last_stats is not None
            results[name + "/ubatched"] = llm.last_stats.num_ubatched_steps

        gen("greedy", PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
        gen("repetition", PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True,
                                                  repetition_penalty=1.4))
        gen("min_tokens", PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MIN_TOKENS))
        gen("eos", PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
        gen("top_k_1", PROMPTS, SamplingParams(temperature=1.0, top_k=1, max_tokens=MAX_NEW, ignore_eos=True))
        # the seeded request alone, then at position 3 of a batch whose other requests use other options
        gen("seeded_alone", PROMPTS[3:4], seeded())
        others = [SamplingParams(temperature=0.7, top_k=20, max_tokens=MAX_NEW, ignore_eos=True),
                  SamplingParams(temperature=0.0, max_tokens=5, repetition_penalty=1.2, ignore_eos=True),
                  SamplingParams(temperature=1.3, min_p=0.1, presence_penalty=0.5, max_tokens=9, ignore_eos=True),
                  seeded(),
                  SamplingParams(temperature=0.9, frequency_penalty=0.3, logit_bias={7: 3.0}, max_tokens=MAX_NEW,
                                 ignore_eos=True),
                  SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)]
        gen("seeded_batch", PROMPTS, others)
    finally:
        llm.close()
    return results


@pytest.fixture(scope="module")
def single(checkpoint: tuple[Any, Path, int]) -> dict[bool, dict[str, Any]]:
    _, path, _ = checkpoint
    return {dbo: run_workloads(str(path), enable_dbo=dbo, device=device_for(1)) for dbo in (False, True)}


def _dp_rank(path: str) -> dict[bool, dict[str, Any]]:
    """One DP=2 rank: the workloads with DBO off, then on."""
    dp = dict(data_parallel_size=2, enable_expert_parallel=True, all2all_backend="torch_ll", device=device_for(2))
    return {dbo: run_workloads(path, enable_dbo=dbo, **dp) for dbo in (False, True)}


@pytest.fixture(scope="module")
def dp2(checkpoint: tuple[Any, Path, int]) -> dict[bool, list[dict[str, Any]]]:
    """{dbo: [rank 0's results, rank 1's results]} from one launch."""
    _, path, _ = checkpoint
    ranks = launch(_dp_rank, 2, (str(path),), timeout_s=240, device=device_for(2))
    return {dbo: [r[dbo] for r in ranks] for dbo in (False, True)}


def engines(single: dict[bool, dict[str, Any]], dp2: dict[bool, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    return {"dp1": single[False], "dp1-dbo": single[True], "dp2": dp2[False][0], "dp2-dbo": dp2[True][0]}


def test_dbo_runs_ubatched(single: dict[bool, dict[str, Any]], dp2: dict[bool, list[dict[str, Any]]]) -> None:
    for name, res in engines(single, dp2).items():
        for workload in ("greedy", "repetition", "min_tokens", "seeded_batch"):
            assert (res[workload + "/ubatched"] > 0) == name.endswith("dbo"), (name, workload)
    for dbo in (False, True):  # every rank returns every output, in input order (ubatched steps are per rank)
        tokens = [{k: v for k, v in r.items() if not k.endswith("/ubatched")} for r in dp2[dbo]]
        assert tokens[0] == tokens[1]


@pytest.mark.parametrize("workload", ["greedy", "repetition", "min_tokens", "eos"])
def test_greedy_generation_equals_transformers(single: dict[bool, dict[str, Any]],
                                               dp2: dict[bool, list[dict[str, Any]]],
                                               references: dict[str, list[list[int]]], workload: str) -> None:
    for name, res in engines(single, dp2).items():
        assert res[workload] == references[workload], f"{name}: {workload}"


def test_the_options_change_the_tokens(references: dict[str, list[list[int]]], checkpoint: Any) -> None:
    """Proof the comparisons above exercise the options: the penalty changes greedy output, and min_tokens holds
    back an EOS that plain greedy emits before MIN_TOKENS outputs."""
    _, _, eos = checkpoint
    assert references["repetition"] != references["greedy"]
    assert any(len(t) < MIN_TOKENS and t[-1] == eos for t in references["eos"])
    assert all(len(t) >= MIN_TOKENS for t in references["min_tokens"])


def test_top_k_one_at_temperature_one_equals_greedy(single: dict[bool, dict[str, Any]],
                                                    dp2: dict[bool, list[dict[str, Any]]]) -> None:
    for name, res in engines(single, dp2).items():
        assert res["top_k_1"] == res["greedy"], name


def test_a_seeded_request_is_the_same_alone_in_a_batch_with_dbo_and_dp2(
        single: dict[bool, dict[str, Any]], dp2: dict[bool, list[dict[str, Any]]]) -> None:
    alone = single[False]["seeded_alone"][0]
    assert alone != single[False]["greedy"][3], "the seeded draw must differ from greedy to mean anything"
    for name, res in engines(single, dp2).items():
        assert res["seeded_alone"] == [alone], name
        assert res["seeded_batch"][3] == alone, name  # on DP=2 it runs on rank 1, next to other requests
        assert [len(t) for t in res["seeded_batch"]] == [MAX_NEW, 5, 9, MAX_NEW, MAX_NEW, 3]


def test_logprobs_equal_log_softmax_of_transformers_logits(checkpoint: tuple[Any, Path, int]) -> None:
    """Through the engine core (``EngineCoreOutput.new_logprobs``): at every step the sampled token's logprob,
    its rank and the top 4 equal ``log_softmax`` of transformers' logits for the same prefix (1e-4)."""
    from runner.config import make_config
    from runner.core.engine_core import EngineCore
    from runner.core.requests import EngineCoreRequest
    from runner.sampling_params import SamplingParams
    from runner.worker.model_runner import ModelRunner

    hf, path, _ = checkpoint
    cfg = make_config(model=str(path), device=device_for(1), **ENGINE)
    core = EngineCore(cfg, ModelRunner(cfg))
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=4),
              SamplingParams(temperature=0.8, seed=5, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0,
                             repetition_penalty=1.3),
              SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)]
    tokens: dict[int, list[int]] = {i: [] for i in range(3)}
    logprobs: dict[int, list[Any]] = {i: [] for i in range(3)}
    try:
        for i, p in enumerate(params):
            core.add_request(EngineCoreRequest(i, PROMPTS[i], p))
        for _ in range(10 * MAX_NEW):
            step = core.step()
            for o in step.outputs:
                tokens[o.request_id] += o.new_token_ids
                if o.new_logprobs is not None:
                    logprobs[o.request_id] += o.new_logprobs
            if not step.running:
                break
    finally:
        core.close()
    assert logprobs[2] == [] and all(len(tokens[i]) == MAX_NEW for i in range(3))
    for i in (0, 1):
        assert [e.token_id for e in logprobs[i]] == tokens[i]
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPTS[i] + tokens[i]])).logits[0, len(PROMPTS[i]) - 1:-1]
        ref = torch.log_softmax(logits.float(), dim=-1)
        for k, entry in enumerate(logprobs[i]):
            assert entry.logprob == pytest.approx(ref[k, entry.token_id].item(), abs=1e-4), (i, k)
            assert entry.rank == int((ref[k] >= ref[k, entry.token_id] - 1e-6).sum()), (i, k)
            n = params[i].logprobs
            assert n is not None
            top = ref[k].topk(n)
            assert entry.top_token_ids == top.indices.tolist(), (i, k)
            assert entry.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-4), (i, k)
    assert {e.rank for e in logprobs[0]} == {1}  # greedy: the sampled token is the most likely
    assert max(e.rank for e in logprobs[1]) > 1  # sampled (and penalised): not always the top token
