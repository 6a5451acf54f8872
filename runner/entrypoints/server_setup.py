"""What every API-server process of ``serve`` sets up alike, with one process or ``--api-server-count N``: the
routes beyond the OpenAI app's, and where the server's logs go."""
from __future__ import annotations

import logging
from typing import Any


def add_routes(app: Any, profile_dir: str | None) -> None:
    """The routes beyond ``build_app``'s: vLLM's /tokenize and /detokenize, and profiling with ``--profile-dir``."""
    from runner.entrypoints.openai.tokenization import add_tokenization_routes
    from runner.entrypoints.profiling import add_profile_routes

    if profile_dir is not None:
        add_profile_routes(app, profile_dir)
    add_tokenization_routes(app)


def log_to_stderr() -> None:
    """INFO logs of the server and of its engine client on stderr (which pid each rank has, rank failures),
    unless the application configured logging."""
    if logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s"))
    for name in ("runner.entrypoints.openai", "ubatch.engine"):
        log = logging.getLogger(name)
        if not log.handlers:
            log.addHandler(handler)
            log.setLevel(logging.INFO)
