"""DeepSeek's decode pipeline (``--dbo-schedule deepseek``) on the tiny DeepSeek-V3 over 2 EP thread ranks.

Checked: the traced compute and all-to-all order is the published one (deepseek-ai/profile-data,
``assets/decode.jpg``); every ubatch -- padding-only and idle ones included -- yields equally often; the
outputs equal the ``moe`` schedule's and DBO off's; and the settings are validated.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from devices import device_for
from runner.attention.kv_cache import allocate_kv_caches, build_attention_metadata
from runner.config import ConfigError, RunnerConfig
from runner.models.loader import load_model, resolve_model_path
from runner.models.schedules import DBOSchedule, check_schedule
from ubatch import UBatchConfig, UBatchWrapper, set_forward_context, trace
from ubatch.forward_context import DPMetadata
from ubatch.modular_moe.config import MoEParallelConfig
from ubatch.slicing import padded_ubatch_slices
from ubatch.testing.thread_ranks import run_thread_ranks
from ubatch.trace_metrics import TimedSpan, spans_from_chrome

MODEL = "tiny-deepseek-v3"  # 3 layers: layer 0 dense (first_k_dense_replace=1), layers 1-2 MoE
LAYERS, MOE_LAYERS = 3, (1, 2)
BLOCK = 4
LINK = "latency_us=300,gbps=1"
# Per rank: the context length of each decode request (prefilled first, DBO off, so every run starts equal).
CONTEXTS = {0: [5, 3, 6, 4, 2, 7], 1: [4, 6, 3, 5, 7, 2]}
# The loader swaps torch.nn.init's functions for no-ops while it builds a model (process-global state):
# two rank threads must not build at the same time.
LOAD_LOCK = threading.Lock()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models")
    resolve_model_path(MODEL, path)  # written once, before the ranks race for it
    return path


def _blocks(num_reqs: int, per: int = 4) -> list[list[int]]:
    return [list(range(i * per, (i + 1) * per)) for i in range(num_reqs)]


def run_decode_step(cache_dir: Path, *, schedule: str, dbo: bool, backend: str = "torch_ll",
                    real: dict[int, int] | None = None, padded: int | None = None,
                    record: trace.TraceRecorder | None = None, any_prefill: bool | None = None) -> list[dict[str, Any]]:
    """Prefill each rank's requests (DBO off), then one decode step as configured; per rank: hidden, yields.

    ``real``: decode tokens per rank (default: all its requests; 0 = an idle rank); ``padded``: rows every
    rank runs (DP padding, routed nowhere). ``record``: trace the decode step only. ``any_prefill``: pass a
    DPMetadata with that phase (None: no DP metadata, as outside the engine).
    """
    barrier = threading.Barrier(2)

    def rank_main(rank: int, groups: list[Any]) -> dict[str, Any]:
        parallel = MoEParallelConfig(ep_rank=rank, ep_size=2, all2all_backend=backend, ep_groups=groups,
                                     max_dispatch_tokens_per_rank=32, emulate_link=LINK)
        with LOAD_LOCK:
            model, _ = load_model(MODEL, parallel, cache_dir=cache_dir)
        model.set_dbo_schedule(schedule)
        model.bind_kv_caches(allocate_kv_caches(model.kv_cache_specs(), 64, BLOCK, torch.float32))
        ctx = CONTEXTS[rank]
        blocks = _blocks(len(ctx))
        gen = torch.Generator().manual_seed(rank)
        prefill = build_attention_metadata([0] * len(ctx), ctx, blocks, BLOCK)
        with torch.no_grad(), set_forward_context(prefill):
            model(torch.randint(0, 512, (sum(ctx),), generator=gen), prefill.positions)

        n = len(ctx) if real is None or rank not in real else real[rank]
        rows = n if padded is None else padded
        meta = build_attention_metadata(ctx[:n], [1] * n, blocks[:n], BLOCK, num_padded_tokens=rows)
        ids = torch.zeros(rows, dtype=torch.int64)
        ids[:n] = torch.randint(0, 512, (n,), generator=gen)
        mask = (torch.arange(rows) < n) if rows > n else None
        slices = padded_ubatch_slices([1] * n, rows, 2) if dbo else None
        dp = None if any_prefill is None else DPMetadata((n, n), num_real_tokens=n, any_prefill=any_prefill)
        wrapper = UBatchWrapper(model, UBatchConfig(num_ubatches=2, handoff_timeout_s=30))
        # The recorder is process-global, so one rank installs it, and it must be in place before *either*
        # rank starts the step: installed after the barrier that releases both, a rank that got there first
        # had its first spans (and the layer they set for its later comm spans) go unrecorded.
        recording = trace.recording(record) if record is not None and rank == 0 else contextlib.nullcontext()
        try:
            with recording:
                barrier.wait()
                with torch.no_grad(), set_forward_context(meta, ubatch_slices=slices, trace_rank=rank,
                                                          dp_metadata=dp, real_token_mask=mask):
                    hidden = wrapper(input_ids=ids, positions=meta.positions)
                if record is not None:
                    barrier.wait()  # removed only once both ranks finished the step
        finally:
            wrapper.close()
        return {"hidden": hidden[:n], "yields": wrapper.last_yield_counts}

    return run_thread_ranks(2, rank_main, num_groups=2, timeout_s=120)


# ---- the published order -------------------------------------------------------------------------------
def published_cycle(layer: int) -> list[tuple[str, int, int]]:
    """DeepSeek's decode figure for one MoE layer: (phase, micro-batch, layer) in compute-stream order.

    SHARED(0) ATTN-0(1) | MLP(0) | ATTN-1(1) SHARED(1) ATTN-0(0) | MLP(1) | ATTN-1(0), where micro-batch 0's
    ATTN-0/ATTN-1 after its MLP belong to the next layer (left out after the last one).
    """
    cycle = [("S", 0, layer), ("A0", 1, layer), ("E", 0, layer), ("A1", 1, layer), ("S", 1, layer),
             ("A0", 0, layer + 1), ("E", 1, layer), ("A1", 0, layer + 1)]
    return [c for c in cycle if c[2] < LAYERS]


# The whole step on the tiny model, stage by stage (ubatch 1 starts one stage behind): the dense layer 0
# fills the pipeline, then layers 1 and 2 repeat the published cycle.
FULL_ORDER = [("A0", 0, 0), ("A1", 0, 0), ("A0", 0, 1), ("A0", 1, 0), ("A1", 0, 1), ("S", 0, 1), ("A1", 1, 0),
              ("A0", 1, 1), ("E", 0, 1), ("A1", 1, 1), ("S", 1, 1), ("A0", 0, 2), ("E", 1, 1), ("A1", 0, 2),
              ("S", 0, 2), ("A0", 1, 2), ("E", 0, 2), ("A1", 1, 2), ("S", 1, 2), ("E", 1, 2)]


@pytest.fixture(scope="module", params=["torch_ll", "torch_ht"])
def staged_trace(request: pytest.FixtureRequest, cache_dir: Path) -> dict[str, Any]:
    rec = trace.TraceRecorder()
    run_decode_step(cache_dir, schedule="deepseek", dbo=True, backend=request.param, record=rec)
    return trace.to_chrome_trace(rec)


def _stages(spans: list[TimedSpan]) -> tuple[list[TimedSpan], dict[tuple[str, int, int], TimedSpan]]:
    """Compute spans of the four stages in start order, and every stage/comm span by (phase, ubatch, layer)."""
    compute = sorted((s for s in spans if s.cat == "compute" and s.args.get("phase") in ("A0", "A1", "S", "E")),
                     key=lambda s: s.start)
    keyed: dict[tuple[str, int, int], TimedSpan] = {}
    for s in compute + [s for s in spans if s.cat == "comm"]:
        phase = s.args["phase"] if s.cat == "compute" else {"dispatch": "D", "combine": "C"}[s.name.rstrip("01")]
        ubatch = trace.ubatch_of_track(s.track)
        assert ubatch is not None, f"{s.name} on {s.track}: not a ubatch's track"
        key = (phase, ubatch, s.args["layer"])
        assert key not in keyed, f"{key} recorded twice"
        keyed[key] = s
    return compute, keyed


@pytest.mark.parametrize("pid", [0, 1])
def test_staged_step_follows_deepseeks_published_decode_order(staged_trace: dict[str, Any], pid: int) -> None:
    _, spans = spans_from_chrome(staged_trace, pid)
    compute, seg = _stages(spans)
    order = [(s.args["phase"], trace.ubatch_of_track(s.track), s.args["layer"]) for s in compute]
    assert order == FULL_ORDER
    assert all(a.end <= b.start for a, b in itertools.pairwise(compute))  # one ubatch computes at a time
    moe_only = [o for o in order if o[2] in MOE_LAYERS]
    for layer in MOE_LAYERS:
        cycle = published_cycle(layer)
        i = moe_only.index(cycle[0])
        assert moe_only[i:i + len(cycle)] == cycle, f"layer {layer} is not the published cycle"
    assert {k[0] for k in seg if k[0] in "DC"} == {"D", "C"}
    for layer in MOE_LAYERS:
        nxt = layer + 1 < LAYERS
        for u in (0, 1):
            d, c = seg["D", u, layer], seg["C", u, layer]
            assert d.start <= seg["S", u, layer].start  # SHARED runs while its own dispatch flies
            assert d.end <= seg["E", u, layer].start  # MLP only once the tokens landed
            assert seg["E", u, layer].end <= c.start  # the combine ships the MLP's output
        # DISPATCH(0) under SHARED(0)+ATTN-0(1); COMBINE(0) under ATTN-1(1), done before SHARED(1)
        assert seg["D", 0, layer].start <= seg["A0", 1, layer].start
        assert seg["C", 0, layer].start <= seg["A1", 1, layer].start
        assert seg["C", 0, layer].end <= seg["S", 1, layer].start
        if nxt:  # DISPATCH(1) under SHARED(1)+ATTN-0(0); COMBINE(1) under ATTN-1(0) of the next layer
            assert seg["D", 1, layer].start <= seg["A0", 0, layer + 1].start
            assert seg["C", 1, layer].start <= seg["A1", 0, layer + 1].start
            assert seg["C", 1, layer].end <= seg["S", 0, layer + 1].start
    yields = [e for e in staged_trace["traceEvents"] if e["ph"] == "i" and e["name"] == "yield" and e["pid"] == pid]
    per_ubatch = 1 * LAYERS + 2 * len(MOE_LAYERS) + 1  # a boundary per layer, 2 per MoE kernel, the offset
    assert len(yields) == 2 * per_ubatch


# ---- outputs and yield counts -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(cache_dir: Path) -> list[torch.Tensor]:
    return [r["hidden"] for r in run_decode_step(cache_dir, schedule="moe", dbo=False)]


YIELDS = {"moe": 2 * len(MOE_LAYERS), "deepseek": LAYERS + 2 * len(MOE_LAYERS) + 1}


@pytest.mark.parametrize("backend", ["torch_ll", "torch_ht"])
def test_outputs_equal_the_moe_schedule_and_dbo_off(cache_dir: Path, reference: list[torch.Tensor],
                                                     backend: str) -> None:
    runs = {s: run_decode_step(cache_dir, schedule=s, dbo=True, backend=backend) for s in ("moe", "deepseek")}
    for rank in (0, 1):
        assert torch.equal(runs["deepseek"][rank]["hidden"], runs["moe"][rank]["hidden"])
        torch.testing.assert_close(runs["deepseek"][rank]["hidden"], reference[rank], rtol=0, atol=1e-5)
        for schedule, n in YIELDS.items():
            assert runs[schedule][rank]["yields"] == [n, n]


@pytest.mark.parametrize("case", ["padding-only second ubatch", "idle rank"])
def test_padding_and_idle_ubatches_yield_like_the_others(cache_dir: Path, reference: list[torch.Tensor],
                                                         case: str) -> None:
    # rank 1 has 2 real tokens padded to 6 rows: its second ubatch (rows 3-5) is padding only; or none at all
    real = {1: 2} if case == "padding-only second ubatch" else {1: 0}
    runs = {s: run_decode_step(cache_dir, schedule=s, dbo=True, real=real, padded=6) for s in ("moe", "deepseek")}
    for rank in (0, 1):
        assert runs["deepseek"][rank]["yields"] == [YIELDS["deepseek"]] * 2
        assert torch.equal(runs["deepseek"][rank]["hidden"], runs["moe"][rank]["hidden"])
    torch.testing.assert_close(runs["deepseek"][0]["hidden"], reference[0], rtol=0, atol=1e-5)


def test_a_prefill_step_runs_the_moe_schedule(cache_dir: Path) -> None:
    """DeepSeek (and SGLang) pipeline decode only: a step where some rank prefills keeps the kernel's yields."""
    prefill = run_decode_step(cache_dir, schedule="deepseek", dbo=True, any_prefill=True)
    decode = run_decode_step(cache_dir, schedule="deepseek", dbo=True, any_prefill=False)
    for rank in (0, 1):
        assert prefill[rank]["yields"] == [YIELDS["moe"]] * 2
        assert decode[rank]["yields"] == [YIELDS["deepseek"]] * 2
        assert torch.equal(prefill[rank]["hidden"], decode[rank]["hidden"])


