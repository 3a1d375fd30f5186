"""The pilot's settings and arithmetic: which candidate settings a host tries, the rates its measurements give,
and the forecast of the whole job on a fleet of hosts, each measured by its own `regen pilot`.

Why one module: `regen pilot`, `regen pilot --forecast-only` and `regen status` must use one arithmetic. Every
figure of the forecast is a product or quotient of measured ones (nothing assumed), so a test recomputes it
from the JSON; its yield is in trainable tokens per device-hour (those ending in a sample the default text
export keeps, app.data.outcomes). Each figure's formula: docs/pilot.md#the-forecasts-arithmetic.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import orjson

from app.base.config import DEFAULT_CAPTURE_QUEUE, DEFAULT_QUEUE, DEFAULT_REGENERATE
from app.base.errors import ConfigError
from app.base.speculative import has_mtp_head

PILOT_VERSION = 1
PILOTS_DIR = "pilots"  # `<storage>/pilots/<name>.json`
RUN_PILOT = "pilot.json"  # a run's copy of the pilot it was produced with (`regen produce --pilot`)
DEFAULT_MTP_TOKENS = 2


@dataclass(frozen=True)
class Candidate:
    """One setting a pilot runs: the run setting (capture mode, speculative generation) and the host's worker
    setting (task slots; the engine's max_num_seqs, None: the device preset's)."""

    name: str
    capture: str
    task_slots: int
    max_num_seqs: int | None = None
    speculative: str | None = None  # "mtp:K": a generation engine's speculative method, a run setting

    @property
    def run_setting(self) -> str:
        return self.capture + (f"+{self.speculative}" if self.speculative else "")

    def run_args(self) -> list[str]:
        """`regen run` arguments that give a run this candidate's setting."""
        args = ["--capture", self.capture, "--task-slots", str(self.task_slots)]
        if self.max_num_seqs:
            args += ["--vllm-arg", f"max_num_seqs={self.max_num_seqs}"]
        if self.speculative:
            args += ["--speculative", self.speculative]
        return args

    def to_json(self) -> dict:
        return asdict(self)


def mtp_available(model_path: str) -> bool:
    """Whether speculative MTP generation can be tried: the checkpoint has an MTP head
    (`app.base.speculative.has_mtp_head`, the same check `--speculative` makes)."""
    return has_mtp_head(model_path)


