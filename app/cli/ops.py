"""Commands for operating the fleet: `regen status` and `regen metrics`.

Both run on any host that reaches the broker and the storage; neither needs a GPU, vLLM or a worker. What is
done comes from storage markers (app.ops.status); the broker adds queue lengths and what live workers run now
(app.ops.fleet). Broker passwords are masked in every line printed.
"""

from __future__ import annotations

import sys
import time

import orjson
import rich_click as click
from rich.console import Console
from rich.live import Live

from app.base.config import DEFAULT_VISIBILITY_TIMEOUT, current, mask_url
from app.base.storage import RunStore, Storage
from app.cli.options import broker_option, storage_option
from app.ops.run_report import collect
from app.ops.status_view import render
from app.pilot.forecast import compare_with_pilots


@click.command("status")
@click.argument("run_id", metavar="[RUN]", required=False)
@storage_option(required=True)
@broker_option()
@click.option("--json", "as_json", is_flag=True, help="Print one complete JSON object instead of tables.")
@click.option("--watch", is_flag=True, help="Refresh every --interval seconds until Ctrl-C.")
@click.option("--interval", type=click.FloatRange(min=0.5), default=5.0, show_default=True,
              help="Seconds between --watch refreshes.")
@click.option("--inspect-timeout", type=click.FloatRange(min=0), default=1.0, show_default=True,
              help="Seconds to wait for workers to answer (0: do not ask; storage still shows their last shard).")
@click.option("--stale-after", type=click.FloatRange(min=1), default=DEFAULT_VISIBILITY_TIMEOUT, show_default=True,
              help="An attempt older than this without marker or error counts as stale, not running.")
def status(run_id, storage, broker, as_json, watch, interval, inspect_timeout, stale_after):
    """Progress of RUN (or one line per run under the storage root): shards, tokens/s, ETA, workers."""
    url = current().broker_for(broker).url
    scanners: dict = {}
    store = RunStore(Storage(storage), run_id) if run_id else None  # its pilots: linked by `regen produce --pilot`

    def snapshot() -> dict:
        report = collect(storage, run_id, url, inspect_timeout, stale_after, scanners)
        return compare_with_pilots(report, store) if store is not None else report

    if as_json and not watch:
        sys.stdout.buffer.write(orjson.dumps(snapshot(), option=orjson.OPT_INDENT_2) + b"\n")
        return
    console = Console()
    if not watch:
        console.print(render(snapshot()))
        return

    with Live(render(snapshot()), console=console, auto_refresh=False) as live:
        try:
            while True:
                time.sleep(interval)
                live.update(render(snapshot()), refresh=True)
        except KeyboardInterrupt:
            pass


@click.command("metrics")
@click.option("--port", type=click.IntRange(0, 65535), default=9808, show_default=True,
              help="Port to serve /metrics on (0: any free one).")
@click.option("--addr", default="0.0.0.0", show_default=True, help="Address to listen on.")
@storage_option(required=True)
@broker_option()
@click.option("--run", "runs", multiple=True, metavar="RUN",
              help="Runs to export (repeatable) [default: every run under the root].")
@click.option("--queue", "queues", multiple=True, metavar="NAME",
              help="Extra queues whose length to export (repeatable) [default: only the queues of the runs exported].")
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
