"""The router: registry (registration, heartbeats, health), placement policies with a
prefix index, the `Generation` backend with failover, metrics, and the server/CLI glue.
The gRPC servicer, the OpenAI HTTP front and the server start-up are cluster/api's.

    config.py        RouterConfig: every setting of `orchard router serve`, its default and help
    registry.py      workers, their load reports and states; candidates by model, task and features
    policy.py        round_robin, least_loaded, prefix_aware (+ imbalance guard), kv_aware (the default)
    prefix_index.py  chained prefix keys of prompts -> workers, LRU bounded
    prompt_blocks.py a prompt's KV block hashes as its workers compute them (their tokenizer, bounded)
    kv_map.py        the KV blocks each worker holds, per tier, replayed from its KV events (exact)
    proxy.py         RouterBackend (place, relay, retry, resume): the router's api Backend
    control.py       the `Router` service (RegisterWorker, Heartbeat, AddWorker, ...)
    metrics.py       orchard_router_* on the router's own Prometheus registry
    server.py        `orchard router serve`
    admin.py         `orchard router register|workers|drain|remove`
"""
