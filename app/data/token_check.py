"""Each generated token held to the target's own sampling: could the record's settings have produced it?

The reference's logits at each output position are judged the way vLLM's sampler forms its candidate set
(greedy, temperature, min_p, top-k, top-p); a token outside the set is a miss by `margin`, counted only beyond a
tolerance for bf16 and engine-versus-transformers noise (`TOL_SIGMA` standard deviations of the position's logits
plus one bf16 step). Positions the loss mask leaves out (forced ids) are not judged. The rule, the tolerance and
why: docs/checking.md#the-token-check-each-generated-token-held-to-the-targets-sampling-appdatatoken_checkpy.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from app.base.manifest import RunSettings

SAMPLING_EPS = 1e-5  # vLLM's: a temperature below it is greedy
TOL_SIGMA = 0.25  # the tolerance in standard deviations of the position's logits over the vocabulary
BF16_STEP = 2.0 ** -7  # bf16's spacing relative to a value: 8 significant bits
CHUNK = 128  # positions judged at once: 128 x a 152K vocabulary of float32 is 78 MB


@dataclass
class TokenMiss:
    """One generated token the record's sampling could not have produced."""

    position: int  # in the output (0: the first generated token)
    index: int  # in input_ids
    token: int
    prob: float  # its probability at the record's temperature (greedy: at 1), before top-k/top-p/min_p
    edge_prob: float  # the lowest probability the set kept
    top_token: int
    top_prob: float
    margin: float  # logits below the set's edge
    tolerance: float

    def line(self) -> str:
        return (f"output token {self.position} (input_ids[{self.index}]) = {self.token}: p={self.prob:.3g}, outside "
                f"the sampling's set (its edge p={self.edge_prob:.3g}; top token {self.top_token} "
                f"p={self.top_prob:.3g}), {self.margin:.3g} logits below the edge, tolerance {self.tolerance:.3g}")


@dataclass
class TokenResult:
    checked: int = 0
    skipped: int = 0  # positions the loss mask leaves out
    misses: list[TokenMiss] = field(default_factory=list)
    worst_sigma: float = -math.inf  # the largest margin seen, in the position's standard deviations (calibration)

    def add(self, other: TokenResult) -> None:
        self.checked += other.checked
        self.skipped += other.skipped
        self.misses += other.misses
        self.worst_sigma = max(self.worst_sigma, other.worst_sigma)


def candidate_edge(logits: torch.Tensor, sampling: dict) -> torch.Tensor:
    """The lowest raw logit vLLM's sampler keeps at each position (`logits` [N, V] float32). With top-k only the k
    highest logits are sorted (the others have no mass after its mask): the vocabulary-wide sort is top-p's alone."""
    temperature = float(sampling.get("temperature") or 0.0)
    top = logits.max(dim=-1, keepdim=True).values
    if temperature < SAMPLING_EPS:
        return top.squeeze(-1)
    top_k = int(sampling.get("top_k") or 0)
    cand = torch.topk(logits, top_k, dim=-1).values if 0 < top_k < logits.shape[-1] else logits
    min_p = float(sampling.get("min_p") or 0.0)
    if min_p > 0:
        cand = cand.masked_fill(cand / temperature < top / temperature + math.log(min_p), -math.inf)
    top_p = float(sampling.get("top_p") or 1.0)
    if top_p < 1.0:
        ordered = cand.sort(dim=-1).values  # ascending, as vLLM sums it
        kept = ((ordered / temperature).softmax(dim=-1).cumsum(dim=-1) > 1 - top_p) & torch.isfinite(ordered)
        kept[:, -1] = True
        return ordered.masked_fill(~kept, math.inf).min(dim=-1).values
    return cand.masked_fill(~torch.isfinite(cand), math.inf).min(dim=-1).values


