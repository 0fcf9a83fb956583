"""Running the server: `serve` in the foreground, and the background daemon (start, stop,
status, logs) with its pid file and log.

The background daemon is a new process (`python -m edgeinfer serve ...` through Popen), never
an os.fork() of the CLI: numba's OpenMP runtime is not fork-safe once kernels have run.
The pid file and log live in `$EDGEINFER_HOME/state/` when EDGEINFER_HOME is set (so a test
or a second store gets its own daemon), else in the platform's user state directory.
"""
from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from edgeinfer import __version__, startup_gc
from edgeinfer.settings import current

from . import DEFAULT_HOST, DEFAULT_PORT

log = logging.getLogger("edgeinfer.server")


class DaemonError(Exception):
    """A lifecycle failure with a one-sentence message for the user."""


# ----- addresses and paths -------------------------------------------------------------------

def parse_address(value: str | None) -> tuple[str, int]:
    """EDGEINFER_HOST forms: "host:port", "host", ":port", "http://host:port"."""
    if not value:
        return DEFAULT_HOST, DEFAULT_PORT
    v = value.strip()
    for prefix in ("http://", "https://"):
        if v.startswith(prefix):
            v = v[len(prefix):]
    v = v.rstrip("/")
    host, port = v, DEFAULT_PORT
    if v.startswith("["):                                   # [::1]:port
        end = v.find("]")
        host, rest = v[1:end], v[end + 1:]
        if rest.startswith(":"):
            port = _port(rest[1:], value)
    elif v.count(":") == 1:
        host, p = v.split(":")
        port = _port(p, value)
    return host or DEFAULT_HOST, port


def _port(p: str, whole: str) -> int:
    try:
        n = int(p)
    except ValueError:
        raise DaemonError(f"bad address {whole!r}: port {p!r} is not a number") from None
    if not 0 < n < 65536:
        raise DaemonError(f"bad address {whole!r}: port {n} is out of range")
    return n


def env_address() -> tuple[str, int]:
    return parse_address(current().host)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def url_for(host: str, port: int) -> str:
    if host in ("0.0.0.0", "", "::"):
        host = "127.0.0.1"                  # a wildcard bind is reached through loopback
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def state_dir() -> Path:
    home = current().home
    if home:
        return home / "state"
    import platformdirs  # lazy: only without EDGEINFER_HOME
    return Path(platformdirs.user_state_dir("edgeinfer", appauthor=False))


def pid_path() -> Path:
    return state_dir() / "daemon.json"


def log_path() -> Path:
    return state_dir() / "daemon.log"


@dataclass(frozen=True)
class DaemonInfo:
    pid: int
    host: str
    port: int
    started_at: float
    version: str

    @property
    def url(self) -> str:
        return url_for(self.host, self.port)


def read_pid_file() -> DaemonInfo | None:
    """The recorded daemon if its process still runs (a stale file is removed)."""
    try:
        info = DaemonInfo(**json.loads(pid_path().read_text()))
    except (OSError, ValueError, TypeError):
        return None
    if not _is_our_process(info.pid):
        with contextlib.suppress(OSError):
            pid_path().unlink()
        return None
    return info


def _is_our_process(pid: int) -> bool:
    """Alive and an edgeinfer server (pids are reused: never signal a stranger)."""
    import psutil  # lazy: keeps `edgeinfer --help` fast (the CLI imports this module)
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return False
        cmd = " ".join(p.cmdline())
    except (psutil.Error, OSError):
        return False
    return "edgeinfer" in cmd and "serve" in cmd


def _write_pid_file(host: str, port: int) -> None:
    d = state_dir()
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f"daemon.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(asdict(DaemonInfo(os.getpid(), host, port, time.time(),
                                                 __version__))))
    os.replace(tmp, pid_path())


def _remove_pid_file() -> None:
    with contextlib.suppress(OSError, ValueError):
        if json.loads(pid_path().read_text()).get("pid") == os.getpid():
            pid_path().unlink()


# ----- foreground ------------------------------------------------------------------------------

