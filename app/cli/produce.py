"""`regen produce` and `regen reconcile`: the producer's command line.

The commands only translate flags into `ProduceOptions` and print; the work is in producer.produce. User
errors are `RegenError`s, printed by app.cli as one line with exit status 2.
"""

from __future__ import annotations

import functools
import sys

import rich_click as click
from click.core import ParameterSource
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from app.base.config import DEFAULT_REGENERATE, DEFAULT_SHARD_SIZE
from app.base.errors import ConfigError
from app.base.manifest import CAPTURE_MODES
from app.base.states_codec import STATES_DTYPES
from app.base.storage import RunStore, Storage
from app.cli.options import broker_option, model_option, queue_option, storage_option
from app.data.format_fit import layer_lines
from app.pilot.forecast import link_pilots, load_pilot_file
from producer.enqueue import COMPRESS_MODES
from producer.normalise import REGENERATE_MODES
from producer.produce import ProduceResult, produce
from producer.retry_dead import retry_dead
from producer.run_setup import (
    DEFAULT_MAX_PROMPT_TOKENS,
    DEFAULT_MAX_TOKENS,
    ProduceOptions,
)

STATES_DTYPE_HELP = ("How hidden states are stored: bf16 (lossless, ~1.45x smaller than raw) or lossy: lossy = "
                     "fp8-e4m3 (~2.3x; a scale per token and layer; error at most 0.067 of each token's norm), "
                     "bf16-m3 (~2.2x) or bf16-m4 (~2.0x, half the error) keep 3 or 4 mantissa bits. Each sample's "
                     "measured error is recorded; readers return bf16 either way.")

LAYERS_HELP = ("Layers to capture: dflash (5 layers for DFlash, no final layer), dflash-K, eagle3 (3 + the final "
               "layer: every state export), or CONVENTION:IDS (dflash:1,2 / vllm:2,3 / hf:2); --dry-run prints the "
               "ids and the export formats they allow.")


def thinking_budget_options(f):
    """--thinking-budget, --thinking-close (produce, run, pilot)."""
    f = click.option("--thinking-close", default=None, metavar="TEXT",
                     help="The text vLLM forces when the budget runs out; must contain </think> [default: "
                          "\"\\n</think>\\n\\n\", how Qwen3's chat templates close a reasoning block].")(f)
    return click.option("--thinking-budget", type=click.IntRange(min=0), default=None, metavar="N",
                        help="Close each thinking-mode sample's reasoning after N tokens (vLLM's "
                             "thinking_token_budget); the record says budget_closed and its loss mask leaves the "
                             "forced ids out. With --capture staged or off, without --speculative [default: none].")(f)


def sampling_options(f):
    """--temperature, --top-p, --top-k, --min-p: bounded as vLLM's SamplingParams takes them (produce, run, pilot)."""
    f = click.option("--min-p", type=click.FloatRange(0, 1), default=None,
                     help="Sampling min_p [default: Qwen3's for the sample's mode, 0].")(f)
    f = click.option("--top-k", type=click.IntRange(min=-1), default=None,
                     help="Sampling top_k; 0 or -1 turns it off [default: Qwen3's for the sample's mode, 20].")(f)
    f = click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=None,
                     help="Sampling top_p [default: Qwen3's for the sample's mode, 0.95 / 0.8].")(f)
    return click.option("--temperature", type=click.FloatRange(min=0, max=100), default=None,
                        help="Sampling temperature [default: Qwen3's for the sample's mode, 0.6 / 0.7].")(f)


# Flags that become run settings; with --resume the stored values win, so giving one is refused.
SETTING_FLAGS = ("shard_size", "max_tokens", "thinking", "temperature", "top_p", "top_k", "min_p", "seed",
                  "capture", "layers", "max_prompt_tokens", "max_prompt_chars", "regenerate", "model",
                  "pause_stub_rate", "pause_window", "pause_min_samples", "vllm_args", "states_dtype", "speculative",
                  "thinking_mix", "sample_temperatures", "take", "capture_check_every", "preserve_thinking",
                  "thinking_budget", "thinking_close", "stop_loops")
# ... and those `regen run` takes over from `regen produce` (samples per prompt can grow on a resume)
RUN_SETTING_FLAGS = (*SETTING_FLAGS, "samples_per_prompt")


