"""gpt-oss and GLM4-MoE against transformers: small random checkpoints written by transformers 5 (with a trained
tokenizer), each family's own features switched on and made to matter, and greedy tokens equal to
transformers' greedy in float32, called directly, through the engine with DBO on every step, over DP=2 with
expert parallelism, and through the server with the ``openai`` client.

- gpt-oss: attention sinks and attention, router and expert biases drawn at scale 0.5 (transformers
  initialises biases to zero), a sliding window of 4 on the even layers with every prompt longer than that, the
  clamped SwiGLU with its limit lowered to 1 so that the clamps bite at this weight scale, the fused
  ``gate_up_proj [E, H, 2I]`` with alternating columns as transformers writes it, yarn RoPE (its default);
- GLM4-MoE: q/k/v biases (scale 0.5) and q/k RMSNorm, RoPE on half of each head, sigmoid routing over 4 groups (2 kept)
  with a non-zero ``e_score_correction_bias`` and ``routed_scaling_factor`` 2.5, a shared expert, one leading
  dense layer.

Each equality also shows its feature ran: DBO's ubatched steps equal the engine's steps (the server's counter is
positive); each EP rank's expert shard is compared with transformers' tensors; the features change the output
(taking the window or the sinks away fails these tests). Also: the Triton attention backend (interpreter), CUDA-
graph decode on the capture stand-in, the built-in ``tiny-gpt-oss`` / ``tiny-glm4-moe``, and the refusals.
"""
from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from devices import device_for
from openai_extra import extra_fields
from runner.attention.kv_cache import blocks_needed
from runner.distributed.launch import launch
from runner.models.loader import load_model
from runner.sampling_params import SamplingParams
from test_models_parity import BLOCK, assert_rel_close, fresh_cache, greedy_generate, run_step
from tiny_checkpoint import SENTENCES, build_tokenizer
from ubatch.modular_moe.config import MoEParallelConfig
from ubatch.modular_moe.layer import FusedMoE

transformers = pytest.importorskip("transformers")

from transformers import GenerationMixin, PreTrainedModel  # noqa: E402

WINDOW = 4
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        hidden_size=64, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=WINDOW, swiglu_limit=1.0,
        initializer_range=0.1, max_position_embeddings=256)),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        n_shared_experts=1, first_k_dense_replace=1, attention_bias=True, use_qk_norm=True,
        routed_scaling_factor=2.5, initializer_range=0.1, max_position_embeddings=256)),
}
PROMPTS = SENTENCES[:4]
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# every step of these 4-request batches runs as two ubatches: tiny thresholds, no cost model
DBO = dict(enable_dbo=True, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=2, dbo_cost_model="off")
ENGINE = dict(dtype="float32", max_num_seqs=8, dist_timeout_s=60.0)


def build_hf(family: str, vocab_size: int) -> PreTrainedModel:
    cfg_name, model_name, kwargs = FAMILIES[family]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_name)(vocab_size=vocab_size, eos_token_id=None, bos_token_id=None,
                                          pad_token_id=None, attn_implementation="eager", **kwargs)
    model = getattr(transformers, model_name)(cfg).eval()
    with torch.no_grad():  # transformers zeroes these: make them matter
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                t.normal_(0, 0.05)
            elif name.endswith(("bias", "sinks")):
                t.normal_(0, 0.5)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[PreTrainedModel, Any, Path]]:
    """family -> (transformers model, tokenizer, checkpoint directory), written once per module."""
    tok = build_tokenizer()
    out = {}
    for family in FAMILIES:
        hf = build_hf(family, len(tok))
        path = tmp_path_factory.mktemp(family)
        hf.save_pretrained(path)
        tok.save_pretrained(path)
        out[family] = (hf, tok, path)
    return out


