"""An FP8 DeepSeek-V3 layout (MLA, a shared expert, a dense first layer, partial blocks) through the offline ``LLM``:
greedy tokens with DBO on every step, on one rank and over DP=2 with EP, equal transformers' on the dequantised
weights; ``quantization='fp8'`` reaches the loader."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from devices import device_for
from fp8_checkpoint import Fp8Pair, write_fp8_pair
from runner.distributed.launch import launch
from runner.sampling_params import SamplingParams
from ubatch.fp8 import FP8_DTYPE

transformers = pytest.importorskip("transformers")

from test_fp8_checkpoints import make_hf  # noqa: E402

PROMPTS = [[5, 17, 99, 3, 42], [7, 8, 9, 10, 11, 12, 13, 14, 15], [200, 1, 33], [60, 61, 62, 63]]
GREEDY: dict[str, Any] = dict(temperature=0.0, max_tokens=8, ignore_eos=True)
# tiny thresholds and no cost model: every step of these batches runs as two ubatches
DBO = dict(enable_dbo=True, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=4, dbo_cost_model="off")
ENGINE = dict(dtype="float32", max_num_seqs=8, dist_timeout_s=60.0)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Fp8Pair:
    return write_fp8_pair(make_hf("dsv3"), tmp_path_factory.mktemp("dsv3-fp8"))


@pytest.fixture(scope="module")
def want(pair: Fp8Pair) -> list[list[int]]:
    """transformers' greedy tokens on the dequantised weights."""
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(pair.reference, attn_implementation="eager").eval()
    out = []
    for p in PROMPTS:
        ids = hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(ids[0, len(p):].tolist())
    return out


def _greedy_with_dbo(path: str, device: str, dp: int) -> dict[str, Any]:
    """Rank body (also run in-process for DP=1): greedy tokens with DBO on every step, and the ubatched steps."""
    from runner import LLM

    extra = dict(data_parallel_size=dp, enable_expert_parallel=True) if dp > 1 else {}
    engine = LLM(model=path, device=device, **ENGINE, **extra, **DBO)
    try:
        outs = engine.generate(PROMPTS, SamplingParams(**GREEDY), use_tqdm=False)
        return {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                "ubatched": engine.last_stats.num_ubatched_steps}
    finally:
        engine.close()


@pytest.mark.parametrize("dp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_fp8_deepseek_v3_with_dbo_on_every_step_equals_transformers(pair: Fp8Pair, want: list[list[int]],
                                                                    dp: int) -> None:
    if dp == 1:
        result = _greedy_with_dbo(str(pair.fp8), device_for(1), 1)
    else:
        per_rank = launch(_greedy_with_dbo, 2, args=(str(pair.fp8), device_for(2), 2), timeout_s=240,
                          device=device_for(2))
        assert per_rank[0]["tokens"] == per_rank[1]["tokens"]
        result = per_rank[0]
    assert result["tokens"] == want
    assert result["ubatched"] > 0


def test_the_quantization_argument_reaches_the_loader(pair: Fp8Pair) -> None:
    from runner import LLM

    engine = LLM(model=str(pair.reference), device=device_for(1), quantization="fp8", **ENGINE)
    try:
        model = engine.model_runner.model
        assert model.model.layers[1].mlp.experts.w13_weight.dtype == FP8_DTYPE
        assert model.model.layers[0].self_attn.kv_a_proj_with_mqa.weight.dtype == FP8_DTYPE
        (out,) = engine.generate([PROMPTS[0]], SamplingParams(**GREEDY), use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 8
    finally:
        engine.close()
    plain = LLM(model=str(pair.reference), device=device_for(1), **ENGINE)
    try:
        assert plain.model_runner.model.model.layers[1].mlp.experts.w13_weight.dtype == torch.float32
    finally:
        plain.close()
