"""`regen verify --reference N`: N stored samples recomputed with plain transformers and judged row by row.

The judgement is app.base.states_compare's, the same the worker-side re-capture uses (a relative error per row
under a measured bound, each row nearer its own counterpart, each slot nearer its own layer). A lossy run's
rows may differ by its promised `max_rel_error` on top (`reference_bound`). The same pass, run on to the LM head,
holds every generated token to the record's own sampling (app.data.token_check: `token_outside_sampling`).
`device` runs the reference where the target fits (`cpu`, `cuda[:N]`, `auto`). Why, and the bound's
arithmetic: docs/checking.md#how-the-reference-comparison-judges.
"""

from __future__ import annotations

import math
import os
import random

from app.base.states_bound import promise
from app.base.states_compare import REL_BOUND, compare
from app.data.engine_modes import shard_mode
from app.data.run_reader import RunReader
from app.data.verify_checks import Problem


def reference_bound(max_rel_error: float = 0.0) -> float:
    """The largest error per row against transformers: the capture's REL_BOUND plus a lossy run's promise."""
    return REL_BOUND + max_rel_error * (1 + REL_BOUND)


def resolve_device(device: str) -> str:
    """`auto` -> `cuda` where torch sees a GPU, else `cpu`; `cuda*` refused in one line where it sees none."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: torch sees no GPU here (torch {torch.__version__})")
    return device


def reference_check(reader: RunReader, pool: list[tuple[str, str]], n: int, problems: list[Problem],
                    device: str = "cpu") -> dict:
    """Recompute `n` samples (a fixed-seed random choice of `pool`'s (shard, sample)) with transformers on `device`
    and judge the stored states; a problem per failing sample, the worst figures per layer in the result."""
    if reader.layers is None:
        problems.append(Problem("reference", None, None, "run captured no hidden states"))
        return {"checked": 0}
    chosen = random.Random(0).sample(pool, min(n, len(pool)))
    if len(chosen) < n:
        problems.append(Problem("reference", None, None, f"only {len(chosen)} intact samples to check, asked {n}"))
    model_path = reader.run_settings.model_path
    if not model_path or not os.path.isdir(model_path):  # checked before importing torch (seconds)
        problems.append(Problem("reference_unavailable", None, None, f"model folder {model_path!r} not found here"))
        return {"checked": 0}
    try:
        from app.data.reference import ReferenceCapture

        device = resolve_device(device)
        ref = ReferenceCapture(model_path, reader.layers, device=device)
    except Exception as exc:  # a model folder that is gone or unloadable here, a device that is not
        problems.append(Problem("reference_unavailable", None, None, f"{type(exc).__name__}: {exc}"[:300]))
        return {"checked": 0}
    lossy = promise(reader.settings)
    bound = reference_bound(lossy.max_rel_error if lossy.lossy else 0.0)
    layers = [int(v) for v in reader.layers]
    per_layer = {v: {"layer": v, "worst_error": 0.0, "shard": None, "sample": None, "token": None} for v in layers}
    worst = {"error": 0.0, "layer": None, "token": None, "shard": None, "sample": None}
    failed = 0
    from app.data import token_check

    tokens_result, token_samples, unchecked = token_check.TokenResult(), 0, {}
    records: dict[str, dict] = {}
    per_mode: dict[str, dict] = {}  # by the engine mode that made the states: an sm_120 host beside an sm_100 one
    try:
        for shard, sid in chosen:
            info = reader.shard(shard)
            tokens, states = reader.states(info, {"sample_id": sid})
            if shard not in records:
                records[shard] = {r["sample_id"]: r for r in reader.records(info) if r.get("status") == "ok"}
            rec = records[shard].get(sid)
            why = "no ok record" if rec is None else token_check.checkable(rec, reader.settings)
            if why is None:
                captured, final = ref.capture_with_final(tokens.tolist())
                judged = token_check.check_record(token_check.record_chunks(final, rec), ref.head, rec)
                tokens_result.add(judged)
                token_samples += 1
                if judged.misses:
                    problems.append(Problem("token_outside_sampling", shard, sid, f"{len(judged.misses)} of "
                                            f"{judged.checked} generated tokens outside the record's sampling "
                                            f"{rec['sampling']}; first: {judged.misses[0].line()}"))
            else:
                captured = ref.capture(tokens.tolist())
                unchecked[why] = unchecked.get(why, 0) + 1
            result = compare(captured, states, layers, bound=bound, token_ids=tokens)
            mode = per_mode.setdefault(shard_mode(info.marker, info.captured)[0],
                                       {"checked": 0, "failed": 0, "worst_error": 0.0})
            mode["checked"] += 1
            mode["failed"] += not result.ok
            mode["worst_error"] = max(mode["worst_error"], result.error)
            for figure in result.per_layer:
                row = per_layer[figure.layer]
                if figure.worst_error >= row["worst_error"]:
                    row.update(worst_error=figure.worst_error, shard=shard, sample=sid, token=figure.worst_token)
            if result.error >= worst["error"]:
                worst = {"error": result.error, "layer": result.layer, "token": result.token, "shard": shard,
                         "sample": sid}
            if not result.ok:
                failed += 1
                problems.append(Problem("reference_mismatch", shard, sid, f"against transformers: {result.line()}"))
    finally:
        ref.close()
        reader.close()
    out = {"checked": len(chosen), "failed": failed, "device": device, "tolerance": bound,
           "worst": worst, "per_layer": list(per_layer.values()), "per_engine_mode": per_mode,
           "tokens": {"samples": token_samples, "tokens": tokens_result.checked, "forced": tokens_result.skipped,
                      "outside": len(tokens_result.misses), "tolerance_sigma": token_check.TOL_SIGMA,
                      "worst_sigma": tokens_result.worst_sigma if math.isfinite(tokens_result.worst_sigma) else None,
                      "unchecked": unchecked}}
    return {**out, "states_dtype": lossy.dtype, "excess": worst["error"] / bound} if lossy.lossy else out


def reference_line(reference: dict) -> str:
    """verify's summary of the reference check: samples, device, the worst error against the bound, per layer."""
    if not reference.get("checked"):
        return "0 samples"
    worst = reference["worst"]
    layers = ", ".join(f"{row['layer']} {row['worst_error']:.2g}" for row in reference["per_layer"])
    modes = reference.get("per_engine_mode") or {}
    by_mode = ("; per engine mode: " + ", ".join(f"{m} {c['checked']} samples, {c['failed']} failed, worst "
                                                 f"{c['worst_error']:.2g}" for m, c in modes.items())
               if len(modes) > 1 else "")
    return (f"{reference['checked']} samples on {reference['device']}, {reference['failed']} failed; worst error "
            f"{worst['error']:.2g} of the row at layer {worst['layer']} token {worst['token']} (bound "
            f"{reference['tolerance']:.3g}); worst per layer: {layers}{by_mode}")


def tokens_line(reference: dict) -> str:
    """The token check's summary: tokens judged, outside the sampling, the worst margin against the tolerance."""
    t = reference.get("tokens") or {}
    if not t.get("tokens"):
        why = "; ".join(f"{n} {w}" for w, n in (t.get("unchecked") or {}).items())
        return f"generated tokens not judged ({why or 'none'})"
    unchecked = sum((t.get("unchecked") or {}).values())
    return (f"generated tokens: {t['tokens']} of {t['samples']} samples judged against their sampling, "
            f"{t['outside']} outside (worst {t['worst_sigma'] or 0:.2g} sd past the set's edge, tolerance "
            f"{t['tolerance_sigma']} sd)" + (f", {t['forced']} forced ids not judged" if t["forced"] else "")
            + (f", {unchecked} samples not judged" if unchecked else ""))
