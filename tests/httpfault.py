"""Test helpers for the store and pull: tiny GGUF files and a fault-injecting HTTP server.

The server is a real threaded `http.server` on 127.0.0.1 (random port). It serves files at
any path you register, e.g. an HF-style `/{owner}/{repo}/resolve/{rev}/{file}` (with the
`X-Linked-Etag` / `ETag` headers the hub sends) and a plain `/x.gguf`, honours
`Range: bytes=N-`, and injects faults per path: drop the connection after N bytes, answer
500 a number of times first, trickle slowly, stall, ignore Range, or lie about the sha256.
"""
from __future__ import annotations

import hashlib
import http.server
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


def make_gguf(path: Path, seed: int = 0, n: int = 4096, arch: str = "llama") -> bytes:
    """Write a small valid GGUF file (a few F32 tensors) and return its bytes."""
    import gguf
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{seed}")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tensor("token_embd.weight", rng.standard_normal((16, n // 16), dtype=np.float32))
    w.add_tensor("output_norm.weight", rng.standard_normal(n // 16, dtype=np.float32))
    w.add_tensor("blk.0.attn_q.weight", rng.standard_normal((8, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path).read_bytes()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Route:
    body: bytes
    etag: str | None = None            # sent as ETag (quoted)
    linked_etag: str | None = None     # sent as X-Linked-Etag (HF LFS style)
    fail_500: int = 0                  # answer 500 this many times first
    drop_after: int | None = None      # close the connection after this many body bytes...
    drop_times: int = 1                # ...on this many GET requests
    ignore_range: bool = False         # always answer 200 with the whole body
    trickle: float = 0.0               # sleep between 1 KiB pieces
    stall: float = 0.0                 # sleep this long before the first body byte...
    stall_times: int = 0               # ...on this many GET requests
    content_length: int | None = None  # override the advertised length (disk-space tests)
    status: int = 200                  # e.g. 404
    head_status: int | None = None     # e.g. 403: a CDN's GET-signed URL refusing HEAD
    gate: threading.Event | None = None  # GET bodies wait for this (deterministic overlap)
    gets: int = 0
    heads: int = 0
    ranges: list[str | None] = field(default_factory=list)


class FaultServer:
    def __init__(self) -> None:
        self.routes: dict[str, Route] = {}
        self.redirects: dict[str, tuple[str, dict[str, str]]] = {}
        self.headers_seen: list[dict[str, str]] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):   # keep pytest output clean
                pass

            def do_HEAD(self):
                self._serve(head=True)

            def do_GET(self):
                self._serve(head=False)

            def _serve(self, head: bool) -> None:
                server.headers_seen.append(dict(self.headers))
                path = self.path.split("?", 1)[0]
                if path in server.redirects:
                    location, extra = server.redirects[path]
                    self.send_response(302)
                    self.send_header("Location", location)
                    for k, v in extra.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                route = server.routes.get(path)
                if route is None or route.status == 404:
                    self._plain(404, b"Entry not found")
                    return
                if route.status != 200:
                    self._plain(route.status, b"error")
                    return
                if head and route.head_status:
                    self._plain(route.head_status, b"")
                    return
                if head:
                    route.heads += 1
                else:
                    route.gets += 1
                    route.ranges.append(self.headers.get("Range"))
                    if route.fail_500 > 0:
                        route.fail_500 -= 1
                        self._plain(500, b"Internal Server Error")
                        return
                body = route.body
                start = 0
                rng = self.headers.get("Range")
                if rng and not route.ignore_range and rng.startswith("bytes="):
                    start = int(rng[6:].split("-", 1)[0])
                    if start >= len(body):
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{len(body)}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                else:
                    self.send_response(200)
                if not route.ignore_range:
                    self.send_header("Accept-Ranges", "bytes")
                length = route.content_length if route.content_length is not None \
                    else len(body) - start
                self.send_header("Content-Length", str(length))
                self.send_header("Content-Type", "application/octet-stream")
                if route.etag:
                    self.send_header("ETag", f'"{route.etag}"')
                if route.linked_etag:
                    self.send_header("X-Linked-Etag", f'"{route.linked_etag}"')
                self.end_headers()
                if head:
                    return
                part = body[start:]
                if route.gate is not None:
                    route.gate.wait(30)
                if route.stall_times > 0:
                    route.stall_times -= 1
                    time.sleep(route.stall)
                if route.drop_after is not None and route.drop_times > 0:
                    route.drop_times -= 1
                    self.wfile.write(part[:route.drop_after])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                if route.trickle:
                    for i in range(0, len(part), 1024):
                        self.wfile.write(part[i:i + 1024])
                        self.wfile.flush()
                        time.sleep(route.trickle)
                    return
                self.wfile.write(part)

            def _plain(self, code: int, text: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Length", str(len(text)))
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(text)

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True)

    def add(self, path: str, body: bytes, **faults) -> Route:
        route = Route(body=body, **faults)
        self.routes[path] = route
        return route

    def redirect(self, path: str, location: str, **headers: str) -> None:
        """Answer `path` with a 302 to `location` (HF resolve -> CDN), with extra headers
        such as X_Linked_Etag='"<sha>"' (underscores become dashes)."""
        self.redirects[path] = (location, {k.replace("_", "-"): v for k, v in headers.items()})

    def __enter__(self) -> "FaultServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)
