"""The terminal app, driven by Textual's pilot.

Most tests run against a small in-process fake daemon (tests/tui_fake_daemon.py: FastAPI +
uvicorn on 127.0.0.1) so they are fast and deterministic; the `real daemon` tests at the end
run `edgeinfer serve` with the bundled gemma3 model when the daemon exists in this tree.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from edgeinfer.tui.api import parse_stats, parse_time
from edgeinfer.tui.app import EdgeInferApp
from edgeinfer.tui.screens.chat import ChatScreen
from edgeinfer.tui.screens.confirm import ConfirmScreen
from edgeinfer.tui.screens.dashboard import DashboardScreen
from edgeinfer.tui.screens.models import ModelsScreen
from edgeinfer.tui.widgets.banner import ConnectionBanner
from edgeinfer.tui.widgets.chat_message import ChatMessage
from edgeinfer.tui.widgets.metric_panel import MetricPanel
from edgeinfer.tui.widgets.stream_status import StreamStatus
from tui_fake_daemon import FakeDaemon, FakeState, free_port

FROZEN_NOW = datetime(2030, 1, 1, 0, 0, 0, tzinfo=timezone.utc)   # fake expiry: +5 min
SIZE = (80, 24)


async def wait_for(pilot, predicate, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        await pilot.pause(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def make_app(host: str, **kw) -> EdgeInferApp:
    kw.setdefault("autostart", False)
    kw.setdefault("clock", lambda: FROZEN_NOW)
    return EdgeInferApp(host, **kw)


def model_select_ready(app) -> bool:
    from textual.widgets import Select
    screen = app.screen
    return isinstance(screen, ChatScreen) and isinstance(
        screen.query_one("#model", Select).value, str)


@contextlib.asynccontextmanager
async def chat_session(host: str, timeout: float = 10.0, **kw):
    """The app on a daemon, run by Textual's pilot, once the model list has loaded."""
    app = make_app(host, **kw)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: model_select_ready(app), timeout=timeout, what="model list")
        yield app, pilot


async def send(pilot, text: str) -> None:
    app = pilot.app
    prompt = app.screen.query_one("#prompt")
    prompt.focus()
    prompt.value = text
    await pilot.press("enter")


@pytest.fixture()
def fake():
    with FakeDaemon() as d:
        yield d


# ----- parsing ----------------------------------------------------------------------------

def test_parse_stats_daemon_shape():
    s = parse_stats({
        "tokens_per_s": 12.0, "running": 2, "queue_depth": 1,
        "process": {"rss_bytes": 100}, "system": {"memory_total_bytes": 1000,
                                                 "memory_available_bytes": 250},
        "models": [{"name": "a", "size_bytes": 7, "expires_at": "2262-04-11T23:47:16Z",
                    "kv_blocks_used": 3, "kv_blocks_total": 10, "prefix_hit_rate": 0.5},
                   {"name": "b", "size_bytes": 9, "expires_at": "2030-01-01T00:00:00Z",
                    "kv_blocks_used": 1, "kv_blocks_total": 10, "prefix_hit_rate": 0.0}]})
    assert (s.tokens_per_s, s.running, s.waiting, s.rss) == (12.0, 2, 1, 100)
    assert (s.mem_used, s.mem_total) == (750, 1000)
    assert (s.kv_used, s.kv_total) == (4, 20)
    assert s.prefix_hit_rate == pytest.approx(0.25)
    assert s.models[0].expires_at is None and s.models[1].memory == 9


def test_parse_stats_tolerates_shapes():
    flat = parse_stats({"tokens_per_s": 3.5, "running": 1, "waiting": 0, "kv_blocks_used": 2,
                        "kv_blocks_total": 8, "prefix_hit_rate": 50, "rss": 10,
                        "models": [{"name": "a", "size": 5,
                                    "expires_at": "2030-01-01T00:00:00.123456789Z"}]})
    assert flat.tokens_per_s == 3.5 and flat.kv_total == 8
    assert flat.prefix_hit_rate == pytest.approx(0.5)
    assert flat.models[0].memory == 5
    assert flat.models[0].expires_at == datetime(2030, 1, 1, 0, 0, 0, 123456, timezone.utc)
    nested = parse_stats({"kv": {"used": 1, "total": 4}, "requests": {"running": 2,
                          "waiting": 3}, "gpu": {"used": 1, "total": 2}})
    assert (nested.kv_used, nested.kv_total, nested.running, nested.waiting) == (1, 4, 2, 3)
    assert nested.gpu_total == 2 and nested.tokens_per_s is None
    assert parse_time("0001-01-01T00:00:00Z") is None
    assert parse_stats({"running": "x"}).running is None