def _broker_options(f, *, storage_required: bool = True):
    f = click.option("--compress", type=click.Choice(COMPRESS_MODES), default="auto", show_default=True,
                     help="zstd shard messages: 2-3x smaller in Redis, a third of the producer's CPU. "
                          "auto: zstd when no --max-pending bounds the queue and the inputs exceed 1 GiB.")(f)
    f = click.option("--max-pending", type=click.IntRange(min=0), default=None,
                     help="Wait while more than N shards wait in the queue (Redis brokers) [default: never wait].")(f)
    f = queue_option(help="The Celery queue the run's shards go to (workers consume it; a staged run's capture "
                          "pass goes to regen.capture).")(f)
    f = broker_option()(f)
    f = storage_option(required=storage_required, help=None if storage_required else
                       "Storage root: a folder (NFS for several hosts) or an fsspec URL (s3://bucket/runs); required "
                       "unless --dry-run [env REGEN_STORAGE; no default].")(f)
    return f


@click.command("produce")
@click.argument("inputs", nargs=-1)
@click.option("--run", "run_id", default=None, metavar="RUN",
              help="Run id [default: the first input's file name].")
@functools.partial(_broker_options, storage_required=False)
@model_option()
@click.option("--shard-size", type=click.IntRange(min=1, max=100_000), default=DEFAULT_SHARD_SIZE, show_default=True,
              help="Samples per shard (one queue message, one output file, the unit of retry).")
@click.option("--max-tokens", type=click.IntRange(min=1), default=DEFAULT_MAX_TOKENS, show_default=True,
              help="Response token cap per turn; at most the model's context (max_position_embeddings).")
@click.option("--thinking/--no-thinking", default=True, show_default=True,
              help="Generate in thinking mode (must match how the drafter will serve).")
@click.option("--thinking-mix", type=click.FloatRange(0, 1), default=None, metavar="P",
              help="Both modes in one run: each sample in thinking mode with probability P (drawn from the run seed "
                   "and the sample id; an input row's own enable_thinking/thinking field is kept), each mode with "
                   "its own sampling defaults. 1 and 0 are --thinking and --no-thinking for rows without a field.")
@click.option("--preserve-thinking", is_flag=True, default=False,
              help="Render earlier assistant turns' reasoning_content into later prompts (the template's "
                   "preserve_thinking; the Qwen3.5/3.6 family drops it before the last user query by default).")
@click.option("--samples-per-prompt", type=click.IntRange(min=1), default=None, metavar="K",
              help="K samples of every prompt, each its own record, seed and id (PROMPT-sK; the first keeps the "
                   "prompt's id) [default: 1]. With --resume RUN: a larger K adds only the new samples.")
@click.option("--sample-temperatures", default=None, metavar="T1,T2,...",
              help="Temperatures the samples of a prompt cycle through (sample k at T[k % n]), in either mode "
                   "[default: none, --temperature for every sample].")
@click.option("--take", "take", multiple=True, metavar="GLOB=N|FRACTION",
              help="Draw N rows (or a FRACTION, written with a point: 0.5) of the inputs GLOB matches, seeded with "
                   "--seed; the rest are counted as left out. Repeatable; unmatched inputs are read whole.")
@sampling_options
@thinking_budget_options
@click.option("--stop-loops", is_flag=True, default=False,
              help="End a request whose output has started repeating one span (the repetition_loop test, checked "
                   "every 16 tokens) instead of generating it to --max-tokens; the record says loop_stopped. With "
                   "--capture staged or off, without --speculative (vLLM refuses the logits processor beside a "
                   "speculative config) [default: off, loops only flagged].")
@click.option("--seed", type=click.IntRange(min=0, max=2**32 - 1), default=0, show_default=True,
              help="Run seed; each prompt gets its own seed from it.")
@click.option("--capture", type=click.Choice(CAPTURE_MODES), default="inline", show_default=True,
              help="Hidden-state capture: during generation, in a second prefill pass, or not at all.")
@click.option("--speculative", default=None, metavar="mtp[:K]",
              help="Speculative generation with the checkpoint's MTP head, K draft tokens a step (mtp = mtp:2), on "
                   "the run's generation engines only (--capture staged or off; never a capture engine). The "
                   "sampling stays the target's; measure whether it pays on the host first (regen pilot) [default: off].")
@click.option("--layers", default="dflash", show_default=True, metavar="SPEC", help=LAYERS_HELP)
@click.option("--max-prompt-tokens", type=click.IntRange(min=1), default=DEFAULT_MAX_PROMPT_TOKENS, show_default=True,
              help="Reject prompts longer than this many tokens (with the target's chat template), as rejected "
                   "records.")
@click.option("--states-dtype", type=click.Choice(STATES_DTYPES), default="bf16", show_default=True,
              help=STATES_DTYPE_HELP)
