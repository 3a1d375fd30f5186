"""Turning one shard of prompts into records (and hidden states): the work inside a generate task.

The whole shard goes to the engine at once (continuous batching). As each request finishes, its hidden
states are checked, compressed and appended to the attempt's hidden-state file on an encoder thread while the
engine keeps generating the others (workers.shard.shard_output.HiddenFileStream).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING

from app.base.chat_render import render_ids
from app.base.ids import seed_for
from app.base.loops import loop_stopped, stop_request
from app.base.manifest import RunSettings, compression_level
from app.base.quality import answer_token_count, is_stub, sample_flags, split_reasoning, think_closed
from app.base.records import conversation_id, loss_mask, rejected_record
from app.base.samples import Sample, read_samples
from app.base.thinking import REASONING_START, budget_mask, forced_span
from app.base.thinking_modes import record_thinking, sampling_for
from app.base.tool_calls import worker_prepare
from workers.engine.fault_hook import capture_faults
from workers.engine.recapture import CheckPolicy, Pending
from workers.engine.request import GenRequest, GenResult
from workers.shard import capture_check
from workers.shard.multiturn import regenerate_turns
from workers.shard.states import encode_into, repair_states, states_dtype, zero_embedding_ids

if TYPE_CHECKING:
    from workers.process.context import WorkerContext


log = logging.getLogger("regen.generate")
SAMPLING_RECORDED = ("temperature", "top_p", "top_k", "min_p")  # the record's `sampling`: what its mode and index gave


def render_prompt(tokenizer, messages: list[dict], tools, thinking: bool, preserve_thinking: bool = False) -> list[int]:
    """The target's own chat template on the messages as vLLM's chat path prepares them (string tool-call
    arguments parsed, app.base.tool_calls); ids are what the engine will see."""
    return render_ids(tokenizer, worker_prepare(messages), tools, thinking, preserve_thinking)


def _special_ids(tokenizer) -> tuple[int | None, set[int]]:
    vocab = tokenizer.get_vocab()
    think_end = vocab.get("</think>")
    eos = {i for i in (tokenizer.eos_token_id, vocab.get("<|im_end|>"), vocab.get("<|endoftext|>")) if i is not None}
    return think_end, eos


class ShardGeneration:
    """One shard's records as they are built: a record per training sample, in `records` order.

    `add` renders a sample's prompt (or rejects it with a reason) and returns its request; `finish` fills the
    record from the engine's result on the delivery thread and hands its states to the encoder pool; `collect`
    waits for the encodings and returns (records, summary). Single-turn runs add one sample per input sample
    and run the engine once; multi-turn runs (workers.shard.multiturn) add one per regenerated turn, round by round.
    """

    def __init__(self, ctx: WorkerContext, manifest: dict, run_id: str, shard_id: str, hidden_out=None):
        settings = RunSettings.view(manifest["settings"])
        self.ctx, self.run_id, self.shard_id = ctx, run_id, shard_id
        self.settings = settings
        self.sampling = settings.sampling_dict()
        self.run_seed = int(self.sampling.pop("seed", 0))
        self.thinking = bool(settings.thinking)  # the mode of samples without their own (app.base.thinking_modes)
        self.preserve_thinking = bool(settings.preserve_thinking)
        self.capture_inline = settings.capture_inline
        if self.capture_inline and hidden_out is None:
            raise ValueError("inline capture needs a hidden-state file to write into")
        self.hidden_out = hidden_out
        self.layers = settings.vllm_layer_ids
        self.max_prompt = int(settings.max_prompt_tokens)
        self.max_len = ctx.engine.options.max_model_len
        self.quality = settings.quality
        self.level = compression_level(settings)
        self.stored = states_dtype(settings)  # how the states are stored (app.base.states_codec)
        self.zero_ids = zero_embedding_ids(settings)  # tokens whose all-zero rows are states
        self.think_end_id, self.eos_ids = _special_ids(ctx.tokenizer)
        # The thinking budget (app.base.thinking) and the loop stop (app.base.loops), as the run's manifest sets them.
        self.thinking_budget = settings.thinking_budget
        self.stop_loops = bool(settings.stop_loops)
        self.eos_id = ctx.tokenizer.eos_token_id
        if self.thinking_budget is not None:
            with ctx.tokenizer_lock:
                self.close_ids = ctx.tokenizer.encode(settings.thinking_close, add_special_tokens=False)
                self.start_ids = ctx.tokenizer.encode(REASONING_START, add_special_tokens=False)
        self.records: list[dict] = []
        self.encoded: dict[int, Future] = {}
        self.spans: list[tuple[float, float]] = []
        self.gen_seconds = 0.0
        # The capture check (workers.shard.capture_check): the samples to re-capture once the shard is generated.
        self.check_policy = CheckPolicy.of(settings)
        self.to_check: list[Pending] = []
        self.faults = capture_faults() if self.capture_inline else None  # None but in the tests

    def base(self, sample: Sample, index: int, messages: list[dict], **extra) -> dict:
        mode = {"thinking": record_thinking(sample, self.settings)}
        if sample.get("mode_rule"):
            mode["mode_rule"] = sample["mode_rule"]
        return {
            "run_id": self.run_id, "shard_id": self.shard_id, "sample_id": sample["id"], "index": index, **extra,
            "prompt_id": sample.get("prompt_id") or extra.get("conversation_id") or sample["id"],
            "sample_index": sample.sample_index, **mode,
            "source": sample.get("source"), "messages": messages, "tools": sample.get("tools"),
            "worker": self.ctx.worker_name, "device": self.ctx.config.device_class,
        }

    def add(self, base: dict) -> GenRequest | None:
        """Append the sample's record; its request, or None when the prompt is rejected (the record says why)."""
        pos = len(self.records)
        thinking = base["thinking"]
        try:
            # the record keeps the messages as rendered: tool-call arguments as the objects the template saw
            base["messages"] = worker_prepare(base["messages"])
            with self.ctx.tokenizer_lock:
                prompt_ids = render_ids(self.ctx.tokenizer, base["messages"], base["tools"], thinking,
                                        self.preserve_thinking)
        except Exception as exc:  # a template (or vLLM's chat path) that cannot render this conversation
            self.records.append(rejected_record(base, "template_error", f"{type(exc).__name__}: {exc}"))
            return None
        if len(prompt_ids) > self.max_prompt or len(prompt_ids) + self.sampling["max_tokens"] > self.max_len:
            self.records.append(rejected_record(
                base, "prompt_too_long",
                f"{len(prompt_ids)} prompt tokens (limit {self.max_prompt}; engine max_model_len {self.max_len} "
                f"with max_tokens {self.sampling['max_tokens']})",
            ))
            return None
        seed = seed_for(self.run_seed, base["sample_id"])
        sampling = sampling_for(self.settings, thinking, base["sample_index"])
        recorded = {k: sampling[k] for k in SAMPLING_RECORDED}
        if thinking and self.thinking_budget is not None:
            sampling["thinking_budget"] = recorded["thinking_budget"] = int(self.thinking_budget)
        if self.stop_loops and self.eos_id is not None:
            sampling["stop_loop"] = stop_request(self.quality.repetition_min_repeats, self.eos_id)
        self.records.append({**base, "seed": seed, "sampling": recorded})
        return GenRequest(str(pos), prompt_ids, {**sampling, "seed": seed}, capture=self.capture_inline)

    def finish(self, res: GenResult) -> dict:
        """The engine's result into its record (on the delivery thread); returns the record."""
        i = int(res.request_id)
        rec = self.records[i]
        input_ids = res.prompt_token_ids + res.output_token_ids
        thinking = rec["thinking"]  # each sample judged in its own mode: no reasoning is no fault without thinking
        reasoning, answer = split_reasoning(res.text, thinking)
        n_answer = answer_token_count(res.output_token_ids, self.think_end_id, self.eos_ids, answer)
        flags = sample_flags(thinking=thinking, reasoning=reasoning, think_closed=think_closed(res.text),
                             answer=answer, answer_tokens=n_answer, finish_reason=res.finish_reason,
                             output_ids=res.output_token_ids, quality=self.quality)
        mask = loss_mask(len(res.prompt_token_ids), len(res.output_token_ids))
        marks = self.forced_ids(rec, res, mask, flags)
        rec.update({
            "status": "ok",
            "input_ids": input_ids,
            "loss_mask": mask, **marks,
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
        states = res.captured_states
        if states is not None:
            if self.faults is not None:
                states, fault = self.faults.corrupt(self.run_id, rec["sample_id"], states)
                if fault:
                    rec["fault_injected_for_tests"] = fault
            wanted, first = self.ctx.capture_checks.wants(rec["sample_id"], self.check_policy)
            if wanted:
                self.to_check.append(Pending(i, rec["sample_id"], input_ids[:-1], states, duplicate=first))
            self.encoded[i] = self.ctx.encode_pool.submit(
                encode_into, self.hidden_out, rec["sample_id"], input_ids[:-1], res.captured_token_ids,
                states, self.layers, self.level, stored=self.stored, zero_ids=self.zero_ids,
                hold_repairable=True)
        return rec

    def forced_ids(self, rec: dict, res: GenResult, mask: list[int], flags: list[str]) -> dict:
        """The record's marks for ids the engine forced, with their mask set to 0 in place: `budget_closed` (the
        thinking budget's close text, app.base.thinking) and `loop_stopped` (the loop stop's end-of-turn id, app.base.loops,
        which also keeps the `repetition_loop` flag the forced id hid from the gate and, like a cut at max_tokens,
        is no stub)."""
        out: dict = {}
        n_prompt = len(res.prompt_token_ids)
        forced = []  # [first, end) in input_ids
        budget = rec["sampling"].get("thinking_budget")
        if budget is not None:
            span = forced_span(res.prompt_token_ids, res.output_token_ids, int(budget), self.start_ids,
                               self.close_ids, self.think_end_id)
            if span is not None:
                mask[:] = budget_mask(mask, n_prompt, span)
                out["budget_closed"] = True
                forced.append([n_prompt + span[0], n_prompt + span[1]])
        if self.stop_loops and loop_stopped(res.output_token_ids, res.finish_reason, self.eos_id,
                                            self.quality.repetition_min_repeats):
            mask[-1] = 0
            out["loop_stopped"] = True
            forced.append([len(mask) - 1, len(mask)])
            # a loop cut short is a loop, as one cut at max_tokens is `truncated`: neither is a stub
            flags[:] = [f for f in flags if f not in ("empty_answer", "stub_answer")]
            if "repetition_loop" not in flags:
                flags.append("repetition_loop")
        if forced:
            out["forced"] = forced
        return out

    def run(self, requests: list[GenRequest], on_done=None) -> None:
        """One engine batch; `on_done(record, result)` runs after each result is in its record."""

        def done(res: GenResult) -> None:
            rec = self.finish(res)
            if on_done is not None:
                on_done(rec, res)

        t0, wall0 = time.monotonic(), time.time()
        span = self.ctx.engine.run(requests, done)
        self.gen_seconds += time.monotonic() - t0
        self.spans.append(span or (wall0, wall0))

    def collect(self, order: list[int] | None = None) -> tuple[list[dict], dict]:
        """Re-capture the samples the capture check chose (while the encoders work), wait for every encoding (all
        states are in the file then); (records in `order`, summary)."""
        outcomes = capture_check.run_checks(self.ctx, self.to_check, self.layers)
        for outcome in outcomes:
            capture_check.mark(self.records[outcome.position], outcome)
        placed, held = {}, {}
        for i in sorted(self.encoded):
            problems, position, n_tokens = self.encoded[i].result()
            if position is None:
                held[i] = (self.records[i]["sample_id"], self.records[i]["input_ids"][:-1], problems)
            else:
                placed[i] = (problems, position, n_tokens, None)
        if held:
            placed.update(repair_states(self.ctx, self.hidden_out, held, self.layers, self.level, self.stored,
                                        self.zero_ids))
        for i, (problems, position, n_tokens, repaired) in placed.items():
            self.records[i]["flags"].extend(problems)
            self.records[i]["hidden"] = {"index": position, "n_tokens": n_tokens, "layers": self.layers}
            if repaired is not None:
                self.records[i]["capture_repaired"] = repaired
        records = self.records if order is None else [self.records[i] for i in order]
        summary = shard_summary(records, self.gen_seconds, self.ctx)
        # When the engine took this shard's requests and finished its last one (the engine's clock, not this
        # thread's, which hears of the end later): the gaps between shards' spans are the engine's idle time.
        summary["engine_started"] = round(min(s[0] for s in self.spans), 4)
        summary["engine_finished"] = round(max(s[1] for s in self.spans), 4)
        summary["capture_check"] = capture_check.summary(outcomes)
        return records, summary


def generate_records(ctx: WorkerContext, manifest: dict, run_id: str, shard_id: str, samples: list[dict],
                     hidden_out=None):
    """Return (records, summary) for one shard; with inline capture each sample's states go into `hidden_out`
    (a `workers.shard.shard_output.HiddenFileStream`) as soon as they are encoded."""
    samples = read_samples(samples, f"shard {shard_id}")
    gen = ShardGeneration(ctx, manifest, run_id, shard_id, hidden_out)
    if RunSettings.view(manifest["settings"]).regenerate == "all":
        return regenerate_turns(gen, samples)
    requests = [req for i, sample in enumerate(samples)
                if (req := gen.add(gen.base(sample, i, sample["messages"]))) is not None]
    gen.run(requests)
    return gen.collect()


def shard_summary(records: list[dict], gen_seconds: float, ctx: WorkerContext) -> dict:
    """A shard's counts. `samples` counts the producer's samples (conversations: a multi-turn conversation's
    turns are several records of one sample), `records` the records written, `ok` the ok records."""
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
        "samples": len({conversation_id(r) for r in records}),
        "records": len(records),
        "ok": len(ok),
        "rejected": rejected,
        "flags": flags,
        "stubs": sum(1 for r in ok if is_stub(r["flags"])),
        "prompt_tokens": sum(r["num_prompt_tokens"] for r in ok),
        "generated_tokens": sum(r["num_output_tokens"] for r in ok),
        "generation_seconds": round(gen_seconds, 4),
        "worker": ctx.worker_name,
        "device": ctx.config.device_class,
        "engine_mode": ctx.engine_mode_key,
    }

