"""The worker deployable: prefill / decode / both gRPC servers around one engine.

    main.py            `baton worker` flags -> WorkerConfig + EngineConfig; register_worker_command
    server.py          WorkerServer: wiring, health, /metrics, heartbeats, SIGTERM drain
    servicer.py        the Worker gRPC edge (messages <-> services, typed errors -> status codes)
    decode_service.py  Generate flows: conditional disaggregation, remote attempts, fallback, aborts
    decode_jobs.py     what Generate takes and yields (job, choices, events) and event coalescing
    remote_prefill.py  one remote prefill attempt on the decode side (Prefill RPC + NIXL arrival)
    prefill_peers.py   the decode worker's prefill workers: channels, one handshake per pair, health
    prefill_service.py Prefill jobs: batched prefill with held blocks, NIXL WRITE, release
    kv_link.py         the thread that owns NIXL (agent, sender, receiver) and polls it
    heartbeat.py       registration + heartbeats (status, step samples, KV events) to the scheduler
    metrics.py         Prometheus metrics (baton_ prefix)
    faults.py          fault injection (InjectFault RPC, --allow-fault-injection)
    config.py          WorkerConfig, DisaggPolicy, TransferConfig
"""
