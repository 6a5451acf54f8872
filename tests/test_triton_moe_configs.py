"""The Triton experts' tuned-configuration tables: loading, lookup, and the kernel's results under each entry.

Loader cases run anywhere (plain Python); the kernel cases run in Triton's CPU interpreter (marked
``triton_interpreter``) on tiny float32 shapes, where the device name tables are looked up under is ``cpu``.
The kernel has one activation (SiLU-and-mul), so every configuration is checked on it, in both layouts.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from ubatch.modular_moe.experts import make_experts, triton_configs
from ubatch.modular_moe.experts.backend_choice import load_choice_table
from ubatch.modular_moe.experts.triton_configs import (
    BUILTIN_CONFIG_DIR,
    CONFIG_DIR_ENV,
    TritonMoEConfig,
    config_dtype,
    default_config,
    device_file_name,
    find_table,
    load_table,
    table_file_names,
)
from ubatch.modular_moe.experts.triton_experts import TritonExperts
from ubatch.modular_moe.types import ExpertTokens

T, H, I, E, TOP_K = 16, 32, 64, 4, 2  # noqa: E741  (I: the experts' intermediate size)
CAPACITY = 12

# token count -> entry; every entry differs in tiles, grouping or both, and all exercise several row and
# column blocks at these shapes (BLOCK_N 16 against I = 64 and H = 32)
TABLE = {
    "1": dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=16, BLOCK_SIZE_K=16, GROUP_SIZE_M=1, num_warps=4, num_stages=2),
    "12": dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, GROUP_SIZE_M=4, num_warps=4, num_stages=3),
    "16": dict(BLOCK_SIZE_M=32, BLOCK_SIZE_N=16, BLOCK_SIZE_K=16, GROUP_SIZE_M=2, num_warps=8, num_stages=2),
    "64": dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=16, BLOCK_SIZE_K=32, GROUP_SIZE_M=3, num_warps=4, num_stages=4),
}


def _write(directory: Path, name: str, content: object) -> Path:
    path = directory / name
    path.write_text(json.dumps(content))
    return path


def _cpu_table_name(hidden: int = H, with_k: bool = True) -> str:
    names = table_file_names(E, I, hidden, "cpu", config_dtype("float32", None), None)
    return names[0] if with_k else names[1]


# ------------------------------------------------------------------------------------------------ the loader


def test_file_names_follow_vllm() -> None:
    assert table_file_names(128, 768, 2048, "NVIDIA H200", None, None) == (
        "E=128,N=768,K=2048,device_name=NVIDIA_H200.json", "E=128,N=768,device_name=NVIDIA_H200.json")
    assert table_file_names(256, 256, 7168, "NVIDIA H100 80GB HBM3", "fp8_w8a16", (128, 128))[1] == (
        "E=256,N=256,device_name=NVIDIA_H100_80GB_HBM3,dtype=fp8_w8a16,block_shape=[128,128].json")
    assert device_file_name("NVIDIA H200 NVL") == "NVIDIA_H200"
    assert config_dtype("bfloat16", None) is None and config_dtype("float16", None) is None
    assert config_dtype("float32", None) == "float32" and config_dtype("bfloat16", (128, 128)) == "fp8_w8a16"


def test_lookup_takes_the_exact_then_the_nearest_bucket(tmp_path: Path) -> None:
    table = load_table(_write(tmp_path, "t.json", TABLE))
    assert table.lookup(12) == TritonMoEConfig(16, 32, 32, 4, 4, 3)
    assert table.lookup(1) == TritonMoEConfig(16, 16, 16, 1, 4, 2)
    assert table.lookup(13) == table.lookup(12)  # nearer 12 than 16
    assert table.lookup(15) == table.lookup(16)
    assert table.lookup(14) == table.lookup(12)  # a tie takes the smaller count, as vLLM's min()
    assert table.lookup(1000) == table.lookup(64)
    assert table.lookup(0) == table.lookup(1)


def test_a_vllm_table_loads_unchanged(tmp_path: Path) -> None:
    """vLLM's tables carry ``triton_version`` and sometimes ``SPLIT_K``: 1 and leave ``num_stages`` out."""
    vllm = {"triton_version": "3.4.0",
            "8": dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, SPLIT_K=1, num_warps=4)}
    table = load_table(_write(tmp_path, "v.json", vllm))
    assert table.entries == {8: TritonMoEConfig(16, 64, 128, 1, 4, TritonMoEConfig().num_stages)}


def test_find_prefers_the_k_qualified_table(tmp_path: Path) -> None:
    _write(tmp_path, _cpu_table_name(with_k=False), {"4": TABLE["1"]})
    table, how = find_table(tmp_path, E, I, H, "cpu", "float32", None)
    assert table is not None and table.path.name == _cpu_table_name(with_k=False) and str(table.path) in how
    _write(tmp_path, _cpu_table_name(), {"4": TABLE["12"]})
    table, _ = find_table(tmp_path, E, I, H, "cpu", "float32", None)
    assert table is not None and table.path.name == _cpu_table_name() and table.lookup(4).group_m == 4
    table, _ = find_table(tmp_path, E, I, 2 * H, "cpu", "float32", None)  # another hidden size: vLLM's name
    assert table is not None and table.path.name == _cpu_table_name(with_k=False)


