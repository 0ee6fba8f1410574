"""The scheduler side of the frontend.

    engine_client.py   the one Session stream to a scheduler, routed per request
    continuation.py    open requests kept so they resume on a new scheduler or replica
    readiness.py       /ready and gRPC health follow the scheduler's health
    drain.py           SIGTERM: /ready 503, new requests 503, open streams end cleanly

  data parallelism (docs/scale_out.md):
    replicas.py        a Session per replica behind one EngineClient; failover
    replica_router.py  the routing rule (kv-aware as SGLang's cache_aware, round-robin)
    kv_index.py        which prompt prefixes a replica holds, keyed by token ids
    kv_subscriber.py   one replica's KV cache events (ZMQ SUB) -> its kv_index
"""
