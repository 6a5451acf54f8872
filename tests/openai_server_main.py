"""``python tests/openai_server_main.py --model NAME [server flags] [--token-delay-s S]``: the OpenAI server over
``FakeEngineClient`` in a process of its own, through ``run_server`` as ``python -m runner serve`` runs it, so
tests can send it real signals (run with the repository on PYTHONPATH). Exits with ``run_server``'s status."""
from __future__ import annotations

import argparse
import asyncio
import sys

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from fake_engine_client import FakeEngineClient
from runner.entrypoints.openai.api_server import run_server
from runner.entrypoints.openai.cli_args import add_server_args
from runner.entrypoints.openai.metrics import ServerMetrics


def add_echo_route(app: FastAPI) -> None:
    """A route added through ``run_server(configure_app=...)``, as the serve command adds profiling."""

    @app.post("/echo")
    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({"echo": (await request.json())})


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--token-delay-s", type=float, default=0.0)
    add_server_args(parser)
    args = parser.parse_args()

    async def serve() -> int:
        engine = FakeEngineClient(token_delay_s=args.token_delay_s)
        engine.metrics = ServerMetrics(args.model, engine.max_model_len)
        return await run_server(args, engine, engine_dead=engine.dead_event, metrics=engine.metrics,
                                configure_app=add_echo_route)

    return asyncio.run(serve())


if __name__ == "__main__":
    sys.exit(main())