def test_unknown_gpu_gets_the_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write(tmp_path, _cpu_table_name(), TABLE)
    table, how = find_table(tmp_path, E, I, H, "NVIDIA B200", "float32", None)
    assert table is None and "E=4,N=64,K=32,device_name=NVIDIA_B200,dtype=float32.json" in how and "default" in how
    monkeypatch.delenv(CONFIG_DIR_ENV, raising=False)
    assert find_table(None, E, I, H, "cpu", "float32", None) == (
        None, f"no table {_cpu_table_name()} or {_cpu_table_name(with_k=False)} in {BUILTIN_CONFIG_DIR} "
              f"({CONFIG_DIR_ENV} is not set); using the default configurations")
    monkeypatch.setenv(CONFIG_DIR_ENV, str(tmp_path))
    table, _ = find_table(None, E, I, H, "cpu", "float32", None)
    assert table is not None and table.lookup(12) == TritonMoEConfig(16, 32, 32, 4, 4, 3)
    monkeypatch.setenv(CONFIG_DIR_ENV, str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="missing does not exist"):
        find_table(None, E, I, H, "cpu", "float32", None)


def test_the_tables_shipped_with_the_package_come_after_the_users(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    builtin, user = tmp_path / "builtin", tmp_path / "user"
    builtin.mkdir()
    user.mkdir()
    monkeypatch.setattr(triton_configs, "BUILTIN_CONFIG_DIR", builtin)
    _write(builtin, _cpu_table_name(), {"4": TABLE["1"]})
    monkeypatch.delenv(CONFIG_DIR_ENV, raising=False)
    table, how = find_table(None, E, I, H, "cpu", "float32", None)
    assert table is not None and table.path.parent == builtin and how == f"using the tuned table {table.path}"
    monkeypatch.setenv(CONFIG_DIR_ENV, str(user))  # a directory of the user's, without this shape: the package's
    table, _ = find_table(None, E, I, H, "cpu", "float32", None)
    assert table is not None and table.path.parent == builtin
    _write(user, _cpu_table_name(with_k=False), {"4": TABLE["12"]})  # the user's wins, even under vLLM's name
    table, _ = find_table(None, E, I, H, "cpu", "float32", None)
    assert table is not None and table.path.parent == user and table.lookup(4).group_m == 4
    table, _ = find_table(tmp_path / "builtin", E, I, H, "NVIDIA B200", "float32", None)  # explicit: only there
    assert table is None


def test_the_package_ships_its_table_directory() -> None:
    assert triton_configs.BUILTIN_CONFIG_DIR.is_dir()
    for path in triton_configs.BUILTIN_CONFIG_DIR.glob("*.json"):  # every committed table loads
        if path.name.endswith(",backends.json"):  # a backend-choice table (tests/test_experts_auto_buckets.py)
            assert load_choice_table(path).entries
        else:
            assert load_table(path).entries


def test_default_rule() -> None:
    assert default_config(4, 128) == TritonMoEConfig(16, 32, 64, 1)
    assert default_config(129, 128) == TritonMoEConfig(64, 64, 32, 8)


@pytest.mark.parametrize(("content", "match"), [
    ({"8x": TABLE["1"]}, r"key '8x' is not a positive token count"),
    ({"0": TABLE["1"]}, r"key '0' is not a positive token count"),
    ({"8": [16, 16]}, r"entry '8' is list"),
    ({"8": {**TABLE["1"], "BLOCK_SIZE_M": "16"}}, r"entry '8' field 'BLOCK_SIZE_M' is '16', expected an integer"),
    ({"8": {**TABLE["1"], "BLOCK_M": 16}}, r"entry '8' has unknown fields \['BLOCK_M'\]"),
    ({"8": {**TABLE["1"], "BLOCK_SIZE_N": 24}}, r"entry '8': block_n=24 must be a power of two"),
    ({"8": {**TABLE["1"], "SPLIT_K": 2}}, r"entry '8' has SPLIT_K=2"),
    ({"triton_version": "3.4.0"}, r"no token-count entries"),
    ([1, 2], r"expected an object"),
])
def test_a_malformed_table_names_the_file_and_key(tmp_path: Path, content: object, match: str) -> None:
    path = _write(tmp_path, "bad.json", content)
    with pytest.raises(ValueError, match=match) as info:
        load_table(path)
    assert str(path) in str(info.value)


def test_invalid_json_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text("{\"8\": ")
    with pytest.raises(ValueError, match=r"broken\.json: not valid JSON"):
        load_table(path)


def test_fixed_configuration_and_table_directory_exclude_each_other(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    with pytest.raises(ValueError, match="either config or block sizes"):
        make_experts("triton", block_m=16, config=TritonMoEConfig())
    with pytest.raises(ValueError, match="config_dir has no effect"):
        make_experts("triton", block_m=16, config_dir=tmp_path)


# ------------------------------------------------------------------------ the kernel under each table entry


def _weights() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(E, 2 * I, H, generator=g) / H**0.5, torch.randn(E, H, I, generator=g) / I**0.5


def _naive(x: torch.Tensor, w13_e: torch.Tensor, w2_e: torch.Tensor) -> torch.Tensor:
    x, w13_e, w2_e = x.double(), w13_e.double(), w2_e.double()
    gate, up = w13_e[:I] @ x, w13_e[I:] @ x
    return w2_e @ (gate * torch.sigmoid(gate) * up)


def _contiguous(num_tokens: int, w13: torch.Tensor, w2: torch.Tensor) -> tuple[ExpertTokens, torch.Tensor]:
    g = torch.Generator().manual_seed(num_tokens)
    hidden = torch.randn(num_tokens, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(num_tokens)])
    ids[0, 1] = -1  # a route to an expert on another rank
    weights = torch.rand(num_tokens, TOP_K, generator=g)
    ref = torch.zeros(num_tokens, H, dtype=torch.float64)
    for t in range(num_tokens):
        for k in range(TOP_K):
            if ids[t, k] >= 0:
                ref[t] += float(weights[t, k]) * _naive(hidden[t], w13[ids[t, k]], w2[ids[t, k]])
    return ExpertTokens("contiguous", hidden, topk_ids=ids, topk_weights=weights), ref


def _masked(w13: torch.Tensor, w2: torch.Tensor) -> tuple[ExpertTokens, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(E, CAPACITY, H, generator=g)
    counts = torch.tensor([5, 0, CAPACITY, 1])
    ref = torch.zeros(E, CAPACITY, H, dtype=torch.float64)
    for e, n in enumerate(counts.tolist()):
        for s in range(n):
            ref[e, s] = _naive(hidden[e, s], w13[e], w2[e])
    return ExpertTokens("masked", hidden, expert_num_tokens=counts), ref


def _assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-5) -> None:
    err = (actual.double() - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= rel * scale, f"max abs err {err:.3g} > {rel:g} * max |ref| {scale:.3g}"


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("num_tokens", [1, 13, 16, 40])
def test_contiguous_results_under_each_table_entry(tmp_path: Path, num_tokens: int,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("triton")
    path = _write(tmp_path, _cpu_table_name(), TABLE)
    experts = TritonExperts(config_dir=tmp_path)
    w13, w2 = _weights()
    tokens, ref = _contiguous(num_tokens, w13, w2)
    with caplog.at_level(logging.INFO, logger="ubatch.experts"):
        out = experts.apply(tokens, w13, w2)
        again = experts.apply(tokens, w13, w2)
    expected_config = load_table(path).lookup(num_tokens)
    assert experts.config_for(torch.device("cpu"), E, I, H, torch.float32, None, num_tokens) == expected_config
    _assert_rel_close(out, ref)
    assert torch.equal(out, again)
    lines = [r.getMessage() for r in caplog.records if r.name == "ubatch.experts"]
    assert lines == [f"Triton experts (E=4, N=64, K=32, float32, cpu): using the tuned table {path}"]


@pytest.mark.triton_interpreter
def test_masked_results_under_the_capacity_bucket(tmp_path: Path) -> None:
    """The masked layout looks up its capacity (12 rows per expert): the GROUP_SIZE_M=4 entry."""
    pytest.importorskip("triton")
    _write(tmp_path, _cpu_table_name(), TABLE)
    experts = TritonExperts(config_dir=tmp_path)
    w13, w2 = _weights()
    tokens, ref = _masked(w13, w2)
    assert experts.config_for(torch.device("cpu"), E, I, H, torch.float32, None, CAPACITY).group_m == 4
    out = experts.apply(tokens, w13, w2)
    _assert_rel_close(out, ref)
    assert not out[0, 5:].any() and not out[1].any() and not out[3, 1:].any()


@pytest.mark.triton_interpreter
def test_without_a_table_the_default_rule_runs_and_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("triton")
    experts = TritonExperts(config_dir=tmp_path)
    w13, w2 = _weights()
    tokens, ref = _contiguous(3, w13, w2)
    with caplog.at_level(logging.INFO, logger="ubatch.experts"):
        _assert_rel_close(experts.apply(tokens, w13, w2), ref)
    assert [r.getMessage() for r in caplog.records if r.name == "ubatch.experts"] == [
        f"Triton experts (E=4, N=64, K=32, float32, cpu): no table {_cpu_table_name()} or "
        f"{_cpu_table_name(with_k=False)} in {tmp_path}; using the default configurations"]
