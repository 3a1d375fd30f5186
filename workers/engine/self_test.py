"""The engine's self-test: a few tokens generated (and captured) before the worker consumes a shard.

Why: a broken engine (no tokens, NaN or all-zero captured states) must fail the worker's start, where the
supervisor restarts it with backoff, rather than fail every shard it would take.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from app.errors import EngineDead
from workers.engine.request import GenRequest, GenResult

if TYPE_CHECKING:
    from workers.engine.interface import Engine


def run_self_test(engine: Engine) -> float:
    """Generate a few tokens on `engine` (either kind) and check them; the seconds it took."""
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