# ---- settings -----------------------------------------------------------------------------------------
def test_schedule_names_are_validated() -> None:
    with pytest.raises(ValueError, match="unknown DBO schedule 'sglang'; choose one of moe, deepseek"):
        DBOSchedule("sglang")
    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM does not support the 'deepseek' DBO schedule"):
        check_schedule("deepseek", ("moe",), "Qwen3MoeForCausalLM")
    with pytest.raises(ConfigError, match="dbo_schedule must be one of moe, deepseek; got 'blog'") as err:
        RunnerConfig(dbo_schedule="blog")
    assert err.value.flag == "--dbo-schedule"
    assert RunnerConfig().dbo_schedule == "moe"


def test_qwen_refuses_the_deepseek_schedule(tmp_path: Path) -> None:
    model, _ = load_model("tiny-qwen3-moe", cache_dir=tmp_path)
    with pytest.raises(ConfigError, match="Qwen3MoeForCausalLM does not support the 'deepseek' DBO schedule") as err:
        model.set_dbo_schedule("deepseek")
    assert err.value.flag == "--dbo-schedule"  # LLM(dbo_schedule="deepseek") on a Qwen model names the setting
    model.set_dbo_schedule("moe")


def test_the_pipeline_needs_exactly_two_ubatches(cache_dir: Path) -> None:
    model, _ = load_model(MODEL, cache_dir=cache_dir)
    model.set_dbo_schedule("deepseek")
    model.bind_kv_caches(allocate_kv_caches(model.kv_cache_specs(), 8, BLOCK, torch.float32))
    meta = build_attention_metadata([0, 0, 0], [1, 1, 1], _blocks(3, 1), BLOCK)
    wrapper = UBatchWrapper(model, UBatchConfig(num_ubatches=3, handoff_timeout_s=30))
    try:
        with (
            torch.no_grad(),
            set_forward_context(meta, ubatch_slices=padded_ubatch_slices([1, 1, 1], 3, 3)),
            pytest.raises(ValueError, match="pipelines exactly 2 micro-batches, got 3 ubatches"),
        ):
            wrapper(input_ids=torch.tensor([1, 2, 3]), positions=meta.positions)
    finally:
        wrapper.close()


