"""``--experts-backend auto`` per token-count bucket: the backend-choice tables, ``BucketedExperts`` and the rule
that picks it for a layer, and the tuner writing the table.

Everything runs on CPU: a CUDA device is faked where the rule needs one (the layer's device, its name, its compute
capability), ``grouped_mm`` computes on CPU, and the cases with a real ``triton`` member run in Triton's CPU
interpreter (marked ``triton_interpreter``). No case depends on a timing: the tuner's timings are stubbed.
"""
from __future__ import annotations

import json
import logging
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from ubatch.fp8 import Fp8Tensor, quantize_blocks
from ubatch.log_once import forget_logged
from ubatch.modular_moe import layer as layer_module
from ubatch.modular_moe.config import MoEParallelConfig
from ubatch.modular_moe.experts import auto, grouped_mm_experts, make_experts
from ubatch.modular_moe.experts.backend_choice import (
    MIXABLE_BACKENDS,
    BackendChoiceTable,
    BucketChoice,
    choose_backend,
    find_choice_table,
    load_choice_table,
    write_choice_table,
)
from ubatch.modular_moe.experts.base import MoEExperts
from ubatch.modular_moe.experts.bucketed_experts import BucketedExperts
from ubatch.modular_moe.experts.grouped_mm_experts import GroupedMMExperts
from ubatch.modular_moe.experts.torch_experts import TorchExperts
from ubatch.modular_moe.experts.triton_configs import (
    CONFIG_DIR_ENV,
    TritonMoEConfig,
    choice_file_name,
    config_dtype,
    load_table,
    table_file_names,
)
from ubatch.modular_moe.layer import FusedMoE
from ubatch.modular_moe.types import ClampedSwiGLU, ExpertMLPExtras, ExpertTokens, Layout

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import tune_moe  # noqa: E402

H, I, E, K = 32, 64, 4, 2  # noqa: E741  (I: the experts' intermediate size)
GPU = "NVIDIA H200"
# small counts run triton, large ones grouped_mm
SPLIT = {1: "triton", 8: "triton", 32: "grouped_mm", 128: "grouped_mm"}


def _doc(choices: dict[int, str]) -> dict[str, object]:
    return {str(m): {"backend": b, "ms": {name: 1.0 + (name != b) for name in MIXABLE_BACKENDS}}
            for m, b in choices.items()}


def _write(path: Path, content: object) -> Path:
    path.write_text(json.dumps(content))
    return path


def _table(tmp_path: Path, choices: dict[int, str] = SPLIT) -> BackendChoiceTable:
    return load_choice_table(_write(tmp_path / "t,backends.json", _doc(choices)))


def _weights(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return ((torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(dtype),
            (torch.randn(E, H, I, generator=g) / I**0.5).to(dtype))


def _contiguous(rows: int, seed: int = 1) -> ExpertTokens:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(rows)])
    if rows > 1:
        ids[0, 1] = -1  # an expert on another rank
    return ExpertTokens("contiguous", torch.randn(rows, H, generator=g), topk_ids=ids,
                        topk_weights=torch.rand(rows, K, generator=g))


