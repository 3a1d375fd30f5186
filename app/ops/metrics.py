"""`regen metrics`: a Prometheus endpoint computed on each scrape from storage markers and Redis.

Why a second endpoint beside Flower's: Flower's `/metrics` has task events but no queue length, and nothing
that knows a run (shards done, tokens, stub rate). This collector follows prometheus_client's custom-collector
pattern: nothing is stored between scrapes except the scanners' caches of immutable markers, so a restart loses
nothing and two exporters agree. Runs are the `--run` ids or, without them, every run under the root, re-listed
on each scrape so a new run appears by itself.
"""

from __future__ import annotations

import threading

from app.base import dead_messages
from app.base.clock import shared_now
from app.base.errors import ConfigError
from app.base.ids import validate_id
from app.base.manifest import load
from app.base.storage import RunStore, Storage
from app.ops.fleet import queue_lengths
from app.ops.status import RunScanner, list_runs, summarise

try:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.registry import Collector
except ImportError:  # fail when the command is built, with the fix (datatrove's lesson)
    CounterMetricFamily = GaugeMetricFamily = None
    Collector = object


class RegenCollector(Collector):
    """Yields the regen_* metric families; `collect` is called by prometheus_client on every scrape."""

    def __init__(self, storage_root: str, broker_url: str, runs: list[str] | None = None,
                 queues: list[str] | None = None):
        if GaugeMetricFamily is None:
            raise ConfigError("regen metrics needs prometheus_client: pip install prometheus_client")
        self.runs = [validate_id(r, "run id") for r in runs or []]
        self.queues = list(queues or [])
        self.broker_url = broker_url
        self.storage = Storage(storage_root)
        self._scanners: dict = {}
        self._lock = threading.Lock()  # the HTTP server may scrape from two threads at once
        self._statuses(shared_now(broker_url))  # a missing run or an unreadable root fails now, not on every scrape

    def _statuses(self, now: float) -> list[dict]:
        out = []
        for run in self.runs or list_runs(self.storage):
            if run not in self._scanners:
                store = RunStore(self.storage, run)
                load(store)
                self._scanners[run] = RunScanner(store)
            out.append(summarise(self._scanners[run].scan(), now))
        return out

    def collect(self):
        with self._lock:
            statuses = self._statuses(shared_now(self.broker_url))
        queues = sorted({*self.queues, *(q for s in statuses for q in (s.get("queue"),
                                                                        s.get("capture", {}).get("queue")) if q)})
        lengths, unacked, error = queue_lengths(self.broker_url, queues)
        up = GaugeMetricFamily("regen_broker_up", "1 if the broker answered this scrape", value=0 if error else 1)
        yield up
        q = GaugeMetricFamily("regen_queue_length", "Messages waiting in the queue (Redis LLEN)", labels=["queue"])
        for name, n in sorted(lengths.items()):
            q.add_metric([name], n)
        yield q
        if unacked is not None:
            yield GaugeMetricFamily("regen_broker_unacked", "Messages fetched by workers but not yet acked",
                                    value=unacked)
        if not error:
            rejected = dead_messages.count(self.broker_url)
            if rejected is not None:
                yield CounterMetricFamily("regen_dead_messages", "Messages workers could not decode or run "
                                          "(Redis list regen.dead-messages)", value=rejected)
        yield from self._run_families(statuses)

    def _run_families(self, statuses: list[dict]):
        shards = GaugeMetricFamily("regen_shards", "Shards of a run by state (storage markers)", labels=["run", "state"])
        samples = CounterMetricFamily("regen_samples", "Samples in completed shards", labels=["run"])
        tokens = CounterMetricFamily("regen_generated_tokens", "Generated tokens in completed shards", labels=["run"])
        rate = GaugeMetricFamily("regen_tokens_per_second", "Generated tokens/s: engine (sum of per-worker rates) "
                                 "or wall (first start to last finish)", labels=["run", "kind"])
        stub = GaugeMetricFamily("regen_stub_rate", "Stub responses / ok samples in completed shards", labels=["run"])
        paused = GaugeMetricFamily("regen_run_paused", "1 while PAUSED.json exists", labels=["run"])
        eta = GaugeMetricFamily("regen_eta_seconds", "Estimated seconds until every shard is done", labels=["run"])
        busy = GaugeMetricFamily("regen_worker_busy_fraction", "Generation seconds / wall seconds since the "
                                 "worker's first attempt", labels=["run", "worker"])
        wrate = GaugeMetricFamily("regen_worker_tokens_per_second", "A worker's generated tokens / generation "
                                  "seconds", labels=["run", "worker"])
        wtok = CounterMetricFamily("regen_worker_generated_tokens", "Generated tokens per worker", labels=["run", "worker"])
        for s in statuses:
            run = s["run"]
            for state in ("total", "done", "running", "failed", "stale", "dead", "remaining"):
                if s["shards"].get(state) is not None:
                    shards.add_metric([run, state], s["shards"][state])
            samples.add_metric([run], s["samples"]["done"])
            tokens.add_metric([run], s["tokens"]["generated"])
            for kind in ("engine", "wall"):
                value = s["rates"][f"{kind}_tokens_per_s"]
                if value is not None:
                    rate.add_metric([run, kind], value)
            if s["stub_rate"] is not None:
                stub.add_metric([run], s["stub_rate"])
            paused.add_metric([run], 1 if s["paused"] else 0)
            if s["eta_seconds"] is not None:
                eta.add_metric([run], s["eta_seconds"])
            for w in s["workers"]:
                if w["busy_fraction"] is not None:
                    busy.add_metric([run, w["name"]], w["busy_fraction"])
                if w["tokens_per_s"] is not None:
                    wrate.add_metric([run, w["name"]], w["tokens_per_s"])
                wtok.add_metric([run, w["name"]], w["generated_tokens"])
        yield from (shards, samples, tokens, rate, stub, paused, eta, busy, wrate, wtok)


def serve(addr: str, port: int, storage_root: str, broker_url: str, runs: list[str], queues: list[str]):
    """Start the HTTP endpoint on its own registry; returns (server, thread). Port 0 picks a free one."""
    collector = RegenCollector(storage_root, broker_url, runs, queues)
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return start_http_server(port, addr=addr, registry=registry)
