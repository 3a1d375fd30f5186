"""The CPU worker's engine in a process of its own: the worker's side work never holds the engine's GIL.

Why: on a CPU host the in-process engine's steps are mostly Python, so any side work holding the GIL holds up
the engine; the GIL is per process, so the engine moves out. Only prompt ids and, per finished sample, its
ids, text and capture file's path cross the pipe (no hidden states), one message per delivery round. The child
dies with the worker; a dead child makes every waiting batch raise `EngineDead`. GPU workers do not use this.
Lifecycle and the measurement behind it: docs/workers.md#the-engine-process-in-detail.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import pickle
import signal
import threading
from collections.abc import Callable
from dataclasses import replace

from app.base.config import Config, current, install
from app.base.errors import EngineDead, EngineLost
from workers.engine.capture_file import attach_capture, remove_capture_file
from workers.engine.in_process import InProcessEngine
from workers.engine.interface import Engine
from workers.engine.jobs import BatchJob, ExclusiveCall, one_by_one
from workers.engine.options import EngineOptions
from workers.engine.request import EngineSpan, GenRequest, GenResult, check_capture_requests
from workers.engine.scheduling import name_thread
from workers.engine.self_test import run_self_test

log = logging.getLogger("regen.engine")

_PR_SET_PDEATHSIG = 1
PROCESS_NAME = "regen-host"  # the engine process's OS-level name (15 bytes at most)


class EngineProcess(Engine):
    """An `Engine` (workers.engine.interface) whose `InProcessEngine` runs in a child process of this one."""

    def __init__(self, options: EngineOptions):
        self.options = options
        context = multiprocessing.get_context("spawn")  # fork would copy this process's threads' locks
        self._conn, child_end = context.Pipe()
        self._proc = context.Process(target=_serve, args=(options, child_end, os.getpid(), current()),
                                     name="regen-engine-host", daemon=False)
        self._proc.start()
        child_end.close()
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._waiting: dict[int, BatchJob | ExclusiveCall] = {}
        self._next_id = 0
        self._dead: str | None = None
        self._dead_error: type[EngineDead] = EngineDead  # EngineLost when its process vanished under a signal
        self._closing = False
        try:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(options.model)  # while the child builds vLLM
            started = self._receive()
        except BaseException:
            self._stop_child(grace=0)
            raise
        if started[0] != "ready":
            self._stop_child()
            raise started[2]
        self._receiver = threading.Thread(target=self._receive_loop, name="regen-deliver", daemon=True)
        self._receiver.start()

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    @property
    def dead(self) -> str | None:
        """Why the engine (its process) died, or None while it runs."""
        return self._dead

    @property
    def delivery_thread_id(self) -> int | None:
        """The thread that reads results and capture files and calls `on_done` (workers.engine.scheduling idles it)."""
        return self._receiver.native_id

    def run(self, requests: list[GenRequest], on_done: Callable[[GenResult], None]) -> EngineSpan | None:
        """`Engine.run`, in the child: `on_done` runs on this process's receiving thread; the span is the
        child engine's."""
        check_capture_requests(self.options, requests)
        if not requests:
            return None
        return self._submit(BatchJob(requests, one_by_one(on_done), finish_on_last=False)).span

    def call(self, fn: Callable, *args):
        """`Engine.call`, in the child: `fn` and `args` must pickle (a module-level function)."""
        return self._submit(ExclusiveCall(fn, args)).result

    def self_test(self) -> float:
        return run_self_test(self)

    def _submit(self, waiter: BatchJob | ExclusiveCall):
        """Send the child a batch (`BatchJob`) or a call (`ExclusiveCall`), wait for its end; raise its error."""
        kind, payload = (("run", waiter.requests) if isinstance(waiter, BatchJob)
                         else ("call", (waiter.fn, waiter.args)))
        with self._lock:
            if self._dead:
                raise self._dead_error(self._dead)
            self._next_id += 1
            key = self._next_id
            self._waiting[key] = waiter
        try:
            with self._send_lock:
                self._conn.send((kind, key, payload))
        except (OSError, ValueError) as exc:  # the pipe is gone: the child died; the receiver says why
            self._receiver.join(timeout=5)
            with self._lock:
                self._waiting.pop(key, None)
                reason = self._dead or f"vLLM engine failed: cannot reach the engine process: {exc!r}"
            raise self._dead_error(reason) from exc
        waiter.finished.wait()
        if waiter.error is not None:
            raise waiter.error
        return waiter

    def _receive(self):
        """One message from the child; EOF (the child is gone) becomes EngineDead with its exit status."""
        try:
            return self._conn.recv()
        except (EOFError, OSError) as exc:
            self._proc.join(timeout=5)
            code = self._proc.exitcode
            error = EngineLost if code is not None and code < 0 else EngineDead  # a signal: killed from outside
            raise error(f"vLLM engine failed: the engine process exited ({exit_status(code)})") from exc

    def _receive_loop(self) -> None:
        name_thread("regen-deliver")
        while True:
            try:
                message = self._receive()
            except EngineDead as exc:
                if not self._closing:
                    self._die(str(exc), lost=isinstance(exc, EngineLost))
                return
            kind, key, payload = message
            with self._lock:
                waiter = self._waiting.get(key)
            if waiter is None:  # a batch already failed (the engine died meanwhile): nobody waits for this
                if kind == "results":
                    for result in payload:
                        if result.capture_path:
                            remove_capture_file(result.capture_path)
                continue
            if kind == "results":  # every result of this batch one delivery round of the child handed on
                for result in payload:
                    self._deliver(waiter, result)
                continue
            with self._lock:  # "done", "called" or "failed": the caller's last message
                self._waiting.pop(key, None)
            if kind == "failed":
                if isinstance(payload, EngineDead):
                    self._die(str(payload))
                waiter.fail(payload)
                continue
            if kind == "called":
                waiter.result = payload
            elif kind == "done":
                waiter.span = payload
            waiter.finished.set()

    def _deliver(self, job: BatchJob, result: GenResult) -> None:
        path, result.capture_path = result.capture_path, None
        if path is not None:
            try:
                attach_capture(result, path, self.options.in_process)  # vLLM's loader waits on a separate core's lock
            except BaseException as exc:  # a capture the engine wrote but nobody can read: the engine is suspect
                message = f"capture file {path} unreadable: {exc!r}"
                self._die(message, kill=True)
                job.fail(EngineDead(message))
                return
        job.deliver(result)

    def _die(self, message: str, kill: bool = False, lost: bool = False) -> None:
        """Mark the engine dead and fail every waiting caller (their tasks exit the worker for a restart).
        `lost`: the process vanished under a signal (EngineLost) rather than failing with an error."""
        error = EngineLost if lost else EngineDead
        with self._lock:
            if self._dead is None:
                self._dead, self._dead_error = message, error
            waiting, self._waiting = list(self._waiting.values()), {}
        for waiter in waiting:
            waiter.fail(error(message))
        if kill:
            self._stop_child(grace=0)

    def _stop_child(self, grace: float = 30) -> None:
        self._proc.join(timeout=grace)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=10)

    def shutdown(self) -> None:
        self._closing = True
        try:
            with self._send_lock:
                self._conn.send(("shutdown", 0, None))
        except (OSError, ValueError):  # already gone
            pass
        self._stop_child()
        self._receiver.join(timeout=10)
        self._conn.close()


