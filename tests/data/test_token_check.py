"""The token check's candidate set is vLLM's own (its sampler's top-k/top-p code, run here on the same logits), and a
token outside it by more than the tolerance is a miss naming its position and probabilities."""

from __future__ import annotations

import math

import pytest
import torch

from app.data.token_check import BF16_STEP, TOL_SIGMA, candidate_edge, judge


def vllm_kept(logits: torch.Tensor, sampling: dict) -> torch.Tensor:
    """The tokens vLLM's sampler can draw: its own top-k/top-p function on the tempered logits (min_p as its
    logits processor does: probabilities below min_p x the top one's removed first)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    scaled = logits / sampling["temperature"]
    if sampling.get("min_p"):
        probs = scaled.softmax(dim=-1)
        scaled = scaled.masked_fill(probs < sampling["min_p"] * probs.max(dim=-1, keepdim=True).values, -math.inf)
    n = len(logits)
    k = torch.full((n,), sampling["top_k"]) if sampling.get("top_k") else None
    p = torch.full((n,), sampling["top_p"]) if sampling.get("top_p", 1.0) < 1.0 else None
    return torch.isfinite(apply_top_k_top_p_pytorch(scaled.clone(), k, p))


@pytest.mark.vllm  # imports vLLM's sampler (~30 s here), no engine
@pytest.mark.parametrize("sampling", [
    {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0},  # Qwen3's thinking defaults
    {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0},  # its non-thinking ones
    {"temperature": 1.0, "top_p": 0.5, "top_k": 0, "min_p": 0.0},
    {"temperature": 1.0, "top_p": 1.0, "top_k": 5, "min_p": 0.0},
    {"temperature": 0.8, "top_p": 1.0, "top_k": 0, "min_p": 0.1},
])
def test_the_candidate_set_is_the_one_vllms_sampler_draws_from(sampling):
    torch.manual_seed(0)
    logits = torch.randn(64, 2000) * 3
    kept = logits >= candidate_edge(logits, sampling).unsqueeze(1)
    assert torch.equal(kept, vllm_kept(logits, sampling))
    assert kept.sum(dim=1).float().mean() > 3  # the sets are not trivial


def test_greedy_keeps_the_top_token_within_the_tolerance_and_names_a_miss():
    torch.manual_seed(1)
    logits = torch.randn(8, 500)
    greedy = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
    top = logits.argmax(dim=1)
    assert judge(logits, top, greedy, 0, 10).misses == []
    sigma = logits.std(dim=1)
    second = logits.topk(2, dim=1)
    near = logits.clone()  # a runner-up within the tolerance of the top: bf16 noise could have swapped them
    near[3, second.indices[3, 1]] = second.values[3, 0] - 0.5 * TOL_SIGMA * sigma[3]
    chosen = top.clone()
    chosen[3] = second.indices[3, 1]
    assert judge(near, chosen, greedy, 0, 10).misses == []
    low = logits.argmin(dim=1)
    chosen[5] = low[5]  # far below: a miss at output position 5, input_ids[15]
    result = judge(logits, chosen, greedy, 0, 10)
    assert [(m.position, m.index, m.token, m.top_token) for m in result.misses] == [(5, 15, int(low[5]), int(top[5]))]
    miss = result.misses[0]
    assert miss.margin == pytest.approx(float(logits[5].max() - logits[5].min()))
    assert miss.tolerance == pytest.approx(float(TOL_SIGMA * sigma[5] + BF16_STEP * logits[5].max().abs()))
    assert "output token 5 (input_ids[15])" in miss.line() and f"top token {int(top[5])}" in miss.line()


def test_a_token_outside_top_k_is_a_miss_and_one_inside_is_not():
    torch.manual_seed(2)
    logits = torch.randn(16, 1000) * 2
    sampling = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0}
    ranks = logits.argsort(dim=1, descending=True)
    inside = ranks[:, 4]
    assert judge(logits, inside, sampling, 0, 3).misses == []
    outside = inside.clone()
    outside[7] = ranks[7, 500]
    misses = judge(logits, outside, sampling, 0, 3).misses
    assert [m.position for m in misses] == [7] and misses[0].prob < misses[0].edge_prob
    assert judge(logits, torch.full((16,), 1000), sampling, 0, 3).misses[0].prob == 0.0  # outside the vocabulary
