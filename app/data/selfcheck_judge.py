"""The judging side of `regen selfcheck`: one mode's captures (workers.engine.selfcheck's file) held to five
checks.

`ids`, `rows`, `reference` (against transformers, app.base.states_compare), `duplicate`, `staged`, and `tokens`
(greedy requests' tokens held to transformers' top tokens within app.data.token_check's tolerance). A verdict is
one line per mode and model: PASS with the worst error against transformers, or FAIL naming the first failed
check, the request and the comparison's line. Each check: docs/capture.md#how-selfcheck-judges.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from app.base.states_compare import REL_BOUND, compare, row_problems

CHECKS = ("ids", "rows", "reference", "duplicate", "staged")
GREEDY_EPS = 1e-5  # vLLM's: a temperature below it is greedy


@dataclass
class Verdict:
    mode: str
    model: str
    ok: bool
    line: str
    worst: float = 0.0
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"mode": self.mode, "model": self.model, "ok": self.ok, "line": self.line, "worst": self.worst,
                "failures": self.failures, "notes": self.notes}


def load(path: str) -> tuple[dict, dict[str, np.ndarray]]:
    with np.load(path) as data:
        arrays = {k: data[k] for k in data.files}
    return json.loads(arrays.pop("meta").tobytes()), arrays


def judge(path: str, model: str, reference_capture, notes: list[str] | None = None, judge_tokens=None) -> Verdict:
    """Hold one mode's captures to CHECKS; `reference_capture(ids) -> bf16 states` is transformers';
    `judge_tokens(prompt, output, sampling)` -> app.data.token_check.TokenResult holds greedy requests' tokens."""
    meta, arrays = load(path)
    layers = meta["layers"]
    failures: list[str] = []
    worst = 0.0
    by_id = {r["id"]: r for r in meta["requests"]}
    diverged: list[str] = []
    for r in meta["requests"]:
        rid = r["id"]
        if r["output"] is None or f"inline/{rid}/states" not in arrays:
            failures.append(f"ids: {rid}: no capture came back")
            continue
        want = list(r["prompt"]) + list(r["output"])[:-1]
        inline_ids, inline = arrays[f"inline/{rid}/ids"], arrays[f"inline/{rid}/states"]
        if inline_ids.tolist() != want:
            failures.append(f"ids: {rid}: {len(inline_ids)} captured ids are not the prompt + output ids "
                            f"({len(want)})")
            continue
        greedy = float((r.get("sampling") or {}).get("temperature", 1.0)) < GREEDY_EPS
        if judge_tokens is not None and greedy:
            judged = judge_tokens(list(r["prompt"]), list(r["output"]), r["sampling"])
            if judged.misses:
                failures.append(f"tokens: {rid}: {len(judged.misses)} of {judged.checked} greedy tokens are not "
                                f"transformers' top token; first: {judged.misses[0].line()}")
        if (problem := row_problems(inline)) is not None:
            failures.append(f"rows: {rid}: {problem.line(layers)}")
        result = compare(reference_capture(want), inline, layers, bound=REL_BOUND, token_ids=want)
        worst = max(worst, result.error)
        if not result.ok:
            failures.append(f"reference: {rid}: {result.line()}")
        staged_key = f"staged/{rid}/states"
        if staged_key not in arrays:
            failures.append(f"staged: {rid}: no staged capture came back")
        elif arrays[f"staged/{rid}/ids"].tolist() != want:
            failures.append(f"ids: {rid}: the staged capture's ids are not the ids it was given")
        else:
            staged = compare(inline, arrays[staged_key], layers, bound=REL_BOUND, token_ids=want)
            if not staged.ok:
                failures.append(f"staged: {rid}: {staged.line()}")
        if rid.endswith("-duplicate"):  # equal requests, equal states: over the ids both have
            original = by_id.get(rid.removesuffix("-duplicate"))
            if original is None or f"inline/{original['id']}/states" not in arrays:
                failures.append(f"duplicate: {rid}: its original has no capture")
            else:
                theirs = arrays[f"inline/{original['id']}/ids"]
                common = next((i for i, (a, b) in enumerate(zip(theirs, inline_ids, strict=False)) if a != b),
                              min(len(theirs), len(inline_ids)))
                same = compare(arrays[f"inline/{original['id']}/states"][:common], inline[:common], layers,
                               bound=REL_BOUND, token_ids=want[:common])
                if not same.ok:
                    failures.append(f"duplicate: {rid}: {same.line()}")
                if original["output"] != r["output"]:
                    diverged.append(f"{rid} sampled other tokens after {common - len(r['prompt']) + 1} of "
                                    f"{len(r['output'])} (sampling is not batch-invariant here)")
    notes = list(notes or []) + diverged
    tail = f" ({'; '.join(notes)})" if notes else ""
    n = len(meta["requests"])
    if failures:
        first = failures[0]
        more = f" (+{len(failures) - 1} more)" if len(failures) > 1 else ""
        return Verdict(meta["mode"], model, False, f"FAIL {first}{more}{tail}", worst, failures, notes)
    checks = CHECKS + (("tokens",) if judge_tokens is not None else ())
    return Verdict(meta["mode"], model, True, f"PASS {n} requests, {', '.join(checks)}; worst error against "
                   f"transformers {worst:.2g} of the row (bound {REL_BOUND:.3g}){tail}", worst, [], notes)
