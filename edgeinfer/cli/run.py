"""`edgeinfer run MODEL [PROMPT]`: stream a completion, or chat interactively.

A store name runs through the daemon (started when none answers), as Ollama does, so the
model stays loaded between commands; `--no-daemon`, or a path to a .gguf file, runs the engine
in this process. Without PROMPT (and with a terminal) it is a chat that keeps the conversation.

A base model (no chat template of its own, such as the bundled gemma3:270m) gets the server's
base-model defaults unless the flags say otherwise: DRY at 0.8 (when sampling), at most 256
output tokens, and a stop (reason "repetition") when the output starts copying itself. A one-shot PROMPT to
a base model (no --raw, no --system) is framed as a question, `Question: PROMPT\nAnswer:`,
and the answer ends at a blank line or the next "Question:" (a base model was trained on text
like that, not on chat turns; measured in README "The first run"). --raw sends PROMPT as it is.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass

from edgeinfer.cli.args import (add_device_arg, add_kv_cache_type_arg, check_device_args,
                                resolve_model_file)
from edgeinfer import startup_gc
from edgeinfer.cli.errors import UserError
from edgeinfer.store.bundled import DEFAULT_MODEL


@dataclass
class RunStats:
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    ttft: float
    decode_time: float
    finish_reason: str | None

    def format(self) -> str:
        prefill = self.prompt_tokens / self.ttft if self.ttft > 0 else 0.0
        decode = (self.output_tokens - 1) / self.decode_time if self.decode_time > 0 else 0.0
        return (f"prompt: {self.prompt_tokens} tokens ({self.cached_tokens} cached), "
                f"TTFT {self.ttft * 1000:.0f} ms, prefill {prefill:.1f} tok/s | "
                f"output: {self.output_tokens} tokens, decode {decode:.1f} tok/s | "
                f"finish: {self.finish_reason}")


def sampling_from_args(args: argparse.Namespace):
    from edgeinfer.runners.sampling_params import SamplingParams
    try:
        dry = getattr(args, "dry_multiplier", None)
        return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              min_p=args.min_p, repeat_penalty=args.repeat_penalty,
                              max_tokens=args.max_tokens, seed=args.seed,
                              stop=tuple(args.stop or ()),
                              dry_multiplier=0.0 if dry is None else dry)
    except ValueError as e:
        raise UserError(str(e)) from None


def prepare_kernels(path: str, backend: str, kv_cache_type: str | None = None) -> None:
    """Compile, with a progress bar on stderr, the CPU kernels this model needs that no
    install or pull compiled (edgeinfer.engine.warmup); a failure only leaves them to
    compile on first use."""
    if backend != "cpu":
        return
    from edgeinfer.cli.load_progress import KernelBar
    from edgeinfer.engine import warmup
    from edgeinfer.settings import current
    try:
        keys = warmup.keys_for_model(path, kv_cache_type or current().kv_cache_type,
                                     current().repack)
        with KernelBar() as bar:
            warmup.prepare(keys, bar)
    except Exception as e:         # noqa: BLE001 - the model still loads and runs
        print(f"edgeinfer: compiling kernels ahead failed ({e}); they compile on first use",
              file=sys.stderr)


def load_engine(path: str, backend: str, num_ctx: int | None, kv_cache_type: str | None = None,
                mmproj: str | None = None):
    from edgeinfer.engine.core import Engine, EngineConfig
    from edgeinfer.formats.gguf_file import GGUFError
    from edgeinfer.settings import current
    prepare_kernels(path, backend, kv_cache_type)
    try:
        settings = current()
        return Engine(path, EngineConfig.from_settings(
            settings, backend, max_model_len=num_ctx or settings.max_model_len,
            kv_cache_type=kv_cache_type or settings.kv_cache_type), mmproj=mmproj).start()
    except GGUFError as e:
        raise UserError(f"{mmproj if mmproj and str(e).startswith('the projector') else path}: "
                        f"{e}") from None
    except ValueError as e:     # e.g. a KV cache type the backend does not have
        raise UserError(str(e)) from None


QA_PREFIX, QA_SUFFIX = "Question: ", "\nAnswer:"
QA_STOPS = ("\nQuestion:", "\n\n")


def qa_framed(prompt: str, params):
    """A one-shot prompt for a base model: the Q/A framing and its stops."""
    text = QA_PREFIX + prompt.strip() + QA_SUFFIX
    return text, dataclasses.replace(params, stop=tuple(params.stop) + QA_STOPS)


def given_from_args(args: argparse.Namespace) -> set[str]:
    """SamplingParams names the command line set (a base model's defaults fill the rest)."""
    given = set()
    if args.max_tokens is not None:
        given.add("max_tokens")
    if getattr(args, "dry_multiplier", None) is not None:
        given.add("dry_multiplier")
    return given


def read_image(path: str) -> bytes:
    """An --image / /image file's bytes, checked to be an image we take (UserError if not)."""
    from edgeinfer.formats.image import ImageError, decode_image
    try:
        data = open(os.path.expanduser(path), "rb").read()
    except OSError as e:
        raise UserError(f"{path}: {e.strerror or e}") from None
    try:
        decode_image(data, path)
    except ImageError as e:
        raise UserError(str(e)) from None
    return data


def with_image_markers(messages: list[dict]) -> tuple[list[dict], list[bytes]]:
    """Messages whose "images" (bytes) become markers before their text, as the daemon's
    /api/chat places them; the images in order."""
    from edgeinfer.engine.images import MEDIA_MARKER
    out, images = [], []
    for m in messages:
        imgs = m.get("images") or []
        images += imgs
        out.append({k: v for k, v in m.items() if k != "images"} |
                   {"content": MEDIA_MARKER * len(imgs) + (m.get("content") or "")})
    return out, images


def stream(engine, prompt_ids: list[int], params, out=None,
           images=None) -> tuple[str, RunStats]:
    """Submit, print text as it arrives, return the text and timings. Ctrl-C aborts. How
    it finishes (stop, length, repetition) is the engine's FinishCheck's to decide."""
    out = out or sys.stdout
    from edgeinfer.engine.core import RequestError
    events: queue.SimpleQueue = queue.SimpleQueue()
    t0 = time.monotonic()
    try:
        rid = engine.submit(prompt_ids, params, events.put, images=images)
    except RequestError as e:
        raise UserError(str(e)) from None
    text, first, last, final = [], None, t0, None
    try:
        while final is None:
            ev = events.get()
            now = time.monotonic()
            if ev.token_ids and first is None:
                first = now
            if ev.text:
                out.write(ev.text)
                out.flush()
                text.append(ev.text)
            last = now
            if ev.finished:
                final = ev
    except KeyboardInterrupt:
        engine.abort(rid)
        raise
    if final.finish_reason == "error":
        raise UserError(final.error or "generation failed")
    first = first or last
    stats = RunStats(final.num_prompt_tokens, final.num_output_tokens, final.num_cached_tokens,
                     first - t0, last - first, final.finish_reason)
    return "".join(text), stats


class LocalSession:
    """The engine in this process."""

    def __init__(self, path: str, backend: str, num_ctx: int | None, params,
                 given: set[str] = frozenset(), repetition_stop: bool | None = None,
                 kv_cache_type: str | None = None, mmproj: str | None = None):
        from edgeinfer.runners.sampling_params import base_model_params, is_base_model
        t = time.monotonic()
        self.engine = load_engine(path, backend, num_ctx, kv_cache_type, mmproj)
        self.load_s = time.monotonic() - t
        base = is_base_model(self.engine)
        self.backend = backend
        self.base_model = base
        self.params = base_model_params(params, given) if base else params
        self.repetition_stop = base if repetition_stop is None else repetition_stop

    def generate(self, messages: list[dict] | None, prompt: str | None,
                 raw: bool, qa: bool = False) -> tuple[str, RunStats]:
        """Stream the reply to stdout; return its text and timings. `qa`: frame `prompt`
        as a question for a base model (see the module docstring)."""
        params = self.params
        if qa:
            prompt, params = qa_framed(prompt, params)
            messages, raw = None, True
        spans = None
        if messages is not None and any(m.get("images") for m in messages):
            from edgeinfer.engine.core import RequestError
            from edgeinfer.formats.image import decode_image
            msgs, data = with_image_markers(messages)
            try:
                ids, spans = self.engine.encode_chat_images(
                    msgs, [decode_image(d) for d in data])
            except RequestError as e:
                raise UserError(str(e)) from None
        elif messages is not None:
            ids = self.engine.encode_chat(messages)
        elif raw:
            ids = self.engine.encode_raw(prompt)
        else:
            ids = self.engine.encode_chat([{"role": "user", "content": prompt}])
        from edgeinfer.runners.sampling_params import with_vocabulary
        params = dataclasses.replace(with_vocabulary(params, self.engine.tokenizer),
                                     stop_on_repetition=self.repetition_stop)
        return stream(self.engine, ids, params, images=spans)

    def close(self) -> None:
        # close, not just shut down: the runner finishes writing the model's repacked
        # weights to disk (backends/cpu/packed_cache.py), which the next run then maps
        self.engine.close()


class DaemonSession:
    """Generation through the daemon's Ollama API; the model stays loaded after we exit."""

    def __init__(self, model: str, backend: str, num_ctx: int | None, params,
                 device: str | None = None, given: set[str] = frozenset(),
                 repetition_stop: bool | None = None, kv_cache_type: str | None = None):
        from edgeinfer.cli.client import ClientError, connect
        try:
            self.client = connect(autostart=True, warm=model)
        except ClientError as e:
            raise UserError(f"{e} (or run with --no-daemon)") from None
        self.model, self.load_s = model, 0.0
        self.backend = backend + (f" (device {device})" if device else "")
        opts = {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p,
                "min_p": params.min_p, "repeat_penalty": params.repeat_penalty}
        # unset: the daemon applies the model's defaults (a cap and DRY for base models)
        if "max_tokens" in given:
            opts["num_predict"] = params.max_tokens
        if "dry_multiplier" in given:
            opts["dry_multiplier"] = params.dry_multiplier
        if repetition_stop is not None:
            opts["stop_on_repetition"] = repetition_stop
        if params.seed is not None:
            opts["seed"] = params.seed
        if params.stop:
            opts["stop"] = list(params.stop)
        if num_ctx:
            opts["num_ctx"] = num_ctx
        if backend != "auto":
            opts["backend"] = backend
        if device:
            opts["device"] = device
        if kv_cache_type:
            opts["kv_cache_type"] = kv_cache_type
        self.options = opts
        self.params = params
        self._base: bool | None = None
        self.preload()

    def preload(self) -> None:
        """Ask the daemon to load the model now, as `ollama run` does (Ollama's empty
        /api/generate, with this run's placement), on a thread of its own: the load then
        overlaps /api/show and, in a chat, the user's typing, instead of following them.
        A failure is the first request's to report."""
        from edgeinfer.cli.client import ClientError
        self._preload_s = 0.0
        body: dict = {"model": self.model}
        placement = {k: v for k, v in self.options.items()
                     if k in ("backend", "device", "kv_cache_type")}
        if placement:
            body["options"] = placement

        def load() -> None:
            t = time.monotonic()
            try:
                done = self.client.request("POST", "/api/generate", body)
            except ClientError:
                return
            if isinstance(done, dict) and done.get("done_reason") == "load":
                self._preload_s = time.monotonic() - t     # --verbose's "model load"
        threading.Thread(target=load, name="edgeinfer-preload", daemon=True).start()

    @property
    def base_model(self) -> bool:
        """The daemon's /api/show says the model has no chat template of its own."""
        if self._base is None:
            from edgeinfer.cli.client import ClientError
            try:
                info = self.client.request("POST", "/api/show", {"model": self.model})
                self._base = bool(isinstance(info, dict) and info.get("base_model"))
            except ClientError:
                self._base = False      # generate reports a missing model in its own words
        return self._base

    def generate(self, messages: list[dict] | None, prompt: str | None,
                 raw: bool, qa: bool = False) -> tuple[str, RunStats]:
        from edgeinfer.cli.client import ClientError, GenerationStats, stream_generate
        options = self.options
        if qa:
            prompt, params = qa_framed(prompt, self.params)
            messages, raw = None, True
            options = {**options, "stop": list(params.stop)}
        if messages is not None and any(m.get("images") for m in messages):
            import base64
            messages = [m | {"images": [base64.b64encode(d).decode() for d in m["images"]]}
                        if m.get("images") else m for m in messages]
        kw = dict(messages=messages) if messages is not None else dict(prompt=prompt, raw=raw)
        from edgeinfer.cli.load_progress import LoadWatcher
        t0 = time.monotonic()
        first = None
        final = None
        text: list[str] = []
        # a first request may load the model and compile kernels: say so on stderr
        watcher = LoadWatcher(self.client.base_url, self.model).__enter__()
        try:
            for item in stream_generate(self.model, options=options, client=self.client, **kw):
                if isinstance(item, GenerationStats):
                    final = item
                else:
                    if first is None:
                        first = time.monotonic()
                        watcher.stop()
                    text.append(item)
                    sys.stdout.write(item)
                    sys.stdout.flush()
        except ClientError as e:
            raise UserError(str(e)) from None
        finally:
            watcher.stop()
        if final is None:
            raise UserError("the daemon ended the stream early")
        # the preload's wait when it loaded the model (the request then found it loaded)
        self.load_s = max(final.load_duration, self._preload_s)
        return "".join(text), RunStats(final.prompt_tokens, final.completion_tokens, final.cached_tokens,
                        (first or time.monotonic()) - t0, final.eval_duration, final.done_reason)

    def close(self) -> None:
        self.client.close()


def chat_loop(session, system: str | None, verbose: bool) -> int:
    messages: list[dict] = [{"role": "system", "content": system}] if system else []
    print("Chatting with the model. /bye or Ctrl-D to quit, /clear to start over, "
          "/image PATH to add a picture, Ctrl-C to stop a reply.", file=sys.stderr)
    pending: list[bytes] = []       # /image: goes with the next message
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:
            print(file=sys.stderr)
            continue
        if not line.strip():
            continue
        if line.strip() in ("/bye", "/exit", "/quit"):
            return 0
        if line.strip() == "/clear":
            messages = messages[:1] if system else []
            pending = []
            print("(conversation cleared)", file=sys.stderr)
            continue
        if line.strip().startswith("/image"):
            path = line.strip()[len("/image"):].strip()
            try:
                pending.append(read_image(path))
                print(f"(image {path} added to your next message)", file=sys.stderr)
            except UserError as e:
                print(f"edgeinfer: {e}", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line,
                         **({"images": pending} if pending else {})})
        sent, pending = pending, []
        try:
            reply, stats = session.generate(messages, None, False)
        except KeyboardInterrupt:
            print("\n(stopped)", file=sys.stderr)
            messages.pop()
            pending = sent
            continue
        except UserError as e:
            print(f"\nedgeinfer: {e}", file=sys.stderr)
            messages.pop()
            pending = sent
            continue
        print()
        messages.append({"role": "assistant", "content": reply})
        if verbose:
            print(stats.format(), file=sys.stderr)


