"""`RegenDataset`: correct tensors by global index, random order, inline and staged runs, DataLoader workers."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from app.data.dataset import RegenDataset
from tests.support.synthetic_run import Spec, build_run, ok_records


def bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16)


@pytest.mark.parametrize("capture", ["inline", "staged"])
def test_items_match_what_was_written(tmp_path, capture):
    built = build_run(tmp_path, Spec(capture=capture, worker_rejects={1, 9}, shards=4, shard_size=5))
    ok = ok_records(built)
    ds = RegenDataset(str(tmp_path), "synth", cache_shards=1)
    assert len(ds) == len(ok) == 18
    order = list(range(len(ds)))
    random.Random(1).shuffle(order)
    for i in order:
        item, rec = ds[i], ok[i]
        assert item["sample_id"] == rec["sample_id"]
        assert item["input_ids"].dtype == torch.long and item["input_ids"].tolist() == rec["input_ids"]
        assert item["loss_mask"].tolist() == rec["loss_mask"]
        hs = item["hidden_states"]
        assert hs.dtype == torch.bfloat16 and hs.shape == (len(rec["input_ids"]) - 1, 3, 16)
        assert np.array_equal(bits(hs), built.states[rec["sample_id"]])
    assert ds[-1]["sample_id"] == ok[-1]["sample_id"]
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_without_hidden_and_capture_off(tmp_path):
    build_run(tmp_path, Spec(capture="off"))
    with pytest.raises(ValueError):
        RegenDataset(str(tmp_path), "synth")
    ds = RegenDataset(str(tmp_path), "synth", with_hidden=False)
    assert len(ds) == 12 and "hidden_states" not in ds[3]


def test_dataloader_with_workers(tmp_path):
    built = build_run(tmp_path)
    ds = RegenDataset(str(tmp_path), "synth")
    ds[0]  # open a reader in the parent before forking
    loader = torch.utils.data.DataLoader(ds, batch_size=None, shuffle=True, num_workers=2)
    seen = {item["sample_id"]: bits(item["hidden_states"]) for item in loader}
    assert set(seen) == set(built.states)
    assert all(np.array_equal(v, built.states[k]) for k, v in seen.items())
