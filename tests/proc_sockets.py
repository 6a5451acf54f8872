"""What processes listen on, which processes exist and how much CPU they used, read from /proc (Linux) for the
fault, socket and server tests.

Listening sockets: ``/proc/net/tcp`` and ``tcp6`` list every TCP socket of the network namespace with its
inode; ``/proc/<pid>/fd`` links name the inodes a process holds. Matching the two gives each process's
listening addresses without psutil.
"""
from __future__ import annotations

import ipaddress
import os
import subprocess
from pathlib import Path

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column


def _address(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp{,6} write addresses as 32-bit words in host (little-endian) byte order."""
    raw = b"".join(bytes.fromhex(hex_addr[i:i + 8])[::-1] for i in range(0, len(hex_addr), 8))
    return ipaddress.ip_address(raw)


def listening_inodes() -> dict[int, tuple[str, int]]:
    """inode -> (address, port) of every listening TCP socket in this network namespace."""
    out: dict[int, tuple[str, int]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != _LISTEN:
                continue
            host, port = fields[1].split(":")
            out[int(fields[9])] = (str(_address(host)), int(port, 16))
    return out


def socket_inodes(pid: int) -> set[int]:
    inodes: set[int] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # the process is gone
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def listening_addresses(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket ``pid`` listens on."""
    table = listening_inodes()
    return sorted(table[i] for i in socket_inodes(pid) if i in table)


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (children, grandchildren...), from the ppid field of /proc/*/stat."""
    parent_of: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent_of[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {p for p, pp in parent_of.items() if pp in frontier} - found
        found |= frontier
    return found


def alive_per_ps(pids: set[int]) -> dict[int, str]:
    """pid -> "state command" for those of ``pids`` that ``ps`` still lists (zombies included)."""
    if not pids:
        return {}
    proc = subprocess.run(["ps", "-o", "pid=,stat=,args=", "-p", ",".join(map(str, sorted(pids)))],
                          capture_output=True, text=True, check=False)
    out = {}
    for line in proc.stdout.splitlines():
        pid, rest = line.strip().split(None, 1)
        out[int(pid)] = rest
    return out


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time the processes used so far (utime + stime of /proc/<pid>/stat)."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")