def candidates(*, slots: int, max_num_seqs: int, slots_for, mtp: bool, mtp_tokens: int = DEFAULT_MTP_TOKENS,
               only: list[str] | None = None) -> list[Candidate]:
    """The settings a host tries: inline capture at the device's task slots, at half of them, and with half the
    engine's batch (its slots recomputed by `slots_for(max_num_seqs)`); staged capture (its capture pass
    included); staged with MTP generation when `mtp`. `only`: those names only, in this order."""
    half_seqs = max(1, max_num_seqs // 2)
    out = [
        Candidate("inline", "inline", slots),
        Candidate(f"inline-slots{max(1, slots // 2)}", "inline", max(1, slots // 2)),
        Candidate(f"inline-seqs{half_seqs}", "inline", slots_for(half_seqs), max_num_seqs=half_seqs),
        Candidate("staged", "staged", slots),
    ]
    if mtp:
        out.append(Candidate(f"staged-mtp{mtp_tokens}", "staged", slots, speculative=f"mtp:{mtp_tokens}"))
    if only:
        by_name = {c.name: c for c in out}
        unknown = [n for n in only if n not in by_name]
        if unknown:
            raise ConfigError(f"--candidates: no candidate {', '.join(unknown)} on this host "
                              f"(known: {', '.join(by_name)})")
        out = [by_name[n] for n in only]
    return out


# -- rates of one candidate ----------------------------------------------------------------------------------
def samples_per_s(measured: dict) -> float:
    return measured["samples"] / measured["window_s"] if measured["window_s"] > 0 else 0.0


def tokens_per_s_per_device(measured: dict) -> float:
    window = measured["window_s"] * max(1, measured["devices"])
    return measured["generated_tokens"] / window if window > 0 else 0.0


def trainable_tokens_per_device_hour(measured: dict) -> float | None:
    """Tokens ending in a trainable sample per device-hour; None for a pilot measured before they were counted."""
    window = measured["window_s"] * max(1, measured["devices"])
    if measured.get("trainable_tokens") is None or window <= 0:
        return None
    return measured["trainable_tokens"] / window * 3600


def capture_share(measured: dict) -> float:
    total = measured["generate_task_s"] + measured["capture_task_s"]
    return measured["capture_task_s"] / total if total > 0 else 0.0


def bytes_per_sample(measured: dict) -> dict[str, float]:
    """Stored bytes per sample by states dtype: the codec's bytes per token (measured) x context tokens per
    sample (measured)."""
    codec = measured["codec"]
    if not codec["tokens"] or not measured["samples"]:
        return {}
    per_sample_tokens = measured["context_tokens"] / measured["samples"]
    return {dtype: n / codec["tokens"] * per_sample_tokens for dtype, n in codec["bytes"].items()}


def raw_bytes_per_sample(measured: dict) -> float:
    """The export's size per sample: raw bf16 of the captured layers over the context tokens."""
    if not measured["samples"]:
        return 0.0
    return measured["context_tokens"] / measured["samples"] * measured["layers"] * measured["hidden_size"] * 2


def rates(measured: dict) -> dict:
    """The derived figures of one candidate, as the pilot prints and stores them."""
    return {"samples_per_s": samples_per_s(measured), "tokens_per_s_per_device": tokens_per_s_per_device(measured),
            "trainable_tokens_per_device_hour": trainable_tokens_per_device_hour(measured),
            "capture_share": capture_share(measured), "bytes_per_sample": bytes_per_sample(measured),
            "raw_bytes_per_sample": raw_bytes_per_sample(measured)}


# -- the forecast over hosts ---------------------------------------------------------------------------------
def capture_failure(entry: dict) -> str | None:
    """Why a candidate's capture is not proven on its host (its run's capture check or reference check failed, or
    the check paused its run); None when it is. Such a candidate is shown as failed and never recommended."""
    if entry.get("capture_failed"):
        return entry["capture_failed"]
    check = (entry.get("measured") or {}).get("capture_check") or {}
    if check.get("failed"):
        return f"capture check: {check['failed']} of {check.get('checked')} re-captured samples differ: " + (
            "; ".join(check.get("failures") or [])[:300])
    reference = entry.get("reference") or {}
    if reference.get("ok") is False:
        return f"verify --reference: {reference.get('problem')}"
    return None


def _measured(pilot: dict) -> list[tuple[dict, dict]]:
    return [(c["candidate"], c["measured"]) for c in pilot["candidates"]
            if c.get("measured") and capture_failure(c) is None]


def _run_setting(candidate: dict) -> str:
    return candidate["capture"] + (f"+{candidate['speculative']}" if candidate.get("speculative") else "")


def best_per_host(pilots: list[dict], setting: str) -> list[tuple[dict, dict] | None]:
    """Each host's fastest candidate (samples/s) under run setting `setting`; None where it has none."""
    out = []
    for pilot in pilots:
        mine = [(c, m) for c, m in _measured(pilot) if _run_setting(c) == setting]
        out.append(max(mine, key=lambda cm: samples_per_s(cm[1])) if mine else None)
    return out


def check_comparable(pilots: list[dict]) -> None:
    """Hosts' pilots combine only when they measured the same job: model, layers, sampling and input."""
    first = pilots[0]
    for other in pilots[1:]:
        for key in ("model", "settings", "inputs"):
            a, b = first.get(key), other.get(key)
            if key == "model":
                a, b = (a or {}).get("fingerprint"), (b or {}).get("fingerprint")
            elif key == "inputs":
                a, b = (a or {}).get("samples"), (b or {}).get("samples")
            if a != b:
                raise ConfigError(f"pilot {other.get('name')} ({other.get('host')}) measured another {key} than "
                                  f"{first.get('name')} ({first.get('host')}): {b!r} != {a!r}; run every host's "
                                  "pilot on the same input, model and settings")


def forecast(pilots: list[dict]) -> dict:
    """The whole input on the fleet of `pilots` (one per host), under the run setting that is fastest on the
    fleet as a whole, with each host's recommended worker setting; see the module docstring."""
    check_comparable(pilots)
    samples = int(pilots[0]["inputs"]["samples"])
    settings = sorted({_run_setting(c) for p in pilots for c, _ in _measured(p)})
    options = []
    for setting in settings:
        best = best_per_host(pilots, setting)
        if any(b is None for b in best):  # a run setting is the whole fleet's: every host must have measured it
            continue
        options.append((sum(samples_per_s(m) for _, m in best), setting, best))
    if not options:
        raise ConfigError("no run setting was measured on every host: nothing to forecast")
    fleet_rate, setting, best = max(options, key=lambda o: o[0])
    samples *= int(pilots[0].get("settings", {}).get("samples_per_prompt") or 1)
    pooled = {k: sum(m[k] for _, m in best) for k in ("samples", "generated_tokens", "context_tokens")}
    per_sample_tokens = pooled["context_tokens"] / pooled["samples"]
    dtypes = sorted({d for _, m in best for d in m["codec"]["bytes"]})
    disk = {d: samples * sum(bytes_per_sample(m).get(d, 0.0) * m["samples"] for _, m in best) / pooled["samples"]
            for d in dtypes}
    layers, hidden = best[0][1]["layers"], best[0][1]["hidden_size"]
    wall_s = samples / fleet_rate if fleet_rate > 0 else None  # None: nothing finished in a measured time
    devices = sum(int(p["device"]["count"]) for p in pilots)
    device_hours = None if wall_s is None else devices * wall_s / 3600
    export_bytes = samples * per_sample_tokens * layers * hidden * 2
    counted = all(m.get("trainable_tokens") is not None for _, m in best)
    trainable = samples * sum(m["trainable_tokens"] for _, m in best) / pooled["samples"] if counted else None
    return {
        "input_samples": samples,
        "run_setting": setting,
        "capture": best[0][0]["capture"],
        "speculative": best[0][0].get("speculative"),
        "fleet_samples_per_s": fleet_rate,
        "wall_s": wall_s,
        "devices": devices,
        "device_hours": device_hours,
        "generated_tokens": samples * pooled["generated_tokens"] / pooled["samples"],
        "context_tokens": samples * per_sample_tokens,
        "trainable_tokens": trainable,
        "trainable_tokens_per_device_hour": trainable / device_hours if trainable is not None and device_hours else None,
        "disk_bytes": disk,
        "export_bytes": export_bytes,
        "modes": mode_forecast(best, samples, device_hours, disk, export_bytes),
        "hosts": [{"host": p["host"], "pilot": p["name"], "device": p["device"], "candidate": c["name"],
                   "task_slots": c["task_slots"], "max_num_seqs": c.get("max_num_seqs"),
                   "samples_per_s": samples_per_s(m)}
                  for p, (c, m) in zip(pilots, best, strict=True)],
        "other_settings": [{"run_setting": s, "fleet_samples_per_s": r} for r, s, _ in options if s != setting],
    }


def mode_forecast(best: list[tuple[dict, dict]], samples: int, device_hours: float | None, disk: dict,
                  export_bytes: float) -> dict:
    """The job per mode, from the chosen candidates' per-mode measurements (see the module docstring); {} when
    the pilots predate them."""
    if not all(m.get("modes") for _, m in best):
        return {}
    names = sorted({mode for _, m in best for mode in m["modes"]})
    pooled = {mode: {k: sum(m["modes"].get(mode, {}).get(k, 0) for _, m in best)
                     for k in ("samples", "generated_tokens", "context_tokens")} for mode in names}
    total = {k: sum(p[k] for p in pooled.values()) for k in ("samples", "generated_tokens", "context_tokens")}
    out = {}
    for mode, p in pooled.items():
        share = p["samples"] / total["samples"] if total["samples"] else 0.0
        n = samples * share
        context_share = p["context_tokens"] / total["context_tokens"] if total["context_tokens"] else 0.0
        generated_share = p["generated_tokens"] / total["generated_tokens"] if total["generated_tokens"] else 0.0
        out[mode] = {
            "share": share, "samples": n,
            "generated_tokens": n * p["generated_tokens"] / p["samples"] if p["samples"] else 0.0,
            "context_tokens": n * p["context_tokens"] / p["samples"] if p["samples"] else 0.0,
            "device_hours": None if device_hours is None else device_hours * generated_share,
            "disk_bytes": {d: v * context_share for d, v in disk.items()},
            "export_bytes": export_bytes * context_share,
        }
    return out


def commands(pilots: list[dict], plan: dict, pilot_paths: list[str], storage: str = "/nfs/regen",
             run: str = "RUN") -> dict:
    """The recommended `regen produce` (the run's settings, once, with the pilots it was forecast from) and
    `regen worker` (each host's) command lines."""
    s = pilots[0]["settings"]
    produce = ["regen produce", " ".join(pilots[0]["inputs"]["files"]), f"--run {run}", f"--storage {storage}",
               f"--model {pilots[0]['model']['path']}", f"--layers {s['layers']}", f"--max-tokens {s['max_tokens']}",
               f"--shard-size {s['shard_size']}", f"--capture {plan['capture']}"]
    if s.get("thinking_mix") is not None:
        produce.append(f"--thinking-mix {s['thinking_mix']}")
    elif not s.get("thinking", True):
        produce.append("--no-thinking")
    if s.get("preserve_thinking"):
        produce.append("--preserve-thinking")
    if int(s.get("samples_per_prompt") or 1) > 1:
        produce.append(f"--samples-per-prompt {s['samples_per_prompt']}")
    if s.get("regenerate", DEFAULT_REGENERATE) != DEFAULT_REGENERATE:
        produce.append(f"--regenerate {s['regenerate']}")
    for key, value in (s.get("sampling") or {}).items():  # as measured: temperature, ..., sample_temperatures
        produce.append(f"--{key.replace('_', '-')} {value}")
    inputs, seed = pilots[0]["inputs"], int((pilots[0].get("sample") or {}).get("seed", 0))
    produce += [f"--take '{rule}'" for rule in inputs.get("take") or []]  # the mix the pilot drew from
    if seed or inputs.get("take") or int(s.get("samples_per_prompt") or 1) > 1 or s.get("thinking_mix") is not None:
        produce.append(f"--seed {seed}")  # the seed the pilot's runs drew modes, samples and --take rows with
    if plan.get("speculative"):
        produce.append(f"--speculative {plan['speculative']}")
    produce += [f"--pilot {path}" for path in pilot_paths]
    workers = {}
    for host in plan["hosts"]:
        line = [f"regen worker --run {run} --storage {storage}", f"--task-slots {host['task_slots']}"]
        if host["device"]["kind"] == "cpu":
            line.insert(1, "--cpu")
        if host.get("max_num_seqs"):
            line.append(f"--max-num-seqs {host['max_num_seqs']}")
        if plan["capture"] == "staged":  # as measured: each worker runs both passes
            line.append(f"--queue {DEFAULT_QUEUE},{DEFAULT_CAPTURE_QUEUE}")
        workers[host["host"]] = " ".join(line)
    return {"produce": " ".join(produce), "workers": workers}


def run_comparison(pilots: list[dict], status: dict) -> dict:
    """A run's real rate beside its pilots' forecast (`regen status`): samples/s and the wall time."""
    try:
        plan = forecast(pilots)
    except Exception as exc:  # a pilot file status cannot use: said, not raised
        return {"pilots": [p.get("name") for p in pilots], "error": str(exc)}
    wall = (status.get("rates") or {}).get("wall_seconds")
    done = (status.get("samples") or {}).get("done") or 0
    real = done / wall if wall else None
    rate = plan["fleet_samples_per_s"]
    return {"pilots": [p.get("name") for p in pilots], "run_setting": plan["run_setting"],
            "forecast_samples_per_s": rate, "real_samples_per_s": real, "forecast_wall_s": plan["wall_s"],
            "real_to_forecast": real / rate if real and rate else None}


# -- the JSON files --------------------------------------------------------------------------------------------
def load_pilot_file(path: str) -> dict:
    """A pilot JSON file, checked to be one; a ConfigError naming the file otherwise."""
    try:
        with open(path, "rb") as fh:
            pilot = orjson.loads(fh.read())
    except (OSError, orjson.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not a pilot JSON file ({exc})") from None
    if not isinstance(pilot, dict) or pilot.get("version") != PILOT_VERSION or "candidates" not in pilot:
        raise ConfigError(f"{path}: not a pilot JSON file of version {PILOT_VERSION} (written by `regen pilot`)")
    return pilot


def link_pilots(store, pilots: list[dict]) -> None:
    """Keep a run's copy of the pilots it was produced with (`regen produce --pilot`), atomically, so `regen
    status` compares the run's rate with their forecast wherever the run's storage is read."""
    store.storage.write_json(store.rel(RUN_PILOT), {"pilots": pilots})


def run_pilots(store) -> list[dict] | None:
    """The pilots linked to a run; None when none is."""
    try:
        return store.storage.read_json(store.rel(RUN_PILOT))["pilots"]
    except FileNotFoundError:
        return None


def compare_with_pilots(report: dict, store) -> dict:
    """`regen status`'s report of a run, with its pilots' forecast beside its real rate (`pilot`) where the run
    was produced with pilots (`regen produce --pilot`)."""
    pilots = run_pilots(store)
    if pilots:
        report["pilot"] = run_comparison(pilots, report)
    return report
