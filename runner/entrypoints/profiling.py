"""``POST /start_profile`` and ``POST /stop_profile`` (vLLM's routes): record a window of every rank's
timeline while the server runs, write one Chrome trace (a process per rank), and answer with where the
step time went, per rank: wall, compute, all-to-all in flight, hidden and exposed, and the host's phases
(schedule, DP vote, inputs, sampling, output processing). ``bench-serve --profile`` uses them.

The routes exist only when the server runs with ``--profile-dir`` (vLLM registers its profiler routes only
when a profiler directory is set): they write files, so a client cannot aim them anywhere else."""
from __future__ import annotations

import os
import tempfile
import time
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from runner.entrypoints.openai.errors import OpenAIError

# The engine's host phases, as the trace names them (docs/design_notes.md, "Tracing, benchmarks and the GPU check").
HOST_PHASES = ("schedule", "update", "dp_vote", "inputs", "sample", "resolve", "store")


def _rank_summary(m: Any) -> dict[str, Any]:
    host_us = sum(us for name, us in m.phases.items() if name in HOST_PHASES)
    return {"rank": m.pid, "wall_ms": m.wall_us / 1e3, "compute_ms": m.compute_us / 1e3, "comm_ms": m.comm_us / 1e3,
            "hidden_ms": m.hidden_us / 1e3, "exposed_ms": m.exposed_us / 1e3,
            "hidden_pct": m.hidden_pct if m.comm_us > 0 else 0.0, "host_ms": host_us / 1e3,
            "phases_ms": {name: us / 1e3 for name, us in m.phases.items()}}


class ProfileRecorder:
    """One recording at a time: ``start`` while one records, or ``stop`` while another stop is writing, is a
    409. Traces go to a directory made for this server (``mkdtemp``: mode 0700, an unpredictable name) under
    ``root``, each in a new file opened exclusively, never following a link (mode 0600)."""

    def __init__(self, root: str) -> None:
        self.directory = tempfile.mkdtemp(prefix="ubatch-profile-", dir=root)
        self.recording = False
        self.stopping = False
        self.count = 0

    def begin_start(self) -> None:
        if self.recording or self.stopping:
            raise OpenAIError(HTTPStatus.CONFLICT, "A profile is already being recorded: POST /stop_profile first")
        self.recording = True

    def begin_stop(self) -> str:
        """The path of the trace the stop writes; 409 unless a recording runs and no other stop is under way."""
        if self.stopping:
            raise OpenAIError(HTTPStatus.CONFLICT, "Another /stop_profile is writing this recording")
        if not self.recording:
            raise OpenAIError(HTTPStatus.CONFLICT, "No profile is being recorded: POST /start_profile first")
        self.stopping = True
        self.count += 1
        return os.path.join(self.directory, f"profile-{self.count}-{int(time.time())}.json")

    def end_stop(self) -> None:
        self.recording = self.stopping = False


def add_profile_routes(app: FastAPI, root: str) -> None:
    """Routes over ``app.state.engine_client`` (an ``MPEngineClient``, ``runner/engine/async_llm.py``), writing
    under ``root`` (``--profile-dir``); ``app.state.profiles`` is the recorder."""
    recorder = app.state.profiles = ProfileRecorder(root)

    @app.post("/start_profile")
    async def start_profile() -> JSONResponse:
        recorder.begin_start()
        try:
            await app.state.engine_client.start_profile()
        except BaseException:
            recorder.recording = False
            raise
        return JSONResponse({"status": "recording"})

    @app.post("/stop_profile")
    async def stop_profile() -> JSONResponse:
        path = recorder.begin_stop()
        try:
            result = await app.state.engine_client.stop_profile(path)
        finally:
            recorder.end_stop()
        if result is None:
            return JSONResponse({"path": None, "ranks": []})
        return JSONResponse({"path": result.path, "error": result.error,
                             "ranks": [_rank_summary(m) for m in result.metrics]})
