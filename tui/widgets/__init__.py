"""Reusable widgets of the terminal app; each one's styles are in the .tcss file beside it."""
from pathlib import Path


def load_css(module_file: str) -> str:
    """The TCSS file beside a widget module, used as the widget's DEFAULT_CSS."""
    return Path(module_file).with_suffix(".tcss").read_text(encoding="utf-8")
