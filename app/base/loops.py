"""Loops stopped early (`--stop-loops`): what a request asks the engine's loop stop for (workers.engine.loop_stop),
and how a record finds that the stop ended it.

The engine checks a request's output every CHECK_EVERY tokens with the quality gate's own test
(app.base.quality.repetition_loop at the run's `repetition_min_repeats`) and, once it holds, forces the end-of-turn
id. So an output the stop ended is a loop followed by that one id, which the model did not choose: the record
says `loop_stopped`, keeps the `repetition_loop` flag, and its loss mask leaves the forced id out. At most
CHECK_EVERY - 1 looping tokens are generated after the loop is first detectable.
"""

from __future__ import annotations

from app.base.quality import repetition_loop

LOOP_STOP_ARG = "regen_loop_stop"  # the key of SamplingParams.extra_args the engine's processor reads
CHECK_EVERY = 16
MAX_PERIOD = 64  # app.base.quality.repetition_loop's default: the longest repeated span looked for


def gpu_runner_refusal(device: str, v1_runner: bool) -> str | None:
    """Why a GPU engine cannot run the loop stop, else None. The processor is written to vLLM's V1 logits-processor
    interface, which the V1 model runner (every CPU engine) loads; a GPU engine of vLLM 0.32 runs Model Runner V2
    wherever it can, whose loader takes only its own interface and refuses the class. Running V1 there
    (VLLM_USE_V2_MODEL_RUNNER=0, `v1_runner`: app.base.config) is the operator's choice to make, not regen's: it
    changes the engine's path."""
    if device == "cpu" or v1_runner:
        return None
    return ("--stop-loops on a GPU engine: the loop stop is a vLLM V1-runner logits processor, and vLLM runs Model "
            "Runner V2 on GPUs, which refuses it; start the workers with VLLM_USE_V2_MODEL_RUNNER=0, or produce "
            "without --stop-loops (loops are then flagged, not stopped)")


def stop_request(min_repeats: int, eos: int) -> dict:
    """The request's ask, as the engine's processor reads it."""
    return {"min_repeats": int(min_repeats), "eos": int(eos), "every": CHECK_EVERY}


def loop_stopped(output_ids: list[int], finish_reason: str | None, eos: int | None, min_repeats: int) -> bool:
    """Whether the loop stop ended this output: it stopped on `eos`, and the ids before it end in a loop at a
    length the stop checks (a multiple of CHECK_EVERY)."""
    if eos is None or finish_reason != "stop" or len(output_ids) < 2 or output_ids[-1] != eos:
        return False
    body = output_ids[:-1]
    return len(body) % CHECK_EVERY == 0 and repetition_loop(body, min_repeats)
