"""regen's shared base and its three upper floors.

- `app/` itself (the base): configuration, the Celery app, storage and the run ledger, the run manifest, record
  schema, codecs and quality rules: what the producer, the workers and the read side must agree on, so that a
  record written by a worker on one host is read the same way by `regen verify` on another. Base modules import
  only each other.
- `app/data/`: the read side (run reader, verify, stats, exports, dataset, the transformers reference).
- `app/ops/`: operations (status, metrics, fleet views).
- `app/cli/`: the `regen` commands, the only place that assembles producer, workers, read side and operations.

`producer/` and `workers/` sit beside `app/data/` and `app/ops/`: they import the base, never each other.
tests/test_layout.py checks these rules on every import.
"""
