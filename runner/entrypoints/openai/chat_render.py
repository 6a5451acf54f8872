"""Chat templates that a request brings (``chat_template``, or ``chat_template_kwargs.chat_template``), as vLLM
treats them: refused with a 400 naming the field unless the server runs with ``--trust-request-chat-template``.

Jinja's sandbox limits what a template can reach, not how long it runs or how much it allocates (``{{ 'a' *
10**9 }}``, nested ``range`` loops). So a trusted request's template renders in a child process forked for it
(``render_in_child``), which the server kills when it runs past ``--chat-template-timeout``, when the client
disconnects, or when the server stops; its address space is capped (``RENDER_MEMORY_BYTES`` above what it
inherits) and a rendering longer than any prompt of the model could be is refused there, so neither its time
nor its memory is the server's. The checkpoint's own template (or ``--chat-template``) renders in the server.
"""
from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import resource
from multiprocessing.connection import Connection
from typing import Any

from runner.entrypoints.openai.errors import OpenAIError, bad_request

# What a template's rendering may allocate beyond the server's address space that the child inherits.
RENDER_MEMORY_BYTES = 1 << 30
_FORK = multiprocessing.get_context("fork")


def request_template_field(top_level: str | None, kwargs: dict[str, Any] | None) -> str | None:
    """The field through which a request brings its own chat template, if it does."""
    if top_level is not None:
        return "chat_template"
    if kwargs and kwargs.get("chat_template") is not None:
        return "chat_template_kwargs.chat_template"
    return None


def refuse_untrusted(field: str) -> OpenAIError:
    """vLLM's refusal of a request's template on a server without ``--trust-request-chat-template``."""
    return bad_request("Chat template is passed with request, but --trust-request-chat-template is not set. "
                       "Refused request with untrusted chat template.", field)


def _render_child(conn: Connection, tokenizer: Any, messages: list[dict[str, Any]], kwargs: dict[str, Any],
                  max_chars: int, parent_pid: int) -> None:
    """The forked child: render, and send back ("ok", text) or ("error", message)."""
    from runner.distributed.liveness import die_with_parent

    die_with_parent(parent_pid)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        inherited = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = inherited + RENDER_MEMORY_BYTES
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    try:
        text = tokenizer.apply_chat_template(messages, **kwargs, tokenize=False)
    except MemoryError:
        conn.send(("error", f"its rendering needs more than {RENDER_MEMORY_BYTES >> 20} MiB"))
        return
    except Exception as exc:  # noqa: BLE001  (the template's own failure, named to the client)
        conn.send(("error", f"{type(exc).__name__}: {str(exc)[:500]}"))
        return
    if not isinstance(text, str):
        conn.send(("error", f"it rendered a {type(text).__name__}, not text"))
    elif len(text) > max_chars:
        conn.send(("error", f"its rendering has {len(text)} characters, more than any prompt of this model's "
                            f"maximum context length could hold ({max_chars})"))
    else:
        conn.send(("ok", text))


async def render_in_child(tokenizer: Any, messages: list[dict[str, Any]], kwargs: dict[str, Any], *,
                          field: str, timeout_s: float, max_chars: int) -> str:
    """``tokenizer.apply_chat_template(messages, **kwargs, tokenize=False)`` in a forked child: 400 naming
    ``field`` when the template fails, runs past ``timeout_s`` or renders more than ``max_chars``. Cancelling
    this (a client disconnect, the server stopping) kills the child."""
    loop = asyncio.get_running_loop()
    reader, writer = _FORK.Pipe(duplex=False)
    child = _FORK.Process(target=_render_child, args=(writer, tokenizer, messages, kwargs, max_chars, os.getpid()),
                          name="chat template render", daemon=True)
    child.start()
    writer.close()
    answer: asyncio.Future[tuple[str, str]] = loop.create_future()

    def readable() -> None:
        loop.remove_reader(reader.fileno())
        if answer.done():
            return
        try:
            answer.set_result(reader.recv())
        except (EOFError, OSError):  # the child died without answering (killed by its limits)
            answer.set_result(("error", "its rendering ended without a result (a resource limit)"))

    loop.add_reader(reader.fileno(), readable)
    try:
        kind, text = await asyncio.wait_for(answer, timeout_s)
    except TimeoutError:
        raise bad_request(f"The request's chat template ran longer than {timeout_s:g} s "
                          "(--chat-template-timeout)", field) from None
    finally:
        with contextlib.suppress(ValueError, OSError):
            loop.remove_reader(reader.fileno())
        reader.close()
        if child.is_alive():
            child.kill()
        child.join(1.0)  # a killed or finished child is reaped at once
    if kind != "ok":
        raise bad_request(f"The request's chat template failed on these messages: {text}", field)
    return text