def judge(logits: torch.Tensor, tokens: torch.Tensor, sampling: dict, start: int, prompt: int) -> TokenResult:
    """Judge `tokens` [N] sampled from `logits` [N, V] (output positions start..start+N-1)."""
    logits = logits.float()
    out = TokenResult(checked=len(tokens))
    vocab = logits.shape[-1]
    inside = tokens < vocab
    chosen = logits.gather(1, tokens.clamp(max=vocab - 1).unsqueeze(1)).squeeze(1)
    edge = candidate_edge(logits, sampling)
    sigma = logits.std(dim=-1)
    margin = torch.where(inside, edge - chosen, torch.full_like(edge, math.inf))
    tolerance = TOL_SIGMA * sigma + BF16_STEP * edge.abs()
    in_vocab = torch.where(inside, margin / sigma.clamp(min=1e-12), torch.full_like(margin, -math.inf))
    out.worst_sigma = float(in_vocab.max())  # ids outside the vocabulary are misses, not a figure
    bad = (margin > tolerance).nonzero().flatten().tolist()
    if bad:
        temperature = float(sampling.get("temperature") or 0.0)
        temperature = temperature if temperature >= SAMPLING_EPS else 1.0  # greedy: the model's own probabilities
        probs = (logits[bad] / temperature).softmax(dim=-1)
        for row, i in enumerate(bad):
            top = int(logits[i].argmax())
            tok = int(tokens[i])
            edge_p = float(probs[row][logits[i] >= edge[i]].min())
            out.misses.append(TokenMiss(start + i, prompt + start + i, tok,
                                        float(probs[row][tok]) if tok < vocab else 0.0, edge_p, top,
                                        float(probs[row][top]), float(margin[i]), float(tolerance[i])))
    return out


def record_chunks(final: torch.Tensor, rec: dict) -> Iterator[tuple[int, torch.Tensor]]:
    """(output position, rows) of a pass over `input_ids[:-1]`: row P-1+j predicts output token j."""
    prompt, n = int(rec["num_prompt_tokens"]), int(rec["num_output_tokens"])
    for start in range(0, n, CHUNK):
        yield start, final[prompt - 1 + start: prompt - 1 + min(n, start + CHUNK)]


def checkable(rec: dict, settings: dict) -> str | None:
    """Why a record's tokens cannot be judged (None: they can)."""
    if not isinstance(rec.get("sampling"), dict):
        return "the record has no `sampling` (written before records kept their settings)"
    if float(RunSettings.view(settings).sampling.repetition_penalty or 1.0) != 1.0:
        return "the run has a repetition penalty, which this check does not apply"
    return None


def check_record(hidden_chunks: Iterator[tuple[int, torch.Tensor]], head, rec: dict) -> TokenResult:
    """Every generated token of `rec` judged at its own `sampling`; `hidden_chunks` yields (output position, final
    normed hidden states [n, H]) whose row i predicts output token position+i, `head` maps them to logits."""
    ids, prompt = rec["input_ids"], int(rec["num_prompt_tokens"])
    mask = rec["loss_mask"]
    result = TokenResult()
    for start, hidden in hidden_chunks:
        with torch.inference_mode():
            logits = head(hidden).float()
        positions = [i for i in range(start, start + len(hidden)) if mask[prompt + i]]
        result.skipped += len(hidden) - len(positions)
        if not positions:
            continue
        rows = torch.tensor([i - start for i in positions])
        tokens = torch.tensor([ids[prompt + i] for i in positions], dtype=torch.long)
        part = judge(logits[rows], tokens, rec["sampling"], 0, prompt)
        for miss in part.misses:  # rows were picked: name the real positions
            miss.position = positions[miss.position]
            miss.index = prompt + miss.position
        result.add(part)
    return result


def check_request(ref, prompt: list[int], output: list[int], sampling: dict) -> TokenResult:
    """`check_record` for a request's prompt and output ids (`ref`: an app.data.reference.ReferenceCapture)."""
    ids = list(prompt) + list(output)
    rec = {"input_ids": ids, "num_prompt_tokens": len(prompt), "num_output_tokens": len(output),
           "loss_mask": [0] * len(prompt) + [1] * len(output), "sampling": sampling}
    _, final = ref.capture_with_final(ids[:-1])
    return check_record(record_chunks(final, rec), ref.head, rec)
