"""Rich tables for `regen status`: the same dict `--json` prints, laid out for a terminal."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text


def _n(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.1f}"
    return f"{value:,}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    d, rest = divmod(seconds, 86400)
    h, rest = divmod(rest, 3600)
    m, s = divmod(rest, 60)
    return (f"{d}d " if d else "") + f"{h:02d}:{m:02d}:{s:02d}"


def render(status: dict):
    return _render_run(status) if "runs" not in status else _render_runs(status)


def _broker_line(broker: dict) -> Text:
    line = f"broker {broker['url']}"
    if broker.get("unacked") is not None:
        line += f", unacked {broker['unacked']:,}"
    if broker.get("dead_messages"):
        line += f", rejected messages {broker['dead_messages']:,} (Redis list regen.dead-messages)"
    if broker.get("error"):
        line += f" (unreachable: {broker['error']})"
    return Text(line, style="red" if broker.get("error") else "dim")


def _render_runs(status: dict):
    table = Table(title=f"runs under {status['storage']}")
    for col in ("run", "shards", "done", "queued", "running", "failed", "dead", "samples", "gen tokens",
                "stub rate", "paused"):
        if col == "paused":  # a long reason is cut, not wrapped over many lines
            table.add_column(col, no_wrap=True, overflow="ellipsis", max_width=20)
        else:
            table.add_column(col, justify="left" if col == "run" else "right", no_wrap=col == "run")
    for r in status["runs"]:
        table.add_row(r["run"], _n(r["shards_total"]), _n(r["done"]), _n(r["queued"]), _n(r["running"]),
                      _n(r["failed"]), _n(r["dead"]), _n(r["samples_done"]), _n(r["generated_tokens"]),
                      "-" if r["stub_rate"] is None else f"{r['stub_rate']:.1%}", r["paused"] or "")
    return Group(table, _broker_line(status["broker"]))


def _render_run(s: dict):
    sh, rates = s["shards"], s["rates"]
    head = Table(title=f"run {s['run']} ({s['storage']})", show_header=False)
    head.add_column("what")
    head.add_column("value", justify="right")
    head.add_row("shards done / total", f"{_n(sh['done'])} / {_n(sh['total'])}")
    for key in ("queued", "running", "failed", "stale", "dead", "waiting"):
        head.add_row(f"  {key}", _n(sh.get(key)))
    head.add_row("samples done (ok)", f"{_n(s['samples']['done'])} ({_n(s['samples']['ok'])})")
    head.add_row("stub rate", "-" if s["stub_rate"] is None else f"{s['stub_rate']:.1%}")
    head.add_row("generated tokens", _n(s["tokens"]["generated"]))
    head.add_row("tokens/s engine / wall", f"{_n(rates['engine_tokens_per_s'])} / {_n(rates['wall_tokens_per_s'])}")
    head.add_row("ETA", _duration(s["eta_seconds"]))
    if "capture" in s:
        c = s["capture"]
        head.add_row("capture done / queued / failed / dead",
                     f"{_n(c['done'])} / {_n(c.get('queued'))} / {_n(c['failed'])} / {_n(c['dead'])}")
    parts = [head]
    if s["paused"]:
        parts.append(Text(f"PAUSED: {s['paused'].get('reason')}", style="bold red"))
    workers = Table(title="workers")
    for col in ("worker", "online", "state", "shard now", "since", "last heartbeat", "last seen", "done", "tok/s",
                "busy"):
        workers.add_column(col)
    for w in s["workers"]:
        online = {True: "yes", False: "no", None: "?"}[w.get("online")]
        age = w.get("heartbeat_age_s")
        workers.add_row(w["name"], online, Text(w.get("state") or "", style="red" if w.get("state") == "dead" else ""),
                        w["current_shard"] or "", w["current_since"] or "",
                        "" if age is None else f"{_duration(age)} ago", w["last_seen"] or "",
                        _n(w["shards_done"]), _n(w["tokens_per_s"]),
                        "-" if w["busy_fraction"] is None else f"{w['busy_fraction']:.0%}")
    parts.append(workers)
    for h in s.get("held_by_dead", [])[:10]:
        parts.append(Text(f"held by a dead worker: {h['shard']} ({h['worker']} on host {h['host']}, last heartbeat "
                          f"{_duration(h['heartbeat_age_s'])} ago); the fleet re-sends it", style="yellow"))
    for f in s["failed"][:10]:
        parts.append(Text(f"failed {f['shard']} ({f['errors']} errors): {f['last_error']}", style="yellow"))
    for d in s["dead"][:10]:
        parts.append(Text(f"dead {d['shard']}: {d['reason']}", style="red"))
    if s.get("retry_dead"):
        parts.append(Text(f"after a fix, re-send dead-lettered shards: {s['retry_dead']} --storage {s['storage']}",
                          style="red"))
    lost = s.get("lost_from_broker")
    if lost:
        parts.append(Text(f"{lost['shards']} shards are neither queued nor running (lost from the broker): "
                          f"{lost['reconcile']} --storage {s['storage']} re-sends them", style="red"))
    if s.get("pilot"):
        parts.append(_pilot_line(s["pilot"]))
    parts.append(_broker_line(s["broker"]))
    return Group(*parts)


def _pilot_line(p: dict) -> Text:
    """The run's real rate beside the forecast of the pilots linked to it (`regen produce --pilot`)."""
    names = ", ".join(str(n) for n in p["pilots"])
    if p.get("error"):
        return Text(f"pilot {names}: no forecast ({p['error']})", style="yellow")
    real = "-" if p["real_samples_per_s"] is None else f"{p['real_samples_per_s']:,.3f}"
    ratio = "" if p["real_to_forecast"] is None else f" ({p['real_to_forecast']:.0%} of the forecast)"
    return Text(f"samples/s: {real} real, {p['forecast_samples_per_s']:,.3f} forecast by pilot {names} "
                f"({p['run_setting']}; forecast wall time {_duration(p['forecast_wall_s'])}){ratio}")
