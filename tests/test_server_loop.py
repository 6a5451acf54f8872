"""``run_loop``: an API server's main runs on uvloop's event loop, as vLLM's API server does, and its result is
the process's exit status."""
from __future__ import annotations

import asyncio

import uvloop

from runner.entrypoints.openai.api_server import run_loop


def test_an_api_server_runs_on_uvloop_and_returns_mains_status() -> None:
    loops: list[asyncio.AbstractEventLoop] = []

    async def main() -> int:
        loops.append(asyncio.get_running_loop())
        await asyncio.sleep(0)
        return 3

    assert run_loop(main()) == 3
    assert isinstance(loops[0], uvloop.Loop)
