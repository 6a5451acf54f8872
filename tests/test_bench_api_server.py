"""``benchmarks/bench_api_server.py --direct-writes off``: its server patch leaves the handler the only writer of a
streamed response (every output reaches ``next_batch``, the response's write is never called by the reader, and
a direct write all the same is reported); and the on/off pairs it counts."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest

from runner.entrypoints.openai.engine_streams import EngineStreams
from runner.sampling_params import SamplingParams
from test_engine_streams import SinkEngine, output, texts

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "benchmarks")]

import bench_api_server  # noqa: E402


def patched(monkeypatch: pytest.MonkeyPatch) -> None:
    """Apply the benchmark's server patch to this process's ``EngineStreams``; undone after the test."""
    for name in ("set_direct_format", "_write_directly"):
        monkeypatch.setattr(EngineStreams, name, getattr(EngineStreams, name))
    exec(bench_api_server.HANDLER_ONLY_PATCH, {})


def test_with_the_patch_every_output_goes_through_the_handler(monkeypatch: pytest.MonkeyPatch) -> None:
    patched(monkeypatch)
    written: list[str] = []

    def write(text: str) -> None:
        written.append(text)

    async def main() -> None:
        engine = SinkEngine()
        streams = EngineStreams(engine, ["r-0"], receive=None)
        streams.open(None, [1, 2], SamplingParams(max_tokens=8))
        streams.set_direct_format(lambda i, out: f"{i}:{out.outputs[0].text};")
        streams.set_direct_write(write)
        sink = engine.sinks["r-0"]
        reader = asyncio.ensure_future(streams.next_batch())
        await asyncio.sleep(0)
        sink.put(output("r-0", "a"))  # the handler waits with nothing queued: unpatched, this is written directly
        sink.put(output("r-0", "b"))
        assert texts(await asyncio.wait_for(reader, 5)) == [(0, "a"), (0, "b")]
        sink.put(output("r-0", "c", finished=True))
        sink.end()
        assert texts(await asyncio.wait_for(streams.next_batch(), 5)) == [(0, "c")]
        assert await asyncio.wait_for(streams.next_batch(), 5) is None
        assert written == []
        await streams.close()

    asyncio.run(main())


def test_a_direct_write_with_the_patch_is_reported_and_queued(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    patched(monkeypatch)

    async def main() -> None:
        streams = EngineStreams(SinkEngine(), ["r-0"], receive=None)
        streams.open(None, [1, 2], SamplingParams(max_tokens=8))
        streams._write_directly(0, output("r-0", "a"))
        assert texts(await asyncio.wait_for(streams.next_batch(), 5)) == [(0, "a")]
        await streams.close()

    asyncio.run(main())
    assert bench_api_server.DIRECT_WRITE_MARK in capsys.readouterr().err


def served_at(us: float) -> tuple[dict[str, Any], dict[str, Any]]:
    return {"tok_s": 1.0}, {"api_us_per_token": us}


def test_pairs_count_where_direct_writes_cost_less() -> None:
    on = [served_at(us) for us in (10.0, 12.0, 9.0, 27.465820312499982)]
    off = [served_at(us) for us in (11.0, 12.0, 8.0, 27.46582031250001)]  # the last: the same clock ticks
    assert bench_api_server.direct_writes_pairs(on, off) == (
        "API server CPU per token, direct writes on / off: 11.00 / 11.50 us (0.957x), on lower in 1 of 4 pairs "
        "(2 equal)")
