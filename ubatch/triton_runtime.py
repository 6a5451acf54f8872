"""What every Triton kernel module of the project shares: the lazy import, the mode check, the interpreter lock.

Triton is optional (the ``triton`` extra), so kernel modules import it only when a kernel is first needed,
and decorate their kernels once per mode: a kernel decorated while ``TRITON_INTERPRET`` is set runs only in
the CPU interpreter, one decorated without it only compiled (see tests/README.md, "Triton: interpreter or
compiler, per process").
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable
from types import ModuleType
from typing import TypeVar

import torch

K = TypeVar("K")
_TRUE_STRINGS = frozenset({"1", "true", "yes", "on", "y"})

# The interpreter is not thread-safe: each launch monkey-patches triton.language for its duration and
# un-patches at exit, and it ast-parses kernel source on first use. Two ranks-as-threads launching at
# once break each other ("Did you forget to add @triton.jit ?", "AST constructor recursion depth
# mismatch"). One lock for every kernel of the project, since the patching is global. Launches only
# compute, never wait on another thread, so serialising them cannot deadlock.
INTERPRETER_LOCK = threading.Lock()


def interpreter_enabled() -> bool:
    """Mirror Triton's own parsing of TRITON_INTERPRET, read at call time (not import time)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE_STRINGS


def import_triton(feature: str) -> tuple[ModuleType, ModuleType]:
    """Return ``(triton, triton.language)``; a missing Triton raises ImportError naming ``feature`` and the extra.

    Called on every use (cheap once imported) so a missing Triton always gets the install hint.
    """
    try:
        import triton
        import triton.language as tl
    except ImportError as exc:
        raise ImportError(f"{feature} needs the Triton package: pip install ubatch[triton]") from exc
    return triton, tl


def kernels_per_mode(define: Callable[[], K]) -> Callable[[], K]:
    """``define`` (which decorates a module's kernels and returns them) as a loader that runs it once per
    interpreter mode and keeps what it returned: a kernel decorated in one mode cannot run in the other."""
    by_mode: dict[bool, K] = {}

    @functools.wraps(define)
    def load() -> K:
        mode = interpreter_enabled()
        if mode not in by_mode:
            by_mode[mode] = define()
        return by_mode[mode]

    return load


def launch_guard(interpret: bool) -> contextlib.AbstractContextManager[object]:
    """Serialise interpreted launches (see INTERPRETER_LOCK); compiled launches need no lock."""
    return INTERPRETER_LOCK if interpret else contextlib.nullcontext()


def launch_mode(feature: str, device: torch.device) -> bool:
    """Whether a launch of ``feature`` on ``device`` runs interpreted: CUDA tensors need compiled Triton, any
    other device ``TRITON_INTERPRET=1``; a mismatch is a RuntimeError naming ``feature`` and the device."""
    interpret = interpreter_enabled()
    if device.type == "cuda" and interpret:
        raise RuntimeError(f"{feature} got CUDA tensors, but TRITON_INTERPRET=1 selects Triton's CPU interpreter; "
                           "unset it to run the compiled kernels")
    if device.type != "cuda" and not interpret:
        raise RuntimeError(f"{feature} got tensors on {device}; without TRITON_INTERPRET=1 they need CUDA tensors")
    return interpret
