"""Start real ``plinth serve`` processes on loopback for the server tests, and talk to them."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

STARTUP_TIMEOUT_S = 240  # the machine is shared: loading can take a while under load


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServerProcess:
    """A running ``plinth serve``: its URL, process and log file."""

    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    api_key: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        """Authorization headers (empty without an API key)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs: Any) -> httpx.Client:
        """A synchronous httpx client on this server."""
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=120, **kwargs)

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as {name: value} (labels dropped; label sets of one name summed)."""
        text = httpx.get(f"{self.url}/metrics", headers=self.headers, timeout=30).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$", line)
            if m:
                values[m.group(1)] = values.get(m.group(1), 0.0) + float(m.group(3))
        return values

    def log_text(self) -> str:
        """What the server printed so far."""
        return self.log.read_text(errors="replace")

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, then wait; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


def start_server(*args: str, api_key: str | None = None) -> ServerProcess:
    """Start ``plinth serve ARGS`` on a free port and wait for ``/health``."""
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="plinth-serve-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "plinth.cli", "serve", "--port", str(port), *args]
    if api_key:
        cmd += ["--api-key", api_key]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("PLINTH_API_KEY", None)
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(f"http://127.0.0.1:{port}", proc, log, api_key)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    last_error = "no answer yet"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"plinth serve exited with {proc.returncode}:\n{server.log_text()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
                return server
        except httpx.HTTPError as exc:  # still loading the model: not listening yet
            last_error = repr(exc)
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(
        f"plinth serve did not become healthy in {STARTUP_TIMEOUT_S}s (last: {last_error}):\n{server.log_text()}"
    )


def running(*args: str, api_key: str | None = None) -> Iterator[ServerProcess]:
    """Start a server for a fixture; stop it afterwards (and show its log if it did not exit 0)."""
    server = start_server(*args, api_key=api_key)
    try:
        yield server
    finally:
        if server.proc.poll() is None:
            code = server.stop()
            assert code == 0, f"plinth serve exited with {code}:\n{server.log_text()}"
