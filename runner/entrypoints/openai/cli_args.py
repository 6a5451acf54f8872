"""The OpenAI server's command-line flags (vLLM's ``make_arg_parser`` names), added to ``python -m runner serve``
next to the engine flags of ``generate``. The host defaults to loopback: exposing the server is an explicit
choice. ``--api-key`` also comes from ``UBATCH_API_KEY`` (as vLLM reads ``VLLM_API_KEY``), so the key need not
show in the process list."""
from __future__ import annotations

import argparse
import os

from runner.entrypoints.openai.server_limits import ServerLimits

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# --max-n's default per engine slot (--max-num-seqs x --data-parallel-size).
MAX_N_PER_SEQ_SLOT = 4


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
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return number


def _positive_seconds(value: str) -> float:
    seconds = float(value)
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {value}")
    return seconds


def add_server_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    group = parser.add_argument_group("OpenAI-compatible server")
    group.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1; 0.0.0.0 exposes the server on every interface)")
    group.add_argument("--port", type=_port, default=8000, help="port to listen on (default 8000; 0: any free port)")
    group.add_argument("--api-key", default=os.environ.get("UBATCH_API_KEY"),
                       help="require 'Authorization: Bearer <key>' on every route except /health, /version and "
                            "/metrics (default: $UBATCH_API_KEY; unset: no key)")
    group.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="the model name(s) clients send in 'model' (default: the --model value); the first "
                            "is the name in responses to requests that name none, and in the metrics")
    group.add_argument("--shutdown-timeout", type=_non_negative_seconds, default=30.0, metavar="SECONDS",
                       help="after SIGTERM/SIGINT, how long running requests may finish before they are aborted "
                            "(default 30)")
    group.add_argument("--max-queued-requests", "--max-waiting-requests", type=_positive_int, default=None,
                       metavar="N", dest="max_queued_requests",
                       help="requests that may wait for a slot; more get 503 with Retry-After (default: no limit)")
    group.add_argument("--max-request-bytes", type=_positive_int, default=ServerLimits.max_request_bytes,
                       metavar="BYTES", help="the largest request body accepted; larger ones get 413 "
                                             f"(default {ServerLimits.max_request_bytes})")
    group.add_argument("--header-timeout", type=_positive_seconds, default=ServerLimits.header_timeout_s,
                       metavar="SECONDS", help="a connection that has not sent a whole request head this long "
                       f"after connecting is closed (default {ServerLimits.header_timeout_s:g})")
    group.add_argument("--body-timeout", type=_positive_seconds, default=ServerLimits.body_timeout_s,
                       metavar="SECONDS", help="a request whose body sends nothing for this long gets 408 and its "
                                               "connection is closed (nginx's client_body_timeout; default "
                                               f"{ServerLimits.body_timeout_s:g})")
    group.add_argument("--body-total-timeout", type=_positive_seconds, default=ServerLimits.body_total_timeout_s,
                       metavar="SECONDS", help="a request whose whole body has not arrived this long after its "
                                               "headers gets 408 and its connection is closed (default "
                                               f"{ServerLimits.body_total_timeout_s:g})")
    group.add_argument("--timeout-keep-alive", type=_positive_seconds, default=ServerLimits.timeout_keep_alive_s,
                       metavar="SECONDS", help="an idle keep-alive connection is closed after this long "
                                               f"(uvicorn's; default {ServerLimits.timeout_keep_alive_s:g})")
    group.add_argument("--limit-concurrency", type=_positive_int, default=ServerLimits.limit_concurrency,
                       metavar="N", help="generation requests (/v1/..., /tokenize, /detokenize) served at once, "
                                         "counted once their body has arrived; more get 503 with Retry-After. "
                                         "/health, /metrics and /version never count (default "
                                         f"{ServerLimits.limit_concurrency})")
    group.add_argument("--max-n", type=_positive_int, default=None, metavar="N",
                       help="the most sequences one request may ask for: n, times the number of prompts of a "
                            f"completion's prompt list (default {MAX_N_PER_SEQ_SLOT} x --max-num-seqs x "
                            "--data-parallel-size: four full batches of the engine)")
    group.add_argument("--trust-request-chat-template", action="store_true",
                       help="let requests bring their own chat template (chat_template, or "
                            "chat_template_kwargs.chat_template); each renders in a child process with a time and "
                            "size bound. Off: such requests get 400 (vLLM's flag)")
    group.add_argument("--chat-template-timeout", type=_positive_seconds,
                       default=ServerLimits.chat_template_timeout_s, metavar="SECONDS",
                       help="with --trust-request-chat-template, how long a request's template may render before "
                            f"the request gets 400 (default {ServerLimits.chat_template_timeout_s:g})")
    group.add_argument("--enable-prompt-tokens-details", action="store_true",
                       help="report usage.prompt_tokens_details.cached_tokens in completion and chat responses: the "
                            "prompt tokens the prefix cache served (vLLM's flag; off: the field is absent)")
    group.add_argument("--profile-dir", default=None, metavar="DIR",
                       help="enable POST /start_profile and /stop_profile: the server records every rank's "
                            "timeline into a private directory (mode 0700) it creates inside DIR (default: off, "
                            "the routes do not exist)")
    group.add_argument("--api-server-count", "-asc", type=_positive_int, default=1, metavar="N",
                       help="API-server processes sharing the port in front of the same engine ranks, each serving "
                            "whole requests (tokenizing, detokenizing, streaming): more spread that CPU over more "
                            "cores (vLLM's flag; default 1)")
    group.add_argument("--uvicorn-log-level", choices=LOG_LEVELS, default="info", help="uvicorn's log level")
    group.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
                       help="log each request (its id, prompt length and sampling parameters) at INFO; off by "
                            "default, as in vLLM")
    group.add_argument("--disable-log-requests", action="store_true",
                       help="turn off uvicorn's access log, and the request log if --enable-log-requests is also "
                            "given (vLLM's older flag; request logs are off unless --enable-log-requests)")
    group.add_argument("--disable-uvicorn-access-log", action="store_true",
                       help="turn off uvicorn's access log (a line per request at INFO; vLLM's flag)")
    return group


