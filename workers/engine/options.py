"""What an engine is built from: the model, the device, the capture layers and vLLM's sizes.

One dataclass for both engines (in this process or in a child process of its own), so a worker's settings
travel as one object: the worker builds it from its config, the child process receives it pickled.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineOptions:
    model: str
    device: str = "cpu"  # "cpu" or "cuda"
    capture_layers: tuple[int, ...] | None = None  # vLLM ids; None = no capture
    max_model_len: int = 4096
    max_num_seqs: int = 64
    gpu_memory_utilization: float = 0.1
    # KV cache size in bytes. None: on a GPU vLLM sizes it from gpu_memory_utilization; on the CPU it is
    # CPU_KV_CACHE_BYTES (workers.engine.llm_arguments).
    kv_cache_memory_bytes: int | None = None
    tensor_parallel_size: int = 1
    enforce_eager: bool = True
    in_process: bool = True
    # The engine (built in-process) lives in a child process of the worker (workers.engine.process), so the
    # worker's side work never holds the GIL the engine's steps need. The CPU preset turns it on.
    host_process: bool = False
    scratch_dir: str = "/tmp/regen-capture"
    dtype: str = "bfloat16"
    extra: dict = field(default_factory=dict)
    # The operator's `--vllm-arg KEY=VALUE`s, as given (app.base.vllm_args parses them with vLLM's parser).
    vllm_args: list[str] = field(default_factory=list)
    # Speculative generation ("mtp:K", app.base.speculative): a generation engine's only; llm_kwargs refuses it
    # beside capture_layers.
    speculative: str | None = None
    # The run's thinking-budget close text (app.base.thinking): the engine gets vLLM's `reasoning_config` with it, which
    # `thinking_token_budget` needs; None: no reasoning config (a budgeted request would be rejected).
    thinking_close: str | None = None
    # vLLM's custom logits processors cannot run beside any speculative config, so only an engine without one
    # gets the loop stop (workers.engine.loop_stop); requests ask for it in their sampling.
    stop_loops: bool = False

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}
