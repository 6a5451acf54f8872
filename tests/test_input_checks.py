"""Bad values at the engine's and library's edges: each is an error naming the value and the bound, never a hang,
a crash or a silent wrong result.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from runner.attention.kv_cache import KVCacheSpec, KVCacheTooLargeError, available_memory, check_kv_cache_fits
from ubatch.modular_moe.prepare_finalize.emulated_link import MAX_LATENCY_US, MIN_GBPS, LinkSpec
from ubatch.plot import main as plot_main


@pytest.mark.parametrize("kwargs,message", [
    (dict(latency_us=math.nan), "latency_us must be a finite number, got nan"),
    (dict(latency_us=math.inf), "latency_us must be a finite number, got inf"),
    (dict(latency_us=1e9), "latency_us must be <= 1000000 (1 s per transfer), got 1e+09"),
    (dict(gbps=math.nan), "gbps must be a number, got nan"),
    (dict(gbps=1e-9), "gbps must be >= 0.001 (1 MB/s), got 1e-09"),
    (dict(gbps=-1.0), "gbps must be > 0, got -1.0"),
])
def test_link_spec_rejects_non_finite_and_out_of_bound_values(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        LinkSpec(**kwargs)
    assert message in str(info.value)


def test_link_spec_bounds_are_inclusive_and_unlimited_bandwidth_stays_the_default() -> None:
    assert LinkSpec.parse(f"latency_us={MAX_LATENCY_US},gbps={MIN_GBPS}") == LinkSpec(MAX_LATENCY_US, MIN_GBPS)
    assert LinkSpec().gbps == math.inf and LinkSpec.parse("latency_us=5").seconds(10**9) == pytest.approx(5e-6)
    with pytest.raises(ValueError, match="bad --emulate-link value 'inf' for gbps; expected a finite number"):
        LinkSpec.parse("gbps=inf")


def test_kv_cache_larger_than_memory_names_the_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    specs = [KVCacheSpec.mha(2, 16)] * 4  # 256 B per token and layer in float32: 16 KiB per 16-token block
    monkeypatch.setattr("runner.attention.kv_cache.available_memory", lambda device: (1 << 30, "test's figure"))
    check_kv_cache_fits(specs, 65536, 16, torch.float32, "cpu")  # exactly 1 GiB fits
    with pytest.raises(KVCacheTooLargeError) as info:
        check_kv_cache_fits(specs, 65537, 16, torch.float32, "cpu")
    assert str(info.value).startswith("the KV cache needs 1.00 GiB (65537 blocks of 16 tokens over 4 layers, "
                                      "float32) but only 1.00 GiB is available (test's figure); it is sized by "
                                      "--num-kv-blocks"), str(info.value)
    assert "lower --max-num-seqs or --max-model-len, or set --num-kv-blocks" in str(info.value)


def test_available_memory_is_known_on_this_machine() -> None:
    found = available_memory("cpu")
    assert found is not None and found[0] > 0 and found[1]


def test_plot_names_a_rank_that_is_not_in_the_trace(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    events = [{"ph": "X", "pid": pid, "tid": 1, "name": "attention", "cat": "compute", "ts": 0, "dur": 5}
              for pid in (0, 1)]
    src = tmp_path / "trace.json"
    src.write_text(json.dumps({"traceEvents": events}))
    assert plot_main([str(src), "--pid", "9", "-o", str(tmp_path / "t.png")]) == 2
    assert capsys.readouterr().err.strip() == ("python -m ubatch.plot: error: no rank 9 in the trace (it holds ranks "
                                               "0, 1); pick one with --pid")
    assert not (tmp_path / "t.png").exists()
