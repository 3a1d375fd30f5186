"""A PyTorch `Dataset` over a whole run, read in place from storage (no export step needed).

Why in place: exporting 100+ TB of states to another layout doubles the disk bill. The shard files already
allow random access: the sample index comes from the completion markers' `ok` counts (no record is read to
build it), a shard's records are decoded once and cached, and each sample's states are two seeks into the
shard's hidden file through a cached reader (app.data.run_reader re-opens files after a DataLoader fork).
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from app.base.storage import Storage
from app.data.run_reader import RunReader, SampleIndex


class RegenDataset(Dataset):
    """`ds[i]` -> {input_ids int64 [T], loss_mask int64 [T], hidden_states bf16 [T-1, L, H], sample_id}.

    Samples are the run's `status: ok` records in shard order; only done shards are included (the index is
    built at construction time, so a run still generating shows the shards done by then). `hidden_states` are
    bf16 whatever the run stores (`--states-dtype`): lossy samples are decoded by the hidden-file reader.
    """

    def __init__(self, storage: Storage | str, run_id: str, with_hidden: bool = True, max_open_files: int = 8,
                 cache_shards: int = 4):
        self.reader = RunReader(storage, run_id, max_open=max_open_files)
        self.with_hidden = with_hidden
        if with_hidden and self.reader.capture_mode == "off":
            raise ValueError(f"run {run_id!r} captured no hidden states; use with_hidden=False")
        self.index = SampleIndex(self.reader, cache_shards=cache_shards)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict:
        info, rec = self.index.record(int(i))
        item = {
            "input_ids": torch.tensor(rec["input_ids"], dtype=torch.long),
            "loss_mask": torch.tensor(rec["loss_mask"], dtype=torch.long),
            "sample_id": rec["sample_id"],
        }
        if self.with_hidden:
            got = self.reader.states(info, rec)
            if got is None:
                raise KeyError(f"shard {info.shard_id} has no hidden states for sample {rec['sample_id']} "
                               "(staged capture not finished?)")
            tokens, states = got
            if tokens.shape[0] != len(rec["input_ids"]) - 1:
                raise ValueError(f"sample {rec['sample_id']}: states for {tokens.shape[0]} tokens, "
                                 f"record has {len(rec['input_ids'])} ids")
            item["hidden_states"] = torch.from_numpy(states.view(np.int16)).view(torch.bfloat16)  # fresh array: no copy
        return item
