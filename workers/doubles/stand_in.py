"""An engine that stands in for a GPU: for benchmarks and tests of the fleet around the engine, never for data.

The fleet's own costs at the job's size cannot be measured with a CPU engine and no GPU runs here, so
`StandInEngine` implements the worker's `Engine` and `regen worker --stand-in-engine SPEC` runs the real worker
around it: only the engine is replaced. It produces real token ids of the model's tokenizer at a configured rate,
with thinking-shaped output lengths. What it does with a batch, and the spec: docs/workers.md#the-stand-in-engine-workersdoublesstand_inpy.
"""

from __future__ import annotations

import heapq
import json
import math
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from app.base.errors import ConfigError, EngineDead
from workers.engine.jobs import BatchJob, one_by_one
from workers.engine.options import EngineOptions
from workers.engine.request import EngineSpan, GenRequest, GenResult, check_capture_requests
from workers.engine.scheduling import name_thread
from workers.engine.self_test import run_self_test

PREFIX = "stand-in"
THREAD_NAME = "regen-stand-in"  # the stand-in's engine thread (the harness leaves its CPU out of the fleet's)
DELIVERY_THREAD = "regen-deliver"  # runs the worker's `on_done` (its records): the fleet's CPU, not the GPU's

# The thinking-mode shape (bench/scale_run.py lays down the job's run with it too)
MEDIAN_OUTPUT = 2300
OUTPUT_SIGMA = 0.75
STUB_SHARE = 0.02
STUB_TOKENS = (4, 40)
MIN_OUTPUT = 16


def thinking_output(rng: np.random.Generator, max_tokens: int) -> tuple[int, str]:
    """(output tokens, kind) of one thinking-mode sample: kind is `stop`, `stub` or `cap` (cut at max_tokens)."""
    if rng.random() < STUB_SHARE:
        n_stub = int(rng.integers(*STUB_TOKENS))
        return (n_stub, "stub") if n_stub < max_tokens else (max_tokens, "cap")
    n_out = max(MIN_OUTPUT, int(rng.lognormal(math.log(MEDIAN_OUTPUT), OUTPUT_SIGMA)))
    if n_out >= max_tokens:
        return max_tokens, "cap"
    return n_out, "stop"


@dataclass(frozen=True)
class StandInSpec:
    rate: float = 11_500.0  # generated tokens/s of the device at a full batch (a 27B FP8 target on one B200)
    scale: float = 1.0  # the stand-in runs this many times faster than the device it stands for
    seqs: int = 0  # sequences in flight at once; 0: the engine options' max_num_seqs
    width: int = 0  # hidden width of captured states; 0: the model's hidden size
    devices: int = 1  # worker processes `regen worker --stand-in-engine` starts
    seed: int = 0

    @classmethod
    def parse(cls, text: str) -> StandInSpec:
        """`[stand-in:]key=value,...`; a malformed spec is one ConfigError line naming the key."""
        body = text.removeprefix(PREFIX).lstrip(":")
        known = {f.name: f.type for f in fields(cls)}
        values: dict[str, Any] = {}
        for part in filter(None, (p.strip() for p in body.split(","))):
            key, sep, value = part.partition("=")
            if not sep or key not in known:
                raise ConfigError(f"stand-in engine spec {text!r}: {part!r} is not one of "
                                  f"{', '.join(k + '=' for k in known)}")
            try:
                values[key] = float(value) if known[key] == "float" else int(value)
            except ValueError:
                raise ConfigError(f"stand-in engine spec {text!r}: {key}={value!r} is not a number") from None
        spec = cls(**values)
        if spec.rate <= 0 or spec.scale <= 0 or spec.seqs < 0 or spec.width < 0 or spec.devices < 1:
            raise ConfigError(f"stand-in engine spec {text!r}: rate and scale must be > 0, devices >= 1, "
                              "seqs and width >= 0")
        return spec

    def text(self) -> str:
        return PREFIX + ":" + ",".join(f"{f.name}={getattr(self, f.name):g}" for f in fields(self))


class _Tokens:
    """A long pool of ordinary token ids and their decodings, sliced into outputs (a slice of ids and its text
    cost microseconds; drawing and decoding 3,000 tokens per sample would cost the stand-in more than the fleet)."""

    POOL = 1 << 20

    def __init__(self, tokenizer, seed: int):
        vocab = tokenizer.get_vocab()
        special = set(tokenizer.all_special_ids)
        added = set(tokenizer.get_added_vocab().values())
        pieces = {}
        for tid in sorted(vocab.values()):
            if tid in special or tid in added:
                continue
            piece = tokenizer.decode([tid])
            if piece and piece.isascii() and piece.isprintable() and "<" not in piece:
                pieces[tid] = piece
        if not pieces:
            raise ConfigError("stand-in engine: the tokenizer has no ordinary ASCII tokens to generate")
        ids = np.fromiter(pieces, dtype=np.int64)
        rng = np.random.default_rng(seed)
        self.ids = ids[rng.integers(0, len(ids), self.POOL)]
        texts = [pieces[int(t)] for t in self.ids]
        self.text = "".join(texts)
        self.offsets = np.concatenate([[0], np.cumsum([len(t) for t in texts])])
        self.think_end = vocab.get("</think>")
        self.think_start = vocab.get("<think>")
        eos = [vocab.get("<|im_end|>"), tokenizer.eos_token_id]
        self.eos = next((t for t in eos if t is not None), None)

    def slice(self, rng: np.random.Generator, n: int) -> tuple[list[int], str]:
        n = max(0, min(n, self.POOL - 1))
        a = int(rng.integers(0, self.POOL - n))
        return self.ids[a:a + n].tolist(), self.text[self.offsets[a]:self.offsets[a + n]]


