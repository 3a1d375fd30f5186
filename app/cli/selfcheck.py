"""`regen selfcheck`: prove the capture on this host and this vLLM, before a run trusts them.

For a new GPU host, a new vLLM version or a new driver: builds a tiny dense model (a channel at 400 in every
token, as real Qwen models carry massive activations) and a tiny hybrid (Gated DeltaNet + full attention)
offline, captures a fixed set of requests in each engine mode the device runs (workers.engine.selfcheck: lengths 1
to ~2,500 tokens, a shared prefix, a duplicate, a KV cache small enough to preempt, Qwen3's thinking sampling
with `top_k` 20, two greedy requests), and judges every capture against transformers on the same device, row by row, and the
greedy requests' tokens against transformers' top tokens (app.data.selfcheck_judge, app.data.token_check).
One line per mode and model; exit 0 only when every mode passed.

Each mode runs in a process of its own (a mode's environment, such as `VLLM_USE_V2_MODEL_RUNNER=0`, is read
when vLLM builds its config). The commands it runs are printed, so one failing mode can be rerun alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import rich_click as click

from app.base.packages import require
from app.base.process_env import child_env
from app.data.selfcheck_judge import Verdict, judge
from workers.engine.selfcheck import MODES, mode
from workers.tiny_model import build_tiny_qwen3, build_tiny_qwen3_5

LAYERS = {"dense": [1, 2, 4], "hybrid": [1, 2, 4]}  # the hybrid's 1 and 2 are linear attention, 4 full attention


def _device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _build_models(folder: Path, which: list[str]) -> dict[str, str]:
    out = {}
    if "dense" in which:
        out["dense"] = build_tiny_qwen3(str(folder / "dense"), massive=400.0)
    if "hybrid" in which:
        out["hybrid"] = build_tiny_qwen3_5(str(folder / "hybrid"))
    return out


@click.command("selfcheck")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Where the engines and the transformers reference run (auto: a GPU if torch sees one).")
@click.option("--modes", default=None, metavar="NAME,...",
              help="Engine modes to prove (default: every mode of the device; see workers.engine.selfcheck).")
@click.option("--models", default="dense,hybrid", show_default=True, metavar="dense,hybrid",
              help="The tiny models to prove each mode on: dense (Qwen3) and/or hybrid (Qwen3.5).")
@click.option("--workdir", type=click.Path(file_okay=False), default=None,
              help="Keep the models, captures and engine logs here (default: a temporary folder, removed).")
@click.option("--timeout", type=click.IntRange(min=30), default=900, show_default=True,
              help="Seconds one mode's engine may take.")
@click.option("--json", "as_json", is_flag=True, help="Print the verdicts as JSON.")
def selfcheck(device: str, modes: str | None, models: str, workdir: str | None, timeout: int, as_json: bool) -> None:
    """Prove hidden-state capture on this host: every engine mode against transformers, one verdict each."""
    require("vllm", "regen selfcheck")
    require("torch", "regen selfcheck")

    device = _device(device)
    chosen = [mode(n.strip()) for n in modes.split(",")] if modes else [m for m in MODES if m.device == device]
    unknown_device = [m.name for m in chosen if m.device != device]
    if unknown_device:
        raise click.UsageError(f"modes {', '.join(unknown_device)} need a {'GPU' if device == 'cpu' else 'CPU'} "
                               f"run (--device {'cuda' if device == 'cpu' else 'cpu'})")
    which = [m.strip() for m in models.split(",") if m.strip()]
    if not which or set(which) - set(LAYERS):
        raise click.UsageError(f"--models takes dense and/or hybrid, not {models!r}")
    with tempfile.TemporaryDirectory(prefix="regen-selfcheck-") as scratch:
        folder = Path(workdir or scratch)
        folder.mkdir(parents=True, exist_ok=True)
        verdicts = _run(folder, _build_models(folder, which), chosen, device, timeout, as_json)
    if as_json:
        click.echo(json.dumps({"device": device, "verdicts": [v.as_dict() for v in verdicts]}, indent=2))
    ok = all(v.ok for v in verdicts)
    if not as_json:
        click.echo(f"selfcheck: {'OK' if ok else 'FAILED'} ({sum(v.ok for v in verdicts)} of {len(verdicts)} "
                   f"mode x model passed on {device})")
    sys.exit(0 if ok else 1)


def _run(folder: Path, model_paths: dict[str, str], chosen, device: str, timeout: int, quiet: bool) -> list:
    from app.data import token_check
    from app.data.reference import ReferenceCapture

    verdicts = []
    for name, path in model_paths.items():
        layers = LAYERS[name]
        reference = ReferenceCapture(path, layers, device=device)
        try:
            for m in chosen:
                out = folder / f"{m.name}-{name}.npz"
                log = folder / f"{m.name}-{name}.log"
                cmd = [sys.executable, "-m", "workers.engine.selfcheck", path, ",".join(map(str, layers)), m.name, str(out)]
                env = child_env(m.env)
                notes = []
                start = time.monotonic()
                try:
                    with log.open("w") as fh:
                        proc = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout)
                    rc = proc.returncode
                except subprocess.TimeoutExpired:
                    rc = None
                if rc != 0 or not out.exists():
                    tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:]
                    why = "timed out" if rc is None else f"exit {rc}"
                    verdict = Verdict(m.name, name, False, f"FAIL engine: {why}: {(tail or ['?'])[0][:200]} "
                                      f"(log {log})", notes=notes)
                else:
                    verdict = judge(str(out), name, reference.capture, notes,
                                    lambda prompt, output, sampling, ref=reference: token_check.check_request(
                                        ref, prompt, output, sampling))
                verdicts.append(verdict)
                if not quiet:
                    click.echo(f"{m.name:14} {name:7} {verdict.line} [{time.monotonic() - start:.0f} s]")
        finally:
            reference.close()
    return verdicts

