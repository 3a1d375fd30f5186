"""Commands for operating the fleet: `regen status` and `regen metrics`.

Both run on any host that reaches the broker and the storage; neither needs a GPU, vLLM or a worker. What is
done comes from storage markers (app/ops/status.py); the broker adds queue lengths and what live workers run now
(app/ops/fleet.py). Broker passwords are masked in every line printed.
"""

from __future__ import annotations

import sys
import time

import click

from app.cli.options import BROKER_HELP, STORAGE_HELP, broker_option, storage_option
from app.settings import DEFAULT_VISIBILITY_TIMEOUT, current, mask_url


def collect(storage_root: str, run_id: str | None, broker_url: str, inspect_timeout: float,
            stale_after: float, scanners: dict | None = None) -> dict:
    """One run's full status (RUN given) or the one-line-per-run overview; a JSON-ready dict."""
    from app import dead_messages
    from app.clock import shared_now
    from app.manifest import load
    from app.ops import fleet
    from app.ops.status import RunScanner, list_runs, summarise
    from app.storage import RunStore, Storage

    scanners = {} if scanners is None else scanners
    storage = Storage(storage_root)
    runs = [run_id] if run_id else list_runs(storage)
    now = shared_now(broker_url)  # the clock leases are written on (app/clock.py)
    statuses = []
    for rid in runs:
        if rid not in scanners:
            store = RunStore(storage, rid)
            load(store)  # a clear error for a run that does not exist
            scanners[rid] = RunScanner(store)
        statuses.append(summarise(scanners[rid].scan(), now, stale_after))
    queues = sorted({q for s in statuses for q in (s.get("queue"), s.get("capture", {}).get("queue")) if q})
    lengths, unacked, q_error = fleet.queue_lengths(broker_url, queues)
    live, w_error = (None, None)
    if run_id and inspect_timeout > 0 and not q_error:
        live, w_error = fleet.live_workers(broker_url, inspect_timeout)
    errors = [e for e in (q_error, w_error) if e]
    rejected = None if q_error else dead_messages.count(broker_url)  # messages no worker could use
    for s in statuses:
        fleet.overlay(s, broker_url, lengths, unacked, live if not w_error else None, errors, now)
        s["broker"]["dead_messages"] = rejected
    if run_id:
        from app.pilot import run_comparison, run_pilots

        pilots = run_pilots(RunStore(storage, run_id))  # linked by `regen produce --pilot`
        if pilots:
            statuses[0]["pilot"] = run_comparison(pilots, statuses[0])
        return {"storage": mask_url(storage.url), **statuses[0]}
    return {"storage": mask_url(storage.url), "broker": {"url": mask_url(broker_url), "queued": lengths,
                                                          "unacked": unacked, "dead_messages": rejected,
                                                          "error": "; ".join(errors) or None},
            "runs": [_run_line(s) for s in statuses]}


def _run_line(s: dict) -> dict:
    sh = s["shards"]
    return {"run": s["run"], "shards_total": sh["total"], "done": sh["done"], "queued": sh["queued"],
            "running": sh["running"], "failed": sh["failed"], "dead": sh["dead"], "samples_done": s["samples"]["done"],
            "generated_tokens": s["tokens"]["generated"], "stub_rate": s["stub_rate"],
            "paused": (s["paused"] or {}).get("reason") if s["paused"] else None}


@click.command("status")
@click.argument("run_id", required=False)
@storage_option(required=True, help=STORAGE_HELP)
@broker_option(help=BROKER_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print one complete JSON object instead of tables.")
@click.option("--watch", is_flag=True, help="Refresh every --interval seconds until Ctrl-C.")
@click.option("--interval", type=click.FloatRange(min=0.5), default=5.0, show_default=True)
@click.option("--inspect-timeout", type=click.FloatRange(min=0), default=1.0, show_default=True,
              help="Seconds to wait for workers to answer (0: do not ask; storage still shows their last shard).")
@click.option("--stale-after", type=click.FloatRange(min=1), default=DEFAULT_VISIBILITY_TIMEOUT, show_default=True,
              help="An attempt older than this without marker or error counts as stale, not running.")
def status(run_id, storage, broker, as_json, watch, interval, inspect_timeout, stale_after):
    """Progress of RUN (or one line per run under the storage root): shards, tokens/s, ETA, workers."""
    import orjson
    from rich.console import Console

    from app.ops.status_view import render

    url = current().broker_for(broker).url
    scanners: dict = {}

    def snapshot() -> dict:
        return collect(storage, run_id, url, inspect_timeout, stale_after, scanners)

    if as_json and not watch:
        sys.stdout.buffer.write(orjson.dumps(snapshot(), option=orjson.OPT_INDENT_2) + b"\n")
        return
    console = Console()
    if not watch:
        console.print(render(snapshot()))
        return
    from rich.live import Live

    with Live(render(snapshot()), console=console, auto_refresh=False) as live:
        try:
            while True:
                time.sleep(interval)
                live.update(render(snapshot()), refresh=True)
        except KeyboardInterrupt:
            pass


@click.command("metrics")
@click.option("--port", type=click.IntRange(0, 65535), default=9808, show_default=True)
@click.option("--addr", default="0.0.0.0", show_default=True, help="Address to listen on.")
@storage_option(required=True, help=STORAGE_HELP)
@broker_option(help=BROKER_HELP)
@click.option("--run", "runs", multiple=True, help="Runs to export (repeatable) [default: every run under the root].")
@click.option("--queue", "queues", multiple=True, help="Extra queues whose length to export (repeatable).")
def metrics(port, addr, storage, broker, runs, queues):
    """Serve Prometheus metrics computed on each scrape: queue lengths, shards, tokens/s, stub rate, busy time."""
    from app.ops.metrics import serve

    url = current().broker_for(broker).url
    server, _thread = serve(addr, port, storage, url, list(runs), list(queues))
    click.echo(f"regen metrics: http://{addr}:{server.server_port}/metrics (broker {mask_url(url)})", err=True)
    try:
        _thread.join()
    except KeyboardInterrupt:
        server.shutdown()


commands = [status, metrics]
