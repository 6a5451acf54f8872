"""The server's limits per client, as its flags set them: a module of its own, without the HTTP stack, so that
building the CLI's parser imports neither fastapi nor uvicorn (the base install runs ``generate`` and ``bench``)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerLimits:
    """The server's limits per client (flags of ``cli_args.add_server_args``)."""

    max_request_bytes: int = 8 << 20
    header_timeout_s: float = 10.0
    body_timeout_s: float = 5.0
    body_total_timeout_s: float = 60.0
    timeout_keep_alive_s: float = 5.0
    limit_concurrency: int | None = 4096
    max_n: int = 1024
    max_logprobs: int = 20
    trust_request_chat_template: bool = False
    chat_template_timeout_s: float = 5.0


DEFAULT_LIMITS = ServerLimits()
