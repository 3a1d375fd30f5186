"""SpecForge offline training data: one `torch.save` dict per sample, `rows_{g}-{g+2000}/data_{i}.ckpt`.

Written as SpecForge's offline reader and its per-algorithm normalisers check them: `specforge-dflash` (the
auxiliary layers concatenated, ascending) and `specforge-eagle3` (the normed last layer and three auxiliary
layers). `index` is the sample's number over the export; 2000 files to a folder, as SpecForge does.
Field by field: docs/formats.md#specforges-offline-files-in-detail.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from app.base.errors import RegenError
from app.base.model_info import read_model_info
from app.data.export_trainers import StateExport
from app.data.final_norm import FinalNorm

GROUP = 2000


def _bf16(states_u16: np.ndarray):
    """The bit patterns as a torch bf16 tensor sharing their memory (strided where they are: torch takes numpy's
    strides, and `view(dtype)` keeps them for a same-size dtype)."""
    import torch

    return torch.from_numpy(states_u16.view(np.int16)).view(torch.bfloat16)


class _SpecForge(StateExport):
    def sample_rel(self, index: int) -> str:
        g = index // GROUP * GROUP
        return f"rows_{g}-{g + GROUP}/data_{index}.ckpt"

    def remove_from(self, end: int) -> None:
        for folder in self.out.listdir(""):
            if not folder.startswith("rows_"):
                continue
            try:
                hi = int(folder.split("-")[-1])
            except ValueError:
                continue
            if hi <= end:
                continue
            for name in self.out.listdir(folder):
                if name.startswith("data_") and name.endswith(".ckpt") and int(name[5:-5]) >= end:
                    self.out.delete(f"{folder}/{name}")

    def save(self, index: int, tensors: dict) -> None:
        """torch.save straight into the file being written (atomically, as `write_bytes` does).

        A file object takes the same path in torch.save as a BytesIO (the zip writer on a buffer), so the bytes
        are the same; the BytesIO grew by reallocation and `getvalue()` copied it once more before the write:
        ~0.25 s of a 14 s, 807 MB DFlash shard's profile went to the buffer (bench/bench_export_speed.py).
        """
        import torch

        with self.out.atomic_writer(self.sample_rel(index)) as fh:
            torch.save(tensors, fh)

    def prepare(self, sample):
        """The torch.save dict built in the read-ahead thread (EAGLE-3's final norm and aux copy are most of a
        sample's CPU time besides decoding); the states are dropped from the sample once the dict holds what
        is written of them."""
        return dataclasses.replace(sample, states=None, tensors=self.tensors(sample))

    def write_sample(self, index: int, sample) -> None:
        self.save(index, sample.tensors if sample.tensors is not None else self.tensors(sample))

    def tensors(self, sample) -> dict:
        raise NotImplementedError

    def base(self, sample) -> dict:
        import torch

        return {"input_ids": torch.tensor(sample.input_ids, dtype=torch.long),
                "loss_mask": torch.tensor(sample.loss_mask, dtype=torch.long)}

    def aux(self, sample):
        """The auxiliary layers side by side, [1, T, n*H] bf16.

        The sample holds them first, decoded in place (`ExportLayers.read_slots`): when they are all it holds
        (DFlash) the reshape is a view and nothing is copied; with the final layer after them (EAGLE-3) it is
        one copy of the auxiliary layers."""
        states = sample.states[:, :len(self.layers.aux), :]
        # contiguous: torch.save writes a tensor's whole storage, so a strided view would write the final layer too
        return _bf16(np.ascontiguousarray(states.reshape(states.shape[0], -1))).unsqueeze(0)


class SpecForgeDFlash(_SpecForge):
    name = "specforge-dflash"
    consecutive_supervision = True

    def meta(self) -> dict:
        return {**super().meta(), "specforge": {"strategy": "dflash", "dflash_config.target_layer_ids":
                                                [v - 1 for v in self.layers.aux]}}

    def tensors(self, sample) -> dict:
        return {**self.base(sample), "hidden_states": self.aux(sample)}


class SpecForgeEagle3(_SpecForge):
    name = "specforge-eagle3"

    def __init__(self, reader, out, layers_spec, model_path: str | None = None):
        super().__init__(reader, out, layers_spec)

        path = model_path or self.model.get("path") or ""
        self.norm = FinalNorm(path)
        want = self.model.get("fingerprint")
        have = read_model_info(path).fingerprint
        if want and have != want:
            raise RegenError(f"{path} is not the checkpoint run {reader.run_id!r} was made with (fingerprint "
                             f"{have} != {want}): the final norm must come from the run's target")

    def meta(self) -> dict:
        return {**super().meta(), "final_norm": self.norm.meta(),
                "specforge": {"strategy": "eagle3", "aux_hidden_state_layer_ids": [v - 1 for v in self.layers.aux]}}

    def tensors(self, sample) -> dict:
        # read_slots: the final layer after the aux ones; a strided view, which the norm's float32 cast reads
        # without a contiguous copy first
        final = _bf16(sample.states[:, len(self.layers.aux), :])
        return {**self.base(sample), "hidden_state": self.norm(final).unsqueeze(0),
                "aux_hidden_state": self.aux(sample)}
