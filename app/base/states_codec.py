"""Lossy stored forms of hidden states, each with an error bound it keeps and a measurement of what it cost.

Why: lossless bf16 stops at ~1.48x, and a drafter trains fine on fewer mantissa bits, so a run may opt in to a
lossy store at under half the disk. Codecs: `fp8-e4m3` (per-row absmax scale), `bf16-m3`, `bf16-m4`. Every
sample's error (per layer, max and RMS over tokens) is measured at write time and kept in the hidden file's
index; NaN/Inf is refused, and a sample above its codec's bound is stored losslessly instead.
Layouts and the bounds' derivations: docs/capture.md#lossy-codecs-in-detail.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from app.base.byte_planes import join_bytes
from app.base.errors import PermanentError

E4M3_MAX = 448.0
_BLOCK_VALUES = 1 << 18  # float32 temporaries of 1 MiB per block: in L2


class NonFiniteStates(PermanentError, ValueError):
    """The states hold NaN/Inf: no lossy codec stores them (the sample is kept as captured). A ValueError too,
    as callers have caught it."""


@dataclass
class Quantised:
    """One sample's states in a lossy stored form: the arrays to compress, and the error they cost."""

    codec: str
    arrays: tuple[np.ndarray, ...]  # fp8-e4m3: (scales float32 [T, L], values uint8 [T, L, H]); bf16-m*: (hi, lo)
    max_rel_error: list[float]  # per layer: the largest over the sample's tokens
    rms_rel_error: list[float]  # per layer: the RMS over the sample's tokens


def bound(codec: str, hidden: int) -> float:
    """The largest per-(token, layer) relative error `codec` can give on rows of `hidden` finite values."""
    if codec == "fp8-e4m3":
        return 2.0**-4 + 2.0**-8 + 2.0**-11 + math.sqrt(hidden) * 2.0**-10 / 446
    if codec in MANTISSA_BITS:
        return 2.0 ** -(MANTISSA_BITS[codec] + 1)
    raise ValueError(f"unknown lossy states codec {codec!r} (known: {', '.join(LOSSY_CODECS)})")


MANTISSA_BITS = {"bf16-m3": 3, "bf16-m4": 4}
LOSSY_CODECS = ("fp8-e4m3", *MANTISSA_BITS)
# The lossy option `--states-dtype lossy` picks, from bench/bench_hidden_codec.py's table: the best ratio of the
# three (2.30-2.43x, under 0.45 of the raw bytes on both data sets) and, on outlier-laden states, the lowest
# worst-case error of the 3-mantissa-bit forms; bf16-m4 halves the error but stores ~0.5 of the raw bytes.
DEFAULT_LOSSY = "fp8-e4m3"
STATES_DTYPES = ("bf16", "lossy", *LOSSY_CODECS)


def resolve(dtype: str) -> str:
    """A `--states-dtype` value -> the codec name a manifest records (`lossy` -> the default lossy codec)."""
    if dtype == "lossy":
        return DEFAULT_LOSSY
    if dtype != "bf16" and dtype not in LOSSY_CODECS:
        raise ValueError(f"unknown states dtype {dtype!r} (choose from {', '.join(STATES_DTYPES)})")
    return dtype


def promised_bound(dtype: str, hidden: int) -> float:
    """What a run's manifest promises for `dtype` (resolved): 0 for bf16, else `bound` rounded up to 4 digits."""
    if dtype == "bf16":
        return 0.0
    return math.ceil(bound(dtype, hidden) * 1e4) / 1e4


def quantise(codec: str, states_u16: np.ndarray) -> Quantised:
    """States `[T, L, H]` (bf16 bit patterns) in `codec`'s stored form, with the error measured per layer."""
    if states_u16.dtype != np.uint16 or states_u16.ndim != 3:
        raise ValueError(f"states must be uint16 [tokens, layers, hidden], got {states_u16.dtype} {states_u16.shape}")
    if codec == "fp8-e4m3":
        return _blocked(codec, states_u16, _fp8_block)
    if codec in MANTISSA_BITS:
        return _blocked(codec, states_u16, _mantissa_block)
    raise ValueError(f"unknown lossy states codec {codec!r} (known: {', '.join(LOSSY_CODECS)})")


