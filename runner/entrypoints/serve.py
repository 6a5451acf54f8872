"""``python -m runner serve MODEL``: the OpenAI-compatible server over the DP ranks (vLLM's ``vllm serve``).

Everything that can be checked before a rank starts is (exit 2 naming the flag); then one engine-core process
per DP rank loads the model and the HTTP server runs until SIGTERM/SIGINT (drain, exit 0) or until a rank dies
(exit 1, naming it). ``--api-server-count N`` > 1 runs N HTTP server processes on the port instead
(``runner/entrypoints/api_servers.py``). Design: docs/design_notes.md, "Front ends" and "Engine client".
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("runner.entrypoints.openai.serve")


def add_serve_args(p: argparse.ArgumentParser, engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """``MODEL`` (positional, or ``--model``), every engine flag of ``generate``, and the server's flags."""
    from runner.entrypoints.engine_args import add_model_positional
    from runner.entrypoints.openai.cli_args import add_server_args
    from runner.entrypoints.tokenizer_args import add_chat_args

    add_model_positional(p, required=True)
    engine_args(p)
    add_server_args(p)
    add_chat_args(p)
    p.add_argument("--debug", action="store_true", help="print the full traceback of an error (also: UBATCH_DEBUG=1; "
                   "default: off)")


def serve_main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from runner.batch_defaults import UsageContext
    from runner.distributed.launch import torchrun_env_present
    from runner.entrypoints.engine_args import (
        config_from_args,
        model_info_or_exit,
        resolve_model_arg,
        with_batch_defaults_from_args,
    )

    resolve_model_arg(args, parser, required=True)
    if torchrun_env_present() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        parser.error("serve starts its own rank processes (--data-parallel-size); do not run it under torchrun")
    cfg = config_from_args(args, parser)
    if cfg.trace_file:
        parser.error("argument --trace-file: the server records a window with POST /start_profile and "
                     "/stop_profile instead")
    info = model_info_or_exit(cfg, parser)
    cfg = with_batch_defaults_from_args(cfg, args, info.max_model_len, UsageContext.OPENAI_API_SERVER)
    from runner.engine.tokenizer import load_tokenizer, load_tokenizer_from_dir
    from runner.entrypoints.openai.cli_args import default_max_n
    from runner.entrypoints.server_setup import log_to_stderr
    from runner.entrypoints.tokenizer_args import (
        apply_chat_template_arg,
        max_logprobs_or_exit,
        read_chat_template,
        tokenizer_dir_or_exit,
    )

    tokenizer_dir = tokenizer_dir_or_exit(args, parser)
    template = read_chat_template(args.chat_template, parser) if args.chat_template else None
    max_logprobs = max_logprobs_or_exit(args.max_logprobs, info.vocab_size, parser)
    if args.max_n is None:
        args.max_n = default_max_n(cfg.max_num_seqs, cfg.data_parallel_size)
    log_to_stderr()
    if tokenizer_dir is not None:
        tokenizer = load_tokenizer_from_dir(tokenizer_dir)
    else:
        tokenizer = load_tokenizer(cfg.model, cfg.cache_dir) if info.has_tokenizer else None
    apply_chat_template_arg(tokenizer, template, cfg.model, parser)
    note = info.generation_config.describe()
    if note:
        print(f"generation config: {note}", file=sys.stderr)
    try:
        if args.api_server_count > 1:
            from runner.entrypoints.api_servers import serve_api_servers

            return serve_api_servers(cfg, args, tokenizer, info.generation_config, max_logprobs)
        from runner.entrypoints.openai.api_server import run_loop

        return run_loop(_serve(cfg, args, tokenizer, info.generation_config, max_logprobs))
    except KeyboardInterrupt:  # a signal before the HTTP server took over signal handling (model loading)
        print("interrupted while the engine was starting", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - one line, the traceback only when asked for
        from runner.distributed.launch import describe_exception

        if args.debug or os.environ.get("UBATCH_DEBUG", "") not in ("", "0"):
            import traceback

            traceback.print_exc()
        print(f"error: {describe_exception(e)}", file=sys.stderr)
        return 1


async def _serve(cfg: Any, args: argparse.Namespace, tokenizer: Any, generation_config: Any, max_logprobs: int) -> int:
    from runner.core.engine_core import tune_gc
    from runner.engine.async_llm import MPEngineClient
    from runner.entrypoints.openai.api_server import bind_socket, run_server
    from runner.entrypoints.openai.cli_args import served_model_names
    from runner.entrypoints.openai.metrics import ServerMetrics
    from runner.entrypoints.server_setup import add_routes

    sock = bind_socket(args.host, args.port)  # before the ranks load: a busy port fails in a second, not minutes
    dead = asyncio.Event()
    client = MPEngineClient(cfg, tokenizer=tokenizer, default_params=generation_config.sampling_defaults,
                            generation_config=generation_config, max_queued_requests=args.max_queued_requests,
                            on_dead=lambda message: dead.set())
    try:
        await client.start()
        tune_gc()  # the API server's objects by now (tokenizer, app) leave the collector's scans, as the cores'
        metrics = ServerMetrics(served_model_names(args)[0], client.max_model_len)
        client.metrics = metrics
        code = await run_server(args, client, engine_dead=dead, metrics=metrics, sock=sock,
                                configure_app=functools.partial(add_routes, profile_dir=args.profile_dir),
                                max_logprobs=max_logprobs)
        if client.dead_error is not None:
            print(f"error: {client.dead_error}", file=sys.stderr)
            code = code or 1
        return code
    finally:
        sock.close()
        if client.dead_error is None:
            await client.shutdown(args.shutdown_timeout + 30.0)
        else:
            await client.close()