def check_bind(host: str, api_key: str | None) -> None:
    if not is_loopback(host) and not api_key:
        raise DaemonError(f"refusing to listen on {host}, which other machines can reach, "
                          "without an API key: pass --api-key KEY or set EDGEINFER_API_KEY")


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise DaemonError(f"cannot listen on {host}:{port}: {e.strerror or e} (is another "
                          "server using the port? pick one with --port or EDGEINFER_HOST)") from None
    sock.set_inheritable(True)
    return sock


def prepare_serve(host: str | None, port: int | None, api_key: str | None,
                  backend: str | None, device: str | None, log_level: str,
                  kv_cache_type: str | None = None):
    """What `serve` (plain or --ray) settles before it listens: the address (flags over
    settings), the API key (required off loopback), the server config, logging. Returns
    (host, port, api_key, config); DaemonError with one sentence otherwise."""
    from .model_manager import ServerConfig  # lazy: the engine loads with a server, not the CLI
    env_host, env_port = env_address()
    host, port = host or env_host, port or env_port
    api_key = api_key or current().api_key
    check_bind(host, api_key)
    try:
        config = ServerConfig.from_env(backend=backend, device=device,
                                       kv_cache_type=kv_cache_type)
    except ValueError as e:
        raise DaemonError(str(e)) from None
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return host, port, api_key, config


def early_spare(warm: str | None, log_level: str):
    """The daemon's spare engine process (edgeinfer/engine/spare.py), started before the
    server's own imports (~0.6 s of fastapi, uvicorn and the engine's modules) so that it
    warms meanwhile: the kernels of `warm` (the model an autostarting `edgeinfer run` asked
    for), else of the bundled default if it is in the store. None when spares are off."""
    settings = current()
    if not (settings.engine_process and settings.spare_runner):
        return None
    from edgeinfer.engine.spare import SpareRunner
    from edgeinfer.store.bundled import DEFAULT_MODEL
    from edgeinfer.store.model_store import Store, StoreError
    hint = None
    for name in ([warm] if warm else []) + [DEFAULT_MODEL]:
        with contextlib.suppress(StoreError, OSError):
            ref = Store().get(name)     # never assembles a bundled package
            hint = str(ref.path) if ref is not None else None
        if hint is not None:
            break
        if name == warm:    # logging is not set up yet: Python's last-resort handler, stderr
            log.warning("--warm %s: no such model in the store; the spare warms %s", warm,
                        DEFAULT_MODEL)
    spares = SpareRunner(True, getattr(logging, log_level.upper(), logging.INFO))
    spares.refill(hint)
    return spares


def serve(host: str | None = None, port: int | None = None, api_key: str | None = None,
          backend: str | None = None, log_level: str = "info", device: str | None = None,
          kv_cache_type: str | None = None, warm: str | None = None) -> int:
    """Run the server in this process until SIGINT/SIGTERM."""
    check_bind(host or env_address()[0], api_key or current().api_key)
    spares = early_spare(warm, log_level)
    # lazy: the server and uvicorn load when it starts, not with every CLI command
    import uvicorn

    from .app import create_app

    host, port, api_key, config = prepare_serve(host, port, api_key, backend, device, log_level,
                                                kv_cache_type)
    # The engine thread takes the GIL back between ~250 kernel calls a step, while the event
    # loop thread encodes and sends every token; with CPython's default 5 ms switch interval
    # the engine often waited for it (single-stream decode through the daemon, 2 cores: 55-60
    # tok/s at 5 ms, 60-70 at 0.5 ms).
    sys.setswitchinterval(0.001)
    sock = _bind(host, port)
    app = create_app(config, api_key=api_key, spares=spares)
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, access_log=False,
                                           timeout_graceful_shutdown=5))
    startup_gc.release()    # main() held it while the server's modules loaded (startup_gc.py)
    _write_pid_file(host, port)
    log.info("edgeinfer listening on %s (api key %s)", url_for(host, port),
             "required" if api_key else "off")
    try:
        server.run(sockets=[sock])
    finally:
        _remove_pid_file()
        sock.close()
    return 0


