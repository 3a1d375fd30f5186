"""The tokens whose input embedding row is zero, read from the checkpoint and kept in the run's manifest: their
all-zero states are states, not capture faults (app/model_info.zero_embedding_ids)."""

from __future__ import annotations

import numpy as np
from safetensors.numpy import save_file

from app.base.model_info import read_model_info, zero_embedding_ids
from producer.run_setup import model_settings


def test_the_padding_row_of_the_tiny_models_embedding_is_found_and_recorded(tiny_qwen3):
    from transformers import AutoTokenizer

    pad = AutoTokenizer.from_pretrained(str(tiny_qwen3)).pad_token_id
    assert zero_embedding_ids(str(tiny_qwen3)) == [pad]  # bf16, nn.Embedding(padding_idx=pad) leaves it zero
    settings = model_settings(read_model_info(str(tiny_qwen3)), str(tiny_qwen3))
    assert settings["zero_embedding_ids"] == [pad]


def test_zero_rows_are_found_in_float_checkpoints_and_negative_zero_counts(tmp_path):
    rows = np.array([[1, 2], [0, 0], [0, -0.0], [0, 1e-30]], dtype=np.float32)
    save_file({"model.embed_tokens.weight": rows, "lm_head.weight": np.zeros((4, 2), np.float32)},
              str(tmp_path / "model.safetensors"))
    assert zero_embedding_ids(str(tmp_path)) == [1, 2]


def test_a_checkpoint_without_zero_rows_or_an_embedding_records_none(tmp_path):
    save_file({"model.embed_tokens.weight": np.ones((3, 2), np.float16)}, str(tmp_path / "model.safetensors"))
    assert zero_embedding_ids(str(tmp_path)) == []
    other = tmp_path / "other"
    other.mkdir()
    save_file({"lm_head.weight": np.zeros((3, 2), np.float32)}, str(other / "model.safetensors"))
    assert zero_embedding_ids(str(other)) == []
