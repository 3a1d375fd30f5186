"""`regen stats`: what a run's data looks like, in the terminal and as one self-contained HTML file.

A glance at length histograms, finish reasons and flag rates (overall, per input file and per mode) shows a
stub-ridden dataset at once; the stub-or-empty rate is red above the run's pause threshold. The yield table
splits generated tokens and engine seconds by outcome (app.data.outcomes) and gives the share of generated tokens
that end in a sample the text exports keep. Only done shards are read. What each table means: docs/checking.md#what-regen-stats-shows-appdatastatspy.
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import io
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from rich.table import Table

from app.base.quality import is_stub
from app.base.states_bound import LayerErrors, promise
from app.base.thinking_modes import record_mode, run_modes
from app.data.engine_modes import ModeCounts, modes_table, shard_mode
from app.data.fanout import WHOLE, Part, open_reader, ordered_map, worker_reader
from app.data.outcomes import OUTCOMES, outcome, trainable
from app.data.run_reader import RunReader


@dataclass
class Group:
    """Counts for the whole run or one input source."""

    ok: int = 0
    stubs: int = 0
    flags: Counter = field(default_factory=Counter)
    finish: Counter = field(default_factory=Counter)
    prompt_tokens: int = 0
    output_tokens: int = 0

    def rate(self, n: int) -> float:
        return n / self.ok if self.ok else 0.0


@dataclass
class Outcome:
    """Samples, generated tokens and engine seconds of one outcome, and how much of it a default export keeps."""

    samples: int = 0
    tokens: int = 0
    seconds: float = 0.0
    trainable_samples: int = 0
    trainable_tokens: int = 0


@dataclass
class RunStats:
    run_id: str
    pause_stub_rate: float
    shards_done: int = 0
    shards_total: int = 0
    rejected: Counter = field(default_factory=Counter)
    total: Group = field(default_factory=Group)
    sources: dict[str, Group] = field(default_factory=lambda: defaultdict(Group))
    modes: dict[str, Group] = field(default_factory=lambda: defaultdict(Group))  # thinking / non_thinking
    source_modes: dict[tuple[str, str], Group] = field(default_factory=lambda: defaultdict(Group))  # (source, mode)
    run_modes: tuple[str, ...] = ("thinking",)  # the modes the run's samples can be in (app.base.thinking_modes.run_modes)
    mode_of: list[str] = field(default_factory=list)  # each sample's mode, beside prompt / reasoning / answer
    prompt: list[int] = field(default_factory=list)
    reasoning: list[int] = field(default_factory=list)
    answer: list[int] = field(default_factory=list)
    mask_sum: list[int] = field(default_factory=list)
    speed: list[tuple[str, str, float]] = field(default_factory=list)  # (worker, finished ISO time, tokens/s)
    states_dtype: str = "bf16"
    states_bound: float = 0.0
    states_errors: LayerErrors | None = None  # lossy runs: the recorded error per layer (app.base.states_bound)
    part: str | None = None  # `I/N` when only that part's shards were read
    engine_modes: ModeCounts = field(default_factory=ModeCounts)  # samples and capture checks per engine mode
    outcomes: dict[str, Outcome] = field(default_factory=lambda: {o: Outcome() for o in OUTCOMES})

    @property
    def generated_tokens(self) -> int:
        return sum(o.tokens for o in self.outcomes.values())

    @property
    def trainable_tokens(self) -> int:
        return sum(o.trainable_tokens for o in self.outcomes.values())

    @property
    def stub_rate(self) -> float:
        return self.total.rate(self.total.stubs)

    @property
    def stub_alarm(self) -> bool:
        return any(self.mode_alarm(m) for m in self.modes) or (self.total.ok > 0
                                                                and self.stub_rate >= self.pause_stub_rate)

    def mode_alarm(self, mode: str) -> bool:
        g = self.modes.get(mode)
        return bool(g and g.ok and g.rate(g.stubs) >= self.pause_stub_rate)

    @property
    def mixed(self) -> bool:
        return len(self.run_modes) > 1

    def by_mode(self, values: list[int]) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {m: [] for m in self.run_modes}
        for mode, v in zip(self.mode_of, values, strict=True):
            out.setdefault(mode, []).append(v)
        return out


def collect(reader: RunReader, processes: int = 1, part: Part = WHOLE) -> RunStats:
    """The run's stats (or one part's: every N-th of the producer's shards), shard by shard in id order.
    `processes` > 1 reads the shards in worker processes; each sends back what it read of a shard, and the
    shards are added here in the same order, so every count, list and float is the one one process makes."""
    st = RunStats(reader.run_id, float(reader.run_settings.quality.pause_stub_rate), part=None if part.whole else str(part),
                  run_modes=run_modes(reader.settings))
    every = reader.expected_shards()
    st.shards_total = len(part.pick(every))
    run_states = promise(reader.settings)
    st.states_dtype, st.states_bound = run_states.dtype, run_states.max_rel_error
    lossy = bool(run_states.lossy and reader.layers)
    if lossy:
        st.states_errors = LayerErrors(list(reader.layers))
    done = set(reader.done_shards())
    shards = [s for s in part.pick(every) if s in done]
    if processes > 1:
        found = ordered_map(_read_task, [(s, lossy) for s in shards], processes, open_reader,
                            (reader.storage.url, reader.run_id))
    else:
        found = (read_shard(reader, reader.shard(s), lossy) for s in shards)
    for mode in st.run_modes:
        st.modes[mode]  # noqa: B018 - every mode of the run has its row, an empty one too
    for shard in found:
        add_shard(st, shard)
    reader.close()
    return st


@dataclass
class ShardRead:
    """What stats takes from one shard: its marker's speed, its hidden file's index entries (lossy runs), its
    records' fields (ok records as (source, prompt, output, answer, mask sum, flags, finish, mode); rejects by
    reason)."""

    speed: tuple[str, str, float] | None
    entries: list[dict]
    ok: list[tuple]
    rejected: list[str]
    engine_mode: tuple[str, int, int] = ("unknown", 0, 0)  # engine mode, samples re-checked, failed (engine_modes.py)
    outcomes: list[tuple[str, bool, int, float]] = field(default_factory=list)  # (outcome, trainable, tokens, s)


def read_shard(reader: RunReader, info, lossy: bool) -> ShardRead:
    hidden = reader.hidden_reader(info) if lossy else None
    entries = list(hidden.entries) if hidden is not None else []  # the index only: no states are read
    m = info.marker
    speed = None
    if m.get("generation_seconds") and m.get("generated_tokens") is not None:
        speed = (str(m.get("worker")), str(m.get("finished")), m["generated_tokens"] / m["generation_seconds"])
    ok, rejected = [], []
    records = list(reader.records(info))
    outcomes = [(outcome(rec), kept, int(rec.get("num_output_tokens") or 0), float(rec.get("seconds") or 0.0))
                for rec, kept in zip(records, trainable(records), strict=True)]
    for rec in records:
        if rec.get("status") != "ok":
            rejected.append(rec.get("reject_reason", "?"))
            continue
        ok.append(((rec.get("source") or {}).get("file") or "?", rec["num_prompt_tokens"], rec["num_output_tokens"],
                   rec.get("num_answer_tokens") or 0, sum(rec["loss_mask"]), tuple(rec.get("flags") or ()),
                   rec.get("finish_reason"), record_mode(rec, reader.settings)))
    return ShardRead(speed, entries, ok, rejected, shard_mode(m, info.captured), outcomes)


def add_shard(st: RunStats, shard: ShardRead) -> None:
    st.shards_done += 1
    for entry in shard.entries:
        st.states_errors.add(entry)
    if shard.speed is not None:
        st.speed.append(shard.speed)
    for reason in shard.rejected:
        st.rejected[reason] += 1
    st.engine_modes.add(shard.engine_mode[0], len(shard.ok), shard.engine_mode[1], shard.engine_mode[2])
    for name, kept, tokens, seconds in shard.outcomes:
        o = st.outcomes[name]
        o.samples += 1
        o.tokens += tokens
        o.seconds += seconds
        o.trainable_samples += kept
        o.trainable_tokens += tokens if kept else 0
    for src, n_prompt, n_out, n_ans, mask_sum, flags, finish, mode in shard.ok:
        st.mode_of.append(mode)
        st.prompt.append(n_prompt)
        st.answer.append(n_ans)
        st.reasoning.append(max(0, n_out - n_ans))
        st.mask_sum.append(mask_sum)
        stub = is_stub(flags)
        for g in (st.total, st.sources[src], st.modes[mode], st.source_modes[(src, mode)]):
            g.ok += 1
            g.stubs += stub
            g.flags.update(flags)
            g.finish[finish] += 1
            g.prompt_tokens += n_prompt
            g.output_tokens += n_out


# -- worker processes (`--processes`) ---------------------------------------------------------------------
def _read_task(task: tuple[str, bool]) -> ShardRead:
    shard, lossy = task
    return read_shard(reader := worker_reader(), reader.shard(shard), lossy)


def yield_line(st: RunStats) -> str:
    """The job's yield: the share of generated tokens that ends in a sample the text exports keep by default."""
    n = st.generated_tokens
    return (f"yield: {_pct(st.trainable_tokens, n)} of generated tokens end in a trainable sample "
            f"({st.trainable_tokens:,} of {n:,}; what `regen export` keeps by default)")