# ----- chat -------------------------------------------------------------------------------

@pytest.mark.asyncio
async def test_chat_streams_reply_with_figures_and_keeps_history(fake):
    async with chat_session(fake.host) as (app, pilot):
        screen = app.screen
        screen.query_one("#system").value = "Be brief."
        screen.query_one("#temperature").value = "0.3"
        await send(pilot, "hi there")
        status = screen.query_one(StreamStatus)
        await wait_for(pilot, lambda: status.state == "done", what="reply done")
        messages = list(screen.query(ChatMessage))
        assert [m.role for m in messages] == ["user", "assistant"]
        assert "Hello! Here is **bold** and `code`." in messages[1].markdown.source
        assert status.tokens == len(fake.state.reply)
        assert status.ttft is not None and status.ttft > 0
        assert status.tokens_per_s is not None and status.tokens_per_s > 0
        assert status.prompt_tokens == 7
        # the daemon's memory on the status line: RSS and KV blocks in use (fake: 900 MiB,
        # 120 of 512 blocks once a model is loaded)
        await wait_for(pilot, lambda: status.rss == 900 * 2**20, what="RSS on the status line")
        line = str(status.render())
        assert "RSS 900" in line
        body = fake.state.chats[-1]
        assert body["model"] == "gemma3:270m" and body["stream"] is True
        assert body["options"]["temperature"] == pytest.approx(0.3)
        assert body["messages"] == [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "hi there"}]
        # second turn carries the whole conversation
        await send(pilot, "and again")
        await wait_for(pilot, lambda: len(fake.state.chats) == 2 and status.state == "done",
                       what="second reply")
        roles = [m["role"] for m in fake.state.chats[-1]["messages"]]
        assert roles == ["system", "user", "assistant", "user"]
        assert fake.state.chats[-1]["messages"][2]["content"] == "Hello! Here is **bold** and `code`."
        # new chat clears everything
        await pilot.press("ctrl+n")
        await pilot.pause()
        assert not screen.query(ChatMessage) and screen.history == []
        assert status.state == "idle"


@pytest.mark.asyncio
async def test_image_command_sends_pictures_with_the_next_message(fake, tmp_path):
    """/image PATH (issue 26): the file goes base64 on the next user message, as Ollama's
    /api/chat takes it; a missing file is a notice, nothing is sent."""
    import base64
    pic = tmp_path / "cat.png"
    pic.write_bytes(b"\x89PNG fake bytes")
    async with chat_session(fake.host) as (app, pilot):
        screen = app.screen
        await send(pilot, f"/image {tmp_path / 'nope.png'}")
        await send(pilot, f"/image {pic}")
        await pilot.pause()
        assert not fake.state.chats and [n for n, _ in screen.pending_images] == ["cat.png"]
        await send(pilot, "what is this?")
        status = screen.query_one(StreamStatus)
        await wait_for(pilot, lambda: status.state == "done", what="reply done")
        user = fake.state.chats[-1]["messages"][-1]
        assert user["content"] == "what is this?"
        assert user["images"] == [base64.b64encode(pic.read_bytes()).decode()]
        assert "[image: cat.png]" in list(screen.query(ChatMessage))[0].markdown.source
        assert screen.pending_images == []


@pytest.mark.asyncio
async def test_tokens_per_s_is_live_while_streaming(fake):
    fake.state.reply = [f" w{i}" for i in range(40)]
    fake.state.token_delay = 0.05
    async with chat_session(fake.host) as (app, pilot):
        await send(pilot, "count")
        status = app.screen.query_one(StreamStatus)
        await wait_for(pilot, lambda: status.state == "streaming" and status.tokens >= 5
                       and status.tokens_per_s is not None, what="live tokens/s")
        assert 0 < status.tokens_per_s < 1000
        await wait_for(pilot, lambda: status.state == "done", what="done")


