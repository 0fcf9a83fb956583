"""PrefixAffinityRouter: Ray Serve's RequestRouter extension point around AffinityPolicy.

Ray Serve runs one router per deployment handle, inside the process that holds the handle
(here: the Ingress replica). For each request it asks `choose_replicas` for ranked
candidates, probes their queue lengths, and sends the request to the least loaded one of
the first rank that accepts. We rank the replica that holds the request's leading prompt
blocks alone first (affinity); when it is overloaded, or nothing matches, we return two
random replicas (power of two choices). `on_request_routed` records which replica took
which blocks; a replica that dies or leaves takes its entries with it.

Modelled on ray.llm's PrefixCacheAffinityRouter, with two differences: the keys are the
chained hashes of full token blocks (edgeinfer.scaleout.keys, what our prefix cache shares)
rather than characters, and the table lives in the router itself rather than in a shared
actor (one ingress; several ingresses would each learn their own, which still converges).
"""
from __future__ import annotations

import logging
from typing import Any, List, Optional

from ray.serve.request_router import (LocalityMixin, MultiplexMixin, PendingRequest,
                                      ReplicaID, RequestRouter, RunningReplica)

from .affinity import AffinityPolicy, power_of_two

log = logging.getLogger("edgeinfer.scaleout")


def keys_of(pending: Optional[PendingRequest]) -> list[int]:
    """The routing keys the Ingress put on the forwarded request (args[0]["keys"])."""
    if pending is None or not pending.args:
        return []
    first = pending.args[0]
    keys = first.get("keys") if isinstance(first, dict) else None
    return keys if isinstance(keys, list) else []


class PrefixAffinityRouter(LocalityMixin, MultiplexMixin, RequestRouter):

    def initialize_state(self, imbalance: int = 0, capacity_blocks: int = 65536,
                         min_match: float = 0.1, mode: str = "affinity", **_: Any) -> None:
        """`mode`: "affinity" (default) or "pow2" (plain power of two, for comparison);
        the rest: AffinityPolicy's fields."""
        self.policy = AffinityPolicy(imbalance=imbalance, capacity_blocks=capacity_blocks,
                                     min_match=min_match)
        self.mode = mode

    async def _loads(self, replicas: List[RunningReplica]) -> dict:
        load, unknown = {}, []
        for r in replicas:
            q = self._replica_queue_len_cache.get(r.replica_id) \
                if self._use_replica_queue_len_cache else None
            if q is None:
                unknown.append(r)
            else:
                load[r.replica_id] = q
        if unknown:
            for r, q in await self._probe_queue_lens(unknown, 0):
                if q is not None:
                    load[r.replica_id] = q
        return load

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None
                              ) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        ids = [r.replica_id for r in candidate_replicas]
        by_id = {r.replica_id: r for r in candidate_replicas}
        keys = keys_of(pending_request)
        load = await self._loads(candidate_replicas)
        # a replica that did not answer the probe in time is full or unwell: never affine
        full = {r.replica_id for r in candidate_replicas
                if load.get(r.replica_id, r.max_ongoing_requests) >= r.max_ongoing_requests}
        usable = [i for i in ids if i not in full] or ids
        if self.mode == "affinity":
            order = self.policy.choose(keys, usable, load)
        else:
            order = power_of_two(usable, load, self.policy.rng)
        return [[by_id[i] for i in order]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        keys = keys_of(pending_request)
        if keys:
            self.policy.record(keys, replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.remove(replica_id)

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        before = set(self._replica_id_set)
        super().update_replicas(replicas)
        for gone in before - set(self._replica_id_set):
            self.policy.remove(gone)
