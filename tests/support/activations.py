"""Synthetic hidden states shaped like a trained LLM's residual stream, for the lossy-codec tests and bench.

Random-init models (the tiny test model, the codec bench's) have near-Gaussian states; trained ones do not,
and what breaks a lossy codec is exactly what they add: heavy tails, a few channels 20-60x the rest with a fixed
sign, norms growing with depth, and "massive activations" on the first token (the attention sink, whose states
are ~100x every other token's). All-negative rows are added too (a sign bit set everywhere must survive). Values
are float32; round them to bf16 with `app.base.hidden_file.float32_to_bf16`.
"""

from __future__ import annotations

import numpy as np

SINK_FACTOR = 100.0


def realistic_activations(rng: np.random.Generator, n_tokens: int, n_layers: int, hidden: int,
                          sink: bool = True, negative_rows: int = 2) -> np.ndarray:
    """float32 `[n_tokens, n_layers, hidden]` with the features above (see the module docstring)."""
    channel_scale = rng.lognormal(0.0, 0.5, size=hidden).astype(np.float32)
    x = rng.standard_t(5, size=(n_tokens, n_layers, hidden)).astype(np.float32) * channel_scale
    outliers = rng.choice(hidden, size=max(1, hidden // 400), replace=False)
    x[:, :, outliers] = (np.abs(x[:, :, outliers]) + 1) * rng.uniform(20, 60, size=outliers.size).astype(np.float32)
    x *= (1.5 ** np.arange(n_layers, dtype=np.float32))[None, :, None]  # norms grow with depth
    if sink and n_tokens:
        x[0] *= SINK_FACTOR
    for t in rng.choice(n_tokens, size=min(negative_rows, n_tokens), replace=False) if n_tokens else ():
        layer = rng.integers(n_layers)
        x[t, layer] = -np.abs(x[t, layer]) - 0.01
    return x