@pytest.mark.asyncio
async def test_stop_key_cancels_generation(fake):
    fake.state.reply = [f" w{i}" for i in range(500)]
    fake.state.token_delay = 0.02
    async with chat_session(fake.host) as (app, pilot):
        await send(pilot, "go on forever")
        screen = app.screen
        status = screen.query_one(StreamStatus)
        await wait_for(pilot, lambda: status.tokens >= 3, what="some tokens")
        assert screen.active_bindings["escape"].enabled     # "Stop" is in the footer
        await pilot.press("escape")
        await wait_for(pilot, lambda: status.state == "stopped", what="stopped")
        n = status.tokens
        await pilot.pause(0.3)
        assert status.tokens == n < 500
        await wait_for(pilot, lambda: fake.state.chat_cancelled == 1, what="server cancel")
        # the partial reply stays in the history; a new message can be sent
        assert screen.history[-1]["role"] == "assistant"
        fake.state.reply = ["ok"]
        await send(pilot, "short please")
        await wait_for(pilot, lambda: status.state == "done", what="next reply")


@pytest.mark.asyncio
async def test_new_chat_while_streaming_drops_the_old_reply(fake):
    fake.state.reply = [f" w{i}" for i in range(500)]
    fake.state.token_delay = 0.02
    async with chat_session(fake.host) as (app, pilot):
        screen = app.screen
        status = screen.query_one(StreamStatus)
        await send(pilot, "first")
        await wait_for(pilot, lambda: status.tokens >= 3, what="streaming")
        await pilot.press("ctrl+n")
        fake.state.reply = ["fresh", " start"]
        await send(pilot, "second")
        await wait_for(pilot, lambda: status.state == "done", what="second reply")
        await pilot.pause(0.3)
        assert screen.history == [{"role": "user", "content": "second"},
                                  {"role": "assistant", "content": "fresh start"}]
        assert [m.role for m in screen.query(ChatMessage)] == ["user", "assistant"]
        assert status.state == "done" and not screen.streaming
        assert fake.state.chats[-1]["messages"] == [{"role": "user", "content": "second"}]


@pytest.mark.asyncio
async def test_empty_store_points_to_models_screen():
    with FakeDaemon(FakeState(models=[])) as d:
        app = make_app(d.host)
        async with app.run_test(size=SIZE) as pilot:
            select = app.screen.query_one("#model")
            await wait_for(pilot, lambda: select.prompt == "no models: F3", what="hint")
            await send(pilot, "anyone?")
            await pilot.pause(0.2)
            assert d.state.chats == [] and not app.screen.query(ChatMessage)


@pytest.mark.asyncio
async def test_chat_error_from_daemon_is_shown_not_raised(fake):
    async with chat_session(fake.host) as (app, pilot):
        fake.state.models.pop(0)           # the selected model disappears
        await send(pilot, "hello?")
        status = app.screen.query_one(StreamStatus)
        await wait_for(pilot, lambda: status.state == "error", what="error state")
        assert "not found" in status.detail
        assert app.screen.history == []


# ----- screens ----------------------------------------------------------------------------

@pytest.mark.asyncio
async def test_dashboard_follows_stats_stream(fake):
    fake.state.loaded["gemma3:270m"] = {"name": "gemma3:270m", "size": 300 * 2**20,
                                        "expires_at": "2030-01-01T00:05:00Z"}
    app = make_app(fake.host)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f2")
        screen = app.screen
        assert isinstance(screen, DashboardScreen)
        tps = screen.query_one("#tps", MetricPanel)
        n0 = tps.pushes
        await pilot.pause(1.0)
        assert tps.pushes - n0 >= 2, "at least two updates a second"
        assert tps.value_text == "42.5 tok/s"
        assert screen.query_one("#kv", MetricPanel).value_text == "120 / 512 (23%)"
        assert screen.query_one("#requests", MetricPanel).value_text == "1 running · 2 waiting"
        assert screen.query_one("#prefix", MetricPanel).value_text == "37.5% hit rate"
        assert screen.query_one("#rss", MetricPanel).value_text == "900.0 MiB"
        assert screen.query_one("#mem", MetricPanel).value_text.startswith("12.0 GiB / 24.0 GiB")
        assert not screen.query_one("#gpu", MetricPanel).display
        table = screen.query_one("#loaded")
        assert table.row_count == 1
        assert [str(c) for c in table.get_row_at(0)] == ["gemma3:270m", "300.0 MiB", "in 5m 0s"]
        fake.state.stats["gpu"] = {"memory_used_bytes": 2**30, "memory_total_bytes": 8 * 2**30}
        await wait_for(pilot, lambda: screen.query_one("#gpu", MetricPanel).display,
                       what="gpu panel")
        # switching away and back keeps the history
        await pilot.press("f1")
        await pilot.press("f2")
        assert len(app.screen.query_one("#tps", MetricPanel).samples) >= n0


