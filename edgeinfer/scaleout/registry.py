"""Where each replica publishes what /api/ps and /metrics show about it.

A small named Ray actor: every replica reports its figures once a second; the Ingress reads
them all. A report older than `ttl` seconds (a dead replica, a node that left) is dropped.
"""
from __future__ import annotations

import time
from typing import Any

import ray

NAME = "edgeinfer-replicas"
NAMESPACE = "edgeinfer"


@ray.remote(num_cpus=0, max_restarts=-1)
class ReplicaRegistry:
    def __init__(self, ttl: float = 3.0):
        self.ttl = ttl
        self.reports: dict[str, dict[str, Any]] = {}

    def report(self, replica: str, info: dict[str, Any]) -> None:
        self.reports[replica] = {**info, "reported_at": time.time()}

    def forget(self, replica: str) -> None:
        self.reports.pop(replica, None)

    def all(self) -> list[dict[str, Any]]:
        now = time.time()
        for k in [k for k, v in self.reports.items() if now - v["reported_at"] > self.ttl]:
            del self.reports[k]
        return sorted(self.reports.values(), key=lambda r: r.get("replica", ""))


def get_or_create(ttl: float = 3.0):
    return ReplicaRegistry.options(name=NAME, namespace=NAMESPACE, get_if_exists=True,
                                   lifetime="detached").remote(ttl)


def lookup():
    return ray.get_actor(NAME, namespace=NAMESPACE)
