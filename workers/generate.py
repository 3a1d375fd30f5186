"""Turning one shard of prompts into records (and hidden states): the work inside a generate task.

The whole shard goes to the engine at once (continuous batching). As each request finishes, its hidden
states are checked, compressed and appended to the attempt's hidden-state file on an encoder thread while the
engine keeps generating the others (workers/shard_output.HiddenFileStream).
"""

from __future__ import annotations

import time
from concurrent.futures import Future

import numpy as np

from app.hidden_file import encode_sample
from app.ids import seed_for
from app.records import loss_mask, rejected_record
from workers.engine import GenRequest, GenResult
from workers.quality import answer_token_count, is_stub, sample_flags, split_reasoning, states_problem


def render_prompt(tokenizer, messages: list[dict], tools, thinking: bool) -> list[int]:
    """The target's own chat template with `enable_thinking`; ids are what the engine will see."""
    text = tokenizer.apply_chat_template(
        messages, tools=tools or None, add_generation_prompt=True, enable_thinking=thinking, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)


def _special_ids(tokenizer) -> tuple[int | None, set[int]]:
    vocab = tokenizer.get_vocab()
    think_end = vocab.get("</think>")
    eos = {i for i in (tokenizer.eos_token_id, vocab.get("<|im_end|>"), vocab.get("<|endoftext|>")) if i is not None}
    return think_end, eos


def generate_shard(ctx, manifest: dict, run_id: str, shard_id: str, samples: list[dict], hidden_out=None):
    """Return (records, summary) for one shard; with inline capture each sample's states go into `hidden_out`
    (a `workers.shard_output.HiddenFileStream`) as soon as they are encoded."""
    settings = manifest["settings"]
    sampling = dict(settings["sampling"])
    run_seed = int(sampling.pop("seed", 0))
    thinking = bool(settings["thinking"])
    capture_inline = settings["capture_mode"] == "inline"
    if capture_inline and hidden_out is None:
        raise ValueError("inline capture needs a hidden-state file to write into")
    layers = settings["layers"]["vllm_ids"] if settings.get("layers") else None
    max_prompt = int(settings["max_prompt_tokens"])
    max_len = ctx.engine.options.max_model_len
    quality = _quality(settings)
    level = int(settings.get("compression_level", 3))
    stored = states_dtype(settings)
    think_end_id, eos_ids = _special_ids(ctx.tokenizer)

    if settings.get("regenerate") == "all":
        from workers.multiturn import fill_earlier_turns

        samples = fill_earlier_turns(ctx, settings, samples, render_prompt)

    records: list[dict | None] = [None] * len(samples)
    requests: list[GenRequest] = []
    for i, sample in enumerate(samples):
        base = {
            "run_id": run_id, "shard_id": shard_id, "sample_id": sample["id"], "index": i,
            "source": sample.get("source"), "messages": sample["messages"], "tools": sample.get("tools"),
            "worker": ctx.worker_name, "device": ctx.config.device_class,
        }
        if "turns" in sample:
            base["turns"] = sample["turns"]
        try:
            with ctx.tokenizer_lock:
                prompt_ids = render_prompt(ctx.tokenizer, sample["messages"], sample.get("tools"), thinking)
        except Exception as exc:  # a template that cannot render this conversation
            records[i] = rejected_record(base, "template_error", f"{type(exc).__name__}: {exc}")
            continue
        if len(prompt_ids) > max_prompt or len(prompt_ids) + sampling["max_tokens"] > max_len:
            records[i] = rejected_record(
                base, "prompt_too_long",
                f"{len(prompt_ids)} prompt tokens (limit {max_prompt}; engine max_model_len {max_len} "
                f"with max_tokens {sampling['max_tokens']})",
            )
            continue
        seed = seed_for(run_seed, sample["id"])
        records[i] = {**base, "seed": seed}
        requests.append(GenRequest(str(i), prompt_ids, {**sampling, "seed": seed}, capture=capture_inline))

    encoded: dict[int, Future] = {}
    stubs = 0

    def on_done(res: GenResult) -> None:
        nonlocal stubs
        i = int(res.request_id)
        rec = records[i]
        input_ids = res.prompt_token_ids + res.output_token_ids
        reasoning, answer = split_reasoning(res.text, thinking)
        n_answer = answer_token_count(res.output_token_ids, think_end_id, eos_ids, answer)
        flags = sample_flags(thinking=thinking, reasoning=reasoning, answer=answer, answer_tokens=n_answer,
                             finish_reason=res.finish_reason, output_ids=res.output_token_ids, quality=quality)
        rec.update({
            "status": "ok",
            "input_ids": input_ids,
            "loss_mask": loss_mask(len(res.prompt_token_ids), len(res.output_token_ids)),
            "num_prompt_tokens": len(res.prompt_token_ids),
            "num_output_tokens": len(res.output_token_ids),
            "num_answer_tokens": n_answer,
            "text": res.text, "reasoning": reasoning, "answer": answer,
            "finish_reason": res.finish_reason,
            "stop_reason": res.stop_reason,
            "seconds": round(res.seconds, 4),
            "flags": flags,
            "hidden": None,
        })
        if res.captured_states is not None:
            encoded[i] = ctx.encode_pool.submit(encode_into, hidden_out, rec["sample_id"], input_ids[:-1],
                                                res.captured_token_ids, res.captured_states, layers, level,
                                                stored=stored)
        if is_stub(flags):
            stubs += 1

    t0, wall0 = time.monotonic(), time.time()
    engine_window = ctx.engine.run(requests, on_done) or (wall0, wall0)  # the engine's own span of this shard
    gen_seconds = time.monotonic() - t0

    for i in sorted(encoded):  # every sample's states are in the file once this loop is through
        problems, position, n_tokens = encoded[i].result()
        records[i]["flags"].extend(problems)
        records[i]["hidden"] = {"index": position, "n_tokens": n_tokens, "layers": layers}
    summary = summarise(records, gen_seconds, ctx)
    # When the engine took this shard's requests and finished its last one (the engine's clock, not this
    # thread's, which hears of the end later): the gaps between shards' spans are the engine's idle time.
    summary["engine_started"], summary["engine_finished"] = (round(t, 4) for t in engine_window)
    return records, summary


