"""Speculative generation as a run setting (`--speculative mtp[:K]`): what it means, where it may run, and the
checks that refuse it where it cannot.

The target's MTP head drafts K tokens per step and the target verifies them, so the run's sampling stays the
target's. Only engines that do not capture may use it (capture is itself vLLM's speculative method), so an
inline-capture run refuses it; whether it pays is measured per host by `regen pilot`. K defaults to 2.
Why: docs/capture.md#why-speculative-generation-is-a-run-setting.
"""

from __future__ import annotations

import json
import os

from safetensors import safe_open

from app.base.errors import ConfigError
from app.base.model_info import read_text_config

METHODS = ("mtp",)
DEFAULT_MTP_TOKENS = 2
MAX_SPECULATIVE_TOKENS = 16


def parse_speculative(text: str | None) -> str | None:
    """`--speculative` as the manifest records it: "mtp" -> "mtp:2", "mtp:3" -> "mtp:3"; None or "" -> None
    (`off` and `none` too). Refuses anything else in one line."""
    if text is None:
        return None
    value = text.strip().lower()
    if value in ("", "off", "none"):
        return None
    method, sep, count = value.partition(":")
    if method not in METHODS:
        raise ConfigError(f"--speculative {text}: unknown method {method!r} (one of {', '.join(METHODS)}, "
                          "as mtp or mtp:K)")
    if not sep:
        return f"{method}:{DEFAULT_MTP_TOKENS}"
    if not count.isdigit() or not 1 <= int(count) <= MAX_SPECULATIVE_TOKENS:
        raise ConfigError(f"--speculative {text}: K (num_speculative_tokens) must be a whole number from 1 to "
                          f"{MAX_SPECULATIVE_TOKENS}")
    return f"{method}:{int(count)}"


def speculative_tokens(setting: str) -> int:
    """K of a normalised setting ("mtp:2" -> 2)."""
    return int(setting.partition(":")[2])


def speculative_config(setting: str) -> dict:
    """vLLM's `speculative_config` for a normalised setting."""
    method, _, _ = setting.partition(":")
    return {"method": method, "num_speculative_tokens": speculative_tokens(setting)}


def describe_engine_config(held: dict | None) -> str | None:
    """The setting string ("mtp:2") of the speculative config an engine holds, as `held_speculative` reports it;
    None when the engine does not generate speculatively (no config, or the capture method)."""
    if not held or held.get("method") not in METHODS:
        return None
    return f"{held['method']}:{int(held['num_speculative_tokens'])}"


def mtp_layers(model_path: str) -> int:
    """`mtp_num_hidden_layers` of the language model's config (0 when absent)."""
    try:
        return int(read_text_config(model_path).get("mtp_num_hidden_layers") or 0)
    except (TypeError, ValueError):
        return 0


def weight_names(model_path: str) -> set[str]:
    """The tensor names of a checkpoint's safetensors files, read from their index or their headers (no weights
    are loaded)."""
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as fh:
            return set(json.load(fh).get("weight_map", {}))

    names: set[str] = set()
    for name in sorted(os.listdir(model_path)) if os.path.isdir(model_path) else ():
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(model_path, name), framework="numpy") as fh:
                names.update(fh.keys())
    return names


def has_mtp_head(model_path: str) -> bool:
    """True when the checkpoint has an MTP head vLLM can run: `mtp_num_hidden_layers` > 0 in the language model's
    config and `mtp.*` weights in its files (a config that names the head while its weights were stripped, as
    some conversions do, would give vLLM a random head)."""
    if mtp_layers(model_path) <= 0:
        return False
    try:
        return any(n.startswith("mtp.") for n in weight_names(model_path))
    except (OSError, ValueError):
        return False


IGNORED_UNDER_SPECULATION = ("min_p", "logit_bias")


def ignored_with_capture(sampling: dict, capture_mode: str) -> str | None:
    """Why a run's sampling cannot be what its inline-capture engines apply, else None.

    vLLM builds no min_p or logit_bias processor when an engine has any `speculative_config`
    (vllm/v1/sample/logits_processor/__init__.py: "min_p and logit_bias parameters won't work with speculative
    decoding"), and inline capture is one (`extract_hidden_states`): the run's manifest would record a setting its
    engines never applied. A staged run's generate stage has no speculative config, and its capture stage's one
    sampled token is thrown away, so only inline capture is refused."""
    if capture_mode != "inline":
        return None
    for name in IGNORED_UNDER_SPECULATION:
        value = sampling.get(name)
        if value:
            flag = "--" + name.replace("_", "-")
            return (f"{flag} {value} with --capture inline: vLLM ignores {name} in an engine with a speculative "
                    f"config, and inline capture is one (extract_hidden_states), so the samples would not follow "
                    f"the run's sampling; use {flag} {0 if name == 'min_p' else 'none'} or --capture staged")
    return None


def check_speculative(setting: str | None, *, capture_mode: str, min_p: float, model_path: str | None) -> None:
    """Refuse, in one line each, a speculative run that cannot be what it says: an inline capture (its one engine
    captures, and capture is itself vLLM's speculative method), a non-zero `min_p` (vLLM ignores it under
    speculative decoding, so the samples would not follow the run's sampling), a checkpoint without an MTP head."""
    if setting is None:
        return
    if capture_mode == "inline":
        raise ConfigError(f"--speculative {setting} with --capture inline: an inline engine captures hidden states, "
                          "and vLLM's capture is itself a speculative method; use --capture staged (or off)")
    if min_p:
        raise ConfigError(f"--speculative {setting} with --min-p {min_p}: vLLM ignores min_p under speculative "
                          "decoding, so the samples would not follow the run's sampling; use --min-p 0")
    if model_path is not None and not has_mtp_head(model_path):
        raise ConfigError(f"--speculative {setting}: {model_path} has no MTP head (needs mtp_num_hidden_layers > 0 "
                          "in its config and mtp.* weights)")
