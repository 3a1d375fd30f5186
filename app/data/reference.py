"""Reference hidden-state capture with plain transformers.

Why: some hosts cannot run vLLM, the fleet's output must be checked against something independent of vLLM's
capture path, and vLLM has shipped capture bugs; a straight transformers forward pass is the ground truth.
Layers are vLLM's ids (app.base.layers), read with forward hooks on the decoder layers (never the normed last
`hidden_states`); no lm_head. States come back as uint16 bf16 bit patterns `[T, L, H]`, as app.base.hidden_file
stores them. Why each choice: docs/checking.md#the-transformers-reference.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from app.base.hidden_file import bf16_to_float32


class _StopForward(Exception):
    """Raised from the deepest hook: the remaining layers, the final norm and the head are not needed."""


def _to_bf16_bits(t: torch.Tensor) -> np.ndarray:
    """A tensor (any float dtype) -> numpy uint16 bf16 bit patterns, rounding like torch's `.to(bfloat16)`."""
    t = t.detach().to("cpu", torch.bfloat16).contiguous()
    return t.view(torch.int16).numpy().view(np.uint16)


class ReferenceCapture:
    """Capture decoder-layer outputs of a causal LM at vLLM layer ids with transformers.

    `ReferenceCapture(model_path, [1, 2, 4])` loads the model once (from a local folder; set HF_HUB_OFFLINE=1
    where no hub is reachable); `capture(token_ids)` returns `[T, len(layers), H]` uint16 bf16 bit patterns
    in the order the layers were given. `ReferenceCapture.from_model(model, layers)` wraps a model already in
    memory (benchmarks, tests that build a random model).
    """

    def __init__(
        self,
        model_path: str | None,
        layers_vllm: Sequence[int],
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.bfloat16,
        *,
        model: torch.nn.Module | None = None,
    ):
        if model is None:
            if model_path is None:
                raise ValueError("give model_path or model")
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
            model.to(device)
        model.eval()
        self.model = model
        self.base = model.model if hasattr(model, "model") else model  # the decoder stack, without lm_head
        # a multimodal wrapper (Qwen3_5ForConditionalGeneration) holds the language model beside its vision tower
        self.base = getattr(self.base, "language_model", self.base)
        self.device = torch.device(device) if model_path is not None else next(model.parameters()).device
        decoder_layers = self.base.layers
        self.num_layers = len(decoder_layers)
        self.layers = [int(x) for x in layers_vllm]
        if not self.layers:
            raise ValueError("no layers requested")
        bad = [v for v in self.layers if not 1 <= v <= self.num_layers]
        if bad:
            raise ValueError(f"vLLM layer ids {bad} outside 1..{self.num_layers} for a {self.num_layers}-layer model")
        if len(set(self.layers)) != len(self.layers):
            raise ValueError(f"repeated layer ids in {self.layers}")
        self._deepest = max(self.layers)
        self._captured: dict[int, torch.Tensor] = {}
        self._active = False  # hooks record only during our own capture(): several captures may share a model
        self._stop = True  # the deepest hook ends the pass (capture); False runs to the final norm (with_final)
        self._handles = [
            decoder_layers[v - 1].register_forward_hook(self._make_hook(v)) for v in sorted(set(self.layers))
        ]

    @classmethod
    def from_model(cls, model: torch.nn.Module, layers_vllm: Sequence[int]) -> ReferenceCapture:
        return cls(None, layers_vllm, model=model)

    def _make_hook(self, vllm_id: int):
        def hook(_module, _inputs, output):
            if not self._active:
                return None
            # Decoder layers return a tensor in current transformers and a tuple (hidden, ...) in older ones.
            hidden = output[0] if isinstance(output, tuple | list) else output
            self._captured[vllm_id] = hidden
            if vllm_id == self._deepest and self._stop:
                raise _StopForward

        return hook

    def close(self) -> None:
        """Remove the hooks (the model stays usable without them)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def capture(self, token_ids: Sequence[int]) -> np.ndarray:
        """States for one sequence: uint16 bf16 bit patterns `[T, L, H]`, layers in the order requested.

        The whole sequence is one causal forward pass with no cache, so token t's state depends on tokens
        0..t only, exactly as in vLLM's prefill + decode.
        """
        return self._run(token_ids)[0]

    def capture_with_final(self, token_ids: Sequence[int]) -> tuple[np.ndarray, torch.Tensor]:
        """`capture` and, from the same pass run to the end, the final normed hidden states `[T, H]`: row t is what
        the LM head (`head`) turns into the logits of token t+1 (app.data.token_check)."""
        self._stop = False
        try:
            return self._run(token_ids)
        finally:
            self._stop = True

    @property
    def head(self) -> torch.nn.Module:
        """The LM head: final hidden states -> logits."""
        return self.model.get_output_embeddings()

    def _run(self, token_ids: Sequence[int]) -> tuple[np.ndarray, torch.Tensor | None]:
        ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=self.device).unsqueeze(0)
        if ids.shape[1] == 0:
            raise ValueError("empty token sequence")
        self._captured = {}
        self._active = True
        final = None
        try:
            with torch.inference_mode():
                final = self.base(input_ids=ids, use_cache=False).last_hidden_state[0]
        except _StopForward:
            pass
        finally:
            self._active = False
            captured, self._captured = self._captured, {}
        missing = [v for v in self.layers if v not in captured]
        if missing:
            raise RuntimeError(f"hooks for vLLM layers {missing} did not fire")
        stacked = torch.stack([captured[v][0] for v in self.layers], dim=1)  # [T, L, H]
        return _to_bf16_bits(stacked), final

    def capture_batch(self, batch: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """`capture` for each sequence (one pass each: no padding, so no mask or position subtleties)."""
        return [self.capture(ids) for ids in batch]


def compare_states(a_u16: np.ndarray, b_u16: np.ndarray) -> dict[str, float]:
    """Differences between two bf16 state arrays (bit patterns) of one shape, computed in float32.

    max_abs / mean_abs are over all elements; rel = ||a - b|| / ||b|| (Frobenius), so it reads the same for
    layers whose activations differ in scale.
    """
    if a_u16.shape != b_u16.shape:
        raise ValueError(f"shapes differ: {a_u16.shape} vs {b_u16.shape}")
    a = bf16_to_float32(np.ascontiguousarray(a_u16, dtype=np.uint16))
    b = bf16_to_float32(np.ascontiguousarray(b_u16, dtype=np.uint16))
    diff = np.abs(a - b, dtype=np.float32)
    norm_b = float(np.linalg.norm(b.astype(np.float64)))
    return {
        "max_abs": float(diff.max()) if diff.size else 0.0,
        "mean_abs": float(diff.mean()) if diff.size else 0.0,
        "rel": float(np.linalg.norm(diff.astype(np.float64)) / norm_b) if norm_b > 0 else float(diff.max(initial=0.0)),
    }
