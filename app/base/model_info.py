"""What the run needs to know about the target model without loading it: shape and a fingerprint.

The fingerprint hashes the files that decide what tokens the model sees and produces (config, tokenizer,
chat template, generation config), so a worker that loaded a different checkpoint or template than the run
was produced for refuses the shard instead of silently mixing data.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import struct
from dataclasses import dataclass, field

import numpy as np

from app.base.architecture import Architecture, read_architecture, text_config
from app.base.errors import ConfigError

FINGERPRINT_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "special_tokens_map.json",
)


@dataclass(frozen=True)
class ModelInfo:
    path: str
    num_layers: int
    hidden_size: int
    model_type: str
    fingerprint: str
    architecture: Architecture | None = field(default=None, compare=False)

    def to_manifest(self) -> dict:
        out = {
            "path": self.path,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "model_type": self.model_type,
            "fingerprint": self.fingerprint,
        }
        arch = self.architecture
        if arch is not None and arch.hybrid:  # dense runs' settings stay as they were (reopening compares them)
            out["architectures"] = list(arch.architectures)
            out["layer_types"] = list(arch.layer_types or ())
        return out


def read_text_config(path: str) -> dict:
    """The language model's settings from `path/config.json`; {} when there is none or it does not parse
    (callers then fall back to their defaults; `read_model_info` is the check that refuses such a folder)."""
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as fh:
            return text_config(json.load(fh))
    except (OSError, ValueError):
        return {}


def read_model_info(path: str) -> ModelInfo:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ConfigError(f"{path}: no config.json (regen needs a local model folder; no model hub is used)")
    with open(cfg_path, encoding="utf-8") as fh:
        config = json.load(fh)
    text = text_config(config)
    digest = hashlib.sha256()
    for name in FINGERPRINT_FILES:
        fp = os.path.join(path, name)
        if os.path.isfile(fp):
            digest.update(name.encode() + b"\0")
            with open(fp, "rb") as fh:
                digest.update(hashlib.sha256(fh.read()).digest())
    try:
        return ModelInfo(
            path=os.path.abspath(path),
            num_layers=int(text["num_hidden_layers"]),
            hidden_size=int(text["hidden_size"]),
            model_type=str(text.get("model_type", config.get("model_type", "?"))),
            fingerprint=digest.hexdigest()[:32],
            architecture=read_architecture(config),
        )
    except KeyError as exc:
        raise ConfigError(f"{cfg_path}: missing {exc.args[0]}") from exc


_ZERO_MASK = {"BF16": (np.uint16, 0x7FFF), "F16": (np.uint16, 0x7FFF), "F32": (np.uint32, 0x7FFFFFFF)}


def zero_embedding_ids(path: str) -> list[int]:
    """Token ids whose input embedding row is all zeros in the checkpoint at `path` (its safetensors files).

    Why the capture checks need them: a real forward pass gives a token an all-zero state only if its embedding
    is zero, and then it does, up to the first layer that mixes in other tokens unconditionally. A padding row
    (`nn.Embedding(padding_idx=...)` starts it at zero and no gradient moves it) is such a token: on a hybrid
    Qwen3.5 its rows stay zero through every linear-attention layer (their output is gated by a projection of the
    zero input). So a zero row is a capture fault except at these tokens. Read from the safetensors header and a
    memory map of the embedding tensor (no torch): rows are compared with +/-0 in blocks. [] when there is no
    `*embed_tokens.weight` tensor in a dtype read here (BF16, F16, F32)."""
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with open(file, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        names = [n for n in header if n.endswith("embed_tokens.weight") and not n.startswith("mtp")]
        if not names:
            continue
        meta = header[min(names, key=len)]
        if meta["dtype"] not in _ZERO_MASK or len(meta["shape"]) != 2:
            return []
        dtype, mask = _ZERO_MASK[meta["dtype"]]
        rows = np.memmap(file, dtype=dtype, mode="r", offset=8 + size + meta["data_offsets"][0],
                         shape=tuple(meta["shape"]))
        out: list[int] = []
        for start in range(0, rows.shape[0], 4096):
            block = np.bitwise_and(rows[start:start + 4096], dtype(mask))
            out += (np.flatnonzero(~block.any(axis=1)) + start).tolist()
        return out
    return []
