"""Where the built-in spawner's ranks meet: a private ``FileStore``, and gloo/NCCL pinned to loopback.

Why a ``FileStore`` in a private directory, not a ``TCPStore``: torch's ``TCPStore`` server listens on every
interface whatever host it is given, and it has no authentication, so any machine that can reach this one
could write keys into a running rendezvous. A store that binds 127.0.0.1 would still be open to every local
user. A file in a directory created with mode 0700 (``tempfile.mkdtemp``) opens no socket at all and is
reachable only by this user; a single-node launch needs nothing more. The directory is removed when the
launch ends, normally or not; only a launcher killed with SIGKILL leaves it behind (a 0700 directory
``ubatch-rdzv-*`` holding one small file, in the temp directory).

The store only introduces the ranks to each other; the collectives then run over gloo (CPU) or NCCL pair
connections. Left alone, gloo picks the address the machine's hostname resolves to, which may be a public
interface, so spawned ranks get ``GLOO_SOCKET_IFNAME`` (and ``NCCL_SOCKET_IFNAME``) set to the loopback
interface unless the user set them. Under ``torchrun`` none of this applies: the rendezvous is torchrun's.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist

STORE_FILE = "store"
RDZV_PREFIX = "ubatch-rdzv-"
IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_IFF_LOOPBACK = 0x8  # <linux/if.h>


def loopback_interface() -> str:
    """Name of the loopback network interface ("lo" on Linux, "lo0" on macOS)."""
    net = Path("/sys/class/net")
    if net.is_dir():
        for iface in sorted(net.iterdir()):
            try:
                if int((iface / "flags").read_text(), 16) & _IFF_LOOPBACK:
                    return iface.name
            except (OSError, ValueError):
                continue
    return "lo0" if sys.platform == "darwin" else "lo"


def loopback_env() -> dict[str, str]:
    """The interface variables spawned ranks need to keep their pair connections on loopback; a variable the
    user already set is left out (theirs wins)."""
    iface = loopback_interface()
    return {var: iface for var in IFNAME_VARS if not os.environ.get(var)}


class PrivateRendezvous:
    """A 0700 temporary directory holding the ``FileStore`` file; ``close()`` (or leaving ``with``) removes it."""

    def __init__(self) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix=RDZV_PREFIX))  # mkdtemp: mode 0700, owned by this user
        self.store_path = str(self.directory / STORE_FILE)

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> PrivateRendezvous:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def join_store(store_path: str, world_size: int, timeout_s: float) -> dist.Store:
    """The rank side: open the shared file as a store whose waits give up after ``timeout_s``."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.FileStore(store_path, world_size)
    store.set_timeout(timedelta(seconds=timeout_s))
    return store
