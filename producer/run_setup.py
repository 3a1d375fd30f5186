"""From command-line options to the run manifest's settings, and back again for `--resume`.

Why here: everything that decides what a sample's output is belongs in `RunSettings` (app.base.manifest), so
that reopening a run with a different value is refused naming the field. The producer-only knobs that decide
*which rows become samples* but are not engine settings (`max_prompt_chars`) are stored in produce.json and
checked the same way. `--resume` rebuilds everything from the stored manifest, and refuses if an input file's
bytes changed (its sha256), because then the shards would no longer be the ones already generated.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field

from app.base.chat_render import manifest_entry
from app.base.config import DEFAULT_QUEUE, DEFAULT_REGENERATE, DEFAULT_SHARD_SIZE
from app.base.errors import ConfigError, InputError, ManifestMismatch
from app.base.layers import parse_layers
from app.base.manifest import (
    CAPTURE_MODES,
    MODES,
    CaptureCheckSettings,
    QualitySettings,
    RunSettings,
    Sampling,
    StatesStorage,
)
from app.base.model_info import read_model_info, read_text_config, zero_embedding_ids
from app.base.speculative import check_speculative, ignored_with_capture, parse_speculative
from app.base.states_codec import STATES_DTYPES, promised_bound, resolve
from app.base.thinking import DEFAULT_THINKING_CLOSE, engine_refusal
from app.base.vllm_args import check_data_args, parse_vllm_args, split_item
from producer.enqueue import COMPRESS_MODES
from producer.normalise import REGENERATE_MODES
from producer.readers import describe_input, file_sha256
from producer.take import match_rules, parse_take
from producer.thinking_modes import mode_prompt_tails

DEFAULT_MAX_PROMPT_TOKENS = 32768
DEFAULT_MAX_TOKENS = 4096
CHARS_PER_TOKEN_CAP = 8  # default char cap = max_prompt_tokens x 8: only prompts that are surely too long


@dataclass
class ProduceOptions:
    """Every option of `regen produce`; the CLI fills it, tests and the benchmark build it directly."""

    inputs: list[str] = field(default_factory=list)
    run_id: str | None = None
    storage: str | None = None
    model: str | None = None
    broker: str | None = None
    queue: str = DEFAULT_QUEUE
    max_pending: int | None = None
    compress: str = "auto"
    shard_size: int = DEFAULT_SHARD_SIZE
    max_tokens: int = DEFAULT_MAX_TOKENS
    thinking: bool = True
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int = 0
    capture: str = "inline"
    layers: str = "dflash"
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS
    max_prompt_chars: int | None = None
    regenerate: str = DEFAULT_REGENERATE
    dry_run: bool = False
    resume: bool = False
    only_shards: frozenset[str] | None = None  # with resume: send only these shards (regen retry-dead)
    estimate_sample: int = 2000
    assumed_response_tokens: int | None = None
    pause_stub_rate: float = 0.20
    pause_window: int = 256
    pause_min_samples: int = 32
    vllm_args: list[str] = field(default_factory=list)  # KEY=VALUE, recorded in the manifest for every worker
    states_dtype: str = "bf16"
    speculative: str | None = None  # "mtp" / "mtp:K" as given; the manifest records it normalised ("mtp:2")
    thinking_mix: float | None = None  # share of samples in thinking mode (app.base.thinking_modes); None: `thinking` for all
    samples_per_prompt: int | None = None  # None: 1 (with --resume: the run's)
    sample_temperatures: list[float] | None = None  # sample k of a prompt at [k % len]
    take: list[str] = field(default_factory=list)  # GLOB=N / GLOB=FRACTION (producer.take)
    capture_check_every: int = 100  # workers re-capture one sample in this many to check their capture (0: none)
    preserve_thinking: bool = False  # the template keeps earlier turns' reasoning (app.base.chat_render)
    render_processes: int | None = None  # the render check's processes (producer.template_check); None: in-process
    thinking_budget: int | None = None  # close each thinking sample's reasoning after N tokens (app.base.thinking)
    thinking_close: str | None = None  # the text forced then [default: app.base.thinking.DEFAULT_THINKING_CLOSE]
    stop_loops: bool = False  # end requests whose output loops (app.base.loops)

    @property
    def prompt_char_cap(self) -> int:
        if self.max_prompt_chars is not None:
            return self.max_prompt_chars
        return self.max_prompt_tokens * CHARS_PER_TOKEN_CAP


def derive_run_id(path: str) -> str:
    """A valid run id from an input file name: `data/ShareGPT V3.jsonl.zst` -> `ShareGPT-V3`."""
    name = os.path.basename(path)
    for suffix in (".zst", ".jsonl", ".ndjson", ".json"):
        if name.lower().endswith(suffix):
            name = name[: -len(suffix)]
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", name)
    name = re.sub(r"\.{2,}", ".", name).strip("._-")[:128]
    return name or "run"


def validate_options(opts: ProduceOptions) -> None:
    if opts.shard_size < 1:
        raise ConfigError(f"--shard-size must be at least 1, not {opts.shard_size}")
    if opts.max_tokens < 1:
        raise ConfigError(f"--max-tokens must be at least 1, not {opts.max_tokens}")
    if opts.max_prompt_tokens < 1:
        raise ConfigError(f"--max-prompt-tokens must be at least 1, not {opts.max_prompt_tokens}")
    if opts.compress not in COMPRESS_MODES:
        raise ConfigError(f"--compress must be one of {', '.join(COMPRESS_MODES)}, not {opts.compress!r}")
    if opts.max_pending is not None and opts.max_pending < 0:
        raise ConfigError(f"--max-pending must be 0 or more, not {opts.max_pending}")
    if opts.capture not in CAPTURE_MODES:
        raise ConfigError(f"--capture must be one of {', '.join(CAPTURE_MODES)}, not {opts.capture!r}")
    if opts.regenerate not in REGENERATE_MODES:
        raise ConfigError(f"--regenerate must be one of {', '.join(REGENERATE_MODES)}, not {opts.regenerate!r}")
    if opts.states_dtype not in STATES_DTYPES:
        raise ConfigError(f"--states-dtype must be one of {', '.join(STATES_DTYPES)}, not {opts.states_dtype!r}")
    if opts.capture == "off" and opts.states_dtype != "bf16":
        raise ConfigError(f"--states-dtype {opts.states_dtype} with --capture off: no hidden states are stored")
    validate_mix_options(opts)
    if opts.speculative and any(split_item(a)[0] == "speculative_config" for a in opts.vllm_args):
        raise ConfigError("--speculative and --vllm-arg speculative_config both set the speculative method; give "
                          "--speculative only")
    # the model's MTP head is checked in build_settings, where the model is read
    check_speculative(parse_speculative(opts.speculative), capture_mode=opts.capture, min_p=opts.min_p or 0.0,
                      model_path=None)
    if why := ignored_with_capture({"min_p": opts.min_p}, opts.capture):
        raise ConfigError(why)
    speculative = parse_speculative(opts.speculative)
    if why := engine_refusal(opts.thinking_budget, opts.thinking_close, opts.stop_loops, opts.capture, speculative):
        raise ConfigError(why)
    any_thinking = opts.thinking if opts.thinking_mix is None else opts.thinking_mix > 0
    if opts.thinking_budget is not None and not any_thinking:
        raise ConfigError(f"--thinking-budget {opts.thinking_budget} with --no-thinking: no sample thinks")
    if opts.thinking_budget is not None and opts.thinking_budget >= opts.max_tokens:
        raise ConfigError(f"--thinking-budget {opts.thinking_budget} is not below --max-tokens {opts.max_tokens}: "
                          "the budget could never close a sample")


def validate_mix_options(opts: ProduceOptions) -> None:
    """Modes, samples per prompt and temperatures that cannot work together, refused in one line each."""
    mix, k, temps = opts.thinking_mix, opts.samples_per_prompt, opts.sample_temperatures
    if mix is not None and not 0 <= mix <= 1:
        raise ConfigError(f"--thinking-mix must be a share between 0 and 1, not {mix}")
    any_thinking = opts.thinking if mix is None else True  # a mix keeps rows that ask for thinking themselves
    if k is not None and k < 1:
        raise ConfigError(f"--samples-per-prompt must be at least 1, not {k}")
    if temps is not None:
        if not temps:
            raise ConfigError("--sample-temperatures lists no temperature")
        if opts.temperature is not None:
            raise ConfigError("--temperature and --sample-temperatures both set the temperature; give one")
        if any(t < 0 for t in temps):
            raise ConfigError(f"--sample-temperatures {temps}: a temperature must be 0 or more")
    greedy = [t for t in ([opts.temperature] if opts.temperature is not None else temps or []) if t == 0]
    if greedy and any_thinking:
        what = "a mix, whose thinking samples" if mix is not None else "thinking"
        raise ConfigError(f"temperature 0 (greedy) with {what}: Qwen3 thinking mode must not be greedy")
    if (k or 1) > 1 and opts.temperature == 0:
        raise ConfigError(f"--samples-per-prompt {k} with --temperature 0: greedy samples of one prompt are "
                          "copies of each other")


def mode_samplings(opts: ProduceOptions) -> dict[str, Sampling]:
    """Each mode's sampling: Qwen's defaults for the mode, with what the operator set applied to both."""
    return {mode: Sampling.defaults(mode == "thinking", opts.max_tokens, opts.seed, temperature=opts.temperature,
                                    top_p=opts.top_p, top_k=opts.top_k, min_p=opts.min_p) for mode in MODES}


def build_settings(opts: ProduceOptions, inputs: list[str]) -> RunSettings:
    """RunSettings for a new (or re-opened) run; hashes every input file (one sequential pass)."""
    validate_options(opts)
    if not opts.model:
        raise ConfigError("--model is required (a local model folder with config.json and the tokenizer)")
    info = read_model_info(opts.model)
    check_lengths(opts.max_tokens, opts.model)
    by_mode = mode_samplings(opts)
    mixed = opts.thinking_mix is not None
    thinking = opts.thinking if not mixed else opts.thinking_mix > 0
    sampling = by_mode["thinking" if thinking else "non_thinking"]
    layers = None if opts.capture == "off" else parse_layers(opts.layers, info.num_layers).to_manifest()
    if layers and info.architecture is not None and info.architecture.hybrid:
        # which captured layers are linear and which full attention: the hybrid checks of `regen verify`
        layers["kinds"] = [info.architecture.layer_kind(v) for v in layers["vllm_ids"]]
    stored = resolve(opts.states_dtype)
    speculative = parse_speculative(opts.speculative)
    for mode in (MODES if mixed else ("thinking" if thinking else "non_thinking",)):
        check_speculative(speculative, capture_mode=opts.capture, min_p=by_mode[mode].min_p, model_path=opts.model)
        if why := ignored_with_capture(asdict(by_mode[mode]), opts.capture):
            raise ConfigError(why)
    tails = None
    if mixed:
        tails = mode_prompt_tails(opts.model)
    take = None
    if opts.take:
        rules = [parse_take(t) for t in opts.take]
        match_rules(rules, inputs)
        take = [r.to_manifest() for r in rules]
    return RunSettings(
        model=model_settings(info, opts.model),
        sampling=sampling,
        thinking=thinking,
        capture_mode=opts.capture,
        layers=layers,
        shard_size=opts.shard_size,
        max_prompt_tokens=opts.max_prompt_tokens,
        regenerate=opts.regenerate,
        inputs=[describe_input(p) for p in inputs],
        quality=QualitySettings(pause_stub_rate=opts.pause_stub_rate, pause_window=opts.pause_window,
                                pause_min_samples=opts.pause_min_samples),
        engine_args=run_engine_args(opts.vllm_args, capture=opts.capture != "off"),
        states=StatesStorage(stored, promised_bound(stored, info.hidden_size)),
        speculative=speculative,
        thinking_mix=float(opts.thinking_mix) if mixed else None,
        mode_sampling={m: asdict(v) for m, v in by_mode.items()} if mixed else None,
        mode_prompt_tails=tails,
        samples_per_prompt=opts.samples_per_prompt or 1,
        sample_temperatures=[float(t) for t in opts.sample_temperatures] if opts.sample_temperatures else None,
        take=take,
        capture_check=CaptureCheckSettings(every=opts.capture_check_every),
        preserve_thinking=bool(opts.preserve_thinking),
        chat_template=manifest_entry(opts.model, bool(opts.preserve_thinking)),
        thinking_budget=opts.thinking_budget,
        thinking_close=(opts.thinking_close if opts.thinking_close is not None else DEFAULT_THINKING_CLOSE)
        if opts.thinking_budget is not None else None,
        stop_loops=bool(opts.stop_loops),
    )


def check_lengths(max_tokens: int, model_path: str, flag: str = "--max-tokens") -> None:
    """Refuse a response cap longer than the model's context (config.json's max_position_embeddings, where it
    gives one): no sample could reach it, and the engine's context is capped there anyway."""
    context = read_text_config(model_path).get("max_position_embeddings")
    if context and max_tokens > int(context):
        raise ConfigError(f"{flag} {max_tokens:,} is longer than the model's context, {int(context):,} tokens "
                          f"(max_position_embeddings in {model_path}/config.json)")


