"""CLI commands for the daemon: `serve`, `daemon start|stop|status|logs`, `ps`, `stop MODEL`."""
from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import datetime
from typing import Any

from edgeinfer.cli.args import add_device_arg, add_kv_cache_type_arg, check_device_args
from edgeinfer import startup_gc
from edgeinfer.cli.errors import UserError
from edgeinfer.server import DEFAULT_PORT

# edgeinfer.cli.client (http.client, ~15 ms) and edgeinfer.server.daemon load inside the
# commands that talk to a daemon: every command's start imports this module to register them


def add_commands(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve", help="run the API server in the foreground",
        description=f"Serve the OpenAI (/v1) and Ollama (/api) APIs. Default address "
                    f"127.0.0.1:{DEFAULT_PORT} (or EDGEINFER_HOST). Any address other than "
                    "loopback needs an API key.")
    _server_args(p)
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--warm", metavar="MODEL",
                   help="a store model whose kernels the spare engine process loads at start, "
                        "so its first load is quick (default: the bundled model)")
    _ray_args(p)
    p.set_defaults(func=cmd_serve, validate=_validate_placement(p), holds_gc=True)

    p = subparsers.add_parser("daemon", help="start, stop or inspect the background daemon")
    sub = p.add_subparsers(dest="daemon_cmd", metavar="ACTION", required=True)
    s = sub.add_parser("start", help="start the daemon in the background")
    _server_args(s)
    s.set_defaults(func=cmd_daemon_start, validate=_validate_placement(s))
    s = sub.add_parser("stop", help="stop the background daemon")
    s.set_defaults(func=cmd_daemon_stop)
    s = sub.add_parser("status", help="is the daemon running, where, with which models")
    s.set_defaults(func=cmd_daemon_status)
    s = sub.add_parser("logs", help="print the daemon's log")
    s.add_argument("-n", "--lines", type=int, default=50)
    s.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    s.set_defaults(func=cmd_daemon_logs)

    p = subparsers.add_parser("ps", help="list the models loaded in the daemon")
    p.set_defaults(func=cmd_ps)

    p = subparsers.add_parser("stop", help="unload a model from the daemon")
    p.add_argument("model", metavar="MODEL")
    p.set_defaults(func=cmd_stop)


def _server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", help="address to bind (default 127.0.0.1, or EDGEINFER_HOST)")
    p.add_argument("--port", type=int, help=f"port (default {DEFAULT_PORT}, or EDGEINFER_HOST)")
    p.add_argument("--api-key", help="require this bearer token (default EDGEINFER_API_KEY)")
    p.add_argument("--backend", help="default backend for the models it loads: cpu, torch, "
                                     "torch:DEVICE, llamacpp or auto (default EDGEINFER_BACKEND, "
                                     "else cpu)")
    add_kv_cache_type_arg(p, "KV cache type of the models it loads (default "
                             "EDGEINFER_KV_CACHE_TYPE, else f16); a request's kv_cache_type "
                             "load option overrides it per model")
    add_device_arg(p, "default device for the models it loads, for torch and auto (default "
                      "EDGEINFER_DEVICE): --backend torch --device cuda is torch:cuda; a "
                      "device alone lets auto place models on it")
    p.add_argument("--allow-image-urls", action="store_true",
                   help="fetch http(s) image URLs in requests (default off: images come "
                        "inline as base64 / data: URLs; EDGEINFER_ALLOW_IMAGE_URLS=1)")


def _ray_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("scale-out on Ray Serve (the edgeinfer[ray] extra; docs/scale-out.md)")
    g.add_argument("--ray", action="store_true",
                   help="serve through engine replicas on Ray Serve")
    g.add_argument("--ray-address", metavar="ADDRESS",
                   help="join this Ray cluster (default: start a local one on 127.0.0.1)")
    g.add_argument("--replicas", type=int, default=1, metavar="N",
                   help="engine replicas (the minimum when autoscaling; default 1)")
    g.add_argument("--max-replicas", type=int, metavar="M",
                   help="autoscale between --replicas and M on queue depth")
    g.add_argument("--routing", choices=["affinity", "pow2"], default="affinity",
                   help="prefix-cache affinity (default) or plain power of two choices")
    g.add_argument("--replica-home", metavar="DIR",
                   help="the model store replicas use on their nodes (default: this "
                        "process's EDGEINFER_HOME); a model missing there is copied from "
                        "this node's store and checked by sha256")


def _validate_placement(p: argparse.ArgumentParser):
    def validate(args: argparse.Namespace) -> None:
        check_device_args(p, args.backend, args.device)
    return validate


def _user_error(msg: str) -> Exception:
    return UserError(msg)


def _image_urls_flag(args: argparse.Namespace) -> None:
    """--allow-image-urls reaches the daemon (this process or its child) as the setting."""
    if getattr(args, "allow_image_urls", False):
        os.environ["EDGEINFER_ALLOW_IMAGE_URLS"] = "1"


def cmd_serve(args: argparse.Namespace) -> int:
    from edgeinfer.server import daemon
    _image_urls_flag(args)
    if args.ray or args.ray_address:
        if args.warm:
            raise _user_error("--warm is for the local daemon's spare engine process; Ray "
                              "replicas load their models in their own processes")
        from edgeinfer.scaleout.launch import ScaleOutError, serve_ray  # lazy: `serve --ray` only
        startup_gc.release()    # the Ray path's own processes load the models
        try:
            return serve_ray(args.host, args.port, args.api_key, args.backend, args.device,
                             args.log_level, replicas=args.replicas,
                             max_replicas=args.max_replicas, ray_address=args.ray_address,
                             routing=args.routing, replica_home=args.replica_home,
                             kv_cache_type=args.kv_cache_type)
        except (ScaleOutError, daemon.DaemonError) as e:
            raise _user_error(str(e)) from None
    try:
        return daemon.serve(args.host, args.port, args.api_key, args.backend, args.log_level,
                            device=args.device, kv_cache_type=args.kv_cache_type,
                            warm=args.warm)
    except daemon.DaemonError as e:
        raise _user_error(str(e)) from None