@pytest.mark.asyncio
async def test_models_pull_delete_load_unload(fake):
    app = make_app(fake.host)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f3")
        screen = app.screen
        assert isinstance(screen, ModelsScreen)
        table = screen.query_one("#models")
        await wait_for(pilot, lambda: table.row_count == 2, what="model rows")
        assert [str(c) for c in table.get_row_at(0)][:5] == [
            "gemma3:270m", "gemma3", "268M", "Q4_K_M", "241.3 MiB"]
        # pull with progress
        fake.state.pull_delay = 0.15
        await pilot.press("p")
        assert screen.focused is screen.query_one("#pull-name")
        await pilot.press(*"new:1b")
        await pilot.press("enter")
        bar = screen.query_one("#pull-bar")
        seen: list[float] = []

        def progressing() -> bool:
            if bar.total:
                seen.append(bar.progress)
            return screen.pulling is False and table.row_count == 3
        await wait_for(pilot, progressing, what="pull to finish")
        assert any(0 < p < 1000 for p in seen), f"no intermediate progress seen: {seen}"
        assert bar.progress == bar.total == 1000
        assert ("pull", {"model": "new:1b", "stream": True}) in fake.state.calls
        # a failing pull says why
        await pilot.press("p")
        await pilot.press(*"nosuch:model", "enter")
        await wait_for(pilot, lambda: "failed" in str(
            screen.query_one("#pull-status").render()), what="pull error")
        await pilot.press("escape")
        # load and unload the selected row
        table.move_cursor(row=0)
        await pilot.press("l")
        await wait_for(pilot, lambda: "gemma3:270m" in fake.state.loaded, what="load")
        await wait_for(pilot, lambda: "loaded" in str(table.get_row_at(0)[-1]), what="mark")
        await pilot.press("u")
        await wait_for(pilot, lambda: "gemma3:270m" not in fake.state.loaded, what="unload")
        # delete asks first; n keeps it, y deletes
        table.move_cursor(row=1)
        await pilot.press("d")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("n")
        assert table.row_count == 3 and not any(c[0] == "delete" for c in fake.state.calls)
        await pilot.press("d")
        await pilot.press("y")
        await wait_for(pilot, lambda: table.row_count == 2, what="delete")
        assert ("delete", {"model": "tiny:latest"}) in fake.state.calls
        # enter on a row opens the chat with that model
        table.move_cursor(row=0)
        await pilot.press("enter")
        assert isinstance(app.screen, ChatScreen)
        await wait_for(pilot, lambda: app.screen.query_one("#model").value == "gemma3:270m",
                       what="model picked")


# ----- connection -------------------------------------------------------------------------

@pytest.mark.asyncio
async def test_banner_when_daemon_down_then_reconnects():
    port = free_port()
    app = make_app(f"127.0.0.1:{port}")
    async with app.run_test(size=SIZE) as pilot:
        banner = app.screen.query_one(ConnectionBanner)
        await wait_for(pilot, lambda: banner.has_class("-visible"), what="banner")
        assert "not reachable" in str(banner.render())
        assert app.connected is False
        with FakeDaemon(port=port):
            await pilot.press("ctrl+r")
            await wait_for(pilot, lambda: app.connected is True, what="reconnect")
            await wait_for(pilot, lambda: not banner.has_class("-visible"), what="banner gone")
            await wait_for(pilot, lambda: model_select_ready(app), what="model list")


@pytest.mark.asyncio
async def test_daemon_killed_mid_stream_shows_banner(fake):
    fake.state.reply = [f" w{i}" for i in range(2000)]
    fake.state.token_delay = 0.01
    async with chat_session(fake.host) as (app, pilot):
        await send(pilot, "long one")
        screen = app.screen
        status = screen.query_one(StreamStatus)
        await wait_for(pilot, lambda: status.tokens >= 3, what="streaming")
        await asyncio.to_thread(fake.stop)
        banner = screen.query_one(ConnectionBanner)
        await wait_for(pilot, lambda: banner.has_class("-visible"), what="banner")
        await wait_for(pilot, lambda: status.state == "error", what="error status")
        assert "daemon lost" in status.detail
        assert app.connected is False
        # it comes back: the banner goes away by itself
        await asyncio.to_thread(fake.start)
        await wait_for(pilot, lambda: app.connected is True, timeout=15, what="reconnect")
        assert not banner.has_class("-visible")


