"""Find the daemon, or start one on this machine when there is none.

The TUI is a client: it never runs the engine itself, nor imports the server. When nothing
answers at the configured address and that address is on this machine, it runs
`edgeinfer daemon start` (a new process; it starts the detached daemon, with its pid file and
log in the state directory, and returns once /health answers). The daemon keeps running after
the TUI exits, like Ollama's.
"""
from __future__ import annotations

import asyncio
import subprocess
import sys
from urllib.parse import urlsplit

from .api import DaemonClient

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0"}


def is_local(base_url: str) -> bool:
    return (urlsplit(base_url).hostname or "") in LOCAL_HOSTS


class LaunchError(Exception):
    """The daemon could not be started; the message says why in one sentence."""


class DaemonLauncher:
    def __init__(self, base_url: str) -> None:
        self.base_url = base_url

    def start(self) -> str:
        """Start a daemon in the background and wait for it (blocking: run it in a thread).
        Returns a sentence saying what was started; raises LaunchError with the reason."""
        parts = urlsplit(self.base_url)
        cmd = [sys.executable, "-m", "edgeinfer", "daemon", "start",
               "--host", parts.hostname or "127.0.0.1", "--port", str(parts.port or 11435)]
        r = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
        if r.returncode != 0:
            why = (r.stderr.strip() or r.stdout.strip() or f"exit code {r.returncode}")
            raise LaunchError(why.splitlines()[0].removeprefix("edgeinfer: "))
        # "edgeinfer daemon started: pid N, URL, log PATH"
        return r.stdout.strip().splitlines()[-1].partition(", ")[0]


async def wait_healthy(client: DaemonClient, timeout: float) -> bool:
    """Poll /health until it answers or the timeout passes."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if await client.health():
            return True
        await asyncio.sleep(0.25)
    return False
