"""`edgeinfer serve --ray`: start or join Ray, deploy Ingress + EngineReplica, serve on
--host/--port until SIGINT/SIGTERM."""
from __future__ import annotations

import logging
import os
import signal
import threading

from edgeinfer.server.daemon import prepare_serve
from edgeinfer.store.model_store import Store

log = logging.getLogger("edgeinfer.scaleout")

APP_NAME = "edgeinfer"


class ScaleOutError(Exception):
    pass


def build_app(config, api_key: str | None, replicas: int, max_replicas: int | None,
              routing: str = "affinity", imbalance: int = 0,
              replica_home: str | None = None):
    """The Serve application: Ingress in front of the EngineReplica deployment."""
    # lazy: Ray is optional (the ray extra); these modules import it
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from .ingress import Ingress
    from .replica import EngineReplica
    from .router import PrefixAffinityRouter

    per_replica = config.max_running_seqs + config.max_queue
    scaling: dict = {"num_replicas": replicas}
    if max_replicas and max_replicas > replicas:
        # queue depth: a replica that has more requests than its engine batches at once
        # (max_running_seqs) is queueing; scale up until none is, down when they idle
        scaling = {"autoscaling_config": {
            "min_replicas": replicas, "initial_replicas": replicas,
            "max_replicas": max_replicas,
            "target_ongoing_requests": max(1, config.max_running_seqs),
            "upscale_delay_s": 10, "downscale_delay_s": 120}}
    # KV pool size in blocks bounds what the router believes a replica still caches
    capacity = max(1, config.kv_budget_bytes // (64 * 1024))
    engine = serve.deployment(
        EngineReplica, name="engine",
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=per_replica,
        health_check_period_s=2, health_check_timeout_s=30,
        graceful_shutdown_timeout_s=5,
        request_router_config=RequestRouterConfig(
            request_router_class=PrefixAffinityRouter,
            request_router_kwargs={"mode": routing, "imbalance": imbalance,
                                   "capacity_blocks": capacity}),
        **scaling)
    ingress = serve.deployment(Ingress, name="ingress", ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=10_000)
    return ingress.bind(engine.bind(config, api_key, home=replica_home), config, api_key)


def serve_ray(host: str | None = None, port: int | None = None, api_key: str | None = None,
              backend: str | None = None, device: str | None = None, log_level: str = "info",
              replicas: int = 1, max_replicas: int | None = None,
              ray_address: str | None = None, routing: str = "affinity",
              kv_cache_type: str | None = None,
              replica_home: str | None = None) -> int:
    try:   # lazy: Ray is optional (the ray extra)
        import ray
        from ray import serve
    except ImportError:
        raise ScaleOutError("--ray needs Ray Serve: pip install 'edgeinfer[ray]' "
                            "(or ./install.sh --dev)") from None
    from . import registry  # lazy: imports ray

    if replicas < 1 or (max_replicas is not None and max_replicas < replicas):
        raise ScaleOutError("--replicas must be at least 1 and --max-replicas at least "
                            "--replicas")
    host, port, api_key, config = prepare_serve(host, port, api_key, backend, device,
                                                log_level, kv_cache_type)  # DaemonError

    if ray_address:
        ray.init(address=ray_address, logging_level=logging.WARNING,
                 log_to_driver=log_level == "debug")
        log.info("joined the Ray cluster at %s", ray_address)
    else:
        # a private local instance ("local": never attach to a cluster `ray start` left
        # running on this machine), node address 127.0.0.1, no dashboard
        ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
                 num_cpus=os.cpu_count() or 1, logging_level=logging.WARNING,
                 log_to_driver=log_level == "debug")
        log.info("started a local Ray instance on 127.0.0.1")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        registry.get_or_create()
        from . import blobs  # lazy: imports ray
        blobs.start_on_this_node(str(Store(config.home).home))   # this node's store
        serve.start(http_options={"host": host, "port": port},
                    proxy_location="HeadOnly")
        serve.run(build_app(config, api_key, replicas, max_replicas, routing,
                            replica_home=replica_home),
                  name=APP_NAME, route_prefix="/", blocking=False)
        log.info("edgeinfer on Ray Serve listening on http://%s:%d (%s replicas, routing %s, "
                 "api key %s)", host, port,
                 f"{replicas}-{max_replicas}" if max_replicas else replicas, routing,
                 "required" if api_key else "off")
        while not stop.wait(0.5):
            pass
    finally:
        log.info("shutting down")
        try:
            serve.delete(APP_NAME)
            if not ray_address:
                serve.shutdown()
            else:
                ray.kill(registry.lookup())
                ray.kill(blobs.lookup())
        except Exception as e:
            log.warning("shutdown: %s", e)
        ray.shutdown()
    return 0
