"""Find the daemon, or start one on this machine when there is none.

The TUI is a client: it never runs the engine itself. When nothing answers at the configured
address and that address is on this machine, it starts the daemon as a new process (never a
fork: numba's OpenMP layer is not fork-safe). It prefers the project's own client helper when
one exists (`edgeinfer.server.daemon.start_background`: pid file and log in the state dir,
the daemon outlives the TUI); otherwise it runs `edgeinfer serve` in a subprocess that it
stops again when the TUI exits.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

from .api import DaemonClient

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0"}


def is_local(base_url: str) -> bool:
    return (urlsplit(base_url).hostname or "") in LOCAL_HOSTS


class LaunchError(Exception):
    """The daemon could not be started; the message says why in one sentence."""


class DaemonLauncher:
    """Starts the daemon at most once; remembers a subprocess it owns."""

    def __init__(self, base_url: str, log_path: Path | None = None) -> None:
        self.base_url = base_url
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    def _port(self) -> int:
        return urlsplit(self.base_url).port or 11435

    def start(self) -> str:
        """Start a daemon in the background (blocking: run it in a thread); return a
        sentence saying how. Raises LaunchError with the daemon's own reason."""
        host = urlsplit(self.base_url).hostname or "127.0.0.1"
        try:
            from edgeinfer.server import daemon as server_daemon
        except ImportError:
            server_daemon = None
        if server_daemon is not None:
            # the project's own helper: detached, pid file and log in the state dir; it
            # keeps running after the TUI exits, like any client-started daemon
            try:
                info = server_daemon.start_background(host, self._port())
            except server_daemon.DaemonError as e:
                raise LaunchError(str(e).splitlines()[0]) from None
            return f"started the edgeinfer daemon (pid {info.pid})"
        cmd = [sys.executable, "-m", "edgeinfer.cli", "serve", "--host", host,
               "--port", str(self._port())]
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            self.process = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                start_new_session=True, env=dict(os.environ))
        finally:
            if log is not subprocess.DEVNULL:
                log.close()
        return f"started `edgeinfer serve` (pid {self.process.pid})"

    def exited(self) -> int | None:
        return self.process.poll() if self.process else None

    def stop(self) -> None:
        """Stop the subprocess we started (if any); a daemon started by the helper stays."""
        p, self.process = self.process, None
        if p is None or p.poll() is not None:
            return
        p.terminate()
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)


async def wait_healthy(client: DaemonClient, timeout: float,
                       launcher: DaemonLauncher | None = None) -> bool:
    """Poll /health until it answers, the timeout passes or our subprocess dies."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if await client.health():
            return True
        if launcher is not None and launcher.process is not None and launcher.exited() is not None:
            return False
        await asyncio.sleep(0.25)
    return False
