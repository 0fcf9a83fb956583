"""Chat: pick a model, type, watch the reply stream in with TTFT, tokens and tokens/s, and
the daemon's memory (RSS, KV blocks in use) on the status line."""
from __future__ import annotations

import asyncio
import base64
import os
import time

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.css.query import NoMatches
from textual.containers import Horizontal, VerticalScroll
from textual.reactive import reactive
from textual.screen import Screen
from textual.widgets import Footer, Input, Markdown, Select

from ..api import ApiError, ChatOptions, DaemonUnreachable, loading_status
from ..widgets.banner import ConnectionBanner
from ..widgets.chat_message import ChatMessage
from ..widgets.stream_status import StreamStatus

DEFAULT_TEMPERATURE = "0.8"
# Text reaches the Markdown widget (a re-parse and a layout pass) and the status line at most
# this often while a reply streams: flushing every token costs the app CPU that the engine in
# the daemon then lacks on a small machine (figures: README "The terminal app").
FLUSH_S = 0.15
MAX_IMAGE_BYTES = 20 * 2**20      # the daemon's limit (edgeinfer.formats.image)


class ChatScreen(Screen):
    CSS_PATH = "chat.tcss"

    BINDINGS = [
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+n", "new_chat", "New"),
        Binding("ctrl+l", "focus('model')", "Model"),
        Binding("ctrl+o", "focus('system')", "System"),
        Binding("ctrl+t", "focus('temperature')", "Temp", show=False),
    ]

    streaming: reactive[bool] = reactive(False, bindings=True)

    def __init__(self) -> None:
        super().__init__()
        self.history: list[dict] = []
        # /image PATH: (file name, base64) pictures that go with the next message
        self.pending_images: list[tuple[str, str]] = []
        self._run = 0              # bumped per send and by "new chat": a late finish is dropped
        self._waiting_for: str | None = None    # the model a sent request waits on

    def compose(self) -> ComposeResult:
        yield ConnectionBanner()
        with Horizontal(id="chat-settings"):
            yield Select([], prompt="model", id="model", allow_blank=True)
            yield Input(placeholder="system prompt (optional)", id="system")
            yield Input(value=DEFAULT_TEMPERATURE, placeholder="temp", id="temperature",
                        type="number", tooltip="temperature (0 = greedy)")
        yield VerticalScroll(id="messages")
        yield StreamStatus(id="status")
        yield Input(placeholder="Message (Enter to send)", id="prompt")
        yield Footer(compact=True, show_command_palette=False)

    def on_mount(self) -> None:
        self.query_one("#model", Select).border_title = "model"
        self.query_one("#system", Input).border_title = "system prompt"
        self.query_one("#temperature", Input).border_title = "temp"
        self.query_one("#prompt", Input).focus()
        self.watch(self.app, "models_version", self._models_changed, init=True)
        self.watch(self.app, "stats", self._on_stats, init=True)

    def _on_stats(self, sample) -> None:
        if sample is None:
            return
        status = self.query_one(StreamStatus)
        status.rss, status.kv_used, status.kv_total = sample.rss, sample.kv_used, sample.kv_total
        if status.state == "waiting" and self._waiting_for:
            # the first request to a model loads it, and may compile kernels first: say so
            loading = loading_status(sample.models, self._waiting_for)
            if loading:
                status.detail = f"loading {loading}"

    # ----- model list ---------------------------------------------------------------------
    def _models_changed(self, _version: int) -> None:
        if self.app.connected:
            self.refresh_models()

    @work(exclusive=True, group="chat-models")
    async def refresh_models(self) -> None:
        try:
            models = await self.app.api.models()
        except DaemonUnreachable as e:
            self.app.report_unreachable(str(e))
            return
        except ApiError as e:
            self.notify(str(e), title="Could not list models", severity="error")
            return
        if not self.is_attached:
            return
        try:
            self._set_models([m.name for m in models])
        except NoMatches:   # the app is shutting down under us
            pass

    def _set_models(self, names: list[str]) -> None:
        select = self.query_one("#model", Select)
        current = select.value
        select.prompt = "model" if names else "no models: F3"
        select.set_options([(n, n) for n in names])
        wanted = self.app.preferred_model
        if wanted in names:
            select.value = wanted
        elif current in names:
            select.value = current
        elif names:
            select.value = names[0]

    def select_model(self, name: str) -> None:
        """Used by the models screen's 'chat with this model'."""
        self.app.preferred_model = name
        select = self.query_one("#model", Select)
        try:
            select.value = name
        except Exception:  # not in the list yet: taken on the next refresh
            self.refresh_models()

    @on(Select.Changed, "#model")
    def _model_picked(self, event: Select.Changed) -> None:
        if isinstance(event.value, str):
            self.app.preferred_model = event.value

    # ----- sending ------------------------------------------------------------------------
    @on(Input.Submitted, "#prompt")
    def _submit(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text:
            return
        if text == "/image" or text.startswith("/image "):
            event.input.value = ""
            self._add_image(text[len("/image"):].strip())
            return
        if self.streaming:
            self.notify("A reply is still streaming: Esc stops it.", severity="warning")
            return
        model = self.query_one("#model", Select).value
        if not isinstance(model, str):
            self.notify("Pick a model first (ctrl+l), or pull one on the Models screen (F3).",
                        severity="warning")
            return
        temperature = self._temperature()
        if temperature is False:
            return
        event.input.value = ""
        message: dict = {"role": "user", "content": text}
        shown = text
        if self.pending_images:     # Ollama's shape: base64 images on the message
            message["images"] = [b for _, b in self.pending_images]
            shown += "\n\n" + " ".join(f"`[image: {n}]`" for n, _ in self.pending_images)
            self.pending_images = []
        self.history.append(message)
        options = ChatOptions(temperature=temperature,
                              system=self.query_one("#system", Input).value)
        self.send(model, list(self.history), options, shown)

    def _add_image(self, path: str) -> None:
        """/image PATH: read the file now (the daemon checks it is an image it takes)."""
        if not path:
            self.notify("Usage: /image PATH (the picture goes with your next message)",
                        severity="warning")
            return
        full = os.path.expanduser(path)
        try:
            if os.path.getsize(full) > MAX_IMAGE_BYTES:
                self.notify(f"{path} is larger than {MAX_IMAGE_BYTES // 2**20} MB",
                            severity="error")
                return
            with open(full, "rb") as f:
                data = f.read()
        except OSError as e:
            self.notify(f"{path}: {e.strerror or e}", severity="error")
            return
        self.pending_images.append((os.path.basename(full), base64.b64encode(data).decode()))
        self.notify(f"{os.path.basename(full)} goes with your next message "
                    f"({len(self.pending_images)} image{'s' * (len(self.pending_images) > 1)})")

    def _temperature(self) -> float | None | bool:
        raw = self.query_one("#temperature", Input).value.strip()
        if not raw:
            return None
        try:
            t = float(raw)
        except ValueError:
            t = -1.0
        if not 0.0 <= t <= 5.0:
            self.notify("Temperature must be a number from 0 to 5.", severity="error")
            return False
        return t

    @work(exclusive=True, group="chat")
    async def send(self, model: str, messages: list[dict[str, str]], options: ChatOptions,
                   text: str) -> None:
        container = self.query_one("#messages", VerticalScroll)
        await container.mount(ChatMessage("user", text))
        reply = ChatMessage("assistant")
        reply.border_subtitle = model
        await container.mount(reply)
        container.anchor()
        status = self.query_one(StreamStatus)
        status.reset()
        status.state = "waiting"
        self._waiting_for = model
        self._run += 1
        run = self._run
        self.streaming = True
        stream = Markdown.get_stream(reply.markdown)
        parts: list[str] = []
        t0 = time.monotonic()
        first: float | None = None
        final = None
        outcome = "done"
        pending: list[str] = []           # text not yet handed to the Markdown widget
        tokens, flushed = 0, 0.0
        try:
            async for chunk in self.app.api.chat(model, messages, options):
                if chunk.content:
                    now = time.monotonic()
                    if first is None:
                        first = now
                        status.ttft = now - t0
                        status.state = "streaming"
                        self._waiting_for = None
                        if status.detail.startswith("loading "):
                            status.detail = ""
                    parts.append(chunk.content)
                    pending.append(chunk.content)
                    tokens += 1
                    if now - flushed >= FLUSH_S:
                        flushed = now
                        status.tokens = tokens
                        if now - first > 0.05 and tokens > 1:
                            status.tokens_per_s = (tokens - 1) / (now - first)
                        await stream.write("".join(pending))
                        pending.clear()
                if chunk.done:
                    final = chunk
                    break
        except asyncio.CancelledError:
            outcome = "stopped"
            raise
        except DaemonUnreachable as e:
            outcome = "error"
            status.detail = f"daemon lost: {e}"
            self.app.report_unreachable(str(e))
        except ApiError as e:
            outcome = "error"
            status.detail = str(e)
            reply.add_class("-error")
            self.notify(str(e), title="Chat failed", severity="error")
        finally:
            if pending:
                status.tokens = tokens
                await stream.write("".join(pending))
            await stream.stop()
            if run == self._run:       # not superseded by "new chat" or a newer send
                self.streaming = False
                await self._finish(reply, status, model, parts, final, outcome)

    async def _finish(self, reply: ChatMessage, status: StreamStatus, model: str,
                      parts: list[str], final, outcome: str) -> None:
        if final is not None:
            if final.eval_count is not None:
                status.tokens = final.eval_count
            if final.eval_count and final.eval_duration_s:
                status.tokens_per_s = final.eval_count / final.eval_duration_s
            status.prompt_tokens = final.prompt_eval_count
            if final.done_reason and final.done_reason != "stop":
                status.detail = f"finish: {final.done_reason}"
        if not parts and outcome == "done":
            await reply.markdown.update("*(empty reply)*")
        status.state = outcome
        if parts and outcome in ("done", "stopped"):
            self.history.append({"role": "assistant", "content": "".join(parts)})
        elif outcome != "done" and self.history and self.history[-1]["role"] == "user":
            self.history.pop()       # keep an unanswered question out of the context
        if outcome == "stopped":
            reply.border_subtitle = f"{model} · stopped"

    # ----- actions ------------------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple) -> bool | None:
        if action == "stop":
            return self.streaming
        return True

    def action_stop(self) -> None:
        if self.streaming:
            self.workers.cancel_group(self, "chat")

    async def action_new_chat(self) -> None:
        self._run += 1
        self.workers.cancel_group(self, "chat")
        self.streaming = False
        self.history.clear()
        self.pending_images = []
        await self.query_one("#messages", VerticalScroll).remove_children()
        self.query_one(StreamStatus).reset()
        self.query_one("#prompt", Input).focus()

    def action_focus(self, widget_id: str) -> None:
        self.query_one(f"#{widget_id}").focus()
