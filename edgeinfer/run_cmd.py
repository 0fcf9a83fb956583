"""`edgeinfer run MODEL [PROMPT]`: stream a completion, or chat interactively.

The engine runs in this process (its own thread); tokens stream to stdout as they are
sampled. Without PROMPT (and with a terminal) it is a chat that keeps the conversation.
"""
from __future__ import annotations

import argparse
import queue
import sys
import time
from dataclasses import dataclass

from edgeinfer.cli import UserError


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
    from edgeinfer.sampling import SamplingParams
    try:
        return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              min_p=args.min_p, repeat_penalty=args.repeat_penalty,
                              max_tokens=args.max_tokens, seed=args.seed,
                              stop=tuple(args.stop or ()))
    except ValueError as e:
        raise UserError(str(e)) from None


def choose_backend(requested: str, path: str) -> str:
    """`auto`: the native engine when it runs the architecture, llama.cpp otherwise."""
    if requested != "auto":
        return requested
    from edgeinfer.gguf_file import read_gguf
    from edgeinfer.model_config import NATIVE_ARCHS
    f = read_gguf(path)
    arch = f.metadata.get("general.architecture")
    f.close()
    return "cpu" if arch in NATIVE_ARCHS else "llamacpp"


def load_engine(path: str, backend: str, num_ctx: int | None):
    from edgeinfer.engine import Engine, EngineConfig
    from edgeinfer.gguf_file import GGUFError
    try:
        return Engine(path, EngineConfig(backend=backend, max_model_len=num_ctx)).start()
    except GGUFError as e:
        raise UserError(f"{path}: {e}") from None


def stream(engine, prompt_ids: list[int], params, out=sys.stdout) -> tuple[str, RunStats]:
    """Submit, print text as it arrives, return the text and timings. Ctrl-C aborts."""
    from edgeinfer.engine import RequestError
    events: queue.SimpleQueue = queue.SimpleQueue()
    t0 = time.monotonic()
    try:
        rid = engine.submit(prompt_ids, params, events.put)
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


def chat_loop(engine, params, system: str | None, verbose: bool) -> int:
    messages: list[dict] = [{"role": "system", "content": system}] if system else []
    print("Chatting with the model. /bye or Ctrl-D to quit, /clear to start over, "
          "Ctrl-C to stop a reply.", file=sys.stderr)
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
            print("(conversation cleared)", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        try:
            reply, stats = stream(engine, engine.encode_chat(messages), params)
        except KeyboardInterrupt:
            print("\n(stopped)", file=sys.stderr)
            messages.pop()
            continue
        except UserError as e:
            print(f"\nedgeinfer: {e}", file=sys.stderr)
            messages.pop()
            continue
        print()
        messages.append({"role": "assistant", "content": reply})
        if verbose:
            print(stats.format(), file=sys.stderr)


def cmd_run(args: argparse.Namespace) -> int:
    from edgeinfer.show_cmd import resolve_model_file
    path = resolve_model_file(args.model)
    backend = choose_backend(args.backend, path)
    params = sampling_from_args(args)
    prompt = args.prompt
    if prompt is None and not sys.stdin.isatty():
        prompt = sys.stdin.read()
    t_load = time.monotonic()
    engine = load_engine(path, backend, args.num_ctx)
    load_s = time.monotonic() - t_load
    try:
        if prompt is None:
            return chat_loop(engine, params, args.system, args.verbose)
        if args.raw:
            ids = engine.encode_raw(prompt)
        else:
            msgs = ([{"role": "system", "content": args.system}] if args.system else [])
            ids = engine.encode_chat(msgs + [{"role": "user", "content": prompt}])
        _, stats = stream(engine, ids, params)
        print()
        if args.verbose:
            print(f"backend: {backend}, model load {load_s * 1000:.0f} ms", file=sys.stderr)
            print(stats.format(), file=sys.stderr)
        return 0
    finally:
        engine.shutdown()


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="0 disables (default 40)")
    p.add_argument("--top-p", type=float, default=0.9, help="1 disables (default 0.9)")
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repeat-penalty", type=float, default=1.1)
    p.add_argument("--max-tokens", type=int, default=None, help="default: until the context is full")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="a stop string (repeatable)")


def add_commands(subparsers) -> None:
    p = subparsers.add_parser("run", help="generate from a prompt, or chat interactively")
    p.add_argument("model", help="a store name (gemma3:270m) or a path to a .gguf file")
    p.add_argument("prompt", nargs="?", help="the prompt; omit for an interactive chat")
    p.add_argument("--raw", action="store_true",
                   help="send PROMPT as plain text (BOS per the model, no chat template)")
    p.add_argument("--system", help="a system prompt")
    add_sampling_args(p)
    p.add_argument("--backend", choices=["auto", "cpu", "llamacpp", "torch"], default="auto")
    p.add_argument("--num-ctx", type=int, default=None, help="context length (default 8192)")
    p.add_argument("--verbose", action="store_true", help="print TTFT and prefill/decode tok/s")
    p.set_defaults(func=cmd_run)