def run_engine_args(items: list[str], capture: bool) -> dict:
    """`--vllm-arg KEY=VALUE`s as the manifest records them ({key: value text}); checked with vLLM's parser
    where vLLM is installed (a producer host may have none: the workers check them at start-up)."""
    if not items:
        return {}

    check_data_args(items, capture=capture, pinned=dict(split_item(i) for i in items))
    try:
        import vllm  # noqa: F401
    except ImportError:
        pass
    else:
        parse_vllm_args(items)
    return dict(split_item(i) for i in items)


def producer_settings(opts: ProduceOptions) -> dict:
    """Settings outside RunSettings that still change which rows become samples (kept in produce.json)."""
    return {"max_prompt_chars": opts.prompt_char_cap}


def check_producer_settings(stored: dict | None, wanted: dict, run_id: str) -> None:
    if not stored:
        return
    differing = [k for k in sorted(set(stored) | set(wanted)) if stored.get(k) != wanted.get(k)]
    if differing:
        raise ManifestMismatch(
            f"run {run_id!r} was produced with different settings: {', '.join(differing)} "
            "(use another --run, or the stored settings)"
        )


def options_from_manifest(manifest: dict, stored_producer: dict | None, opts: ProduceOptions) -> ProduceOptions:
    """`--resume`: the stored run's inputs and settings, with this invocation's broker/queue/storage options."""
    s = RunSettings.view(manifest["settings"])
    resumed = ProduceOptions(**{**opts.__dict__})
    resumed.inputs = [i["path"] for i in s.inputs]
    resumed.shard_size = s.shard_size
    resumed.max_prompt_tokens = s.max_prompt_tokens
    resumed.regenerate = s.regenerate
    resumed.thinking = s.thinking
    resumed.capture = s.capture_mode
    resumed.max_tokens = s.sampling.max_tokens
    resumed.model = s.model_path
    resumed.vllm_args = [f"{k}={v}" for k, v in (s.engine_args or {}).items()]
    resumed.states_dtype = s.states_dtype
    resumed.speculative = s.speculative
    resumed.seed = int(s.sampling.seed)  # the modes' draw and --take's are seeded with it
    resumed.thinking_mix = s.thinking_mix
    stored_k = int(s.samples_per_prompt)
    if opts.samples_per_prompt is not None and opts.samples_per_prompt < stored_k:
        raise ConfigError(f"--samples-per-prompt {opts.samples_per_prompt} with --resume: the run has {stored_k} "
                          "samples per prompt; a resume can add samples, never drop them")
    resumed.samples_per_prompt = max(stored_k, opts.samples_per_prompt or 0)
    resumed.sample_temperatures = s.sample_temperatures
    resumed.preserve_thinking = bool(s.preserve_thinking)
    resumed.thinking_budget = s.thinking_budget
    resumed.thinking_close = s.thinking_close
    resumed.stop_loops = bool(s.stop_loops)
    if stored_producer and "max_prompt_chars" in stored_producer:
        resumed.max_prompt_chars = stored_producer["max_prompt_chars"]
    return resumed


def verify_inputs(stored_inputs: list[dict]) -> list[str]:
    """Check each stored input still exists with the same bytes; return their paths in the stored order."""
    paths = []
    for entry in stored_inputs:
        path = entry["path"]
        if not os.path.isfile(path):
            raise InputError(f"{path}: input of this run is missing; restore it to resume")
        if os.path.getsize(path) != entry["size"] or file_sha256(path) != entry["sha256"]:
            raise InputError(f"{path}: input changed since the run was produced (sha256 differs); refusing to resume")
        paths.append(path)
    return paths


def model_settings(info, path: str) -> dict:
    """The manifest's `model`: the model's shape and fingerprint, and, where the checkpoint has token ids whose
    embedding row is zero (a padding row), those ids (`zero_embedding_ids`): their all-zero rows are states, not
    capture faults (app.base.model_info.zero_embedding_ids). Left out when there are none, as older runs have it."""
    out = info.to_manifest()
    zero = zero_embedding_ids(path)
    if zero:
        out["zero_embedding_ids"] = zero
    return out