def states_dtype(settings: dict) -> str:
    """The run's stored states dtype (app/states_codec.py); runs made before the setting existed store bf16."""
    return (settings.get("states") or {}).get("dtype", "bf16")


def encode_into(hidden_out, sample_id: str, *args, **kwargs) -> tuple[list[str], int, int]:
    """check_and_encode, then append to the attempt's file (a HiddenFileStream): (flags, position, tokens)."""
    problems, sample = check_and_encode(sample_id, *args, **kwargs)
    return problems, hidden_out.append(sample), sample.n_tokens


def check_and_encode(sample_id: str, expected_ids: list[int], captured_ids: np.ndarray, states: np.ndarray,
                     layers: list[int], level: int, trim: bool = False, stored: str = "bf16"):
    """(capture flags, encoded sample) for one finished sample, on an encoder thread.

    The quality gate's checks (all-zero layer, NaN/Inf) read the states as captured, before a lossy `stored`
    dtype quantises them; a sample they flag is stored losslessly (app/hidden_file.encode_sample).

    The check reads every state once (~50 ms for a real model's [4000, 5, 5120] sample) and encoding ~0.4 s: both
    run here, several samples at a time, rather than on the engine's single delivery thread, which would otherwise
    cap a worker at a few samples per second of real size. Flags are added to the record when the shard collects
    the results, before anything counts or writes them. `expected_ids` are the record's `input_ids[:-1]`; with
    `trim` (staged capture, whose prefill also covers the last id) only that many captured tokens are checked
    and kept.
    """
    want = np.asarray(expected_ids, dtype=np.int64)
    if trim:
        captured_ids, states = captured_ids[: len(want)], states[: len(want)]
    problems = []
    if captured_ids.shape != want.shape or not np.array_equal(captured_ids, want):
        problems.append("capture_mismatch")
    problem = states_problem(states)
    if problem:
        problems.append(problem)
    return problems, encode_sample(sample_id, captured_ids, np.ascontiguousarray(states), layers, level,
                                   stored=stored)


def summarise(records: list[dict], gen_seconds: float, ctx) -> dict:
    flags: dict[str, int] = {}
    ok = [r for r in records if r.get("status") == "ok"]
    for r in ok:
        for f in r["flags"]:
            flags[f] = flags.get(f, 0) + 1
    rejected: dict[str, int] = {}
    for r in records:
        if r.get("status") == "rejected":
            rejected[r["reject_reason"]] = rejected.get(r["reject_reason"], 0) + 1
    return {
        "samples": len(records),
        "ok": len(ok),
        "rejected": rejected,
        "flags": flags,
        "stubs": sum(1 for r in ok if is_stub(r["flags"])),
        "prompt_tokens": sum(r["num_prompt_tokens"] for r in ok),
        "generated_tokens": sum(r["num_output_tokens"] for r in ok),
        "generation_seconds": round(gen_seconds, 4),
        "worker": ctx.worker_name,
        "device": ctx.config.device_class,
    }


def _quality(settings: dict):
    from app.manifest import QualitySettings

    return QualitySettings(**settings.get("quality", {}))