YIELD_HEADER = ["outcome", "samples", "generated tokens", "share of tokens", "engine seconds", "share of seconds",
                "trainable samples", "trainable tokens"]


def _yield_rows(st: RunStats) -> list[list[str]]:
    tokens, seconds = st.generated_tokens, sum(o.seconds for o in st.outcomes.values())
    return [[name.replace("_", " "), str(o.samples), f"{o.tokens:,}", _pct(o.tokens, tokens), f"{o.seconds:,.1f}",
             f"{100 * o.seconds / seconds:.1f}%" if seconds else "-", str(o.trainable_samples),
             f"{o.trainable_tokens:,}"] for name, o in st.outcomes.items()]


def yield_summary(st: RunStats) -> dict:
    """The yield part of `regen stats --json`."""
    tokens = st.generated_tokens
    return {"generated_tokens": tokens, "trainable_tokens": st.trainable_tokens,
            "trainable_share": st.trainable_tokens / tokens if tokens else 0.0,
            "outcomes": {name: vars(o).copy() for name, o in st.outcomes.items()}}


def stub_line(st: RunStats) -> str:
    return (f"stub-or-empty: {100 * st.stub_rate:.1f}% of samples "
            f"({st.total.stubs} of {st.total.ok}; pause threshold {100 * st.pause_stub_rate:.0f}%)")


