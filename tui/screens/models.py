"""Models: the local models, pull by name with a progress bar, delete, load and unload."""
from __future__ import annotations

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.reactive import reactive
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Input, Label, ProgressBar

from ..api import ApiError, DaemonUnreachable, ModelInfo, Stats, fmt_bytes
from ..widgets.banner import ConnectionBanner
from .confirm import ConfirmScreen


class ModelsScreen(Screen):
    CSS_PATH = "models.tcss"

    BINDINGS = [
        Binding("p", "pull", "Pull"),
        Binding("d,delete", "delete", "Delete"),
        Binding("l", "load", "Load"),
        Binding("u", "unload", "Unload"),
        Binding("r", "refresh", "Refresh", show=False),
        Binding("escape", "focus_table", "Back to list", show=False),
    ]

    pulling: reactive[bool] = reactive(False)

    def __init__(self) -> None:
        super().__init__()
        self.models: list[ModelInfo] = []
        self.loaded_names: set[str] = set()

    def compose(self) -> ComposeResult:
        yield ConnectionBanner()
        yield DataTable(id="models", cursor_type="row", zebra_stripes=True)
        with Horizontal(id="pull-row"):
            yield Input(placeholder="model to pull: gemma3:270m, hf://owner/repo/file.gguf, URL",
                        id="pull-name")
        with Horizontal(id="pull-progress-row"):
            yield Label("", id="pull-status")
            yield ProgressBar(id="pull-bar", show_eta=False)
        yield Footer(compact=True, show_command_palette=False)

    def on_mount(self) -> None:
        table = self.query_one("#models", DataTable)
        for label, key in (("name", "name"), ("family", "family"), ("params", "params"),
                           ("quant", "quant"), ("size", "size"), ("modified", "modified"),
                           ("loaded", "loaded")):
            table.add_column(label, key=key)
        self.query_one("#pull-name", Input).border_title = "pull (p)"
        self.query_one("#pull-progress-row").display = False
        table.focus()
        self.watch(self.app, "models_version", self._models_changed, init=True)
        self.watch(self.app, "stats", self._stats_changed, init=False)

    # ----- listing ------------------------------------------------------------------------
    def _models_changed(self, _version: int) -> None:
        if self.app.connected:
            self.action_refresh()

    def _stats_changed(self, stats: Stats | None) -> None:
        if stats is None:
            return
        names = {m.name for m in stats.models}
        if names != self.loaded_names:
            self.loaded_names = names
            self._fill()

    def action_refresh(self) -> None:
        self.refresh_models()

    @work(exclusive=True, group="models-list")
    async def refresh_models(self) -> None:
        api = self.app.api
        try:
            self.models = await api.models()
            try:
                self.loaded_names = {m.name for m in await api.loaded()}
            except ApiError:
                pass
        except DaemonUnreachable as e:
            self.app.report_unreachable(str(e))
            return
        except ApiError as e:
            self.notify(str(e), title="Could not list models", severity="error")
            return
        self._fill()

    def _fill(self) -> None:
        table = self.query_one("#models", DataTable)
        selected = self.selected_name()
        table.clear()
        for m in self.models:
            table.add_row(
                m.name, m.family or "-", m.parameter_size or "-", m.quantization or "-",
                fmt_bytes(m.size),
                m.modified_at.astimezone().strftime("%Y-%m-%d %H:%M") if m.modified_at else "-",
                "● loaded" if m.name in self.loaded_names else "",
                key=m.name)
        if selected is not None and selected in {m.name for m in self.models}:
            table.move_cursor(row=table.get_row_index(selected))
        table.border_title = f"local models ({len(self.models)})"

    def selected_name(self) -> str | None:
        table = self.query_one("#models", DataTable)
        if not table.row_count:
            return None
        try:
            key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key
        except Exception:
            return None
        return key.value if key is not None else None

    # ----- pull ---------------------------------------------------------------------------
    def action_pull(self) -> None:
        self.query_one("#pull-name", Input).focus()

    def action_focus_table(self) -> None:
        self.query_one("#models", DataTable).focus()

    @on(Input.Submitted, "#pull-name")
    def _pull_submitted(self, event: Input.Submitted) -> None:
        name = event.value.strip()
        if not name:
            return
        if self.pulling:
            self.notify("A pull is already running.", severity="warning")
            return
        self.pull(name)

    @work(exclusive=True, group="pull")
    async def pull(self, name: str) -> None:
        row = self.query_one("#pull-progress-row")
        status = self.query_one("#pull-status", Label)
        bar = self.query_one("#pull-bar", ProgressBar)
        row.display = True
        bar.update(total=None, progress=0)
        status.update(f"pulling {name}")
        self.pulling = True
        ok = False
        try:
            async for p in self.app.api.pull(name):
                if p.total:
                    bar.update(total=p.total, progress=p.completed or 0)
                    status.update(f"{p.status} {fmt_bytes(p.completed)} / {fmt_bytes(p.total)}")
                else:
                    status.update(p.status or "…")
            ok = True
        except DaemonUnreachable as e:
            status.update(f"pull of {name} failed: daemon lost ({e})")
            self.app.report_unreachable(str(e))
        except ApiError as e:
            status.update(f"pull of {name} failed: {e}")
            self.notify(str(e), title=f"Pull of {name} failed", severity="error")
        finally:
            self.pulling = False
        if ok:
            if bar.total is None:
                bar.update(total=1, progress=1)
            else:
                bar.update(progress=bar.total)
            status.update(f"pulled {name}")
            self.query_one("#pull-name", Input).value = ""
            self.notify(f"Pulled {name}.")
            self.app.models_version += 1
            self.action_focus_table()

    # ----- delete / load / unload ---------------------------------------------------------
    def _need_selection(self) -> str | None:
        name = self.selected_name()
        if name is None:
            self.notify("No model selected.", severity="warning")
        return name

    def action_delete(self) -> None:
        name = self._need_selection()
        if name is None:
            return

        def confirmed(yes: bool | None) -> None:
            if yes:
                self.delete_model(name)

        self.app.push_screen(ConfirmScreen(f"Delete {name}?",
                                           "Its file goes when no other name uses it."),
                             confirmed)

    @work(group="model-ops")
    async def delete_model(self, name: str) -> None:
        if await self._call(f"Delete {name}", self.app.api.delete, name):
            self.notify(f"Deleted {name}.")
            self.app.models_version += 1

    def action_load(self) -> None:
        name = self._need_selection()
        if name is not None:
            self.load_model(name)

    @work(group="model-ops")
    async def load_model(self, name: str) -> None:
        self.notify(f"Loading {name}…")
        if await self._call(f"Load {name}", self.app.api.load, name):
            self.notify(f"Loaded {name}.")
            self.refresh_models()

    def action_unload(self) -> None:
        name = self._need_selection()
        if name is not None:
            self.unload_model(name)

    @work(group="model-ops")
    async def unload_model(self, name: str) -> None:
        if await self._call(f"Unload {name}", self.app.api.unload, name):
            self.notify(f"Unloaded {name}.")
            self.refresh_models()

    async def _call(self, what: str, fn, *args) -> bool:
        try:
            await fn(*args)
            return True
        except DaemonUnreachable as e:
            self.app.report_unreachable(str(e))
        except ApiError as e:
            self.notify(str(e), title=f"{what} failed", severity="error")
        return False

    def action_chat(self) -> None:
        name = self.selected_name()
        if name is not None:
            self.app.open_chat(name)

    @on(DataTable.RowSelected, "#models")
    def _row_selected(self, event: DataTable.RowSelected) -> None:
        self.action_chat()
