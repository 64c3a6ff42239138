"""The router: registry (registration, heartbeats, health), placement policies with a
prefix index, the `Generation` proxy with failover, metrics, and the server/CLI glue.

    config.py        RouterConfig: every setting of `orchard router serve`, its default and help
    registry.py      workers, their load reports and states
    policy.py        round_robin, least_loaded, prefix_aware (+ imbalance guard)
    prefix_index.py  chained prefix keys of prompts -> workers, LRU bounded
    proxy.py         RouterBackend (place, relay, retry, resume) and its gRPC servicer
    control.py       the `Router` service (RegisterWorker, Heartbeat, AddWorker, ...)
    metrics.py       orchard_router_* on the router's own Prometheus registry
    server.py        `orchard router serve`
    admin.py         `orchard router register|workers|drain|remove`
    loadgen.py       a closed-loop gRPC load generator for the router benchmarks (load/)
    testing.py       FakeWorker: a model-free worker for the router's tests
"""