@click.option("--max-prompt-chars", type=click.IntRange(min=0), default=None,
              help="Reject prompts longer than this many characters [default: 8 x --max-prompt-tokens].")
@click.option("--regenerate", type=click.Choice(REGENERATE_MODES), default=DEFAULT_REGENERATE, show_default=True,
              help="last: the final assistant turn; all: every assistant turn, in order.")
@click.option("--pause-stub-rate", type=click.FloatRange(0, 1), default=0.20, show_default=True,
              help="Pause the run when this share of a worker's recent samples are stubs or empty (1 = never).")
@click.option("--pause-window", type=click.IntRange(min=1), default=256, show_default=True,
              help="How many recent samples per worker the stub rate is measured over.")
@click.option("--pause-min-samples", type=click.IntRange(min=1), default=32, show_default=True,
              help="Samples a worker must have seen before it may pause the run.")
@click.option("--capture-check-every", type=click.IntRange(min=0), default=100, show_default=True,
              help="Each worker re-captures one sample in N (chosen by sample id) and every engine's first 4 on its "
                   "own engine in another batch, and pauses the run when the states differ (0: the first 4 only; "
                   "docs/capture.md, 'How a run proves its states').")
@click.option("--vllm-arg", "vllm_args", multiple=True, metavar="KEY=VALUE",
              help="A vLLM engine argument every worker of the run applies, recorded in the manifest; the only way "
                   "to give one that changes the data (dtype, quantization, kv_cache_dtype). Repeatable.")
@click.option("--dry-run", is_flag=True, help="Count, estimate tokens and disk, enqueue nothing.")
@click.option("--estimate-sample", type=click.IntRange(min=1), default=2000, show_default=True,
              help="Prompts tokenised for the --dry-run estimate.")
@click.option("--assumed-response-tokens", type=click.IntRange(min=0), default=None,
              help="Per-sample response length for the estimate [default: max-tokens / 2].")
@click.option("--pilot", "pilot_files", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="A `regen pilot` JSON file (one per host) whose forecast `regen status` compares the run with; "
                   "kept in the run's folder. Repeatable.")
@click.option("--resume", "resume_run", default=None, metavar="RUN",
              help="Re-send the shards of RUN that have no completion marker (inputs and settings from the run) "
                   "[default: a new run].")
@click.pass_context
def produce_command(ctx: click.Context, inputs, run_id, resume_run, pilot_files, **options) -> None:
    """Shard chat datasets (.jsonl, .jsonl.zst, .json; globs welcome) into the generation queue."""
    if resume_run:
        if inputs:
            raise ConfigError("--resume reads the inputs from the run; do not also give INPUTS")
        given = [n for n in SETTING_FLAGS if ctx.get_parameter_source(n) == ParameterSource.COMMANDLINE]
        if given:
            names = ", ".join("--" + n.replace("_", "-") for n in given)
            raise ConfigError(f"--resume uses the run's stored settings; drop {names}")
        if run_id and run_id != resume_run:
            raise ConfigError(f"--run {run_id} and --resume {resume_run} name different runs")
        run_id = resume_run
    elif not inputs:
        raise ConfigError("give INPUTS to produce, or --resume RUN")
    options["vllm_args"] = list(options.get("vllm_args") or ())
    options = mix_options(options, ctx.get_parameter_source("thinking") == ParameterSource.COMMANDLINE)

    pilots = [load_pilot_file(path) for path in pilot_files]  # a bad file fails here, before anything is sent
    if run_id is not None and not run_id.strip():  # compose passes ${REGEN_RUN:-}: unset in .env
        raise ConfigError("--run is empty: give the run id (with compose, set REGEN_RUN in .env)")
    opts = ProduceOptions(inputs=list(inputs), run_id=run_id, resume=bool(resume_run), **options)
    result = _run(opts)
    if pilots and result.status != "dry_run":
        link_pilots(RunStore(Storage(opts.storage), result.run_id), pilots)


def mix_options(options: dict, thinking_given: bool) -> dict:
    """The mode, samples and take options as ProduceOptions holds them (shared with `regen run`)."""
    out = {**options, "take": list(options.get("take") or ())}
    if out.get("thinking_mix") is not None and thinking_given:
        raise ConfigError("--thinking-mix sets each sample's mode; drop --thinking/--no-thinking")
    out["sample_temperatures"] = _temperatures(out.get("sample_temperatures"))
    return out