# ---- the engine: DP=2 ranks (processes), the phase-aware all-to-all, --dbo-schedule -------------------
ENGINE: dict[str, Any] = dict(
    model=MODEL, data_parallel_size=2, enable_expert_parallel=True, all2all_backend="auto",
    dbo_decode_token_threshold=2, dbo_prefill_token_threshold=4, max_num_batched_tokens=64, max_num_seqs=4,
    dbo_cost_model="off", dist_timeout_s=60.0, device=device_for(2))
ENGINE_VARIANTS: dict[str, dict[str, Any]] = {
    "off": dict(enable_dbo=False), "moe": dict(enable_dbo=True, dbo_schedule="moe"),
    "deepseek": dict(enable_dbo=True, dbo_schedule="deepseek")}


def run_engine_variants(cache_dir: str) -> dict[str, Any]:
    """Rank body: the same prompts under each variant; tokens, ubatched steps, the last step's yields."""
    from runner.entrypoints.llm import LLM
    from runner.sampling_params import SamplingParams

    prompts = [[(7 * i + 13 * j) % 509 for j in range(n)] for i, n in enumerate([6, 9, 4, 7, 8, 5, 3, 10])]
    out: dict[str, Any] = {}
    for name, settings in ENGINE_VARIANTS.items():
        llm = LLM(**ENGINE, **settings, cache_dir=cache_dir)
        try:
            outs = llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
            wrapper = llm.model_runner.wrapper
            assert llm.last_stats is not None
            out[name] = {"tokens": [o.outputs[0].token_ids for o in outs],
                         "ubatched": llm.last_stats.num_ubatched_steps,
                         "last_yields": None if wrapper is None else wrapper.last_yield_counts}
        finally:
            llm.close()
    return out


def test_engine_tokens_are_equal_under_both_schedules(cache_dir: Path) -> None:
    from runner.distributed.launch import launch

    results = launch(run_engine_variants, 2, (str(cache_dir),), timeout_s=240, device=device_for(2))
    for rank in (0, 1):
        r = results[rank]
        assert r["moe"]["tokens"] == r["off"]["tokens"] and r["deepseek"]["tokens"] == r["off"]["tokens"]
        assert r["moe"]["ubatched"] > 0 and r["deepseek"]["ubatched"] == r["moe"]["ubatched"]
        # the last step decodes 4 sequences per rank: ubatched, and staged only under --dbo-schedule deepseek
        assert r["moe"]["last_yields"] == [YIELDS["moe"]] * 2
        assert r["deepseek"]["last_yields"] == [YIELDS["deepseek"]] * 2


def test_cli_flag_reaches_the_config() -> None:
    from runner.entrypoints.cli import build_parser

    args = build_parser().parse_args(["generate", "--model", MODEL, "--dbo-schedule", "deepseek"])
    assert args.dbo_schedule == "deepseek"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--dbo-schedule", "blog"])
