"""A ``python -m runner serve`` subprocess for the benchmark: started on a free loopback port, ready once
``/health`` answers, stopped with SIGTERM (the server drains and exits 0) and SIGKILL only if that hangs."""
from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx

METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)$")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(base_url: str, names: tuple[str, ...], timeout_s: float = 10.0) -> dict[str, float]:
    """Sum of each named metric over its label sets, from ``/metrics`` (Prometheus text format)."""
    text = httpx.get(f"{base_url}/metrics", timeout=timeout_s).text
    found: dict[str, float] = {}
    for line in text.splitlines():
        m = METRIC_LINE.match(line.strip())
        if m and m.group(1) in names:
            found[m.group(1)] = found.get(m.group(1), 0.0) + float(m.group(3))
    return found


class ServerProcess:
    """``with ServerProcess(model, args) as srv: srv.base_url``; its log goes to a file (``log_path``) in
    ``log_dir``, or in the temporary directory when none is given; its tail is shown if it fails to start.
    ``finish_log`` removes it or says where it stays."""

    def __init__(self, model: str, serve_args: str = "", *, startup_timeout_s: float = 600.0,
                 name: str = "server", log_dir: str | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.name = name
        self.cmd = [sys.executable, "-m", "runner", "serve", model, "--host", "127.0.0.1", "--port", str(self.port),
                    "--disable-log-requests", *shlex.split(serve_args)]
        self.startup_timeout_s = startup_timeout_s
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115  (closed by stop(), after the server's last line)
            prefix=f"ubatch-bench-{name.replace(' ', '-')}-", suffix=".log", dir=log_dir, delete=False)
        self.log_path = self.log.name
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} ({shlex.join(self.cmd)}) exited with code {self.proc.returncode} "
                                   f"before it was ready:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"{self.name} did not answer /health within {self.startup_timeout_s:.0f} s:\n"
                           f"{self.log_tail()}")

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM, wait for the drain; the exit code (0 for a clean shutdown)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        code, self.proc = self.proc.returncode, None
        return code

    def log_tail(self, lines: int = 30) -> str:
        self.log.flush()
        with open(self.log.name, errors="replace") as fh:
            return "".join(fh.readlines()[-lines:])

    def finish_log(self, keep: bool) -> str | None:
        """Close the log; remove it unless ``keep``. Returns the path kept, or None when it was removed."""
        self.log.close()
        if keep:
            return self.log_path
        os.unlink(self.log_path)
        return None