def exit_status(code: int | None) -> str:
    """How a child process ended, in words: "killed by SIGKILL", "exit code 1"."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


# The child process ----------------------------------------------------------------------------------------
def _serve(options: EngineOptions, conn, parent_pid: int, settings: Config) -> None:
    """The engine process's main: build the engine, then run what the worker sends until told to stop. It runs
    under the worker's config (app.base.config), handed over rather than read again."""
    install(settings)
    _die_with_parent(parent_pid)
    name_thread(PROCESS_NAME)  # the main thread's name is the process's: `ps`, `top` and tests tell it apart
    # Ctrl-C reaches the whole process group and `regen worker` may signal it too: the worker decides when its
    # engine stops (a warm shutdown finishes its shards first), and its death takes this process with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=settings.log_level,
                        format="%(asctime)s %(levelname)s %(name)s[engine host]: %(message)s")
    try:
        engine = InProcessEngine(replace(options, host_process=False), read_captures=False)
    except BaseException as exc:
        conn.send(("failed", 0, _portable(exc)))
        return
    send_lock = threading.Lock()

    def send(message) -> None:
        with send_lock:
            conn.send(message)

    send(("ready", 0, None))
    # This process's other threads (main, delivery, one per batch) keep the normal policy, unlike the worker's:
    # they share the engine thread's GIL, and one lowered while holding it left the engine thread waiting until
    # the OpenMP thread it had to yield to spun out its turn (docs/workers.md#thread-priorities-in-detail).
    while True:
        try:
            kind, key, payload = conn.recv()
        except (EOFError, OSError):  # the worker is gone
            os._exit(0)
        if kind == "shutdown":
            break
        target = _run_batch if kind == "run" else _run_call
        threading.Thread(target=target, args=(engine, send, key, payload), daemon=True).start()
    engine.shutdown()
    conn.close()


def _run_batch(engine: InProcessEngine, send, key: int, requests: list[GenRequest]) -> None:
    try:
        span = engine.run_batched(requests, lambda results: send(("results", key, results)))
    except BaseException as exc:
        send(("failed", key, _portable(exc)))
        return
    send(("done", key, span))


def _run_call(engine: InProcessEngine, send, key: int, payload) -> None:
    fn, args = payload
    try:
        result = engine.call(fn, *args)
    except BaseException as exc:
        send(("failed", key, _portable(exc)))
        return
    send(("called", key, result))


def _portable(exc: BaseException) -> BaseException:
    """`exc` if it survives pickling, else a RuntimeError with its text (vLLM's errors may hold live objects)."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


def _die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when the worker dies (Linux; elsewhere the closed pipe ends it)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the worker died before the request took effect
        os._exit(0)