def hf_greedy(hf: PreTrainedModel, ids: list[int], n: int = MAX_TOKENS) -> list[int]:
    assert isinstance(hf, GenerationMixin)  # a ...ForCausalLM
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def want(checkpoints) -> dict[str, list[list[int]]]:
    """transformers' greedy continuation of every prompt, per family."""
    return {f: [hf_greedy(hf, tok.encode(p)) for p in PROMPTS] for f, (hf, tok, _) in checkpoints.items()}


def test_checkpoints_have_the_features_on(checkpoints) -> None:
    hf, tok, path = checkpoints["gpt_oss"]
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert cfg["sliding_window"] == WINDOW and cfg["rope_parameters"]["rope_type"] == "yarn"
    assert all(len(tok.encode(p)) > 2 * WINDOW for p in PROMPTS)  # windows cut every prompt
    assert cfg["swiglu_limit"] == 1.0
    layer = hf.model.layers[0]
    for t in (layer.self_attn.sinks, layer.self_attn.q_proj.bias, layer.mlp.router.bias,
              layer.mlp.experts.gate_up_proj_bias, layer.mlp.experts.down_proj_bias):
        assert float(t.detach().abs().min()) > 0
    hf, _, path = checkpoints["glm4_moe"]
    glm = json.loads((path / "config.json").read_text())
    assert glm["rope_parameters"]["partial_rotary_factor"] == 0.5 and glm["use_qk_norm"] and glm["attention_bias"]
    assert glm["first_k_dense_replace"] == 1 and glm["n_group"] == 4 and glm["topk_group"] == 2
    moe = hf.model.layers[1].mlp
    for t in (hf.model.layers[1].self_attn.k_proj.bias, moe.gate.e_score_correction_bias):
        assert float(t.detach().abs().min()) > 0


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_and_chunked_greedy_equal_transformers(checkpoints, family: str) -> None:
    """The model called directly: prefill logits, then greedy decoding with one prompt prefilled in chunks."""
    hf, tok, path = checkpoints[family]
    prompts = [tok.encode(p) for p in PROMPTS[:3]]
    model, _ = load_model(str(path))
    alloc = fresh_cache(model)
    blocks = [alloc.allocate(blocks_needed(len(p), BLOCK)) for p in prompts]
    logits = run_step(model, sum(prompts, []), [0] * len(prompts), [len(p) for p in prompts], blocks)
    for p, ours in zip(prompts, logits.split([len(p) for p in prompts]), strict=True):
        with torch.no_grad():
            assert_rel_close(ours, hf(torch.tensor([p])).logits[0].float())
    ours = greedy_generate(model, prompts, 12, chunked={1: 3})
    assert ours == [hf_greedy(hf, p, 12) for p in prompts]


def _engine_run(path: str, device: str, dp: int, modes: tuple[str, ...] = ("off", "on")) -> dict[str, Any]:
    """Rank body (also run in-process for DP=1): greedy tokens with DBO off and/or on, and the steps."""
    from runner import LLM

    extra = dict(data_parallel_size=dp, enable_expert_parallel=True) if dp > 1 else {}
    result: dict[str, Any] = {}
    for name in modes:
        dbo = DBO if name == "on" else {}
        engine = LLM(model=path, device=device, **ENGINE, **extra, **dbo)
        try:
            outs = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
            stats = engine.last_stats
            result[name] = ([list(o.outputs[0].token_ids) for o in outs], stats.num_steps,
                            stats.num_ubatched_steps)
        finally:
            engine.close()
    return result


def _check_engine(result: dict[str, Any], want: list[list[int]]) -> None:
    if "off" in result:
        assert result["off"][0] == want and result["off"][2] == 0
    assert result["on"][0] == want
    assert result["on"][1] > 0 and result["on"][2] == result["on"][1]  # DBO ran on every step


