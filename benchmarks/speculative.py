"""Prompt-lookup speculative decoding: decode tok/s with and without it, and llama.cpp.

    .venv/bin/python benchmarks/speculative.py [--model PATH] [--rounds 3] [--threads 2]

Two tasks on the same model, greedy:
  grounded   a ~400-token code listing, the same listing with one change (a renamed
             function), then the start of a third copy: the continuation reproduces it;
  free text  a story opening, 128 tokens (EOS ignored): little to look up.
Each round runs ours with speculation, ours without, and llama.cpp (llama-cpp-python, plain
token-by-token greedy decoding) one after another; medians of the rounds, with the range.
Decode tok/s = generated tokens after the first / time after the first token.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import model_path, setup_env  # noqa: E402

LISTING = '''import json
import os
from dataclasses import dataclass


@dataclass
class Account:
    owner: str
    balance: float = 0.0
    history: list = None

    def deposit(self, amount: float) -> None:
        if amount <= 0:
            raise ValueError("deposit must be positive")
        self.balance += amount
        self.history = (self.history or []) + [("deposit", amount)]

    def withdraw(self, amount: float) -> None:
        if amount > self.balance:
            raise ValueError("insufficient funds")
        self.balance -= amount
        self.history = (self.history or []) + [("withdraw", amount)]


def load_accounts(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        raw = json.load(f)
    return {name: Account(name, data["balance"], data["history"]) for name, data in raw.items()}


def save_accounts(path: str, accounts: dict) -> None:
    raw = {a.owner: {"balance": a.balance, "history": a.history} for a in accounts.values()}
    with open(path, "w") as f:
        json.dump(raw, f, indent=2)


def transfer(accounts: dict, src: str, dst: str, amount: float) -> None:
    accounts[src].withdraw(amount)
    accounts[dst].deposit(amount)


def main() -> None:
    accounts = load_accounts("accounts.json")
    accounts.setdefault("alice", Account("alice"))
    accounts.setdefault("bob", Account("bob"))
    accounts["alice"].deposit(100.0)
    transfer(accounts, "alice", "bob", 25.0)
    save_accounts("accounts.json", accounts)
    for account in accounts.values():
        print(account.owner, account.balance)


if __name__ == "__main__":
    main()
'''
_RENAMED = LISTING.replace("def transfer(", "def move_money(").replace(
    "    transfer(accounts", "    move_money(accounts")
# The listing, the listing with one change, and the start of a third copy: the continuation
# reproduces ~400 tokens of input (a 270M base model copies reliably only in this framing)
GROUNDED = ("# accounts.py\n" + LISTING + "\n\n# accounts.py, again, with transfer() renamed to "
            "move_money()\n" + _RENAMED + "\n\n# accounts.py, once more\n" + _RENAMED[:120])
FREE = "Once upon a time, in a small village at the edge of a great forest, there lived"


def ours(engine, ids: list[int], n: int) -> float:
    from edgeinfer.runners.sampling_params import SamplingParams
    out = engine.generate(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return (out.num_output_tokens - 1) / (out.finish_time - out.first_token_time)


def llama(llm, ids: list[int], n: int) -> float:
    import numpy as np
    llm.reset()
    llm.eval(ids)
    tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    t = time.perf_counter()
    for _ in range(n - 1):
        llm.eval([tok])
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    return (n - 1) / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--grounded-tokens", type=int, default=300)
    ap.add_argument("--free-tokens", type=int, default=128)
    a = ap.parse_args()
    setup_env(a.threads)
    import llama_cpp

    from edgeinfer.engine.core import Engine, EngineConfig
    path = model_path(a.model)
    cfg = dict(kv_budget_bytes=256 << 20, max_model_len=2048, threads=a.threads)
    spec = Engine(path, EngineConfig(speculative=True, **cfg))
    plain = Engine(path, EngineConfig(speculative=False, **cfg))
    llm = llama_cpp.Llama(model_path=path, n_ctx=2048, n_batch=2048, n_threads=a.threads,
                          n_threads_batch=a.threads, verbose=False)
    tasks = {"grounded": (spec.encode_raw(GROUNDED), a.grounded_tokens),
             "free text": (spec.encode_raw(FREE), a.free_tokens)}
    ours(spec, tasks["free text"][0], 4)
    ours(plain, tasks["free text"][0], 4)
    res: dict[tuple[str, str], list[float]] = {}
    for r in range(a.rounds):
        for name, (ids, n) in tasks.items():
            for who, fn in (("ours+spec", lambda: ours(spec, ids, n)),
                            ("ours", lambda: ours(plain, ids, n)),
                            ("llama.cpp", lambda: llama(llm, ids, n))):
                res.setdefault((name, who), []).append(fn())
        print(f"round {r + 1}: " + ", ".join(f"{k[0]}/{k[1]} {v[-1]:.1f}" for k, v in res.items()),
              flush=True)
    print(f"\ndecode tok/s, medians of {a.rounds} rounds (range), {a.threads} threads")
    print("| task | ours + speculation | ours plain | llama.cpp | spec / plain | spec / llama.cpp |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in tasks:
        m = {w: statistics.median(res[(name, w)]) for w in ("ours+spec", "ours", "llama.cpp")}
        rng = {w: f"{min(res[(name, w)]):.0f}-{max(res[(name, w)]):.0f}" for w in m}
        print(f"| {name} | {m['ours+spec']:.1f} ({rng['ours+spec']}) | {m['ours']:.1f} "
              f"({rng['ours']}) | {m['llama.cpp']:.1f} ({rng['llama.cpp']}) | "
              f"{m['ours+spec'] / m['ours']:.2f} | {m['ours+spec'] / m['llama.cpp']:.2f} |")
    spec.close()
    plain.close()


if __name__ == "__main__":
    main()