# ----- snapshots (pytest-textual-snapshot; live figures frozen) ---------------------------
# Update after a deliberate visual change: pytest tests/test_tui.py --snapshot-update

SERIES = [round(40 + 25 * __import__("math").sin(i / 4), 1) for i in range(60)]
HAIKU = ("Blocks of sixteen keys,\n*shared* prefixes stay warm —\nthe next prompt flies by.\n\n"
         "```python\ncache.match(tokens)\n```\n")


def freeze(app) -> None:
    """Stop live updates (connection worker) and cursor blinking."""
    from textual.widgets import Input
    app.workers.cancel_group(app, "connection")
    for w in app.screen.query(Input):
        w.cursor_blink = False


def synthetic_stats(i: int):
    from edgeinfer.tui.api import LoadedModel, Stats
    return Stats(tokens_per_s=SERIES[i], running=1 + i % 3, waiting=i % 2,
                 kv_used=100 + 5 * i, kv_total=512, prefix_hit_rate=min(0.9, i / 60),
                 rss=700 * 2**20 + i * 2**20, mem_used=int((10 + i / 20) * 2**30),
                 mem_total=24 * 2**30,
                 models=(LoadedModel("gemma3:270m", 300 * 2**20,
                                     datetime(2030, 1, 1, 0, 4, 30, tzinfo=timezone.utc)),))


async def chat_scene(pilot, fake) -> None:
    app = pilot.app
    await wait_for(pilot, lambda: model_select_ready(app), what="model list")
    fake.state.reply = [HAIKU[i:i + 6] for i in range(0, len(HAIKU), 6)]
    await send(pilot, "Write a haiku about prefix caches")
    status = app.screen.query_one(StreamStatus)
    await wait_for(pilot, lambda: status.state == "done", what="reply")
    freeze(app)
    status.ttft, status.tokens_per_s = 0.125, 38.4


async def dashboard_scene(pilot) -> None:
    app = pilot.app
    await wait_for(pilot, lambda: app.stats is not None, what="first stats")
    freeze(app)
    await pilot.press("f2")
    # the screen's on_mount replays the app's history: let it finish before replacing it
    await wait_for(pilot, lambda: isinstance(app.screen, DashboardScreen) and
                   app.screen.query_one("#tps", MetricPanel).pushes >= 1, what="dashboard")
    await pilot.pause()
    for panel in app.screen.query(MetricPanel):
        panel.samples.clear()
    for i in range(len(SERIES)):
        app._publish(synthetic_stats(i))
    await pilot.pause()


