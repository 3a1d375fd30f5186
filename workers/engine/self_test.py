"""The engine's self-test before the worker consumes a shard: the run's own sampling, the prompts that break
engines, and the capture check over them.

Why: a broken engine must fail the worker's start (restarted with backoff, one line saying why) rather than
fail or silently mis-capture every shard; a trivial test passed engines that crashed on the run's first shard.
One batch with the run's sampling (1-token, short, duplicate, chunked-long prompts); checks `tokens`, `ids`,
`rows`, `duplicate` and `recapture`. A failure raises `SelfTestFailed` naming the check and the engine mode.
The prompts and checks in detail: docs/capture.md#the-workers-start-test-in-detail.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from app.base.errors import EngineDead
from app.base.manifest import THINKING_SAMPLING
from app.base.states_compare import compare, row_problems
from workers.engine.engine_mode import mode_key
from workers.engine.fault_hook import capture_faults
from workers.engine.recapture import Pending, recheck
from workers.engine.request import GenRequest, GenResult

if TYPE_CHECKING:
    from workers.engine.interface import Engine

MAX_TOKENS = 4
LONG_TEXT = ("The quick brown fox jumps over the lazy dog while the committee reviews the budget for next year. ")
LONG_DEFAULT = 600  # the long prompt where the engine's token budget is unknown


SELF_TEST_RUN = "self-test"  # the run id under which the test-only fault injector corrupts this test's captures


class SelfTestFailed(EngineDead):
    """The engine failed its start-up self-test: one line, naming the check and the engine mode."""


def run_self_test(engine: Engine) -> float:
    """`Engine.self_test`: the start test with the default sampling and no mode read (see `run_start_test`)."""
    return run_start_test(engine, None, None)


def start_sampling(sampling: dict | None) -> dict:
    """The sampling the test generates with: the run's (`top_k` included), or the default thinking-mode one."""
    chosen = dict(sampling if sampling is not None else THINKING_SAMPLING)
    chosen.pop("seed", None)
    chosen["max_tokens"] = MAX_TOKENS
    return chosen


def start_prompts(tokenizer, max_model_len: int, budget: int | None) -> dict[str, list[int]]:
    """The prompts by name: one token, a short one, one past the token budget (as long as the engine allows)."""
    short = tokenizer.encode("Hello") or [1]
    want = (budget + 16) if budget else LONG_DEFAULT
    room = max_model_len - MAX_TOKENS - 1
    text = tokenizer.encode(LONG_TEXT * 8) or short
    long = (text * (min(want, room) // len(text) + 1))[:min(want, room)]
    return {"one-token": short[:1], "short": short, "long": long}


def run_start_test(engine: Engine, sampling: dict | None, mode: dict | None) -> float:
    """Run the test on `engine` (either kind, see the module); the seconds it took. Raises SelfTestFailed."""
    key = mode_key(mode) if mode is not None else "not read"
    options = engine.options
    captures = options.capture_layers is not None
    t0 = time.monotonic()
    prompts = start_prompts(engine.tokenizer, options.max_model_len, (mode or {}).get("max_num_batched_tokens"))
    params = start_sampling(sampling)
    requests = [GenRequest(name, ids, {**params, "seed": 1234 + k}, capture=captures)
                for k, (name, ids) in enumerate(prompts.items())]
    requests.append(GenRequest("short-again", prompts["short"], {**params, "seed": 1234 + 1}, capture=captures))
    got: dict[str, GenResult] = {}

    def fail(check: str, detail: str):
        return SelfTestFailed(f"engine self-test failed, check '{check}': {detail}; engine mode: {key}; "
                              f"sampling {params}")

    try:
        engine.run(requests, lambda res: got.__setitem__(res.request_id, res))
    except EngineDead as exc:
        raise fail("generate", str(exc)) from exc
    for req in requests:
        res = got.get(req.request_id)
        if res is None or not res.output_token_ids:
            raise fail("tokens", f"the {req.request_id} prompt ({len(req.prompt_token_ids)} tokens) produced no tokens")
    if captures:
        _check_captures(engine, requests, got, fail)
    return time.monotonic() - t0


def _check_captures(engine: Engine, requests: list[GenRequest], got: dict[str, GenResult], fail) -> None:
    layers = list(engine.options.capture_layers)
    stored: dict[str, tuple[list[int], np.ndarray]] = {}
    faults = capture_faults()  # the test-only fault injector (workers.engine.fault_hook): None but in tests
    for req in requests:
        res = got[req.request_id]
        ids = res.prompt_token_ids + res.output_token_ids[:-1]
        if res.captured_states is None or res.captured_token_ids is None:
            raise fail("ids", f"the {req.request_id} prompt returned no captured states")
        if res.captured_token_ids.tolist() != ids or res.captured_states.shape[0] != len(ids):
            raise fail("ids", f"the {req.request_id} prompt's capture covers {len(res.captured_token_ids)} ids, "
                              f"{res.captured_states.shape[0]} rows for its {len(ids)} prompt and output tokens")
        states = res.captured_states
        if faults is not None:  # tests only: this test's own captures, each of the two equal ones alike
            states, _ = faults.corrupt(SELF_TEST_RUN, req.request_id, states)
        problem = row_problems(states)
        if problem:
            raise fail("rows", f"the {req.request_id} prompt: {problem.line(layers)}")
        stored[req.request_id] = ids, states
    # Equal requests may sample apart after a few tokens (a random model's near-uniform logits, rounded apart in
    # two rows of one batch, pick different tokens from the same seed): their states are compared where their
    # tokens are still the same, the prompt and the common start of the output.
    common = len(got["short"].prompt_token_ids) + _common_prefix(got["short"].output_token_ids,
                                                                  got["short-again"].output_token_ids)
    same = compare(stored["short"][1][:common], stored["short-again"][1][:common], layers)
    if not same.ok:
        raise fail("duplicate", f"two equal requests in one batch captured different states: {same.line()}")
    # Each alone, in a prefill-only batch of its own: the composition the generation batch did not have.
    for k, name in enumerate(("one-token", "short", "long")):
        ids, states = stored[name]
        (outcome,) = recheck(engine, [Pending(k, name, ids, states, duplicate=name == "short")], layers)
        if not outcome.ok:
            raise fail(outcome.check, f"the {name} prompt re-captured in a batch of its own: {outcome.line}")


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