@pytest.mark.parametrize("family", list(FAMILIES))
def test_engine_with_dbo_on_every_step_equals_transformers(checkpoints, want, family: str) -> None:
    _check_engine(_engine_run(str(checkpoints[family][2]), device_for(1), 1), want[family])


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_dp2_expert_parallel_equals_transformers(checkpoints, want, family: str) -> None:
    path = str(checkpoints[family][2])
    per_rank = launch(_engine_run, 2, args=(path, device_for(2), 2, ("on",)), timeout_s=240, device=device_for(2))
    assert per_rank[0] == per_rank[1]  # every rank returns every output
    _check_engine(per_rank[0], want[family])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_expert_parallel_ranks_hold_their_experts(checkpoints, family: str) -> None:
    """What each EP rank loads from the checkpoint's own layout (gpt-oss: fused, transposed, interleaved)."""
    hf, _, path = checkpoints[family]
    layer = 1  # an MoE layer in both
    for rank in range(2):
        model, _ = load_model(str(path), parallel=MoEParallelConfig(ep_rank=rank, ep_size=2))
        experts = model.get_submodule(f"model.layers.{layer}.mlp.experts")
        assert isinstance(experts, FusedMoE)
        assert experts.local_expert_range == range(4 * rank, 4 * rank + 4)
        ref = hf.model.layers[layer].mlp.experts
        local = slice(4 * rank, 4 * rank + 4)
        if family == "gpt_oss":
            gate_up = ref.gate_up_proj[local].transpose(1, 2)  # [E, 2I, H], gate/up rows alternating
            want13 = torch.cat((gate_up[:, 0::2], gate_up[:, 1::2]), dim=1)
            want_b13 = torch.cat((ref.gate_up_proj_bias[local, 0::2], ref.gate_up_proj_bias[local, 1::2]), 1)
            torch.testing.assert_close(experts.w13_bias, want_b13, rtol=0, atol=0)
            torch.testing.assert_close(experts.w2_bias, ref.down_proj_bias[local], rtol=0, atol=0)
            torch.testing.assert_close(experts.w2_weight, ref.down_proj[local].transpose(1, 2), rtol=0, atol=0)
        else:
            want13 = ref.gate_up_proj[local]
        torch.testing.assert_close(experts.w13_weight, want13, rtol=0, atol=0)


@pytest.mark.triton_interpreter
def test_gpt_oss_under_the_triton_attention_backend_equals_transformers(checkpoints, want) -> None:
    """The GPU backend's paths with sinks and windows (SDPA prefill with the sink key, chunked prefill's windowed
    masks, the decode kernel) under the interpreter, with grouped_mm experts (the GPU default) and DBO."""
    from runner import LLM

    llm = LLM(model=str(checkpoints["gpt_oss"][2]), attention_backend="triton", experts_backend="grouped_mm",
              max_num_batched_tokens=16, block_size=4, device="cpu", **ENGINE, **DBO)
    try:
        assert llm.runner.attention_backend.name == "triton"
        outs = llm.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                            use_tqdm=False)  # the interpreter is slow: 2 prompts, 4 tokens
        assert [list(o.outputs[0].token_ids) for o in outs] == [w[:4] for w in want["gpt_oss"][:2]]
        assert llm.last_stats.num_ubatched_steps > 0
    finally:
        llm.close()


# ---------------------------------------------------------------------------------------------- the server
@contextlib.contextmanager
def _server(path: Path, args: str) -> Iterator[Any]:
    from runner.entrypoints.benchserve.server_proc import ServerProcess

    srv = ServerProcess(str(path), args, startup_timeout_s=300, name=path.name)
    srv.start()
    try:
        yield srv
    finally:
        code = srv.stop()
    assert code == 0


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_server_dp2_ep_dbo_with_the_openai_client_equals_transformers(checkpoints, want, family: str) -> None:
    import openai

    from runner.entrypoints.benchserve.server_proc import scrape

    path = checkpoints[family][2]
    args = ("--device cpu --dtype float32 --max-num-seqs 8 --dist-timeout-s 30 -dp 2 --enable-expert-parallel "
            "--enable-dbo --dbo-decode-token-threshold 2 --dbo-prefill-token-threshold 2 --dbo-cost-model off")
    with _server(path, args) as srv:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        full = client.completions.create(model=str(path), prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0,
                                         extra_body={"return_token_ids": True, "ignore_eos": True})
        got = [extra_fields(ch)["token_ids"] for ch in sorted(full.choices, key=lambda ch: ch.index)]
        assert got == want[family]
        assert scrape(srv.base_url, ("ubatch:dbo_ubatched_steps_total",))["ubatch:dbo_ubatched_steps_total"] > 0


