"""How a worker process runs, apart from what it does to a shard (workers/shard/).

What `regen worker` starts and supervises, the devices and task slots, the context a process holds, the
in-flight ledger, the transport guard, the frozen heap and the watchdogs.
Each module, file by file: docs/workers.md#the-worker-process-package-file-by-file.
"""