@pytest.fixture()
def quiet_fake(monkeypatch):
    """A fake daemon that sends one stats event a minute: nothing moves during a snapshot.
    Times show in UTC so the pictures do not depend on the machine's zone."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    with FakeDaemon(FakeState(stats_interval=60.0)) as d:
        yield d
    monkeypatch.undo()
    time.tzset()


def test_snapshot_chat(snap_compare, quiet_fake):
    app = make_app(quiet_fake.host)
    assert snap_compare(app, terminal_size=SIZE,
                        run_before=lambda pilot: chat_scene(pilot, quiet_fake))


def test_snapshot_dashboard(snap_compare, quiet_fake):
    assert snap_compare(make_app(quiet_fake.host), terminal_size=SIZE,
                        run_before=dashboard_scene)


def test_snapshot_models(snap_compare, quiet_fake):
    quiet_fake.state.loaded["gemma3:270m"] = {"name": "gemma3:270m", "size": 1,
                                              "expires_at": "2030-01-01T00:05:00Z"}

    async def run_before(pilot):
        app = pilot.app
        await wait_for(pilot, lambda: app.connected, what="connection")
        freeze(app)
        await pilot.press("f3")
        table = app.screen.query_one("#models")
        await wait_for(pilot, lambda: table.row_count == 2 and "loaded" in str(
            table.get_row_at(0)[-1]), what="rows")
    assert snap_compare(make_app(quiet_fake.host), terminal_size=SIZE, run_before=run_before)


def test_snapshot_daemon_down(snap_compare):
    async def run_before(pilot):
        app = pilot.app
        await wait_for(pilot, lambda: app.connected is False, what="down")
        freeze(app)
        app.banner = app._down_text()
    # port 1: nothing listens there, and the banner text names it
    assert snap_compare(make_app("127.0.0.1:1"), terminal_size=SIZE, run_before=run_before)


# ----- against the real daemon (`edgeinfer serve`, bundled gemma3:270m) -------------------

# The daemon is part of this tree: a broken import is a failure, never a silent skip.
from daemon_fixture import register_gemma, shared_daemon, start_daemon, warm  # noqa: E402,F401


@pytest.fixture(scope="module")
def own_daemon(tmp_path_factory, gemma3_path):
    """A daemon this module may pull into and finally kill."""
    home = tmp_path_factory.mktemp("tui-daemon-home")
    register_gemma(home, gemma3_path)
    d = start_daemon(home)
    try:
        warm(d)
        yield d
    finally:
        d.stop()


@pytest.mark.asyncio
async def test_real_daemon_chat_dashboard_models(shared_daemon):
    async with chat_session(f"127.0.0.1:{shared_daemon.port}", timeout=30, clock=None) as (app, pilot):
        assert app.screen.query_one("#model").value == "gemma3:270m"
        app.screen.query_one("#temperature").value = "0"
        await send(pilot, "The capital of France is")
        status = app.screen.query_one(StreamStatus)
        await wait_for(pilot, lambda: status.tokens >= 4 and status.tokens_per_s is not None
                       or status.state in ("done", "error"), timeout=120, what="streamed tokens")
        assert status.state in ("streaming", "done"), status.detail
        assert status.ttft is not None and status.tokens_per_s > 0
        reply = list(app.screen.query(ChatMessage))[-1]
        await wait_for(pilot, lambda: reply.markdown.source.strip() != "", what="reply text")
        if status.state == "streaming":
            await pilot.press("escape")
            await wait_for(pilot, lambda: status.state == "stopped", what="stop")
        assert app.screen.history[-1]["role"] == "assistant"
        assert app.screen.history[-1]["content"].strip()
        # the dashboard shows live figures from /api/stats/stream
        await pilot.press("f2")
        dash = app.screen
        assert isinstance(dash, DashboardScreen)
        n0 = dash.query_one("#tps", MetricPanel).pushes
        await pilot.pause(1.5)
        assert dash.query_one("#tps", MetricPanel).pushes - n0 >= 3, "updates >= 2 a second"
        assert dash.query_one("#rss", MetricPanel).value_text.endswith("iB")
        assert " / " in dash.query_one("#kv", MetricPanel).value_text
        table = dash.query_one("#loaded")
        await wait_for(pilot, lambda: table.row_count >= 1, what="loaded model row")
        assert str(table.get_row_at(0)[0]) == "gemma3:270m"
        # models screen lists the store
        await pilot.press("f3")
        models = app.screen.query_one("#models")
        await wait_for(pilot, lambda: models.row_count >= 1, what="models")
        row = [str(c) for c in models.get_row_at(0)]
        assert row[0] == "gemma3:270m" and row[3] == "Q4_K_M" and row[1] == "gemma3"


@pytest.mark.asyncio
async def test_real_daemon_pull_progress_from_local_server(own_daemon, tmp_path):
    from httpfault import FaultServer, make_gguf
    data = make_gguf(tmp_path / "src.gguf", seed=3, n=131072)       # ~1 MiB
    with FaultServer() as srv:
        srv.add("/tui-tiny.gguf", data, trickle=0.004)
        app = make_app(f"127.0.0.1:{own_daemon.port}", clock=None)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("f3")
            screen = app.screen
            table = screen.query_one("#models")
            await wait_for(pilot, lambda: table.row_count >= 1, timeout=30, what="models")
            n = table.row_count
            await pilot.press("p")
            screen.query_one("#pull-name").value = f"{srv.url}/tui-tiny.gguf"
            await pilot.press("enter")
            bar = screen.query_one("#pull-bar")
            seen: list[tuple[float, float | None]] = []

            def finished() -> bool:
                seen.append((bar.progress, bar.total))
                return not screen.pulling and table.row_count == n + 1
            await wait_for(pilot, finished, timeout=60, what="pull")
            assert bar.total == len(data) and bar.progress == bar.total
            assert any(t and 0 < p < t for p, t in seen), "no intermediate progress shown"
            names = {str(table.get_row_at(i)[0]) for i in range(table.row_count)}
            assert any(name.startswith("tui-tiny") for name in names), names


@pytest.mark.asyncio
async def test_real_daemon_killed_mid_stream_shows_banner(own_daemon):
    async with chat_session(f"127.0.0.1:{own_daemon.port}", timeout=30, clock=None) as (app, pilot):
        app.screen.select_model("gemma3:270m")
        await pilot.pause()
        status = app.screen.query_one(StreamStatus)
        for _attempt in range(3):        # a base model may end a reply at once: ask again
            await send(pilot, "Write a very long story about a dragon named Ember.")
            await wait_for(pilot, lambda: status.state not in ("idle", "waiting"),
                           timeout=120, what="first token")
            if status.state == "streaming":
                break
        assert status.state == "streaming", status.detail
        own_daemon.proc.kill()
        await asyncio.to_thread(own_daemon.proc.wait, 10)
        banner = app.screen.query_one(ConnectionBanner)
        await wait_for(pilot, lambda: banner.has_class("-visible"), what="banner")
        await wait_for(pilot, lambda: status.state == "error", what="error state")
        assert "not reachable" in str(banner.render())
        assert app.connected is False
        # the app keeps running: screens still switch, and the banner is on each
        await pilot.press("f2")
        assert app.screen.query_one(ConnectionBanner).has_class("-visible")


# ----- docs screenshots: EDGEINFER_TUI_SCREENSHOTS=1 pytest tests/test_tui.py -k docs --------

def test_docs_screenshots(quiet_fake, tmp_path):
    """Renders the three docs screenshots every run (into a temporary folder, checked below);
    EDGEINFER_TUI_SCREENSHOTS=1 writes them over docs/tui-*.svg instead."""
    import os

    from textual._doc import take_svg_screenshot
    docs = Path(__file__).resolve().parent.parent / "docs" \
        if os.environ.get("EDGEINFER_TUI_SCREENSHOTS") else tmp_path
    quiet_fake.state.loaded["gemma3:270m"] = {"name": "gemma3:270m", "size": 1,
                                              "expires_at": "2030-01-01T00:05:00Z"}

    async def models_scene(pilot):
        await wait_for(pilot, lambda: pilot.app.connected, what="connection")
        freeze(pilot.app)
        await pilot.press("f3")
        await wait_for(pilot, lambda: pilot.app.screen.query_one("#models").row_count == 2,
                       what="rows")

    scenes = {"chat": lambda pilot: chat_scene(pilot, quiet_fake),
              "dashboard": dashboard_scene, "models": models_scene}
    for name, scene in scenes.items():
        svg = take_svg_screenshot(app=make_app(quiet_fake.host), terminal_size=(100, 30),
                                  run_before=scene, title=f"edgeinfer tui: {name}")
        (docs / f"tui-{name}.svg").write_text(svg, encoding="utf-8")
        # each scene really rendered: an SVG with the app's title and its own screen's text
        assert svg.lstrip().startswith("<svg") and svg.rstrip().endswith("</svg>"), name
        assert f"edgeinfer tui: {name}".replace(" ", "&#160;") in svg, name
    text = {n: (docs / f"tui-{n}.svg").read_text(encoding="utf-8") for n in scenes}
    assert "gemma3" in text["models"] and "gemma3" in text["chat"]
    assert len(set(text.values())) == 3          # three different screens


@pytest.mark.asyncio
async def test_real_daemon_started_when_none_answers(tmp_path, monkeypatch):
    from edgeinfer.server import daemon as server_daemon
    home = tmp_path / "home"
    monkeypatch.setenv("EDGEINFER_HOME", str(home))     # its own store, pid file and log
    monkeypatch.delenv("EDGEINFER_API_KEY", raising=False)
    port = free_port()
    app = EdgeInferApp(f"127.0.0.1:{port}", autostart=True)
    try:
        async with app.run_test(size=SIZE) as pilot:
            banner = app.screen.query_one(ConnectionBanner)
            await wait_for(pilot, lambda: "Starting" in app.banner or app.connected,
                           what="start banner")
            await wait_for(pilot, lambda: app.connected is True, timeout=120,
                           what="started daemon")
            assert not banner.has_class("-visible")
            info = server_daemon.read_pid_file()
            assert info is not None and info.port == port
    finally:
        await asyncio.to_thread(server_daemon.stop_background)