def mode_stub_line(st: RunStats, mode: str) -> str:
    g = st.modes[mode]
    return (f"{mode.replace('_', '-')}: stub-or-empty {_pct(g.stubs, g.ok)} of {g.ok} samples "
            f"(pause threshold {100 * st.pause_stub_rate:.0f}%, judged per mode)")


def _mode_rows(st: RunStats, flags: list[str]) -> list[list[str]]:
    rows = []
    for mode in st.run_modes:
        g = st.modes[mode]
        values = {name: st.by_mode(v)[mode] for name, v in (("reasoning", st.reasoning), ("answer", st.answer))}
        rows.append([mode.replace("_", "-"), str(g.ok), _pct(g.stubs, g.ok), *(_pct(g.flags[f], g.ok) for f in flags),
                     *(f"{sum(values[n]) / len(values[n]):.0f}" if values[n] else "-" for n in ("reasoning", "answer")),
                     f"{g.output_tokens / g.ok:.0f}" if g.ok else "-"])
    return rows


def modes_summary(st: RunStats) -> dict:
    """The per-mode part of `regen stats --json`."""
    out = {}
    for mode in st.run_modes:
        g = st.modes[mode]
        out[mode] = {"ok": g.ok, "stubs": g.stubs, "stub_rate": g.rate(g.stubs), "stub_alarm": st.mode_alarm(mode),
                     "flags": dict(g.flags), "finish_reasons": {str(k): v for k, v in g.finish.items()},
                     "prompt_tokens": g.prompt_tokens, "output_tokens": g.output_tokens,
                     "answer_tokens": sum(st.by_mode(st.answer)[mode]),
                     "reasoning_tokens": sum(st.by_mode(st.reasoning)[mode])}
    return out


_MODE_COLUMNS = ("mode", "ok", "stub-or-empty")
_MODE_TAIL = ("mean reasoning tokens", "mean answer tokens", "mean output tokens")


def _pct(n: int, total: int) -> str:
    return f"{100 * n / total:.1f}%" if total else "-"


def _summary_rows(st: RunStats) -> list[tuple[str, str]]:
    t = st.total
    return [("shards done", f"{st.shards_done} of {st.shards_total}"), ("ok samples", str(t.ok)),
            ("worker-rejected", str(sum(st.rejected.values()))), ("prompt tokens", str(t.prompt_tokens)),
            ("generated tokens", str(t.output_tokens))]