def _masked(capacity: int, seed: int = 2) -> ExpertTokens:
    g = torch.Generator().manual_seed(seed)
    counts = torch.tensor([capacity // 2, 0, capacity, 1])
    return ExpertTokens("masked", torch.randn(E, capacity, H, generator=g), expert_num_tokens=counts)


def _spy(member: MoEExperts, name: str, ran: Counter) -> MoEExperts:
    """Count the calls ``member`` computes (its ``apply`` / ``apply_fp8``), by ``name``."""
    apply, apply_fp8 = member.apply, member.apply_fp8

    def counting_apply(tokens: ExpertTokens, w13: torch.Tensor, w2: torch.Tensor,
                       extras: ExpertMLPExtras | None = None) -> torch.Tensor:
        ran[name] += 1
        return apply(tokens, w13, w2, extras)

    def counting_apply_fp8(tokens: ExpertTokens, w13: Fp8Tensor, w2: Fp8Tensor,
                           extras: ExpertMLPExtras | None = None) -> torch.Tensor:
        ran[f"{name}/fp8"] += 1
        return apply_fp8(tokens, w13, w2, extras)

    member.apply = counting_apply  # type: ignore[method-assign]
    member.apply_fp8 = counting_apply_fp8  # type: ignore[method-assign]
    return member


class _StandIn(TorchExperts):
    """The torch computation under other capability flags (for dispatch and flag cases without Triton)."""

    def __init__(self, layouts: tuple[Layout, ...] = ("contiguous", "masked"), extras: bool = True,
                 fp8_weights: bool = False, fp8_activations: bool = False) -> None:
        self.supported_layouts = layouts
        self.supports_extras = extras
        self.supports_fp8_weights = fp8_weights
        self.accepts_fp8_activations = fp8_activations

    def apply_fp8(self, tokens: ExpertTokens, w13: Fp8Tensor, w2: Fp8Tensor,
                  extras: ExpertMLPExtras | None = None) -> torch.Tensor:
        dtype = tokens.hidden.dtype
        return self.apply(tokens, w13.dequantize(dtype), w2.dequantize(dtype), extras)


# ------------------------------------------------------------------------------------------- the table


def test_file_name_is_the_k_qualified_triton_name_with_backends() -> None:
    assert choice_file_name(128, 768, 2048, GPU, None, None) == (
        "E=128,N=768,K=2048,device_name=NVIDIA_H200,backends.json")
    assert choice_file_name(256, 256, 7168, "NVIDIA H100 80GB HBM3", "fp8_w8a16", (128, 128)) == (
        "E=256,N=256,K=7168,device_name=NVIDIA_H100_80GB_HBM3,dtype=fp8_w8a16,block_shape=[128,128],backends.json")
    triton_names = table_file_names(128, 768, 2048, GPU, None, None)
    assert choice_file_name(128, 768, 2048, GPU, None, None) not in triton_names


MALFORMED = [
    ("not json", "{", "not valid JSON"),
    ("a list", [], "expected an object of token count"),
    ("bad key", {"x": {"backend": "triton", "ms": {"triton": 1}}}, "key 'x' is not a positive token count"),
    ("zero key", {"0": {"backend": "triton", "ms": {"triton": 1}}}, "key '0' is not a positive token count"),
    ("not an object", {"4": "triton"}, "entry '4' is 'triton', expected an object"),
    ("no ms", {"4": {"backend": "triton"}}, "entry '4' .* exactly 'backend' and 'ms'"),
    ("extra field", {"4": {"backend": "triton", "ms": {"triton": 1}, "config": 1}}, "entry '4' .* exactly"),
    ("torch chosen", {"4": {"backend": "torch", "ms": {"torch": 1}}},
     "entry '4' chooses backend 'torch', which cannot be mixed per bucket; expected one of triton, grouped_mm"),
    ("deep_gemm chosen", {"2": {"backend": "deep_gemm", "ms": {"deep_gemm": 1}}},
     "entry '2' chooses backend 'deep_gemm'"),
    ("ms not an object", {"4": {"backend": "triton", "ms": [1]}}, "entry '4' field 'ms' is \\[1\\]"),
    ("ms a string", {"4": {"backend": "triton", "ms": {"triton": "fast"}}}, "entry '4' time of 'triton' is 'fast'"),
    ("ms negative", {"4": {"backend": "triton", "ms": {"triton": -1}}}, "entry '4' time of 'triton' is -1"),
    ("ms a bool", {"4": {"backend": "triton", "ms": {"triton": True}}}, "entry '4' time of 'triton' is True"),
    ("chosen unmeasured", {"4": {"backend": "grouped_mm", "ms": {"triton": 1}}},
     "entry '4' chooses 'grouped_mm' but has no time measured"),
    ("empty", {}, "no token-count entries"),
]


@pytest.mark.parametrize("content,match", [(c, m) for _, c, m in MALFORMED], ids=[i for i, _, _ in MALFORMED])
def test_a_malformed_table_names_the_file_and_the_key(tmp_path: Path, content: object, match: str) -> None:
    path = tmp_path / "E=4,N=64,K=32,device_name=cpu,backends.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ValueError, match=match) as info:
        load_choice_table(path)
    assert str(info.value).startswith(f"{path}: ")


def test_lookup_takes_the_nearest_bucket_as_the_triton_tables(tmp_path: Path) -> None:
    table = _table(tmp_path)
    assert [table.lookup(m) for m in (1, 4, 8, 19, 20, 21, 32, 1000)] == [
        "triton", "triton", "triton", "triton", "triton", "grouped_mm", "grouped_mm", "grouped_mm"]
    assert table.lookup(0) == "triton" and table.backends == ("triton", "grouped_mm")
    assert table.buckets_of("grouped_mm") == [32, 128]
    # the same nearest-count rule (ties to the smaller count) as MoEConfigTable.lookup, on the same keys
    configs = {m: TritonMoEConfig(block_m=16 << i) for i, m in enumerate(SPLIT)}
    triton = load_table(_write(tmp_path / "t.json", {str(m): c.to_json() for m, c in reversed(configs.items())}))
    by_config = {c: m for m, c in configs.items()}
    for m in range(0, 200):
        assert table.lookup(m) == SPLIT[by_config[triton.lookup(m)]], m


def test_fastest_mixable_backend_is_chosen_and_written(tmp_path: Path) -> None:
    assert choose_backend({"triton": 2.0, "grouped_mm": 1.0, "torch": 0.5}) == "grouped_mm"  # torch never
    assert choose_backend({"triton": 1.0, "torch": 0.5}) == "triton"
    assert choose_backend({"triton": 1.0, "grouped_mm": 1.0}) == "triton"  # a tie: the listed order
    with pytest.raises(ValueError, match=r"no backend that can be mixed .* among the measured \['torch'\]"):
        choose_backend({"torch": 1.0})
    table = write_choice_table(tmp_path / "w,backends.json", {64: {"triton": 2.0, "grouped_mm": 1.5},
                                                              1: {"triton": 0.1, "grouped_mm": 0.3}})
    assert table.entries == {1: BucketChoice("triton", {"triton": 0.1, "grouped_mm": 0.3}),
                             64: BucketChoice("grouped_mm", {"triton": 2.0, "grouped_mm": 1.5})}
    assert list(json.loads(table.path.read_text())) == ["1", "64"]


def test_found_where_the_triton_tables_are(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = choice_file_name(E, I, H, GPU, None, None)
    monkeypatch.delenv(CONFIG_DIR_ENV, raising=False)
    table, how = find_choice_table(None, E, I, H, GPU, None, None)
    assert table is None and name in how and f"{CONFIG_DIR_ENV} is not set" in how
    monkeypatch.setenv(CONFIG_DIR_ENV, str(tmp_path))
    _write(tmp_path / name, _doc(SPLIT))
    table, how = find_choice_table(None, E, I, H, GPU, None, None)
    assert table is not None and table.path == tmp_path / name and how == f"using the backend-choice table {table.path}"
    assert find_choice_table(None, E, I, 2 * H, GPU, None, None)[0] is None  # another hidden size: no table
    assert find_choice_table(None, E, I, H, GPU, "fp8_w8a16", (128, 128))[0] is None  # another dtype: none
    monkeypatch.setenv(CONFIG_DIR_ENV, str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="missing does not exist"):
        find_choice_table(None, E, I, H, GPU, None, None)


# ---------------------------------------------------------------------------------------- BucketedExperts


def test_dispatches_each_call_by_its_token_count(tmp_path: Path) -> None:
    ran: Counter = Counter()
    members = {"triton": _spy(_StandIn(), "triton", ran), "grouped_mm": _spy(GroupedMMExperts(), "grouped_mm", ran)}
    experts = BucketedExperts(_table(tmp_path), members)
    w13, w2 = _weights()
    reference = TorchExperts()
    for rows, layout, expected in ((4, "contiguous", "triton"), (24, "contiguous", "grouped_mm"),
                                   (6, "masked", "triton"), (40, "masked", "grouped_mm")):
        ran.clear()
        tokens = _contiguous(rows) if layout == "contiguous" else _masked(rows)
        out = experts.run(tokens, w13, w2)
        assert ran == Counter({expected: 1}), (rows, layout)
        torch.testing.assert_close(out, reference.run(tokens, w13, w2), rtol=1e-5, atol=1e-6)
    assert experts.member_for(4) is members["triton"] and experts.member_for(1000) is members["grouped_mm"]


def test_fp8_weights_take_each_members_own_path(tmp_path: Path) -> None:
    """``run`` is the member's: one with FP8 kernels gets ``apply_fp8``, one without the dequantised weights."""
    ran: Counter = Counter()
    members = {"triton": _spy(_StandIn(fp8_weights=True), "triton", ran),
               "grouped_mm": _spy(GroupedMMExperts(), "grouped_mm", ran)}
    experts = BucketedExperts(_table(tmp_path), members)
    assert not experts.supports_fp8_weights  # grouped_mm has no FP8 kernel
    w13, w2 = _weights()
    fp8_w13, fp8_w2 = (Fp8Tensor(*quantize_blocks(w, (16, 16)), (16, 16)) for w in (w13, w2))
    experts.run(_contiguous(2), fp8_w13, fp8_w2)
    experts.run(_contiguous(64), fp8_w13, fp8_w2)
    assert ran == Counter({"triton/fp8": 1, "triton": 1, "grouped_mm": 1})  # the stand-in's apply_fp8 -> apply


def test_flags_are_the_members_intersection(tmp_path: Path) -> None:
    members: dict[str, MoEExperts] = {
        "triton": _StandIn(layouts=("contiguous", "masked"), extras=True, fp8_weights=True, fp8_activations=True),
        "grouped_mm": _StandIn(layouts=("masked",), extras=False, fp8_weights=True, fp8_activations=False)}
    experts = BucketedExperts(_table(tmp_path), members)
    assert experts.name == "auto"
    assert (experts.supported_layouts, experts.supports_extras, experts.supports_fp8_weights,
            experts.accepts_fp8_activations) == (("masked",), False, True, False)
    members["grouped_mm"] = _StandIn(extras=True, fp8_activations=True)
    both = BucketedExperts(_table(tmp_path), members)
    assert (both.supported_layouts, both.supports_extras, both.accepts_fp8_activations) == (
        ("contiguous", "masked"), True, True)
    with pytest.raises(ValueError, match=r"runs backends \['triton', 'grouped_mm'\], got members \['triton'\]"):
        BucketedExperts(_table(tmp_path), {"triton": _StandIn()})


def test_extras_a_member_lacks_are_refused_naming_the_table_and_the_member(tmp_path: Path) -> None:
    table = _table(tmp_path)
    experts = BucketedExperts(table, {"triton": _StandIn(extras=False), "grouped_mm": GroupedMMExperts()})
    extras = ExpertMLPExtras(None, None, ClampedSwiGLU())
    with pytest.raises(ValueError, match=rf"{table.path} runs 'triton' at token counts \[1, 8\], which does not "
                                         "implement expert biases"):
        experts.check_extras(extras)
    experts.check_extras(None)
    w13, w2 = _weights()
    with pytest.raises(ValueError, match="which does not implement"):  # grouped_mm's bucket refuses as well
        experts.run(_contiguous(64), w13, w2, extras)


@pytest.mark.triton_interpreter
def test_real_triton_and_grouped_mm_members_equal_torch(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    ran: Counter = Counter()
    experts = BucketedExperts.from_table(_table(tmp_path))
    for name, member in experts.members.items():
        _spy(member, name, ran)
    assert (experts.supported_layouts, experts.supports_extras, experts.supports_fp8_weights,
            experts.accepts_fp8_activations) == (("contiguous", "masked"), False, False, False)
    w13, w2 = _weights()
    reference = make_experts("torch")
    for tokens, expected in ((_contiguous(3), "triton"), (_contiguous(48), "grouped_mm"), (_masked(5), "triton"),
                             (_masked(36), "grouped_mm")):
        ran.clear()
        torch.testing.assert_close(experts.run(tokens, w13, w2), reference.run(tokens, w13, w2), rtol=1e-5, atol=1e-5)
        assert ran == Counter({expected: 1})


# ------------------------------------------------------------------------------------- the layer's rule


@pytest.fixture
def fake_h200(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A layer built as on a CUDA H200 (device, name, compute capability 9.0), its tensors still on the CPU;
    ``UBATCH_MOE_CONFIG_DIR`` is an empty tmp directory (returned)."""
    real = layer_module.experts_for_layer

    def on_cuda(name: str, device: torch.device, *args: object) -> MoEExperts:
        assert device.type == "cpu"
        return real(name, torch.device("cuda"), *args)  # type: ignore[arg-type]

    monkeypatch.setattr(layer_module, "experts_for_layer", on_cuda)
    monkeypatch.setattr(auto, "device_table_name", lambda device: GPU)
    monkeypatch.setattr(grouped_mm_experts, "_capability", lambda device: (9, 0))
    config_dir = tmp_path / "configs"
    config_dir.mkdir()
    monkeypatch.setenv(CONFIG_DIR_ENV, str(config_dir))
    forget_logged()
    return config_dir


def _layer() -> FusedMoE:
    layer = FusedMoE(E, K, H, I, parallel=MoEParallelConfig(experts_backend="auto"), params_dtype=torch.float32)
    w13, w2 = _weights()
    layer.load_fused_experts(w13, w2)
    return layer


def _layer_table(config_dir: Path, choices: dict[int, str], dtype: str | None = "float32") -> Path:
    return _write(config_dir / choice_file_name(E, I, H, GPU, dtype, None), _doc(choices))


@pytest.mark.triton_interpreter
def test_a_layer_on_a_gpu_with_a_table_runs_the_buckets(fake_h200: Path, caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("triton")
    path = _layer_table(fake_h200, SPLIT)
    layer = _layer()
    with caplog.at_level(logging.INFO, logger="ubatch.experts"):
        experts = layer.kernel.experts
    assert isinstance(experts, BucketedExperts) and experts.table.path == path
    assert (f"experts backend auto (E={E}, N={I}, K={H}, float32, {GPU}): using the backend-choice table {path}; "
            "per token-count bucket: triton at [1, 8] tokens, grouped_mm at [32, 128] tokens") in caplog.messages
    reference = FusedMoE(E, K, H, I, parallel=MoEParallelConfig(experts_backend="torch"))
    reference.load_fused_experts(*_weights())
    g = torch.Generator().manual_seed(3)
    for rows in (2, 40):  # a triton bucket, a grouped_mm one, through the whole layer
        x, logits = torch.randn(rows, H, generator=g), torch.randn(rows, E, generator=g)
        torch.testing.assert_close(layer(x, logits), reference(x, logits), rtol=1e-5, atol=1e-5)


def test_a_layer_on_a_gpu_without_a_table_keeps_the_device_rule(fake_h200: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    _write(fake_h200 / choice_file_name(E, I, 2 * H, GPU, "float32", None), _doc(SPLIT))  # another shape's
    _layer_table(fake_h200, SPLIT, dtype=None)  # the bf16 table: this layer is float32
    with caplog.at_level(logging.INFO, logger="ubatch.experts"):
        experts = _layer().kernel.experts
    assert isinstance(experts, GroupedMMExperts)
    name = choice_file_name(E, I, H, GPU, "float32", None)
    assert any(m.startswith(f"experts backend auto (E={E}, N={I}, K={H}, float32, {GPU}): no table {name} in ")
               and m.endswith("; using grouped_mm (the device rule)") for m in caplog.messages), caplog.messages


def test_a_named_backend_ignores_the_table(fake_h200: Path) -> None:
    _layer_table(fake_h200, {1: "grouped_mm"})
    layer = FusedMoE(E, K, H, I, parallel=MoEParallelConfig(experts_backend="torch"), params_dtype=torch.float32)
    assert isinstance(layer.kernel.experts, TorchExperts)


def test_the_cpu_never_reads_a_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write(tmp_path / choice_file_name(E, I, H, "cpu", "float32", None), _doc({1: "grouped_mm"}))
    monkeypatch.setenv(CONFIG_DIR_ENV, str(tmp_path))
    assert isinstance(_layer().kernel.experts, TorchExperts)


def test_extras_with_a_triton_bucket_are_refused_when_the_kernel_is_built(fake_h200: Path) -> None:
    pytest.importorskip("triton")  # the table's triton member is built before the extras are checked
    path = _layer_table(fake_h200, SPLIT)
    layer = FusedMoE(E, K, H, I, parallel=MoEParallelConfig(experts_backend="auto"), params_dtype=torch.float32,
                     expert_bias=True, activation=ClampedSwiGLU())
    with pytest.raises(ValueError, match=rf"{path} runs 'triton' at token counts \[1, 8\], which does not implement"):
        _ = layer.kernel


def test_extras_with_grouped_mm_buckets_only_are_accepted(fake_h200: Path) -> None:
    _layer_table(fake_h200, {1: "grouped_mm", 64: "grouped_mm"})
    layer = FusedMoE(E, K, H, I, parallel=MoEParallelConfig(experts_backend="auto"), params_dtype=torch.float32,
                     expert_bias=True, activation=ClampedSwiGLU())
    experts = layer.kernel.experts
    assert isinstance(experts, BucketedExperts) and experts.supports_extras and list(experts.members) == ["grouped_mm"]


# ------------------------------------------------------------------------------------------------- tuner


def test_the_tuner_writes_a_choice_table_the_loader_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``tune`` with the measurements stubbed: grouped_mm wins the large counts, torch (faster still) is recorded
    and never chosen, and the file lands beside the Triton table under the name the layer looks up."""
    times = {1: (0.1, {"grouped_mm": 0.3, "torch": 0.01}), 64: (0.9, {"grouped_mm": 0.5, "torch": 0.01})}

    def fake_tune_one(shape: tuple[int, int, int], num_tokens: int, *args: object, **kwargs: object
                      ) -> tuple[TritonMoEConfig, float, int, float, dict[str, float]]:
        ms, others = times[num_tokens]
        return TritonMoEConfig(), ms, 1, 2 * ms, dict(others)

    monkeypatch.setattr(tune_moe, "tune_one", fake_tune_one)
    table_path, choice_path, rows = tune_moe.tune((E, I, H), [1, 64], K, "fp8", "cuda", GPU, tmp_path, 1.0, 1)
    block = tune_moe.FP8_BLOCK
    dtype = config_dtype("bfloat16", block)
    assert table_path == tmp_path / table_file_names(E, I, H, GPU, dtype, block)[0]
    assert choice_path == tmp_path / choice_file_name(E, I, H, GPU, dtype, block)
    choices = load_choice_table(choice_path)
    assert choices.entries == {
        1: BucketChoice("triton", {"triton": 0.1, "grouped_mm": 0.3, "torch": 0.01}),
        64: BucketChoice("grouped_mm", {"triton": 0.9, "grouped_mm": 0.5, "torch": 0.01})}
    assert [r["backend"] for r in rows] == ["triton", "grouped_mm"]
    assert find_choice_table(tmp_path, E, I, H, GPU, dtype, block)[0] == choices
    summary = tmp_path / "summary.json"
    tune_moe.write_summary(summary, GPU, [(E, I, H)], [(table_path, choice_path, rows)])
    assert json.loads(summary.read_text())["tables"][0]["choice_path"] == str(choice_path)
