"""``POST /start_profile`` and ``POST /stop_profile`` (vLLM's routes): record a window of every rank's
timeline while the server runs, write one Chrome trace (a process per rank), and answer with where the
step time went, per rank: wall, compute, all-to-all in flight, hidden and exposed, and the host's phases
(schedule, DP vote, inputs, sampling, output processing). ``bench-serve --profile`` uses them."""
from __future__ import annotations

import os
import tempfile
import time
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

# The engine's host phases, as the trace names them (docs/design_notes.md, section 14).
HOST_PHASES = ("schedule", "update", "dp_vote", "inputs", "sample", "resolve", "store")


def _rank_summary(m: Any) -> dict[str, Any]:
    host_us = sum(us for name, us in m.phases.items() if name in HOST_PHASES)
    return {"rank": m.pid, "wall_ms": m.wall_us / 1e3, "compute_ms": m.compute_us / 1e3, "comm_ms": m.comm_us / 1e3,
            "hidden_ms": m.hidden_us / 1e3, "exposed_ms": m.exposed_us / 1e3,
            "hidden_pct": m.hidden_pct if m.comm_us > 0 else 0.0, "host_ms": host_us / 1e3,
            "phases_ms": {name: us / 1e3 for name, us in m.phases.items()}}


def add_profile_routes(app: FastAPI) -> None:
    """Routes over ``app.state.engine_client`` (an ``MPEngineClient``)."""

    @app.post("/start_profile")
    async def start_profile() -> JSONResponse:
        await app.state.engine_client.start_profile()
        return JSONResponse({"status": "recording"})

    @app.post("/stop_profile")
    async def stop_profile() -> JSONResponse:
        path = os.path.join(tempfile.gettempdir(), f"ubatch-profile-{os.getpid()}-{int(time.time())}.json")
        result = await app.state.engine_client.stop_profile(path)
        if result is None:
            return JSONResponse({"path": None, "ranks": []})
        return JSONResponse({"path": result.path, "ranks": [_rank_summary(m) for m in result.metrics]})