def _group_row(name: str, g: Group, flags: list[str]) -> list[str]:
    return [name, str(g.ok), _pct(g.stubs, g.ok), *(_pct(g.flags[f], g.ok) for f in flags),
            f"{g.output_tokens / g.ok:.0f}" if g.ok else "-"]


def _source_rows(st: RunStats, flags: list[str]) -> list[list[str]]:
    """A row per input source; in a mixed run each source's row is followed by a row per mode it has samples in
    (a source's stub rate means nothing across modes: non-thinking answers are short by design)."""
    rows = []
    for src, g in sorted(st.sources.items()):
        rows.append(_group_row(src, g, flags))
        if st.mixed:
            rows += [_group_row(f"  {src}, {mode.replace('_', '-')}", st.source_modes[(src, mode)], flags)
                     for mode in st.run_modes if st.source_modes.get((src, mode), Group()).ok]
    return rows


def _flag_header(st: RunStats) -> list[str]:
    return ["what", "samples", "rate", *(f"rate, {m.replace('_', '-')}" for m in st.run_modes if st.mixed)]


def _flag_rows(st: RunStats, flags: list[str]) -> list[list]:
    """The run-wide flags, finish reasons and rejects; a mixed run adds each mode's rate of the flag or reason."""
    def per_mode(count) -> list[str]:
        return [_pct(count(st.modes[m]), st.modes[m].ok) for m in st.run_modes] if st.mixed else []

    rows = [[f"flag {f}", st.total.flags[f], _pct(st.total.flags[f], st.total.ok),
             *per_mode(lambda g, f=f: g.flags[f])] for f in flags]
    rows += [[f"finish {r}", n, _pct(n, st.total.ok), *per_mode(lambda g, r=r: g.finish[r])]
             for r, n in st.total.finish.most_common()]
    blank = [""] * (len(st.run_modes) if st.mixed else 0)
    rows += [[f"rejected {r}", n, "", *blank] for r, n in st.rejected.most_common()]
    return rows


def _finish_mode_rows(st: RunStats) -> tuple[list[str], list[list[str]]]:
    """Finish reasons per mode: (header, rows)."""
    reasons = sorted({str(r) for g in st.modes.values() for r in g.finish})
    rows = []
    for mode in st.run_modes:
        g = st.modes[mode]
        counts = {str(k): v for k, v in g.finish.items()}
        rows.append([mode.replace("_", "-"), *(_pct(counts.get(r, 0), g.ok) for r in reasons)])
    return ["mode", *(f"finish {r}" for r in reasons)], rows


def _states_rows(st: RunStats) -> list[list[str]]:
    return [[str(layer), f"{worst:.5f}", f"{rms:.5f}"] for layer, worst, rms in st.states_errors.rows()]


def _states_line(st: RunStats) -> str:
    e = st.states_errors
    return (f"{e.lossy_samples} samples stored {st.states_dtype}, {e.lossless_samples} lossless "
            "(flagged by the quality gate, or above the bound)")


def states_summary(st: RunStats) -> dict:
    """The stored-states part of `regen stats --json`."""
    out = {"dtype": st.states_dtype, "max_rel_error_bound": st.states_bound}
    if st.states_errors is not None:
        e = st.states_errors
        out.update(lossy_samples=e.lossy_samples, lossless_samples=e.lossless_samples,
                   layers=[{"layer": layer, "max": worst, "rms": rms} for layer, worst, rms in e.rows()])
    return out