# ----- background ------------------------------------------------------------------------------

def health(url: str, timeout: float = 2.0) -> dict | None:
    """GET /health: the daemon's answer, or None. http.client, as the CLI's own client: an
    autostarting `edgeinfer run` asks before and while the daemon starts, and httpx would
    add ~0.1 s of imports in front of that start."""
    import http.client
    import urllib.parse
    u = urllib.parse.urlsplit(url)
    cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    conn = cls(u.hostname, u.port, timeout=timeout)
    try:
        conn.request("GET", "/health")
        r = conn.getresponse()
        data = r.read()
        return json.loads(data) if r.status == 200 else None
    except (OSError, http.client.HTTPException, ValueError):
        return None
    finally:
        conn.close()


def start_background(host: str | None = None, port: int | None = None,
                     api_key: str | None = None, backend: str | None = None,
                     wait_s: float = 120.0, device: str | None = None,
                     kv_cache_type: str | None = None, warm: str | None = None) -> DaemonInfo:
    """Start `edgeinfer serve` as a detached process and wait until /health answers;
    `warm`: the model its spare engine process warms first (`serve --warm`)."""
    env_host, env_port = env_address()
    host, port = host or env_host, port or env_port
    running = read_pid_file()
    if running is not None:
        return running
    check_bind(host, api_key or current().api_key)
    if health(url_for(host, port)) is not None:
        raise DaemonError(f"another server already answers on {url_for(host, port)}")
    d = state_dir()
    d.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "edgeinfer", "serve", "--host", host, "--port", str(port)]
    if backend:
        cmd += ["--backend", backend]
    if device:
        cmd += ["--device", device]
    if kv_cache_type:
        cmd += ["--kv-cache-type", kv_cache_type]
    if warm:
        cmd += ["--warm", warm]
    env = dict(os.environ)
    if sys.platform == "linux" and current().engine_process:
        # the allocator `serve` would re-execute itself for (cli/main.py _daemon_allocator),
        # given from the start: one Python start-up less before the daemon answers
        env.update(PYTHONMALLOC="malloc", _EDGEINFER_REEXEC="1")
    if api_key:
        env["EDGEINFER_API_KEY"] = api_key       # not in argv, where `ps` would show it
    kwargs: dict = {}
    if os.name == "nt":
        kwargs["creationflags"] = subprocess.CREATE_NEW_PROCESS_GROUP | 0x00000008  # DETACHED
    else:
        kwargs["start_new_session"] = True       # Ctrl-C in the terminal must not reach it
    with open(log_path(), "ab") as logf:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf,
                                stderr=subprocess.STDOUT, env=env, **kwargs)
    deadline = time.monotonic() + wait_s
    url = url_for(host, port)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DaemonError(f"the daemon exited at start (code {proc.returncode}); "
                              f"last log lines:\n{tail_log(8)}")
        if health(url, timeout=1.0) is not None:
            info = read_pid_file()
            return info or DaemonInfo(proc.pid, host, port, time.time(), "")
        time.sleep(0.02)        # a refused loopback connection costs ~0.1 ms
    raise DaemonError(f"the daemon did not answer on {url} within {wait_s:.0f}s; see {log_path()}")


def stop_background(wait_s: float = 30.0) -> DaemonInfo | None:
    """SIGTERM the recorded daemon (graceful: engines shut down), SIGKILL after wait_s."""
    info = read_pid_file()
    if info is None:
        return None
    import psutil  # lazy: keeps `edgeinfer --help` fast (the CLI imports this module)
    try:
        p = psutil.Process(info.pid)
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(wait_s)
        except psutil.TimeoutExpired:
            p.kill()
            p.wait(10)
    except psutil.NoSuchProcess:
        pass
    with contextlib.suppress(OSError):
        if read_pid_file() is None:
            pid_path().unlink(missing_ok=True)
    return info


def tail_log(lines: int = 50) -> str:
    try:
        with open(log_path(), "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 256 * 1024))
            data = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])
