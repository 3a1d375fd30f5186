"""The operator's own vLLM engine settings (`--vllm-arg KEY=VALUE`), checked by vLLM's parser before anything
starts.

They are parsed with vLLM's own `EngineArgs` parser, so a bad key or value fails `regen worker` at start-up
with vLLM's message. Settings that would change the data a run's manifest pins are refused unless the manifest
carries them; prefix caching on a capture engine and `speculative_config` on a capture run are always refused.
What is refused and why: docs/configuration.md#how---vllm-arg-is-checked.
"""

from __future__ import annotations

import argparse
import contextlib
import functools

from app.base.errors import ConfigError

# EngineArgs fields that decide which tokens and states a sample gets, beyond what the worker itself sets.
DATA_CHANGING = {
    "model": "the model", "tokenizer": "the tokenizer", "revision": "the model", "tokenizer_revision": "the tokenizer",
    "code_revision": "the model", "hf_config_path": "the model", "hf_overrides": "the model's config",
    "tokenizer_mode": "the tokenizer", "skip_tokenizer_init": "the tokenizer", "dtype": "dtype",
    "quantization": "the weights' numerics", "kv_cache_dtype": "the attention numerics",
    "calculate_kv_scales": "the attention numerics", "speculative_config": "capture",
    "kv_transfer_config": "capture", "seed": "sampling", "generation_config": "sampling",
    "override_generation_config": "sampling", "logits_processors": "sampling", "language_model_only": "the model",
    "max_logprobs": "sampling",
}
CAPTURE_ONLY_REFUSED = ("enable_prefix_caching",)
_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print and exit(2); the caller turns this into a one-line error
        raise ConfigError(f"--vllm-arg: vLLM's engine arguments: {message}")


@contextlib.contextmanager
def _a_device_for_the_parser():
    """vLLM's parser computes its defaults by building every config, and `DeviceConfig()` raises "Failed to infer
    device type" where vLLM finds no device: a head host with the CUDA build and no GPU (vllm/config/device.py).
    There, while the parser is built, vLLM's platform is its own "unspecified" one with a device type: the
    defaults it computes are never used (only the values given are read back) and no engine runs in this
    process (workers start their engines in processes of their own, where the real platform is found)."""
    from vllm import platforms
    from vllm.platforms.interface import UnspecifiedPlatform

    found = platforms.current_platform
    if found.device_type:
        yield
        return

    class ParseOnlyPlatform(UnspecifiedPlatform):
        device_type = "cpu"

    platforms.current_platform = ParseOnlyPlatform()
    try:
        yield
    finally:
        platforms.current_platform = found


@functools.lru_cache(maxsize=1)
def _parser():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class Parser(_Parser, FlexibleArgumentParser):
        pass

    parser = Parser(allow_abbrev=False, add_help=False)
    with _a_device_for_the_parser():
        EngineArgs.add_cli_args(parser)
    return parser


def split_item(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    key = key.strip().lstrip("-").replace("-", "_")
    if not sep or not key:
        raise ConfigError(f"--vllm-arg {item!r}: expected KEY=VALUE (an EngineArgs field, e.g. "
                          "max_num_batched_tokens=8192)")
    return key, value.strip()


def parse_vllm_args(items: list[str] | tuple[str, ...]) -> dict:
    """`["max_num_batched_tokens=8192", "enable_prefix_caching=false"]` -> typed `LLM(...)` keyword arguments.

    Raises ConfigError with vLLM's parser message for an unknown key or a bad value.
    """
    if not items:
        return {}
    parser = _parser()
    out: dict = {}
    for item in items:
        key, value = split_item(item)
        flag = "--" + key.replace("_", "-")
        action = next((a for a in parser._actions if flag in a.option_strings), None)
        if action is not None and action.nargs == 0:  # a boolean flag: --x / --no-x
            low = value.lower()
            if low not in _TRUE | _FALSE:
                raise ConfigError(f"--vllm-arg {item!r}: {flag} is a flag; give true or false")
            argv = [flag if low in _TRUE or not isinstance(action, argparse.BooleanOptionalAction)
                    else "--no-" + flag[2:]]
            if low in _FALSE and not isinstance(action, argparse.BooleanOptionalAction):
                out[action.dest] = action.default
                continue
        else:
            argv = [flag, value]
        namespace = parser.parse_args(argv)  # an unknown key or a bad value: vLLM's message, as ConfigError
        dest = action.dest if action is not None else key
        out[dest] = getattr(namespace, dest)
    return out


def data_changing(key: str) -> str | None:
    """What a setting would change in the data (None: nothing the manifest pins)."""
    return DATA_CHANGING.get(key)


def check_data_args(items: list[str] | tuple[str, ...], *, capture: bool, pinned: dict | None = None,
                    run_id: str | None = None) -> None:
    """Refuse a setting that would change the data the run pins, unless the run's manifest carries it as given;
    refuse prefix caching on a capture engine outright."""
    pinned = pinned or {}
    where = f"run {run_id!r}" if run_id else "the run"
    for item in items or ():
        key, value = split_item(item)
        if capture and key == "speculative_config":
            raise ConfigError("--vllm-arg speculative_config on a capture run would replace the capture engines' own "
                              "(capture is vLLM's extract_hidden_states method); for MTP generation use "
                              "--speculative mtp[:K] with --capture staged or off")
        if capture and key in CAPTURE_ONLY_REFUSED and value.lower() not in _FALSE:
            raise ConfigError(f"--vllm-arg {item}: capture engines run without prefix caching, because prefix-cached "
                              "tokens get no hidden states from the sample's own forward pass (vLLM issue 44485)")
        what = data_changing(key)
        if what is None or (key in pinned and str(pinned[key]) == value):
            continue
        raise ConfigError(f"--vllm-arg {key}={value} would change {what}, which {where}'s manifest pins; "
                          "give it to `regen produce --vllm-arg` so the manifest records it, or leave it out")


def validate(items: list[str] | tuple[str, ...], *, capture: bool, pinned: dict | None = None,
             run_id: str | None = None) -> dict:
    """Both checks, as `regen worker` / `regen run` do at start-up; the typed arguments."""
    check_data_args(items, capture=capture, pinned=pinned, run_id=run_id)
    return parse_vllm_args(items)


def worker_vllm_args(given: list[str] | tuple[str, ...], *, capture: bool, pinned: dict | None = None,
                     run_id: str | None = None) -> list[str]:
    """The KEY=VALUEs a worker's engine gets: the run manifest's (`pinned`), then the operator's `given`, each
    checked (the operator's against what the manifest pins) before any process starts."""
    pinned = pinned or {}
    from_manifest = [f"{k}={v}" for k, v in pinned.items()]
    validate(list(given), capture=capture, pinned=pinned, run_id=run_id)
    if from_manifest:
        parse_vllm_args(from_manifest)
    return from_manifest + list(given)


def effective_values(vllm_config, keys) -> dict:
    """The values the built engine holds for `keys` (EngineArgs fields), read from its VllmConfig's sections:
    proof that an operator's setting reached the engine rather than only the command line."""
    sections = [getattr(vllm_config, name) for name in dir(vllm_config)
                if name.endswith("_config") and not name.startswith("_")]
    out = {}
    for key in keys:
        for section in sections:
            if section is not None and hasattr(section, key):
                out[key] = getattr(section, key)
                break
    return out