def dequantise(codec: str, arrays: tuple[np.ndarray, ...], shape: tuple[int, int, int]) -> np.ndarray:
    """The stored arrays back to bf16 bit patterns `[T, L, H]` (what every reader returns)."""
    if codec == "fp8-e4m3":
        scales, codes = arrays
        out = np.empty(shape, dtype=np.uint16)
        rows, flat_scales, flat_out = codes.reshape(-1, shape[2]), scales.reshape(-1), out.reshape(-1, shape[2])
        step = max(1, _BLOCK_VALUES // max(1, shape[2]))
        for start in range(0, rows.shape[0], step):
            flat_out[start:start + step] = _fp8_decode(rows[start:start + step], flat_scales[start:start + step])
        return out
    if codec in MANTISSA_BITS:
        high, low = arrays
        return join_bytes(high.reshape(-1), low.reshape(-1)).reshape(shape)
    raise ValueError(f"unknown lossy states codec {codec!r}")


# --- FP8 e4m3 ------------------------------------------------------------------------------------------------


def _e4m3_values() -> np.ndarray:
    """float32 value of each e4m3fn byte (bit layout s eeee mmm, bias 7; 0x7F / 0xFF are NaN, there is no Inf)."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp, mant = (codes >> 3) & 0xF, codes & 0x7
    magnitude = np.where(exp == 0, mant * 2.0**-9, (1 + mant / 8) * 2.0 ** (exp - 7.0))
    values = (sign * magnitude).astype(np.float32)
    values[[0x7F, 0xFF]] = np.nan
    return values


_E4M3_VALUES = _e4m3_values()


def fp8_scales(absmax: np.ndarray) -> np.ndarray:
    """Per row: absmax / 448 in float32, nudged up where rounding left absmax / scale above 448 (so every
    scaled value is at most 448 and none rounds to the NaN code); 1 for all-zero rows."""
    scales = (absmax / np.float32(E4M3_MAX)).astype(np.float32)
    over = absmax / np.where(scales > 0, scales, 1) > np.float32(E4M3_MAX)
    scales = np.where(over, np.nextafter(scales, np.float32(np.inf)), scales)
    return np.where(absmax > 0, scales, np.float32(1)).astype(np.float32)


def fp8_round(scaled: np.ndarray) -> np.ndarray:
    """float32 values with |y| <= 448 -> their e4m3 bytes, rounded to nearest-even (torch's conversion).

    On the float32 bits, without float temporaries: in the normal range the magnitude's bits are rounded at the
    3rd mantissa bit and shifted, which leaves `exponent << 3 | mantissa` with float32's bias (127) where e4m3
    has 7, so 120 << 3 comes off. Below 2**-5 the e4m3 grid is the multiples of 2**-9 (subnormals and the
    lowest binade): adding 2**14, whose float32 spacing is 2**-9, rounds the magnitude onto that grid in the
    FPU, and the sum's low bits are the code.
    """
    bits = np.ascontiguousarray(scaled, dtype=np.float32).view(np.uint32)
    magnitude = bits & np.uint32(0x7FFFFFFF)
    normal = magnitude + ((magnitude >> 20) & 1)
    normal += 0x7FFFF
    normal >>= 20
    normal -= 120 << 3
    small = (magnitude.view(np.float32) + np.float32(2.0**14)).view(np.uint32)
    small -= 0x46800000  # the bits of 2**14
    code = np.where(magnitude < (122 << 23), small, normal).astype(np.uint8)  # 122 << 23: the bits of 2**-5
    code |= (bits >> 24).astype(np.uint8) & 0x80
    return code


@functools.cache
def _code_table() -> np.ndarray:
    """e4m3 code of every float32 by its top 16 bits and whether any lower bit is set: 2**17 entries.

    Rounding to 3 mantissa bits needs the bits down to the 4th mantissa bit (in the top 16) and whether anything
    below is set (a tie only when nothing is), so `fp8_round` of `top16 << 16` and of `top16 << 16 | 1` covers
    every float32. One gather replaces `fp8_round`'s dozen array passes (1.45x faster on a 256K-value block).
    """
    top = np.arange(1 << 16, dtype=np.uint32) << 16
    with np.errstate(invalid="ignore", over="ignore"):
        table = np.empty(1 << 17, dtype=np.uint8)
        table[0::2] = fp8_round(top.view(np.float32))
        table[1::2] = fp8_round((top | 1).view(np.float32))
    return table


def fp8_codes(scaled: np.ndarray) -> np.ndarray:
    """`fp8_round(scaled)` through the code table (|scaled| <= 448, finite)."""
    bits = np.ascontiguousarray(scaled, dtype=np.float32).view(np.uint32)
    index = bits >> 16
    index <<= 1
    index |= (bits & 0xFFFF) != 0
    return _code_table().take(index)


def _row_tables(scales: np.ndarray) -> np.ndarray:
    """Per row: the bf16 bit pattern (in the top half of a uint32) a reader returns for each of the 256 codes,
    `bf16(e4m3 * scale)` rounded to nearest-even. Rows hold thousands of values, so 256 products per row and one
    gather per value beat a multiply and a rounding per value."""
    products = _E4M3_VALUES[None, :] * scales.reshape(-1, 1)  # NaN codes give NaN: never stored
    bits = products.view(np.uint32)
    bits += 0x7FFF + ((bits >> 16) & 1)
    bits &= 0xFFFF0000
    return bits


def _gather(tables: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """tables `[R, 256]`, codes `[..., H]` (R rows) -> each code looked up in its row's table."""
    rows = codes.reshape(-1, codes.shape[-1])
    index = rows.astype(np.int32)
    index += (np.arange(rows.shape[0], dtype=np.int32) * 256)[:, None]
    return tables.reshape(-1).take(index).reshape(codes.shape)


def _fp8_block(x: np.ndarray, absmax: np.ndarray):
    """(scales, codes) and the per-row errors of one block of rows, measured on what a reader will return."""
    scales = fp8_scales(absmax)
    codes = fp8_codes(x / scales[..., None])
    with np.errstate(invalid="ignore"):
        decoded = _gather(_row_tables(scales), codes).view(np.float32)
    return (scales, codes), row_errors(x, decoded, absmax)


def _fp8_decode(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """e4m3 bytes `[..., H]` times their rows' scales `[...]`, as bf16 bit patterns (round to nearest-even)."""
    with np.errstate(invalid="ignore"):
        tables = (_row_tables(scales) >> 16).astype(np.uint16)
    return _gather(tables, codes)


# --- bf16 with fewer mantissa bits ---------------------------------------------------------------------------


def round_mantissa(bits: np.ndarray, keep: int) -> np.ndarray:
    """bf16 bit patterns (finite) rounded to nearest-even at `keep` of their 7 mantissa bits.

    A value that rounds past the largest finite bf16 is kept at the largest finite value with `keep` bits
    instead of becoming Inf (the quality gate must never see an Inf that the engine did not produce).
    """
    drop = 7 - keep
    wide = bits.astype(np.uint32)
    rounded = (wide + ((1 << (drop - 1)) - 1) + ((wide >> drop) & 1)) & ~np.uint32((1 << drop) - 1)
    overflow = (rounded & 0x7F80) == 0x7F80
    largest = (wide & 0x8000) | (0x7F7F & ~((1 << drop) - 1))
    return np.where(overflow, largest, rounded).astype(np.uint16)


def _mantissa_block(x: np.ndarray, absmax: np.ndarray, bits: np.ndarray, keep: int):
    """The rounded bit patterns and the per-row errors of one block of rows."""
    rounded = round_mantissa(bits, keep)
    return rounded, row_errors(x, (rounded.astype(np.uint32) << 16).view(np.float32), absmax)


# --- the blocked pass shared by the codecs -------------------------------------------------------------------


def _blocked(codec: str, states_u16: np.ndarray, block_fn) -> Quantised:
    n_tokens, n_layers, hidden = states_u16.shape
    states = np.ascontiguousarray(states_u16)
    rel = np.zeros((n_tokens, n_layers), dtype=np.float64)
    fp8 = codec == "fp8-e4m3"
    if fp8:
        scales = np.empty((n_tokens, n_layers), dtype=np.float32)
        codes = np.empty(states.shape, dtype=np.uint8)
    else:
        high = np.empty(states.shape, dtype=np.uint8)
        low = np.empty(states.shape, dtype=np.uint8)
    step = max(1, _BLOCK_VALUES // max(1, n_layers * hidden))
    for start in range(0, n_tokens, step):
        bits = states[start:start + step]
        absbits = (bits & 0x7FFF).max(axis=2) if hidden else np.zeros(bits.shape[:2], np.uint16)
        if (absbits >= 0x7F80).any():
            raise NonFiniteStates("lossy states codecs take finite states only (store NaN/Inf samples as bf16)")
        x = (bits.astype(np.uint32) << 16).view(np.float32)
        absmax = (absbits.astype(np.uint32) << 16).view(np.float32)
        if fp8:
            (scales[start:start + step], codes[start:start + step]), rel[start:start + step] = block_fn(x, absmax)
        else:
            rounded, rel[start:start + step] = block_fn(x, absmax, bits, MANTISSA_BITS[codec])
            high[start:start + step] = rounded >> 8
            low[start:start + step] = rounded
    arrays = (scales, codes) if fp8 else (high, low)
    return Quantised(codec, arrays, *layer_errors(rel))


def row_errors(x: np.ndarray, decoded: np.ndarray, absmax: np.ndarray) -> np.ndarray:
    """Per row (last axis): ||decoded - x|| / ||x||; 0 where both are all zeros, inf where only x is.

    Sums of squares in float32 (SIMD, ~1e-6 relative) when every row's largest magnitude `absmax` is within
    2**+-50 (activations are); otherwise their squares could over- or underflow float32, so float64.
    """
    nonzero = absmax[absmax > 0]
    if nonzero.size and (nonzero.min() < 2.0**-50 or nonzero.max() > 2.0**50):
        x, decoded = x.astype(np.float64), decoded.astype(np.float64)
    diff = decoded - x
    err2 = np.einsum("...i,...i->...", diff, diff)
    norm2 = np.einsum("...i,...i->...", x, x)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.sqrt(err2 / np.where(norm2 > 0, norm2, 1))
    return np.where(norm2 > 0, rel, np.where(err2 > 0, np.inf, 0.0))


def layer_errors(rel: np.ndarray) -> tuple[list[float], list[float]]:
    """Per-(token, layer) relative errors `[T, L]` -> (max over tokens, RMS over tokens), per layer."""
    if rel.shape[0] == 0:
        return [0.0] * rel.shape[1], [0.0] * rel.shape[1]
    return rel.max(axis=0).tolist(), np.sqrt(np.square(rel).mean(axis=0)).tolist()
