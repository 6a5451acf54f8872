"""``--device auto|cuda|cpu``: which device the engine's ranks run on, and what follows from it.

vLLM has ``--device`` for the same reason: a machine with CUDA is not always the machine to run on CUDA.
With ``auto`` the ranks use CUDA when ``torch.cuda.is_available()``; NCCL then needs one GPU per rank on a
host, and a launch with fewer fails fast naming ``--device cpu``, which runs the same ranks over gloo on the
CPU. With ``cpu`` nothing touches CUDA (no ``torch.cuda.set_device``, no CUDA stream or event) even when a
GPU is present: the model runner, the ubatch wrapper's streams, the forward thread and the launcher all
follow the configured device, not ``torch.cuda.is_available()``. ``cuda`` on a machine without CUDA is an
error naming the value, raised where the setting is validated (before any rank starts).

This module is the one place that turns the setting into a device type and a process-group backend; it
imports torch only inside its functions, so ``runner.config`` can validate without loading it early.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEVICE_CHOICES = ("auto", "cuda", "cpu")


class DeviceUnavailableError(RuntimeError):
    """``device="cuda"`` on a machine where CUDA is not available."""


def check_device_choice(choice: object) -> str:
    """``choice`` itself when it is one of :data:`DEVICE_CHOICES`, else ``ValueError`` naming it."""
    if choice not in DEVICE_CHOICES:
        raise ValueError(f"device must be one of {', '.join(DEVICE_CHOICES)}; got {choice!r}")
    return choice


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def resolve_device_type(choice: str) -> str:
    """``"cuda"`` or ``"cpu"`` for the setting ``choice`` on this machine.

    ``auto`` is CUDA when it is available; ``cuda`` without CUDA raises :class:`DeviceUnavailableError`
    rather than running somewhere the user did not ask for.
    """
    check_device_choice(choice)
    if choice == "cpu":
        return "cpu"
    available = cuda_available()
    if choice == "cuda" and not available:
        raise DeviceUnavailableError("device 'cuda' was requested but CUDA is not available on this machine "
                                     "(torch.cuda.is_available() is False); use device 'cpu' or 'auto'")
    return "cuda" if available else "cpu"


def backend_for(device_type: str) -> str:
    """The process-group backend of ranks on ``device_type``: NCCL for CUDA tensors, gloo for CPU ones."""
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"device type must be 'cuda' or 'cpu', got {device_type!r}")
    return "nccl" if device_type == "cuda" else "gloo"


def torch_device(choice: str) -> torch.device:
    """The ``torch.device`` this process's model runs on: the current CUDA device (the launcher set it per
    rank) or the CPU."""
    import torch

    if resolve_device_type(choice) == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_world_backend(backend: str, device_type: str) -> None:
    """A world someone else initialised must be able to move this device's tensors: NCCL cannot move CPU
    ones, so ``device='cpu'`` in an NCCL world is refused here rather than failing at the first all-to-all."""
    if backend == "nccl" and device_type == "cpu":
        raise RuntimeError("this torch.distributed world uses the NCCL backend, which cannot move CPU tensors, but "
                           "the engine runs on device 'cpu'; initialise the world with gloo (torchrun: the "
                           "engine does so itself with --device cpu) or run on CUDA")