_POOL_ROWS = 1024


def _state_pool(layers: int, width: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.standard_normal((1, layers, width), dtype=np.float32))
    f32 = rng.standard_normal((_POOL_ROWS, layers, width), dtype=np.float32) * scale
    return (f32.view(np.uint32) >> 16).astype(np.uint16)  # bf16 bit patterns (truncated)


def _states(pool: np.ndarray, n_tokens: int, rng: np.random.Generator) -> np.ndarray:
    at = np.arange(n_tokens) + int(rng.integers(0, _POOL_ROWS))
    states = pool[at % _POOL_ROWS]
    laps = at // _POOL_ROWS
    masks = rng.integers(1, 128, (int(laps[-1]) + 1 if n_tokens else 1, pool.shape[2]), dtype=np.uint16)
    states ^= masks[laps][:, None, :]
    return states


@dataclass
class _Seq:
    finish_at: float  # device-time (tokens of per-sequence progress) at which it finishes
    order: int
    request: GenRequest
    job: BatchJob
    admitted: float  # wall clock, when the device took it
    finished: float = 0.0  # wall clock, when its last token was made

    def __lt__(self, other: _Seq) -> bool:
        return (self.finish_at, self.order) < (other.finish_at, other.order)


class StandInEngine:
    """The worker's `Engine`, standing in for a GPU (module docstring)."""

    def __init__(self, options: EngineOptions, spec: str | StandInSpec):
        from transformers import AutoTokenizer

        self.options = options
        self.spec = spec if isinstance(spec, StandInSpec) else StandInSpec.parse(spec)
        self.tokenizer = AutoTokenizer.from_pretrained(options.model)
        self.seqs = self.spec.seqs or options.max_num_seqs
        self.per_seq_rate = self.spec.rate * self.spec.scale / self.seqs  # tokens/s of one sequence in flight
        self.tokens = _Tokens(self.tokenizer, self.spec.seed)
        self.width = self.spec.width or _hidden_size(options.model)
        self._pool = (_state_pool(len(options.capture_layers), self.width, self.spec.seed)
                      if options.capture_layers else None)
        self._lock = threading.Condition()
        self._waiting: list[tuple[GenRequest, BatchJob]] = []
        self._active: list[_Seq] = []
        self._progress = 0.0  # tokens one sequence in flight has advanced since the start (device time)
        self._stamp = time.monotonic()
        self._order = 0
        self._dead: str | None = None
        self._stopping = False
        self.busy_seconds = 0.0
        self.idle_seconds = 0.0
        self.generated_tokens = 0
        self._started = time.monotonic()
        self._done: queue.Queue = queue.Queue()
        self._delivery_id: int | None = None
        self._engine_thread = threading.Thread(target=self._engine_loop, name=THREAD_NAME, daemon=True)
        self._delivery_thread = threading.Thread(target=self._deliver_loop, name=DELIVERY_THREAD, daemon=True)
        self._engine_thread.start()
        self._delivery_thread.start()

    # -- Engine ----------------------------------------------------------------------------------------
    @property
    def dead(self) -> str | None:
        return self._dead

    @property
    def delivery_thread_id(self) -> int | None:
        return self._delivery_id

    def run(self, requests: list[GenRequest], on_done: Callable[[GenResult], None]) -> EngineSpan | None:
        if self._dead:
            raise EngineDead(self._dead)
        if not requests:
            return None
        check_capture_requests(self.options, requests)
        job = BatchJob(requests, one_by_one(on_done))
        job.first_in, job.last_out = None, 0.0  # the device's span of this batch (wall clock)
        with self._lock:
            for req in requests:
                self._waiting.append((req, job))
            self._lock.notify_all()
        job.finished.wait()
        if job.error is not None:
            raise job.error
        return (job.first_in or job.last_out, job.last_out)

    def call(self, fn: Callable, *args) -> Any:
        """`fn(device, *args)` between steps; the device is `StandInDevice`, which holds no vLLM configuration."""
        return fn(StandInDevice(self.spec), *args)

    def self_test(self) -> float:
        return run_self_test(self)

    def shutdown(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        self._done.put(None)
        self._engine_thread.join(timeout=5)
        self._delivery_thread.join(timeout=5)

    def stats(self) -> dict:
        """Busy and idle seconds since the engine started, and the tokens it generated."""
        with self._lock:
            return {"busy_seconds": self.busy_seconds, "idle_seconds": self.idle_seconds,
                    "generated_tokens": self.generated_tokens, "spec": self.spec.text()}

    # -- the device ------------------------------------------------------------------------------------
    def _admit(self, now: float) -> None:
        while self._waiting and len(self._active) < self.seqs:
            req, job = self._waiting.pop(0)
            n_out = self._length(req)
            self._order += 1
            # the wall time of `now`, the instant its progress counts from (admitting takes time of its own)
            wall = time.time() - (time.monotonic() - now)
            heapq.heappush(self._active, _Seq(self._progress + n_out, self._order, req, job, wall))
            if job.first_in is None:
                job.first_in = wall

    def _length(self, req: GenRequest) -> int:
        rng = np.random.default_rng([self.spec.seed, int(req.sampling.get("seed") or 0) & 0xFFFFFFFF])
        return thinking_output(rng, int(req.sampling.get("max_tokens") or 16))[0]

    def _advance(self, now: float) -> None:
        elapsed = now - self._stamp
        self._stamp = now
        if self._active:
            self.busy_seconds += elapsed
            self._progress += elapsed * self.per_seq_rate
        else:
            self.idle_seconds += elapsed

    def _engine_loop(self) -> None:
        name_thread(THREAD_NAME)
        try:
            with self._lock:
                while not self._stopping:
                    now = time.monotonic()
                    self._advance(now)
                    while self._active and self._active[0].finish_at <= self._progress + 1e-9:
                        seq = heapq.heappop(self._active)
                        seq.finished = time.time()
                        self._done.put(seq)
                    self._admit(now)
                    if self._active:
                        wait = (self._active[0].finish_at - self._progress) / self.per_seq_rate
                        self._lock.wait(timeout=max(wait, 1e-4))
                    else:
                        self._lock.wait()
        except BaseException as exc:  # a stand-in that fails must look like an engine that died
            self._dead = f"stand-in engine died: {type(exc).__name__}: {exc}"
            with self._lock:
                jobs = {id(j): j for _, j in self._waiting} | {id(s.job): s.job for s in self._active}
            for job in jobs.values():
                job.fail(EngineDead(self._dead))
            self._done.put(None)

    def _deliver_loop(self) -> None:
        name_thread(DELIVERY_THREAD)
        self._delivery_id = threading.get_native_id()
        while True:
            seq = self._done.get()
            if seq is None:
                break
            try:
                result = self._result(seq)
            except BaseException as exc:
                seq.job.fail(EngineDead(f"stand-in engine failed: {type(exc).__name__}: {exc}"))
                continue
            seq.job.last_out = max(seq.job.last_out, seq.finished)
            seq.job.deliver(result)

    def _result(self, seq: _Seq) -> GenResult:
        """The finished sequence's output: thinking ids, `</think>`, an answer and the end of turn (or reasoning
        cut at the cap), with their text."""
        req = seq.request
        max_tokens = int(req.sampling.get("max_tokens") or 16)
        rng = np.random.default_rng([self.spec.seed, int(req.sampling.get("seed") or 0) & 0xFFFFFFFF])
        n_out, kind = thinking_output(rng, max_tokens)
        tok = self.tokens
        if kind == "cap" or tok.think_end is None or tok.eos is None:
            ids, text = tok.slice(rng, n_out)
            finish = "length" if kind == "cap" else "stop"
        else:
            n_answer = int(rng.integers(1, 3)) if kind == "stub" else max(1, int(n_out * rng.uniform(0.1, 0.3)))
            n_reason = max(0, n_out - n_answer - 2)
            r_ids, r_text = tok.slice(rng, n_reason)
            a_ids, a_text = tok.slice(rng, n_answer)
            ids = r_ids + [tok.think_end] + a_ids + [tok.eos]
            text = f"{r_text}</think>{a_text}"
            finish = "stop"
        with self._lock:
            self.generated_tokens += len(ids)
        result = GenResult(req.request_id, list(req.prompt_token_ids), ids, text, finish, None,
                           seconds=time.time() - seq.admitted)
        if req.capture and self._pool is not None:
            context = result.prompt_token_ids + ids
            result.captured_token_ids = np.asarray(context[:-1] if req.include_output_tokens
                                                   else result.prompt_token_ids, dtype=np.int64)
            result.captured_states = _states(self._pool, len(result.captured_token_ids), rng)
        return result


@dataclass(frozen=True)
class StandInConfig:
    """The engine configuration a stand-in holds, in the shape the worker reads a built engine's
    (`llm_engine.vllm_config`): no speculative method (workers.engine.llm_arguments.held_speculative)."""

    speculative_config: None = None


@dataclass(frozen=True)
class StandInLLMEngine:
    vllm_config: StandInConfig = StandInConfig()


@dataclass(frozen=True)
class StandInDevice:
    """What `Engine.call` hands `fn` on a stand-in: its spec, and the configuration it holds."""

    spec: StandInSpec
    llm_engine: StandInLLMEngine = StandInLLMEngine()


def _hidden_size(model: str) -> int:
    try:
        with open(os.path.join(model, "config.json"), encoding="utf-8") as fh:
            config = json.load(fh)
    except (OSError, ValueError):
        return 128
    return int((config.get("text_config") or config).get("hidden_size") or 128)
