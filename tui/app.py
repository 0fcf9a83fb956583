"""`edgeinfer tui`: the Textual terminal app, a client of the daemon over HTTP.

One app, three modes (screens): chat (F1), dashboard (F2), models (F3). The app owns the
connection: a worker that finds or starts the daemon, then follows `/api/stats/stream`
(publishing each sample on the `stats` reactive), and on any break shows the banner and
reconnects with backoff. Screens read `app.api` for their own requests in their own workers
and report a broken connection with `report_unreachable()`.
"""
from __future__ import annotations

import asyncio
from collections import deque
from datetime import datetime, timezone
from typing import Callable

import httpx
from textual import work
from textual.app import App
from textual.binding import Binding
from textual.reactive import reactive

from edgeinfer.store.bundled import DEFAULT_MODEL

from .api import ApiError, DaemonClient, DaemonUnreachable, Stats
from .daemon import DaemonLauncher, LaunchError, is_local, wait_healthy
from .screens.chat import ChatScreen
from .screens.dashboard import DashboardScreen
from .screens.models import ModelsScreen

HISTORY = 120
START_TIMEOUT = 90.0   # first start of a daemon may compile kernels


class EdgeInferApp(App):
    TITLE = "edgeinfer"
    CSS_PATH = "app.tcss"
    MODES = {"chat": ChatScreen, "dashboard": DashboardScreen, "models": ModelsScreen}
    DEFAULT_MODE = "chat"

    BINDINGS = [
        Binding("f1", "switch_mode('chat')", "Chat"),
        Binding("f2", "switch_mode('dashboard')", "Dash"),
        Binding("f3", "switch_mode('models')", "Models"),
        Binding("ctrl+r", "reconnect", "Reconnect", show=False),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    connected: reactive[bool | None] = reactive(None)   # None until the first check
    banner: reactive[str] = reactive("")                # empty: hidden
    stats: reactive[Stats | None] = reactive(None, always_update=True)
    models_version: reactive[int] = reactive(0)          # bump: model lists reload

    def __init__(self, host: str | None = None, *, autostart: bool = True,
                 transport: httpx.AsyncBaseTransport | None = None,
                 clock: Callable[[], datetime] | None = None,
                 stream_stats: bool = True, model: str | None = None) -> None:
        super().__init__()
        self.api = DaemonClient(host, transport=transport)
        self.autostart = autostart and is_local(self.api.base_url)
        self.launcher = DaemonLauncher(self.api.base_url)
        self.stats_history: deque[Stats] = deque(maxlen=HISTORY)
        # the chat screen selects this one when the daemon lists it (else the first listed)
        self.preferred_model: str | None = model or DEFAULT_MODEL
        self.stream_stats = stream_stats
        self._clock = clock or (lambda: datetime.now(timezone.utc))
        self._wake = asyncio.Event()
        self._reason = ""
        self._tried_start = False      # the app starts a daemon at most once
        self.sub_title = self.api.host

    def now(self) -> datetime:
        return self._clock()

    # ----- lifecycle ----------------------------------------------------------------------
    def on_mount(self) -> None:
        self.follow_daemon()

    async def on_unmount(self) -> None:
        await self.api.close()

    # ----- connection ---------------------------------------------------------------------
    def report_unreachable(self, reason: str) -> None:
        """A request failed on transport: show the banner now; the connection worker
        is already reconnecting (its stream broke too) or will be woken."""
        self._reason = reason
        if self.connected is not False:
            self.connected = False
        self._wake.set()

    def watch_connected(self, old: bool | None, new: bool | None) -> None:
        if new:
            self.banner = ""
            if old is False:
                self.notify(f"Reconnected to the daemon at {self.api.host}.")
            self.models_version += 1
        elif new is False:
            self.banner = self._down_text()

    def _down_text(self, retry_in: float | None = None) -> str:
        why = f" ({self._reason})" if self._reason else ""
        when = f" in {retry_in:.0f}s" if retry_in and retry_in >= 1 else ""
        return (f"⚠ edgeinfer daemon at {self.api.host} is not reachable{why}. "
                f"Reconnecting{when}… (ctrl+r retries now)")

    def action_reconnect(self) -> None:
        self._wake.set()

    @work(exclusive=True, group="connection", exit_on_error=False)
    async def follow_daemon(self) -> None:
        """Runs for the app's life. Nothing it meets ends it: an unexpected error becomes
        the banner's reason and the loop goes on reconnecting."""
        while True:
            try:
                await self._connection_loop()
            except asyncio.CancelledError:
                raise
            except Exception as e:   # a bug or a daemon answering nonsense: keep going
                self._reason = f"{type(e).__name__}: {e}"
                self.connected = False
                await self._sleep(5.0)

    async def _connection_loop(self) -> None:
        backoff = 0.5
        while True:
            if not await self.api.health():
                if self.autostart and not self._tried_start:
                    self._tried_start = True
                    self.banner = f"Starting the edgeinfer daemon at {self.api.host}…"
                    try:
                        how = await asyncio.to_thread(self.launcher.start)
                    except (OSError, LaunchError) as e:
                        how = ""
                        self._reason = f"could not start it: {e}"
                    if how and await wait_healthy(self.api, START_TIMEOUT):
                        continue
                    if not self._reason:
                        self._reason = "it did not start; see `edgeinfer daemon logs`"
                if not self._reason:
                    self._reason = "connection refused"
                self.connected = False
                self.banner = self._down_text(backoff)
                await self._sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            self._reason = ""
            self.connected = True
            loop = asyncio.get_running_loop()
            since = loop.time()
            await self._follow_stats()
            # the stream ended or broke: the daemon went away (or is restarting, or refuses
            # us); a connection that keeps breaking at once is retried ever more slowly
            backoff = 0.5 if loop.time() - since > 10 else min(backoff * 2, 5.0)
            if not self._reason:
                self._reason = "connection lost"
            self.connected = False
            await self._sleep(0.2)

    async def _follow_stats(self) -> None:
        if not self.stream_stats:
            await self._poll_stats()
            return
        try:
            async for sample in self.api.stats_stream():
                self._publish(sample)
        except DaemonUnreachable as e:
            self._reason = str(e)
        except ApiError as e:
            if e.status in (404, 405, 501):
                await self._poll_stats()   # a daemon without the stream: poll /api/ps
            elif e.status in (401, 403):
                self._reason = f"{e}; set EDGEINFER_API_KEY"
            else:
                self._reason = str(e)

    async def _poll_stats(self) -> None:
        """Fallback: no live figures, but loaded models and liveness once a second."""
        while True:
            try:
                loaded = await self.api.loaded()
            except (DaemonUnreachable, ApiError) as e:
                self._reason = str(e)
                return
            self._publish(Stats(models=tuple(loaded)))
            await self._sleep(1.0)
            if self.connected is False:
                return

    def _publish(self, sample: Stats) -> None:
        self.stats_history.append(sample)
        self.stats = sample

    async def _sleep(self, seconds: float) -> None:
        """Sleep, but wake early on ctrl+r or a reported failure."""
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), timeout=seconds)
        except asyncio.TimeoutError:
            pass

    # ----- navigation ---------------------------------------------------------------------
    def open_chat(self, model: str) -> None:
        self.preferred_model = model
        self.switch_mode("chat")
        screen = self.screen
        if isinstance(screen, ChatScreen):
            screen.select_model(model)


def run(host: str | None = None, autostart: bool = True, model: str | None = None) -> int:
    app = EdgeInferApp(host, autostart=autostart, model=model)
    app.run()
    return app.return_code or 0