# ---------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("change, message", [
    ({"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": []}},
     r"gpt-oss checkpoints quantized with 'mxfp4' \(quantization_config.quant_method\) are not supported yet"),
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]},
     r"unsupported layer type 'chunked_attention' in layer_types"),
    ({"layer_types": ["full_attention"]}, r"layer_types has 1 entries for 3 layers"),
    ({"sliding_window": None}, r"layer_types has sliding_attention layers but sliding_window=None"),
])
def test_gpt_oss_configs_we_cannot_run_are_refused_by_name(checkpoints, tmp_path: Path, change: dict[str, Any],
                                                           message: str) -> None:
    from runner.models.loader import CheckpointError

    src = checkpoints["gpt_oss"][2]
    cfg = {**json.loads((src / "config.json").read_text()), **change}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=message):
        load_model(str(tmp_path))


@pytest.mark.parametrize("name", ["tiny-gpt-oss", "tiny-glm4-moe"])
def test_built_in_tiny_models_give_the_same_tokens_with_dbo(tmp_path: Path, name: str) -> None:
    """The built-in models (``--model tiny-gpt-oss`` / ``tiny-glm4-moe``: what a CLI or GPU check runs) load
    from the loader's own tiny checkpoint; DBO on every step changes no token."""
    from runner import LLM

    prompts = [[(11 * i + 5 * j) % 500 + 1 for j in range(n)] for i, n in enumerate([21, 6, 17, 9])]
    tokens = {}
    for mode, dbo in (("off", {}), ("on", DBO)):
        llm = LLM(model=name, cache_dir=str(tmp_path), device="cpu", **ENGINE, **dbo)
        try:
            outs = llm.generate(prompts, GREEDY, use_tqdm=False)
            tokens[mode] = [list(o.outputs[0].token_ids) for o in outs]
            assert (llm.last_stats.num_ubatched_steps > 0) == (mode == "on")
        finally:
            llm.close()
    assert tokens["on"] == tokens["off"] and all(len(t) == MAX_TOKENS for t in tokens["on"])
    assert len({tuple(t) for t in tokens["on"]}) > 1  # not one degenerate continuation


@pytest.mark.parametrize("dbo", [True, False], ids=["dbo", "no-dbo"])
def test_gpt_oss_graph_decode_replay_equals_eager(tmp_path: Path, dbo: bool) -> None:
    """CUDA-graph decode (the eager capture stand-in of ``test_cudagraph_dispatch.py``) over sinks and windowed
    layers: contexts up to 32 tokens against a window of 16, every size's replay equal to its eager step."""
    import runner.worker.cuda_graphs as manager
    from cudagraph.backends import EagerReplayBackend
    from test_cudagraph_dispatch import REPLAY_SIZES, DecodeBatches, check_replay_equals_eager, make_runner

    runner = make_runner(model="tiny-gpt-oss", cache_dir=str(tmp_path), enable_dbo=dbo)
    try:
        batches = DecodeBatches(runner, num_reqs=max(REPLAY_SIZES))
        assert max(batches.ctx) > 16  # past the window
        gr = manager.make_graph_runner(runner, backend=EagerReplayBackend(), num_warmups=0, progress=False)
        gr.capture()
        check_replay_equals_eager(runner, batches, gr, dbo, None)
        gr.clear()
    finally:
        runner.close()