def print_terminal(st: RunStats, console) -> None:
    summary = Table(title=f"run {st.run_id}" + (f", part {st.part}" if st.part else ""), show_header=False)
    for k, v in _summary_rows(st):
        summary.add_row(k, v)
    console.print(summary)
    flags = sorted(st.total.flags)
    if st.mixed:
        for mode in st.run_modes:
            line = mode_stub_line(st, mode)
            console.print(f"[bold red]{line}[/bold red]" if st.mode_alarm(mode) else f"[green]{line}[/green]")
        per_mode = Table(title="per mode")
        for col in (*_MODE_COLUMNS, *flags, *_MODE_TAIL):
            per_mode.add_column(col, justify="left" if col == "mode" else "right")
        for row in _mode_rows(st, flags):
            per_mode.add_row(*row)
        console.print(per_mode)
        finish = Table(title="finish reasons per mode")
        header, rows = _finish_mode_rows(st)
        for col in header:
            finish.add_column(col, justify="left" if col == "mode" else "right")
        for row in rows:
            finish.add_row(*row)
        console.print(finish)
    else:
        console.print(f"[bold red]{stub_line(st)}[/bold red]" if st.stub_alarm else f"[green]{stub_line(st)}[/green]")
    t = Table(title="flags and finish reasons")
    for col in _flag_header(st):
        t.add_column(col, justify="left" if col == "what" else "right")
    for row in _flag_rows(st, flags):
        t.add_row(*map(str, row))
    console.print(t)
    console.print(yield_table(st))
    console.print(yield_line(st), soft_wrap=True)
    per = Table(title="per input source")
    for col in ("source", "ok", "stub-or-empty", *flags, "mean output tokens"):
        per.add_column(col, justify="left" if col == "source" else "right")
    for row in _source_rows(st, flags):
        per.add_row(*row)
    console.print(per)
    console.print(modes_table(st.engine_modes, "per engine mode (the engine that captured the states; the capture "
                                               "check's re-captures)"))
    if st.states_errors is not None:
        errors = Table(title=f"stored states: {st.states_dtype}, relative error per token (bound {st.states_bound})")
        for col in ("layer (vLLM id)", "max", "RMS"):
            errors.add_column(col, justify="right")
        for row in _states_rows(st):
            errors.add_row(*row)
        console.print(errors)
        console.print(_states_line(st))
    for name, values in (("prompt", st.prompt), ("reasoning", st.reasoning), ("answer", st.answer)):
        for mode, part in (st.by_mode(values).items() if st.mixed else (("", values),)):
            if part:
                s = sorted(part)
                of = f" ({mode.replace('_', '-')})" if mode else ""
                console.print(f"{name} tokens{of}: median {s[len(s) // 2]}, p90 {s[int(0.9 * (len(s) - 1))]}, "
                              f"max {s[-1]}")


def yield_table(st: RunStats) -> Table:
    table = Table(title="yield: generated tokens and engine seconds by outcome")
    for col in YIELD_HEADER:
        table.add_column(col, justify="left" if col == "outcome" else "right")
    for row in _yield_rows(st):
        table.add_row(*row)
    return table


