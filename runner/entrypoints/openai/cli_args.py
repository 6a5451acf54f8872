"""The OpenAI server's command-line flags (vLLM's ``make_arg_parser`` names), added to ``python -m runner serve``
next to the engine flags of ``generate``. The host defaults to loopback: exposing the server is an explicit
choice. ``--api-key`` also comes from ``UBATCH_API_KEY`` (as vLLM reads ``VLLM_API_KEY``), so the key need not
show in the process list."""
from __future__ import annotations

import argparse
import os

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def _port(value: str) -> int:
    port = int(value)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"--port must be in [0, 65535] (0: any free port), got {value}")
    return port


def _non_negative_seconds(value: str) -> float:
    seconds = float(value)
    if not seconds >= 0:
        raise argparse.ArgumentTypeError(f"--shutdown-timeout must be >= 0 seconds, got {value}")
    return seconds


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"--max-queued-requests must be >= 1, got {value}")
    return number


def add_server_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    group = parser.add_argument_group("OpenAI-compatible server")
    group.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1; 0.0.0.0 exposes the server on every interface)")
    group.add_argument("--port", type=_port, default=8000, help="port to listen on (default 8000; 0: any free port)")
    group.add_argument("--api-key", default=os.environ.get("UBATCH_API_KEY"),
                       help="require 'Authorization: Bearer <key>' on every /v1 route (default: $UBATCH_API_KEY; "
                            "unset: no key)")
    group.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="the model name(s) clients send in 'model' (default: the --model value); the first "
                            "is the name in responses to requests that name none, and in the metrics")
    group.add_argument("--shutdown-timeout", type=_non_negative_seconds, default=30.0, metavar="SECONDS",
                       help="after SIGTERM/SIGINT, how long running requests may finish before they are aborted "
                            "(default 30)")
    group.add_argument("--max-queued-requests", type=_positive_int, default=None, metavar="N",
                       help="requests that may wait for a slot; more get 503 (default: no limit)")
    group.add_argument("--uvicorn-log-level", choices=LOG_LEVELS, default="info", help="uvicorn's log level")
    group.add_argument("--disable-log-requests", action="store_true",
                       help="do not log each request (its id, prompt length and sampling parameters)")
    return group


def served_model_names(args: argparse.Namespace) -> list[str]:
    """``--served-model-name``, or the model path/name."""
    return list(args.served_model_name) if args.served_model_name else [str(args.model)]