def cmd_daemon_start(args: argparse.Namespace) -> int:
    from edgeinfer.server import daemon
    _image_urls_flag(args)
    try:
        running = daemon.read_pid_file()
        info = daemon.start_background(args.host, args.port, args.api_key, args.backend,
                                       device=args.device, kv_cache_type=args.kv_cache_type)
    except daemon.DaemonError as e:
        raise _user_error(str(e)) from None
    word = "already running" if running else "started"
    print(f"edgeinfer daemon {word}: pid {info.pid}, {info.url}, log {daemon.log_path()}")
    return 0


def cmd_daemon_stop(args: argparse.Namespace) -> int:
    from edgeinfer.server import daemon
    info = daemon.stop_background()
    print(f"edgeinfer daemon stopped (pid {info.pid})" if info else "no edgeinfer daemon running")
    return 0


def _human_size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def _until(expires_at: str | None) -> str:
    if not expires_at or expires_at.startswith("2262"):
        return "Forever"
    try:
        left = datetime.fromisoformat(expires_at.replace("Z", "+00:00")).timestamp() - time.time()
    except ValueError:
        return expires_at
    if left <= 0:
        return "Stopping..."
    if left < 90:
        return f"{left:.0f} seconds from now"
    if left < 5400:
        return f"{left / 60:.0f} minutes from now"
    return f"{left / 3600:.0f} hours from now"


def _kv_cell(m: dict) -> str:
    kind = m.get("kv_cache_type")
    if not kind:
        return "-"
    per_token = m.get("kv_bytes_per_token")
    cell = f"{kind} {per_token:,} B/tok" if per_token else kind
    # Gemma 3's sliding-window layers hold only their window: per_token is the rest's
    return cell + (f" + {m['kv_window']}-tok window" if m.get("kv_window") else "")


def _state(m: dict) -> str:
    """The UNTIL cell: a load in progress says what it is doing (compiling kernels (3/12))."""
    if m.get("state") == "loading":
        return str((m.get("load_progress") or {}).get("text") or "loading")
    return "busy" if m.get("active_requests") else _until(m.get("expires_at"))


def format_ps(models: list[dict]) -> str:
    """Ollama's `ps` table plus the backend, the weights' format and the KV cache (type and
    bytes per token of context) of each loaded copy."""
    rows = [("NAME", "ID", "SIZE", "PROCESSOR", "BACKEND", "WEIGHTS", "KV CACHE", "CONTEXT",
             "UNTIL")]
    for m in models:
        backend = m.get("backend") or "cpu"
        device = m.get("device") or ("cuda" if backend == "torch" else "cpu")
        proc = "100% GPU" if device in ("cuda", "mps") else "100% CPU"
        rows.append((m["name"], (m.get("digest") or "")[:12], _human_size(m.get("size", 0)),
                     proc, backend, m.get("weights_format") or "-", _kv_cell(m),
                     str(m.get("context_length", "")), _state(m)))
    if any("replica" in m for m in models):       # serve --ray: one row per replica's copy
        rows[0] += ("REPLICA", "NODE", "RUN/QUEUE", "KV BLOCKS", "PREFIX HITS")
        for i, m in enumerate(models, 1):
            rows[i] += (str(m.get("replica", "-")), str(m.get("node", "-")),
                        f"{m.get('running', 0)}/{m.get('queued', 0)}",
                        f"{m.get('kv_blocks_used', 0)}/{m.get('kv_blocks_total', 0)}",
                        f"{100 * float(m.get('prefix_hit_rate', 0.0)):.0f}%")
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("    ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def cmd_daemon_status(args: argparse.Namespace) -> int:
    from edgeinfer.cli.client import Client, ClientError
    from edgeinfer.server import daemon
    info = daemon.read_pid_file()
    if info is None:
        print("edgeinfer daemon: not running")
        return 1
    up = time.time() - info.started_at
    print(f"edgeinfer daemon: running, pid {info.pid}, {info.url}, up {up / 60:.1f} min")
    print(f"  log: {daemon.log_path()}")
    try:
        with Client(info.url) as c:
            models = c.request("GET", "/api/ps")["models"]
    except ClientError as e:
        print(f"  not answering: {e}")
        return 1
    print(format_ps(models) if models else "  no models loaded")
    return 0


def cmd_daemon_logs(args: argparse.Namespace) -> int:
    from edgeinfer.server import daemon
    text = daemon.tail_log(args.lines)
    if text:
        print(text)
    if not args.follow:
        return 0
    path = daemon.log_path()
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            while True:
                line = f.readline()
                if line:
                    sys.stdout.write(line.decode("utf-8", errors="replace"))
                    sys.stdout.flush()
                else:
                    time.sleep(0.3)
    except FileNotFoundError:
        raise _user_error(f"no daemon log at {path}") from None


def cmd_ps(args: argparse.Namespace) -> int:
    from edgeinfer.cli.client import ClientError, connect
    try:
        with connect(autostart=False) as c:
            models = c.request("GET", "/api/ps")["models"]
    except ClientError as e:
        raise _user_error(str(e)) from None
    print(format_ps(models))
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    from edgeinfer.cli.client import ClientError, connect
    try:
        with connect(autostart=False) as c:
            c.request("POST", "/api/generate", {"model": args.model, "keep_alive": 0})
    except ClientError as e:
        raise _user_error(str(e)) from None
    return 0
