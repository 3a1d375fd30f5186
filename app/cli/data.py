"""Commands that read a run's data: `regen verify`, `regen stats`, `regen export`.

All three read through app.data.run_reader and need neither a broker nor a GPU; the heavy packages (matplotlib,
pyarrow, datasets, torch for `--reference`) are imported only inside the functions that use them, so
`regen --help` stays fast.
"""

from __future__ import annotations

import sys
from pathlib import Path

import orjson
import rich_click as click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from app.base.errors import ConfigError
from app.base.packages import require
from app.cli.options import StorageRoot, storage_option
from app.data import export_formats
from app.data.engine_modes import modes_table
from app.data.export import Exporter, ExportOptions
from app.data.fanout import Part
from app.data.run_reader import RunReader
from app.data.stats import (
    collect,
    modes_summary,
    plots,
    print_terminal,
    render_html,
    states_summary,
    yield_summary,
)
from app.data.verify import verify_run
from app.data.verify_reference import reference_line, tokens_line

_storage = storage_option(required=True)


def _processes(what: str, extra: str = ""):
    return click.option("--processes", type=click.IntRange(min=1), default=1, show_default=True,
                        help=f"Worker processes on this host; shards are {what} in parallel, the result is the "
                             f"same.{extra}")


def _part_option(what: str):
    return click.option("--part", "part_spec", default=None, metavar="I/N",
                        help=f"Only the I-th of N disjoint parts of the run's shards (every N-th shard, 1-based); "
                             f"run the N parts at once on several hosts [default: every shard]. {what}")


def _part(spec: str | None):
    try:
        return Part.parse(spec)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None


def _console(stderr: bool = False):
    return Console(stderr=stderr, highlight=False)


@click.command("verify")
@click.argument("run_id", metavar="RUN")
@_storage
@click.option("--reference", type=click.IntRange(min=0), default=0, show_default=True,
              help="Recompute N samples' states with transformers and judge them row by row: each token's error "
                   "relative to its row under 2^-3 (measured GPU-vs-CPU bf16 noise), no row shifted, foreign or in another layer's slot.")
@click.option("--device", "reference_device", default="cpu", show_default=True, metavar="cpu|cuda|cuda:N|auto",
              help="Where --reference runs the model (a target too big for the CPU on a GPU; auto: a GPU if any).")
@click.option("--workers", type=click.IntRange(min=1), default=4, show_default=True,
              help="Shards checked in parallel.")
@click.option("--strict", is_flag=True, help="Warnings (e.g. a dead-lettered staged capture) fail the check too.")
@click.option("--allow-incomplete", is_flag=True,
              help="Dead-lettered and unfinished shards are warnings, not failures (a run in progress).")
