"""Prefix-affinity routing as plain Python: which replica should take a request.

The policy keeps, per replica, the block hashes (edgeinfer.scaleout.keys) of the prompts
it was sent, in LRU order and bounded like the replica's own KV pool: a replica that took
a prompt holds its full blocks in its prefix cache until newer ones push them out. A
request goes to the replica holding the longest run of its leading blocks, unless that
replica's queue is longer than the shortest one by more than `imbalance`; then (and when
nothing matches) it is power-of-two choices: the less loaded of two random replicas.

No Ray here: edgeinfer.scaleout.router adapts it to Ray Serve's RequestRouter and
benchmarks/routing_sim.py runs it against round-robin and power-of-two.
"""
from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Sequence

Replica = Hashable


@dataclass
class RoutingCounts:
    affinity: int = 0        # went to the replica holding its prefix
    overloaded: int = 0      # had a holder, but it was overloaded: power of two
    no_match: int = 0        # nothing cached anywhere: power of two
    unkeyed: int = 0         # no prompt to route on: power of two

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class AffinityPolicy:
    imbalance: int = 0                     # queue-length gap that counts as overloaded
    min_match: float = 0.1                 # matched share of the request's blocks to count
    capacity_blocks: int = 65536           # per replica: about its KV pool's block count
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        self._held: dict[Replica, OrderedDict[int, None]] = {}
        self._holders: dict[int, set[Replica]] = {}
        self.counts = RoutingCounts()

    # ----- state -------------------------------------------------------------------------
    def record(self, keys: Sequence[int], replica: Replica) -> None:
        """`replica` computed (and caches) these blocks."""
        held = self._held.setdefault(replica, OrderedDict())
        for k in keys:
            if k in held:
                held.move_to_end(k)
            else:
                held[k] = None
                self._holders.setdefault(k, set()).add(replica)
        while len(held) > self.capacity_blocks:
            k, _ = held.popitem(last=False)
            self._drop(k, replica)

    def remove(self, replica: Replica) -> None:
        """A replica is gone (died, scaled down): its cache went with it."""
        for k in self._held.pop(replica, ()):
            self._drop(k, replica)

    def _drop(self, key: int, replica: Replica) -> None:
        s = self._holders.get(key)
        if s is not None:
            s.discard(replica)
            if not s:
                del self._holders[key]

    def held_blocks(self, replica: Replica) -> int:
        return len(self._held.get(replica, ()))

    # ----- decisions -----------------------------------------------------------------------
    def match(self, keys: Sequence[int], candidates: Iterable[Replica]) -> tuple[int, list[Replica]]:
        """(blocks matched, the candidates holding that many) for the longest cached run of
        leading blocks; (0, []) when none holds even the first."""
        live = set(candidates)
        best: list[Replica] = []
        depth = 0
        for k in keys:
            holders = self._holders.get(k)
            if not holders:
                break
            here = live & holders if best == [] else set(best) & holders
            if not here:
                break
            best, depth = list(here), depth + 1
        return depth, best

    def choose(self, keys: Sequence[int], candidates: Sequence[Replica],
               load: dict[Replica, int]) -> list[Replica]:
        """Replicas in order of preference (first is the choice; the second, when given, is
        what power of two compared it with)."""
        if not candidates:
            return []
        lowest = min(load.get(r, 0) for r in candidates)
        if keys:
            depth, holders = self.match(keys, candidates)
            if holders and depth < self.min_match * len(keys):
                holders = []            # a shared template preamble is no reason to pile up
            if holders:
                best = min(holders, key=lambda r: (load.get(r, 0), self.rng.random()))
                if load.get(best, 0) - lowest <= self.imbalance:
                    self.counts.affinity += 1
                    return [best]
                self.counts.overloaded += 1
            else:
                self.counts.no_match += 1
        else:
            self.counts.unkeyed += 1
        return power_of_two(candidates, load, self.rng)


def power_of_two(candidates: Sequence[Replica], load: dict[Replica, int],
                 rng: random.Random) -> list[Replica]:
    if len(candidates) == 1:
        return [candidates[0]]
    a, b = rng.sample(list(candidates), 2)
    return [a, b] if (load.get(a, 0), rng.random()) <= (load.get(b, 0), 0.5) else [b, a]