def uvicorn_access_log(args: argparse.Namespace) -> bool:
    """Whether uvicorn writes its access log: on unless ``--disable-uvicorn-access-log`` or
    ``--disable-log-requests``, and only where ``--uvicorn-log-level`` lets its INFO lines through (uvicorn
    builds each line's arguments before its logger drops them)."""
    return not (args.disable_uvicorn_access_log or args.disable_log_requests) \
        and LOG_LEVELS.index(args.uvicorn_log_level) >= LOG_LEVELS.index("info")


def request_logging(args: argparse.Namespace) -> bool:
    """Whether the server logs a line per request: ``--enable-log-requests`` (off by default, as in vLLM), unless
    ``--disable-log-requests`` is also given."""
    return args.enable_log_requests and not args.disable_log_requests


def served_model_names(args: argparse.Namespace) -> list[str]:
    """``--served-model-name``, or the model path/name."""
    return list(args.served_model_name) if args.served_model_name else [str(args.model)]


def default_max_n(max_num_seqs: int, data_parallel_size: int) -> int:
    """``--max-n`` when not given: four times the sequences the engine runs in one step."""
    return MAX_N_PER_SEQ_SLOT * max_num_seqs * data_parallel_size


def server_limits(args: argparse.Namespace, max_logprobs: int = ServerLimits.max_logprobs) -> ServerLimits:
    """The per-client limits the flags set (``max_logprobs``: ``--max-logprobs``, resolved against the
    vocabulary)."""
    return ServerLimits(max_request_bytes=args.max_request_bytes, header_timeout_s=args.header_timeout,
                        body_timeout_s=args.body_timeout, body_total_timeout_s=args.body_total_timeout,
                        timeout_keep_alive_s=args.timeout_keep_alive, limit_concurrency=args.limit_concurrency,
                        max_n=args.max_n if args.max_n is not None else ServerLimits.max_n,
                        max_logprobs=max_logprobs, trust_request_chat_template=args.trust_request_chat_template,
                        chat_template_timeout_s=args.chat_template_timeout)
