"""edgeinfer's terminal app (Textual): chat, live dashboard and model management.

A client of the daemon over HTTP and nothing more; `edgeinfer tui` starts it
(see `edgeinfer.tui.app`).
"""
