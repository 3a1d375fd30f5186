"""The selfcheck's judge on captures written as workers/engine/selfcheck.py writes them, without an engine: transformers'
own states pass; a shifted capture, zero rows, wrong ids, a staged capture of other rows and a duplicate whose
states differ each fail with the check named."""

from __future__ import annotations

import json

import numpy as np
import pytest

from app.data.selfcheck_judge import judge

LAYERS = [1, 2, 4]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from app.data.reference import ReferenceCapture
    from workers.tiny_model import build_tiny_qwen3

    ref = ReferenceCapture(build_tiny_qwen3(str(tmp_path_factory.mktemp("judge-model")), massive=400.0), LAYERS)
    yield ref
    ref.close()


def write(path, reference, change=None):
    rng = np.random.default_rng(0)
    reqs, arrays = [], {}
    prompts = {"len-1": [57], "len-40": rng.integers(10, 400, 40).tolist()}
    prompts["len-40-duplicate"] = prompts["len-40"]
    for rid, prompt in prompts.items():
        output = rng.integers(10, 400, 6).tolist() if rid != "len-40-duplicate" else reqs[1]["output"]
        ids = prompt + output[:-1]
        states = reference.capture(ids)
        reqs.append({"id": rid, "prompt": prompt, "sampling": {}, "output": output, "finish_reason": "length"})
        for tag in ("inline", "staged"):
            arrays[f"{tag}/{rid}/ids"] = np.asarray(ids, dtype=np.int64)
            arrays[f"{tag}/{rid}/states"] = states.copy()
    if change:
        change(arrays, reference)
    arrays["meta"] = np.frombuffer(json.dumps({"mode": "cpu", "layers": LAYERS, "vocab": 400,
                                               "requests": reqs}).encode(), dtype=np.uint8)
    np.savez(path, **arrays)
    return str(path)


def test_transformers_own_states_pass(tmp_path, reference):
    verdict = judge(write(tmp_path / "c.npz", reference), "dense", reference.capture, ["top_k skipped: why"])
    assert verdict.ok, verdict.failures
    assert verdict.line.startswith("PASS 3 requests, ids, rows, reference, duplicate, staged; worst error")
    assert verdict.line.endswith("(top_k skipped: why)")


def _shift(arrays, reference):
    ids = arrays["inline/len-40/ids"].tolist()
    arrays["inline/len-40/states"] = reference.capture(ids + [77])[1:]


def _zero(arrays, reference):
    arrays["inline/len-40/states"][10:14, 1] = 0


def _ids(arrays, reference):
    arrays["inline/len-40/ids"] = arrays["inline/len-40/ids"][::-1].copy()


def _staged(arrays, reference):
    arrays["staged/len-40/states"] = reference.capture(arrays["staged/len-40/ids"][::-1].tolist())


def _duplicate(arrays, reference):
    ids = arrays["inline/len-40-duplicate/ids"].tolist()
    arrays["inline/len-40-duplicate/states"] = reference.capture([5] + ids[1:])


@pytest.mark.parametrize(("change", "check"), [(_shift, "FAIL reference: len-40: "), (_zero, "FAIL rows: len-40: "),
                                               (_ids, "FAIL ids: len-40: "), (_staged, "FAIL staged: len-40: "),
                                               (_duplicate, "FAIL reference: len-40-duplicate")])
def test_each_fault_fails_its_check(tmp_path, reference, change, check):
    verdict = judge(write(tmp_path / "c.npz", reference, change), "dense", reference.capture)
    assert not verdict.ok and verdict.line.startswith(check), verdict.line


@pytest.fixture(scope="module")
def plain_reference(tmp_path_factory):
    """The tiny model without the massive channel: its logits differ per token (the massive one's are all equal)."""
    from app.data.reference import ReferenceCapture
    from workers.tiny_model import build_tiny_qwen3

    ref = ReferenceCapture(build_tiny_qwen3(str(tmp_path_factory.mktemp("judge-plain"))), LAYERS)
    yield ref
    ref.close()


def _greedy(path, reference, wrong: bool):
    """A greedy request whose output is transformers' own top tokens (or, `wrong`, the last one its lowest)."""
    import torch

    from app.data import token_check

    prompt = list(range(30, 70))
    ids = list(prompt)
    for _ in range(6):
        _, final = reference.capture_with_final(ids)
        with torch.inference_mode():
            ids.append(int(reference.head(final[-1:]).float().argmax()))
    output = ids[len(prompt):]
    if wrong:
        _, final = reference.capture_with_final(ids[:-1])
        with torch.inference_mode():
            output[-1] = int(reference.head(final[-1:]).float().argmin())
    greedy = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
    states = reference.capture(prompt + output[:-1])
    arrays = {}
    for tag in ("inline", "staged"):
        arrays[f"{tag}/greedy/ids"] = np.asarray(prompt + output[:-1], dtype=np.int64)
        arrays[f"{tag}/greedy/states"] = states.copy()
    arrays["meta"] = np.frombuffer(json.dumps({"mode": "cpu", "layers": LAYERS, "vocab": 400, "requests": [
        {"id": "greedy", "prompt": prompt, "sampling": greedy, "output": output, "finish_reason": "length"}]}).encode(),
        dtype=np.uint8)
    np.savez(path, **arrays)
    return judge(str(path), "dense", reference.capture, None,
                 lambda p, o, s: token_check.check_request(reference, p, o, s))


def test_greedy_tokens_are_held_to_transformers_top_tokens(tmp_path, plain_reference):
    reference = plain_reference
    right = _greedy(tmp_path / "g.npz", reference, wrong=False)
    assert right.ok and right.line.startswith("PASS 1 requests, ids, rows, reference, duplicate, staged, tokens;")
    wrong = _greedy(tmp_path / "w.npz", reference, wrong=True)
    assert not wrong.ok
    assert wrong.line.startswith("FAIL tokens: greedy: 1 of 6 greedy tokens are not transformers' top token; first: "
                                 "output token 5 (input_ids[45])"), wrong.line
