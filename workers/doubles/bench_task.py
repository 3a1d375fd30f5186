"""The fleet bench's second baseline: `LLM.generate` run by a worker process on its own engine.

Why: two identical `LLM.generate` processes on a 2-core box differ by a few percent for their whole lives
(memory placement, which core the OpenMP team lands on), about as much as the fleet target's margin. Timing
direct calls on the very engine the worker's shards run on takes that per-process difference out of the
comparison; the bench still times a separate direct process too, so a slow worker engine cannot hide behind it.

The task runs the prompts (token ids, so no chat template) with the sampling a shard of the bench's run gets,
on the engine thread between shards (`Engine.call`; on the CPU in the engine process), times `generate`
alone, removes the capture files outside the timed window, and writes {"tokens", "seconds"} to `result_path`
(a file the bench polls; workers keep no task results). Nothing is written to any run. Registered only where `REGEN_BENCH_TASKS=1` (the bench's own
worker): a message naming a file to write has no place on a production queue.
"""

from __future__ import annotations

import os
import time

import orjson

from app.base.celery_app import BENCH_DIRECT_TASK
from workers.engine.capture_file import remove_capture_file
from workers.engine.llm_arguments import sampling_params
from workers.engine.request import GenRequest
from workers.process.context import WorkerContext


def direct_generate(ctx: WorkerContext, prompts: list[list[int]], sampling: dict) -> tuple[int, float]:
    """(generated tokens, seconds in `LLM.generate`) for `prompts`, sample i seeded `sampling["seed"] + i`."""
    capture = ctx.engine.options.capture_layers is not None
    requests = [GenRequest(str(i), p, {**sampling, "seed": int(sampling.get("seed", 0)) + i}, capture=capture)
                for i, p in enumerate(prompts)]
    return ctx.engine.call(timed_generate, requests)


def timed_generate(llm, requests: list[GenRequest]) -> tuple[int, float]:
    """On the engine thread (of an engine process too, so a module-level function): `LLM.generate`
    over `requests`, timed alone; capture files are removed after the timed window."""
    from vllm.inputs import TokensPrompt

    params = [sampling_params(r) for r in requests]
    prompts = [TokensPrompt(prompt_token_ids=r.prompt_token_ids) for r in requests]
    started = time.monotonic()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.monotonic() - started
    paths = [p for p in ((out.kv_transfer_params or {}).get("hidden_states_path") for out in outputs) if p]
    # In-process, the connector writes a request's file on a later engine step, so the last step's requests have
    # none yet: step the idle engine until they exist (as the worker's loop does), or they would be written
    # after this removal and left in the scratch folder.
    for _ in range(_FLUSH_STEPS):
        if all(os.path.exists(p) for p in paths):
            break
        llm.llm_engine.step()
    for path in paths:
        remove_capture_file(path)
    return sum(len(out.outputs[0].token_ids) for out in outputs), seconds


_FLUSH_STEPS = 100  # empty steps at most; one is enough in vLLM 0.32


def register_bench(celery) -> None:
    @celery.task(name=BENCH_DIRECT_TASK)
    def bench_direct(prompts: list[list[int]], sampling: dict, result_path: str) -> None:
        tokens, seconds = direct_generate(WorkerContext.get(), prompts, sampling)
        tmp = f"{result_path}.tmp-{os.getpid()}"
        with open(tmp, "wb") as fh:
            fh.write(orjson.dumps({"tokens": tokens, "seconds": seconds}))
        os.replace(tmp, result_path)
