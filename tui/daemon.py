"""Find the daemon, or start one on this machine when there is none.

The TUI is a client: it never runs the engine itself. When nothing answers at the configured
address and that address is on this machine, it starts the daemon the way every client
command does (`edgeinfer.server.daemon.start_background`: a new detached process, never a
fork, since numba's OpenMP layer is not fork-safe; pid file and log in the state directory).
The daemon keeps running after the TUI exits, like Ollama's.
"""
from __future__ import annotations

import asyncio
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
        from edgeinfer.server import daemon as server_daemon
        parts = urlsplit(self.base_url)
        try:
            info = server_daemon.start_background(parts.hostname or "127.0.0.1",
                                                  parts.port or 11435)
        except server_daemon.DaemonError as e:
            raise LaunchError(str(e).splitlines()[0]) from None
        return f"started the edgeinfer daemon (pid {info.pid})"


async def wait_healthy(client: DaemonClient, timeout: float) -> bool:
    """Poll /health until it answers or the timeout passes."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if await client.health():
            return True
        await asyncio.sleep(0.25)
    return False
