"""Reading and removing the capture connector's per-request files (safetensors: token ids and hidden states).

`read_capture_file` reads them without torch, because it runs once per sample beside the engine: a torch op on
that thread would give torch a second OpenMP team beside the engine thread's (libgomp, seeing more threads than
cores, stops spin-waiting: an fp32 CPU engine measured ~0.8x). vLLM's own loader (`load_capture_with_torch`)
is for a separate engine-core process, whose file lock it waits on, and dtypes the reader leaves to torch.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import struct

import numpy as np
import orjson

from app.base.hidden_file import float32_to_bf16
from workers.engine.request import GenResult

MAP_ABOVE = 1 << 20  # files larger than this are memory-mapped, smaller ones read whole
_TOKEN_DTYPES = {"I64": np.int64, "I32": np.int32}
_STATE_DTYPES = {"BF16": np.uint16, "F32": np.float32, "F16": np.float16}


def attach_capture(result: GenResult | None, path: str, in_process: bool) -> None:
    """Attach the capture file's token ids and states to `result` (None: nobody asked), then remove the file."""
    if result is not None:
        loaded = read_capture_file(path) if in_process else None
        result.captured_token_ids, result.captured_states = loaded or load_capture_with_torch(path, in_process)
    remove_capture_file(path)


def load_capture_with_torch(path: str, in_process: bool) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's own loader (an engine-core process: it waits on the writer's file lock), or other dtypes."""
    import torch

    if in_process:
        from safetensors.torch import load_file as load
    else:
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            load_hidden_states as load,
        )
    data = load(path)
    states = data["hidden_states"]
    if states.dtype != torch.bfloat16:
        states = states.to(torch.bfloat16)
    return (data["token_ids"].numpy().astype(np.int64),
            states.contiguous().view(torch.int16).numpy().view(np.uint16))


def read_capture_file(path: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(token ids int64, bf16 states as uint16) from a capture file, or None for dtypes left to torch's loader.

    A safetensors file is an 8-byte header length, a JSON header (dtype, shape, byte offsets per tensor) and the
    raw bytes. Files above `MAP_ABOVE` are memory-mapped, not read: a real model's sample is hundreds of MB
    ([4000 tokens, 5 layers, 5120] bf16 = 205 MB), and copying it out (`read` + `safetensors.deserialize`, two
    copies) took ~250 ms per sample on the delivery thread, where mapping takes ~0.1 ms; the arrays are views of
    the scratch file's pages (read-only), which stay valid after the file is unlinked, until the arrays are freed.
    Small files (the tiny test model's) are read whole: ~20 us, less than setting up a mapping.
    No torch tensors are built (see the module's docstring); fp32/fp16 states are rounded to bf16 in numpy.
    """
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        data = fh.read() if size <= MAP_ABOVE else mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        (header_len,) = struct.unpack_from("<Q", data)
        header = orjson.loads(data[8:8 + header_len])
        ids, states = header["token_ids"], header["hidden_states"]
    except (struct.error, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"not a capture file ({size} bytes): {exc}") from exc
    if ids["dtype"] not in _TOKEN_DTYPES or states["dtype"] not in _STATE_DTYPES:
        return None
    token_ids = _tensor(data, 8 + header_len, ids, _TOKEN_DTYPES[ids["dtype"]]).astype(np.int64)
    values = _tensor(data, 8 + header_len, states, _STATE_DTYPES[states["dtype"]])
    if states["dtype"] != "BF16":
        values = float32_to_bf16(values.astype(np.float32, copy=False))
    return token_ids, values


def _tensor(data, base: int, meta: dict, dtype) -> np.ndarray:
    """A view of one tensor's bytes; offsets and shape are checked against the file, so a torn or foreign file
    is an error here instead of a wrong array."""
    start, end = (int(x) for x in meta["data_offsets"])
    shape = [int(x) for x in meta["shape"]]
    itemsize = np.dtype(dtype).itemsize
    count = math.prod(shape)  # Python ints: exact, and ~50x cheaper than np.prod on a 3-element list
    if not 0 <= start <= end <= len(data) - base or end - start != count * itemsize:
        raise ValueError(f"capture tensor {meta} does not fit the file ({len(data)} bytes)")
    return np.frombuffer(data, dtype=dtype, count=count, offset=base + start).reshape(shape)


def still_being_written(path: str) -> bool:
    """True while the connector still holds the file's lock (the write is not finished)."""
    import fcntl

    lock = path + ".lock"
    if not os.path.exists(lock):
        return False
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def remove_capture_file(path: str) -> None:
    """Remove a capture file and its lock file (either may be gone already)."""
    for p in (path, path + ".lock"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)