def local_backend(path: str, backend: str, device: str | None) -> str:
    """--backend/--device for the engine in this process, resolved against the file's
    architecture and this machine's devices (a missing device is one line, exit 1)."""
    from edgeinfer.runners.choice import BackendChoiceError, resolve_for_file
    from edgeinfer.formats.gguf_file import GGUFError, read_gguf
    try:
        read_gguf(path).close()
    except GGUFError as e:
        raise UserError(f"{path}: {e}") from None
    try:
        return resolve_for_file(path, backend, device)
    except BackendChoiceError as e:
        raise UserError(str(e)) from None


def _surely_cpu(backend: str, device: str | None) -> bool:
    """Whether --backend/--device leave only the numba CPU backend (or llama.cpp, for an
    architecture without a native model): what auto picks on this machine (without torch
    where no GPU shows) when they leave the choice to it."""
    if backend not in ("auto", "cpu") or device not in (None, "cpu"):
        return False
    from edgeinfer.runners.choice import auto_backend
    return backend == "cpu" or device == "cpu" or auto_backend() == "cpu"


def cmd_run(args: argparse.Namespace) -> int:
    params = sampling_from_args(args)
    prompt = args.prompt
    if prompt is None and not sys.stdin.isatty():
        prompt = sys.stdin.read()
    device = getattr(args, "device", None)
    images = [read_image(p) for p in (getattr(args, "image", None) or [])]
    mmproj = getattr(args, "mmproj", None)
    if images and args.raw:
        raise UserError("--image needs the chat template: it cannot go with --raw")
    if images and prompt is None:
        raise UserError("--image goes with a PROMPT; in the interactive chat use /image PATH")
    local_file = args.model.endswith(".gguf") or os.path.exists(args.model)
    if args.no_daemon or local_file:
        from edgeinfer.formats.gguf_file import remember_headers
        path = resolve_model_file(args.model)
        # one parse of the header and vocabulary for the backend choice, the kernel steps
        # and the runner (~0.07 s each for a 150k vocabulary); the engine holds them anyway.
        # Walked in numba (~0.04 s) where the CPU backend will surely run, numba anyway
        remember_headers(compiled_walk=_surely_cpu(args.backend, device))
        if mmproj is None and not local_file:      # a store model's own projector
            from edgeinfer.store.model_store import Store
            proj = Store().resolve(args.model).projector_path
            mmproj = str(proj) if proj else None
        session = LocalSession(path, local_backend(path, args.backend, device), args.num_ctx,
                               params, given_from_args(args), args.repetition_stop,
                               args.kv_cache_type, mmproj)
    else:
        if mmproj:
            raise UserError(f"--mmproj is for a model file run in this process; store it with "
                            f"the model instead: edgeinfer pull SOURCE --name {args.model} "
                            f"--mmproj {mmproj}")
        session = DaemonSession(args.model, args.backend, args.num_ctx, params, device,
                                given_from_args(args), args.repetition_stop,
                                args.kv_cache_type)
    startup_gc.release()        # main() held it while this process loaded (startup_gc.py)
    try:
        if prompt is None:
            return chat_loop(session, args.system, args.verbose)
        msgs = None
        if not args.raw:
            msgs = ([{"role": "system", "content": args.system}] if args.system else []) + \
                [{"role": "user", "content": prompt, **({"images": images} if images else {})}]
        qa = not args.raw and not args.system and not images and session.base_model
        _, stats = session.generate(msgs, prompt, args.raw, qa=qa)
        print()
        if args.verbose:
            print(f"backend: {session.backend}, model load {session.load_s * 1000:.0f} ms",
                  file=sys.stderr)
            print(stats.format(), file=sys.stderr)
        return 0
    finally:
        session.close()


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="0 disables (default 40)")
    p.add_argument("--top-p", type=float, default=0.9, help="1 disables (default 0.9)")
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repeat-penalty", type=float, default=1.1)
    p.add_argument("--max-tokens", type=int, default=None,
                   help="default: until the context is full (256 for base models)")
    p.add_argument("--dry-multiplier", type=float, default=None,
                   help="DRY repetition penalty strength; 0 disables (default: 0.8 for base "
                        "models, else off)")
    p.add_argument("--repetition-stop", action=argparse.BooleanOptionalAction, default=None,
                   help="end the output (reason: repetition) once it repeats itself verbatim "
                        "(default: on for base models)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="a stop string (repeatable)")


def add_commands(subparsers) -> None:
    p = subparsers.add_parser("run", help="generate from a prompt, or chat interactively")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help=f"a store name (default {DEFAULT_MODEL}, the bundled chat model) or a "
                        "path to a .gguf file")
    p.add_argument("prompt", nargs="?", help="the prompt; omit for an interactive chat")
    p.add_argument("--raw", action="store_true",
                   help="send PROMPT as plain text (BOS per the model, no chat template)")
    p.add_argument("--system", help="a system prompt")
    p.add_argument("--image", action="append", metavar="PATH",
                   help="a picture for the prompt (PNG, JPEG, WebP, GIF, BMP; repeatable); "
                        "the model needs a vision projector")
    p.add_argument("--mmproj", metavar="FILE",
                   help="the vision projector for a model run from a file (a store model "
                        "uses the one pulled with it: pull --mmproj)")
    add_sampling_args(p)
    p.add_argument("--backend", default="auto",
                   choices=["auto", "cpu", "llamacpp", "torch", "torch:cuda", "torch:mps", "torch:cpu"],
                   help="auto: torch on CUDA, then MPS, then the native CPU engine; llama.cpp "
                        "for architectures without a native model")
    add_device_arg(p, "where torch runs: --backend torch --device cuda is torch:cuda; with "
                      "auto, cpu picks the native CPU engine and cuda/mps torch on that device")
    p.add_argument("--num-ctx", type=int, default=None, help="context length (default 8192)")
    add_kv_cache_type_arg(p, "K/V cache type: f16 (llama.cpp's default) or q8_0 (8-bit blocks, "
                             "about half the memory; default EDGEINFER_KV_CACHE_TYPE, else f16)")
    p.add_argument("--verbose", action="store_true", help="print TTFT and prefill/decode tok/s")
    p.add_argument("--no-daemon", action="store_true",
                   help="run the engine in this process instead of through the daemon")
    p.set_defaults(func=cmd_run, validate=lambda a: check_device_args(p, a.backend, a.device),
                   holds_gc=True)

