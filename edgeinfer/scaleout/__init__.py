"""Scale-out on Ray Serve: engine replicas behind the same OpenAI and Ollama API.

    edgeinfer serve --ray [--ray-address ADDRESS] --replicas N [--max-replicas M]

Layout (each module small, Ray imported only where it is needed):

- `keys`:     block hashes of a request's prompt tokens (the prefix cache's full blocks,
              chained), and the ingress-side prompt encoder that produces them.
- `affinity`: the routing policy as plain Python (prefix affinity, power-of-two fallback);
              the Ray router and benchmarks/routing_sim.py both drive it.
- `router`:   `PrefixAffinityRouter`, Ray Serve's RequestRouter extension point around it.
- `replica`:  `EngineReplica`, the deployment: each replica runs edgeinfer.server's own
              FastAPI app in process (one ModelManager: one engine per model, its KV and
              prefix cache) and streams its ASGI response back.
- `ingress`:  `Ingress`, the HTTP entry: forwards each request to a replica with its routing
              key, turns a replica that dies mid-stream into an error in the API's shape,
              and aggregates /api/ps and /metrics over the replicas.
- `launch`:   start or join Ray, deploy, serve on --host/--port until interrupted.

Only `keys` and `affinity` import without Ray installed (the `edgeinfer[ray]` extra).
"""