def _temperatures(text: str | None) -> list[float] | None:
    if text is None:
        return None
    try:
        return [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ConfigError(f"--sample-temperatures {text!r}: expected numbers separated by commas (0.6,0.8)") from None


@click.command("reconcile")
@click.argument("run_id", metavar="RUN")
@_broker_options
def reconcile_command(run_id, **options) -> None:
    """Re-send every shard of RUN without a completion marker (same as `produce --resume RUN`)."""
    _run(ProduceOptions(run_id=run_id, resume=True, **options))


def _run(opts: ProduceOptions) -> ProduceResult:
    out = Console()
    err = Console(stderr=True)
    if err.is_terminal:
        with Progress(TextColumn("reading"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                      TimeRemainingColumn(), console=err, transient=True) as bar:
            task = bar.add_task("read", total=None)
            result = produce(opts, progress=lambda done, total: bar.update(task, completed=done, total=total))
    else:
        result = produce(opts)
    _report(out, result)
    return result


def _report(out: Console, result: ProduceResult) -> None:
    acc = result.accounting
    if result.status == "already_produced":
        out.print(f"run {result.run_id} is already produced ({acc.shards} shards); nothing enqueued. "
                  f"To re-send shards that have no completion marker: regen produce --resume {result.run_id}")
        return
    title = {"dry_run": f"dry run of {result.run_id}: nothing enqueued",
             "produced": f"produced run {result.run_id}"}[result.status]
    table = Table(title=title, show_header=False)
    table.add_column("what")
    table.add_column("count", justify="right")
    table.add_row("rows read", f"{acc.read:,}")
    several = bool(acc.mode_counts) and acc.mode_counts.get("samples") != acc.enqueued
    table.add_row("prompts" if several else "samples" if result.status == "dry_run" else "samples in shards",
                  f"{acc.enqueued:,}")
    table.add_row("duplicates", f"{acc.duplicates:,}")
    if acc.left_out:
        table.add_row("left out (--take)", f"{acc.left_out:,}")
    table.add_row("rejected", f"{acc.rejected:,}")
    for reason, n in sorted(acc.rejected_by_reason.items()):
        table.add_row(f"  {reason}", f"{n:,}")
    table.add_row("shards", f"{acc.shards:,}")
    made = acc.mode_counts
    if made and (made.get("samples") != acc.enqueued or len([n for n in made["modes"].values() if n]) > 1):
        table.add_row("samples", f"{made['samples']:,}")
        for mode, n in made["modes"].items():
            table.add_row(f"  {mode.replace('_', '-')}", f"{n:,}")
    if result.status == "produced":
        table.add_row("shards sent", f"{acc.shards_sent:,}")
        table.add_row("shards already done", f"{acc.shards_skipped_done:,}")
        if acc.shards_skipped_dead:
            table.add_row("shards dead-lettered, not sent", f"{acc.shards_skipped_dead:,}")
    out.print(table)
    if result.status == "produced" and acc.shards_skipped_dead:
        out.print(f"{acc.shards_skipped_dead:,} dead-lettered shards were not sent; after a fix, re-send them with:")
        out.print(f"regen retry-dead {result.run_id}", soft_wrap=True)
    if result.status == "dry_run":  # decisions shown before any GPU time: the layers, the exports they allow
        for line in layer_lines(result.layers):
            out.print(line, soft_wrap=True, markup=False)
    if result.estimate is not None:
        for line in result.estimate.lines():
            out.print(line)
    if acc.rejected and result.status == "produced":
        out.print(f"rejected rows are listed in {result.storage_url}/{result.run_id}/rejects.jsonl")
    sys.stdout.flush()


@click.command("retry-dead")
@click.argument("run_id", metavar="RUN")
@click.option("--shard", "shards", multiple=True, metavar="SHARD",
              help="Only this dead-lettered shard (repeatable) [default: all].")
@_broker_options
def retry_dead_command(run_id, shards, **options) -> None:
    """Archive RUN's dead letters (kept under archive/ with their errors) and re-send those shards."""
    out = Console()
    result = retry_dead(ProduceOptions(run_id=run_id, resume=True, **options), list(shards))
    if not result.archived:
        out.print(f"run {run_id} has no dead-lettered shards")
        return
    for key, where in result.archived.items():
        out.print(f"archived dead letter of {key} to {where}", soft_wrap=True)
    out.print(f"re-sent {result.sent} shard(s) of {run_id}" + (f", {result.captures} staged capture(s)"
                                                              if result.captures else ""))


commands = [produce_command, reconcile_command, retry_dead_command]
