"""A hidden-state connector that also works when the KV cache lives on the CPU.

vLLM's `ExampleHiddenStatesConnector` (with the `extract_hidden_states` method) copies each finished
request's states out of a KV-cache-like buffer and writes them to a safetensors file. Its copy uses CUDA
streams and pinned memory, so on a CPU engine it fails (`pin_memory=True requires a CUDA ... backend`,
docs/measured-facts.md). On the CPU this subclass extracts synchronously and writes the file before reporting the request
as sent; on a GPU it defers to the stock, asynchronous path.

It overrides a private method (`_submit_async_write`), so it is pinned to the vLLM versions it was written
and tested against: `SUPPORTED_VLLM` below, checked when the worker builds its engine.
"""

from __future__ import annotations

import os

import torch
import vllm
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

from app.base.errors import ConfigError

SUPPORTED_VLLM = ((0, 32), (0, 33))


class _DoneEvent:
    """Stands in for the CUDA event the parent polls: the CPU copy is complete when we return."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class CpuCapableHiddenStatesConnector(ExampleHiddenStatesConnector):
    """`ExampleHiddenStatesConnector` with a synchronous extraction path for a CPU-resident cache."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if self._kv_cache is None or self._kv_cache.is_cuda or not self._is_tp_rank_zero:
            return super()._submit_async_write(pending)
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets.reshape(1, -1) + block_ids.reshape(-1, 1) * self._block_size).flatten()
        num_tokens = pending.token_ids.shape[0]
        states = extract_from_kv_cache(self._kv_cache, slots, num_tokens).clone()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            save_file({"hidden_states": states, "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)
        self._req_copy_events[pending.req_id] = _DoneEvent()


def check_vllm_version() -> None:
    major_minor = tuple(int(x) for x in vllm.__version__.split(".")[:2])
    if major_minor not in SUPPORTED_VLLM:
        raise ConfigError(
            f"vLLM {vllm.__version__} is not a version the capture connector was written for "
            f"({', '.join('.'.join(map(str, v)) for v in SUPPORTED_VLLM)}); pin vllm accordingly"
        )