def plots(st: RunStats) -> dict[str, bytes]:
    """PNG images (matplotlib, Agg backend) by name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out: dict[str, bytes] = {}

    def save(name: str, fig) -> None:
        buf = io.BytesIO()
        fig.tight_layout()
        fig.savefig(buf, format="png", dpi=90)
        plt.close(fig)
        out[name] = buf.getvalue()

    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5))
    colors = {"thinking": "#4477aa", "non_thinking": "#ee7733"}
    for ax, (title, values) in zip(axes.flat, (("prompt tokens", st.prompt), ("reasoning tokens", st.reasoning),
                                               ("answer tokens", st.answer), ("loss-mask sum", st.mask_sum)),
                                   strict=True):
        if st.mixed:  # one histogram per mode, over the same bins
            parts = st.by_mode(values)
            bins = max(1, min(50, len(set(values)) or 1))
            ax.hist([parts[m] or [0] for m in st.run_modes], bins=bins, color=[colors[m] for m in st.run_modes],
                    label=[m.replace("_", "-") for m in st.run_modes], histtype="bar")
            ax.legend(fontsize=8)
        else:
            ax.hist(values or [0], bins=50, color="#4477aa")
        ax.set_title(title)
        ax.set_ylabel("samples")
    save("token_histograms", fig)

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    fin = st.total.finish.most_common()
    a1.bar([str(k) for k, _ in fin], [v for _, v in fin], color="#228833")
    a1.set_title("finish reasons")
    names = ["stub-or-empty", *sorted(st.total.flags)]
    rates = [100 * st.stub_rate, *(100 * st.total.rate(st.total.flags[f]) for f in names[1:])]
    a2.barh(names, rates, color=["#cc3311" if st.stub_alarm else "#4477aa"] + ["#4477aa"] * (len(names) - 1))
    a2.axvline(100 * st.pause_stub_rate, color="#cc3311", linestyle="--", linewidth=1)
    a2.set_xlabel("% of ok samples")
    a2.set_title("quality flags")
    save("finish_and_flags", fig)

    if st.mixed:  # the flags and finish reasons of each mode side by side
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
        reasons = sorted({str(r) for g in st.modes.values() for r in g.finish})
        names = ["stub-or-empty", *sorted(st.total.flags)]
        width = 0.8 / len(st.run_modes)
        for k, mode in enumerate(st.run_modes):
            g = st.modes[mode]
            finish = {str(r): n for r, n in g.finish.items()}
            a1.bar([i + k * width for i in range(len(reasons))], [100 * g.rate(finish.get(r, 0)) for r in reasons],
                   width, color=colors[mode], label=mode.replace("_", "-"))
            rates = [100 * g.rate(g.stubs), *(100 * g.rate(g.flags[f]) for f in names[1:])]
            a2.barh([i + k * width for i in range(len(names))], rates, width, color=colors[mode],
                    label=mode.replace("_", "-"))
        a1.set_xticks([i + 0.4 - width / 2 for i in range(len(reasons))], reasons)
        a1.set_ylabel("% of the mode's ok samples")
        a1.set_title("finish reasons per mode")
        a1.legend(fontsize=8)
        a2.set_yticks([i + 0.4 - width / 2 for i in range(len(names))], names)
        a2.axvline(100 * st.pause_stub_rate, color="#cc3311", linestyle="--", linewidth=1)
        a2.set_xlabel("% of the mode's ok samples")
        a2.set_title("quality flags per mode")
        save("flags_per_mode", fig)

    fig, ax = plt.subplots(figsize=(10, 3.8))
    by_worker: dict[str, list[tuple[dt.datetime, float]]] = defaultdict(list)
    for worker, finished, speed in st.speed:
        try:
            by_worker[worker].append((dt.datetime.fromisoformat(finished), speed))
        except ValueError:
            continue
    for worker, pts in sorted(by_worker.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=worker)
    ax.set_title("generation speed per worker (per shard)")
    ax.set_ylabel("generated tokens / s")
    if by_worker:
        ax.legend(fontsize=8)
    fig.autofmt_xdate()
    save("speed", fig)
    return out


def _table(header: list[str], rows: list[list[str]]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


def render_html(st: RunStats, images: dict[str, bytes]) -> str:
    flags = sorted(st.total.flags)
    color = "#cc3311" if st.stub_alarm else "#228833"
    parts = [
        f"<h1>regen run {html.escape(st.run_id)}</h1>",
        f'<p class="stub" style="color:{color};font-weight:bold">{html.escape(stub_line(st))}</p>',
        _table(["", ""], [list(r) for r in _summary_rows(st)]),
        "<h2>yield</h2>",
        f'<p class="yield">{html.escape(yield_line(st))}</p>',
        _table(YIELD_HEADER, _yield_rows(st)),
        "<h2>flags and finish reasons</h2>",
        _table(_flag_header(st), _flag_rows(st, flags)),
        *(["<h2>per mode</h2>",
           *(f'<p class="stub-{m}" style="color:{"#cc3311" if st.mode_alarm(m) else "#228833"};font-weight:bold">'
             f"{html.escape(mode_stub_line(st, m))}</p>" for m in st.run_modes),
           _table([*_MODE_COLUMNS, *flags, *_MODE_TAIL], _mode_rows(st, flags)),
           "<h2>finish reasons per mode</h2>", _table(*_finish_mode_rows(st))] if st.mixed else []),
        "<h2>per input source</h2>",
        _table(["source", "ok", "stub-or-empty", *flags, "mean output tokens"], _source_rows(st, flags)),
        "<h2>per engine mode</h2>",
        _table(st.engine_modes.header(), st.engine_modes.rows()),
    ]
    if st.states_errors is not None:
        parts += [f"<h2>stored states: {html.escape(st.states_dtype)} (bound {st.states_bound})</h2>",
                  _table(["layer (vLLM id)", "max relative error", "RMS relative error"], _states_rows(st)),
                  f"<p>{html.escape(_states_line(st))}</p>"]
    for name, png in images.items():
        b64 = base64.b64encode(png).decode()
        parts.append(f'<h2>{html.escape(name.replace("_", " "))}</h2><img alt="{name}" '
                     f'src="data:image/png;base64,{b64}">')
    style = ("body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin:1em 0}"
             "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}td:first-child{text-align:left}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>regen stats {html.escape(st.run_id)}</title>"
            f"<style>{style}</style></head><body>{''.join(parts)}</body></html>")
