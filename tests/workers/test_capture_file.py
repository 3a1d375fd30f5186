"""Reading the capture connector's per-request files without torch (workers/engine/capture_file.py `read_capture_file`).

Small files are read whole, large ones (a real model's samples) are memory-mapped; both paths are tested.

The files are written here with safetensors' torch writer, as the connector writes them; what the reader
returns must be bit-identical to torch's own `.to(torch.bfloat16)` for every dtype a model may run in.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from workers.engine.capture_file import MAP_ABOVE, read_capture_file, remove_capture_file


def _write(path, states: torch.Tensor, ids: torch.Tensor) -> str:
    save_file({"hidden_states": states.contiguous(), "token_ids": ids.contiguous()}, str(path))
    return str(path)


def _bf16_bits(states: torch.Tensor) -> np.ndarray:
    return states.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_capture_file_read_matches_torch(tmp_path, dtype, id_dtype):
    gen = torch.Generator().manual_seed(7)
    states = (torch.randn(13, 3, 64, generator=gen) * 40).to(dtype)
    ids = torch.randint(0, 5000, (13,), generator=gen, dtype=id_dtype)
    got = read_capture_file(_write(tmp_path / "r.safetensors", states, ids))
    assert got is not None
    token_ids, bits = got
    assert token_ids.dtype == np.int64 and token_ids.tolist() == ids.tolist()
    assert bits.dtype == np.uint16 and bits.shape == (13, 3, 64)
    assert np.array_equal(bits, _bf16_bits(states))


def test_capture_file_keeps_non_finite_values(tmp_path):
    """A NaN or Inf in an fp32 capture must reach the sample check as NaN/Inf, never as a finite number."""
    states = torch.ones(4, 2, 8)
    states[1, 0, 3] = float("nan")
    states[2, 1, 5] = float("inf")
    states[3, 0, 0] = -float("inf")
    _, bits = read_capture_file(_write(tmp_path / "r.safetensors", states, torch.arange(4)))
    values = (bits.astype(np.uint32) << 16).view(np.float32)
    assert np.isnan(values[1, 0, 3])
    assert values[2, 1, 5] == np.inf and values[3, 0, 0] == -np.inf
    assert np.isfinite(values).sum() == values.size - 3


def test_capture_file_other_dtypes_go_to_torch_loader(tmp_path):
    """float64 states (no model runs in it) are left to the torch fallback instead of being misread."""
    path = _write(tmp_path / "r.safetensors", torch.zeros(2, 1, 4, dtype=torch.float64), torch.arange(2))
    assert read_capture_file(path) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_large_capture_file_is_mapped_and_survives_its_removal(tmp_path, dtype):
    """Above MAP_ABOVE the reader maps the file; the delivery thread unlinks it right after reading, and the
    arrays must still hold the states (the mapping keeps the pages) when the encoder reads them later."""
    gen = torch.Generator().manual_seed(3)
    tokens = MAP_ABOVE // (2 * 3 * 128) + 50
    states = (torch.randn(tokens, 3, 128, generator=gen) * 5).to(dtype)
    ids = torch.randint(0, 5000, (tokens,), generator=gen)
    path = _write(tmp_path / "big.safetensors", states, ids)
    assert os.path.getsize(path) > MAP_ABOVE
    token_ids, bits = read_capture_file(path)
    remove_capture_file(path)
    assert not os.path.exists(path)
    assert token_ids.tolist() == ids.tolist()
    assert np.array_equal(bits, _bf16_bits(states))


@pytest.mark.parametrize("cut", [0, 5, 100, -1])
def test_truncated_capture_file_is_an_error_not_a_wrong_array(tmp_path, cut):
    """A file cut short (a writer that died mid-write) must raise, never come back as fewer tokens."""
    path = _write(tmp_path / "r.safetensors", torch.ones(8, 2, 16, dtype=torch.bfloat16), torch.arange(8))
    with open(path, "rb") as fh:
        data = fh.read()
    with open(path, "wb") as fh:
        fh.write(data[:cut] if cut >= 0 else data[:cut - 1])
    with pytest.raises(ValueError):
        read_capture_file(path)