@click.option("--sample", type=click.FloatRange(min=0, min_open=True), default=None, metavar="N|FRACTION",
              help="Decode the states of only N samples (or this fraction, e.g. 0.01) [default: every sample], spread over workers and "
                   "shards; everything else is still checked for every shard.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@_processes("checked", " Above 1, they replace the --workers threads.")
@_part_option("Each part checks its shards and the run-wide accounting; the run is verified when every part "
              "exits 0.")
def verify_cmd(run_id: str, storage: str, reference: int, reference_device: str, workers: int, strict: bool,
               allow_incomplete: bool, sample: float | None, as_json: bool, processes: int,
               part_spec: str | None) -> None:
    """Check RUN: markers, sizes, sha256, CRCs, token ids, states, masks and the accounting identity.

    Exit status 0 only when every check holds and the run is complete; otherwise the first line says how many
    samples are missing and why, and the problems are listed by shard and sample.
    """
    part = _part(part_spec)
    if reference and not part.whole:
        raise click.UsageError("--reference recomputes a few samples of the whole run: run it without --part")
    if reference:
        require("torch", "regen verify --reference")
    if reference_device != "cpu" and not reference:
        raise click.UsageError("--device places the --reference model: give --reference N with it")
    if not (reference_device in ("cpu", "cuda", "auto") or reference_device.startswith("cuda:")):
        raise click.UsageError(f"--device {reference_device!r}: expected cpu, cuda, cuda:N or auto")
    reader = RunReader(storage, run_id)
    err = _console(stderr=True)
    done = set(reader.done_shards())
    n = sum(1 for s in part.pick(reader.expected_shards()) if s in done)
    options = {"reference": reference, "reference_device": reference_device, "workers": workers, "allow_incomplete": allow_incomplete, "sample": sample,
               "processes": processes, "part": part}
    if as_json:
        report = verify_run(reader, **options)
    else:
        with err.status(f"verifying {n} shards of {run_id}") as status:
            seen = [0]

            def tick(_shard: str) -> None:
                seen[0] += 1
                status.update(f"verified {seen[0]}/{n} shards of {run_id}" + ("" if part.whole else f", part {part}"))

            report = verify_run(reader, progress=tick, **options)
    if as_json:
        click.echo(orjson.dumps(report.to_dict(strict), option=orjson.OPT_INDENT_2).decode())
    else:
        _print_verify(report, strict)
    sys.exit(0 if report.ok(strict) else 1)


def _print_verify(report, strict: bool) -> None:
    out = _console()
    if report.headline():
        out.print(f"[red]verify: {report.headline()}[/red]")
    acc = report.accounting
    summary = Table(title=f"run {report.run_id}", show_header=False)
    for key, value in [*acc.items(), *((f"shards {k}", v) for k, v in report.shards.items())]:
        summary.add_row(key.replace("_", " "), str(value))
    if report.reference:
        summary.add_row("reference", reference_line(report.reference))
        summary.add_row("reference tokens", tokens_line(report.reference))
    if report.sampled:
        s = report.sampled
        summary.add_row("states decoded", f"{s['states_decoded']:,} of {s['of_samples']:,} samples, in "
                                          f"{s['shards_read']} of {s['of_shards']} shards")
        summary.add_row("  by worker", ", ".join(f"{w} {n}" for w, n in s["by_worker"].items()) or "-")
        summary.add_row("  checked for every shard", s["checked_everywhere"])
        summary.add_row("  not read", s["not_read"])
    out.print(summary)
    if report.modes and report.modes.modes:
        out.print(modes_table(report.modes, "per engine mode"))
    if report.problems:
        table = Table(title=f"{len(report.problems)} problems")
        for col in ("severity", "kind", "shard", "sample", "detail"):
            table.add_column(col, overflow="fold")
        for p in report.problems[:500]:
            style = "red" if p.severity == "error" or strict else "yellow"
            table.add_row(p.severity, p.kind, p.shard or "-", p.sample or "-", p.detail, style=style)
        out.print(table)
        if len(report.problems) > 500:
            out.print(f"... and {len(report.problems) - 500} more (use --json for all)")
    if report.ok(strict):
        out.print("[green]verify: OK[/green]")
    else:
        out.print(f"[red]verify: FAILED ({len(report.errors(strict))} problems)[/red]")


@click.command("export")
@click.argument("run_id", metavar="RUN")
@_storage
@click.option("--format", "fmt", required=True, type=click.Choice(export_formats.names()),
              help="What to write (docs/formats.md): text rows, a trainer's hidden-state files, or ids and loss "
                   "masks only.")
@click.option("--out", required=True, type=StorageRoot(), metavar="FOLDER",
              help="Output folder (path or URL); a rerun resumes it.")
@click.option("--exclude-flags", default="", show_default=False, metavar="FLAG,...",
              help="Comma-separated quality flags to leave out, e.g. stub_answer,truncated [default: none].")
@click.option("--min-response-tokens", type=click.IntRange(min=0), default=0, show_default=True,
              help="Leave out samples with fewer generated tokens.")
@click.option("--include-unterminated", is_flag=True,
              help="Text formats: keep samples whose thinking never reached </think> (reasoning, empty answer).")
@click.option("--layers", "layers", default=None,
              help="Hidden-state formats: the captured layers to write (e.g. dflash:1,16,31); default: all the run "
              "captured (the final layer goes where the format wants it).")
@click.option("--model", "model", default=None,
              help="specforge-eagle3: the target checkpoint folder for the final norm (default: the run's model).")
@_processes("exported")
@_part_option("The parts write into one --out; the last to finish assembles the files made from every shard.")
def export_cmd(run_id: str, storage: str, fmt: str, out: str, exclude_flags: str, min_response_tokens: int,
               include_unterminated: bool, layers: str | None, model: str | None, processes: int,
               part_spec: str | None) -> None:
    """Export RUN's ok records (done shards): text rows (ShareGPT, SpecForge JSONL), Parquet, trainer-ready
    hidden states (SpecForge DFlash / EAGLE-3, speculators), or ids and loss masks only for trainers that run the
    target themselves (SpecForge online, speculators on_missing=generate)."""
    part = _part(part_spec)
    flags = tuple(f.strip() for f in exclude_flags.split(",") if f.strip())
    exporter = Exporter(RunReader(storage, run_id), out,
                        ExportOptions(fmt, flags, min_response_tokens, include_unterminated, layers, model))
    columns = (TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeRemainingColumn())
    with Progress(*columns, console=_console(stderr=True)) as progress:
        task = progress.add_task(f"export {fmt}" + ("" if part.whole else f" part {part}"), total=0)
        totals = exporter.run(lambda _s: progress.advance(task), processes=processes, part=part,
                              on_plan=lambda n: progress.update(task, total=progress.tasks[0].total + n))
    console = _console()
    table = Table(title=f"export of {run_id} -> {out}" + ("" if part.whole else f" (part {part})"),
                  show_header=False)
    table.add_row("shards exported now / skipped (done before)",
                  f"{totals['shards_exported_now']} / {totals['shards_skipped']}")
    if totals["shards_claimed_elsewhere"]:
        table.add_row("shards left to other exporters (claimed)", str(totals["shards_claimed_elsewhere"]))
    table.add_row("files of every shard (token_freq.pt, dataset, joined JSONL)", _ASSEMBLY[totals["assembly"]])
    table.add_row("conversations exported" if export_formats.get(fmt).per_conversation else "samples exported",
                  str(totals["exported"]))
    for reason, n in totals["filtered"].items():
        table.add_row(f"left out: {reason}", str(n))
    if totals.get("file"):
        table.add_row("one file of every row", f"{out.rstrip('/')}/{totals['file']}")
    console.print(table)


_ASSEMBLY = {"assembled": "written now", "assembled_before": "up to date",
             "claimed": "being written by another exporter",
             "waiting": "not yet: other parts are still exporting (the last to finish writes them)"}


@click.command("stats")
@click.argument("run_id", metavar="RUN")
@_storage
@click.option("--html", "html_path", default=None, metavar="FILE",
              help="Also write a self-contained HTML report (plots embedded) [default: none].")
@click.option("--json", "as_json", is_flag=True, help="Print the summary numbers as JSON instead of tables.")
@_processes("read")
@_part_option("Each part reports its shards; the parts' counts add up to the run's (--json).")
def stats_cmd(run_id: str, storage: str, html_path: str | None, as_json: bool, processes: int,
              part_spec: str | None) -> None:
    """Token lengths, finish reasons, quality-flag rates (overall and per source), the yield (generated tokens and
    engine seconds by outcome, the share in trainable samples) and worker speed of RUN.

    Reads only done shards, so it works while the run is in progress.
    """
    part = _part(part_spec)
    if html_path:
        require("matplotlib", "regen stats --html")
    st = collect(RunReader(storage, run_id), processes=processes, part=part)
    if as_json:
        t = st.total
        click.echo(orjson.dumps({
            "run_id": run_id, "part": str(part), "shards_done": st.shards_done, "shards_total": st.shards_total,
            "ok": t.ok, "stubs": t.stubs,
            "stub_rate": st.stub_rate, "stub_alarm": st.stub_alarm, "flags": dict(t.flags),
            "finish_reasons": {str(k): v for k, v in t.finish.items()}, "rejected": dict(st.rejected),
            "sources": {s: {"ok": g.ok, "stubs": g.stubs, "flags": dict(g.flags)} for s, g in st.sources.items()},
            "states": states_summary(st), "modes": modes_summary(st),
            "engine_modes": st.engine_modes.as_dict(), "yield": yield_summary(st),
        }, option=orjson.OPT_INDENT_2).decode())
    else:
        print_terminal(st, _console())
    if html_path:
        Path(html_path).write_text(render_html(st, plots(st)), encoding="utf-8")
        _console(stderr=True).print(f"wrote {html_path}")


commands: list = [verify_cmd, stats_cmd, export_cmd]
