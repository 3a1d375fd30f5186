"""How a worker process runs, apart from what it does to a shard (workers/shard/).

plan.py               what `regen worker` starts: one WorkerConfig per GPU group (or the CPU), from flags and a run
supervisor.py         starts the worker children (`python -m workers.worker_main`, their environment from
                      app.process_env), restarts one that dies
devices.py            device classes, their engine presets, GPU pinning, task slots and encoder threads
context.py            `WorkerConfig` and `WorkerContext`: the config, model, engine and encoder pool a process holds
inflight.py           the in-flight ledger: the shards this process runs now, their attempts' leases, temporaries
message_guard.py      the transport guard: a message that cannot be decoded is set aside instead of fatal
heap.py               the start-up heap frozen out of garbage collection
engine_watch.py       the watchdog that stops a worker whose engine died while idle
dead_holder_watch.py  the re-send of shards that dead processes held, one check a period for the fleet
"""
