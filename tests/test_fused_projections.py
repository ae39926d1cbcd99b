"""`vlm_grpo.engine.fused_projections`: the stacked q/k/v stand-ins compute what the LoRA layers compute, in any
call order, with one GEMM per layer, and give the model back as they found it."""

from __future__ import annotations

import pytest
import torch

from vlm_grpo.engine.fused_projections import PROJECTIONS, FusedQKV, fusable_sites
from vlm_grpo.models.loader import FastVisionModel


def _model(tiny_dir, family="qwen2_5_vl", **lora):
    model, _ = FastVisionModel.from_pretrained(tiny_dir(family))
    model = FastVisionModel.get_peft_model(model, r=4, **lora)
    torch.manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # a trained-looking adapter, so the merged weights differ from the base
            param.data.normal_(0, 0.3)
    return model.eval()


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "gemma3", "idefics3"])
def test_stand_ins_give_the_lora_layers_outputs_in_any_order(tiny_dir, family):
    model = _model(tiny_dir, family)
    fused = FusedQKV(model)
    text_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    assert len(fused.sites) == text_layers  # the decoder's attention layers, not the vision tower's
    site = fused.sites[0]
    hidden = site.originals[0].in_features
    x = torch.randn(2, 3, hidden)
    with torch.no_grad():
        expected = [projection(x) for projection in site.originals]  # PEFT: base + scaling * B(A(x))
        fused.fill()
        with fused.swapped():
            assert all(getattr(site.attention, name) is part for name, part in zip(PROJECTIONS, site.parts))
            for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
                got = {}
                for count, index in enumerate(order, start=1):
                    got[index] = getattr(site.attention, PROJECTIONS[index])(x)
                    # one stacked GEMM serves the three parts, then the input is let go
                    assert site.stacked.last is None if count == 3 else site.stacked.last[2] == count
                for index, want in enumerate(expected):
                    torch.testing.assert_close(got[index], want, rtol=1e-5, atol=1e-5)
            other = torch.randn(2, 3, hidden)  # a different input: a part computes its own slice, not a stale one
            site.attention.q_proj(x)
            torch.testing.assert_close(site.attention.k_proj(other), site.originals[1](other), rtol=1e-5, atol=1e-5)
    assert all(getattr(site.attention, name) is original for name, original in zip(PROJECTIONS, site.originals))
    assert site.stacked.last is None


def test_fill_follows_the_adapter_and_the_stacked_memory_stays_put(tiny_dir):
    model = _model(tiny_dir)
    fused = FusedQKV(model)
    site = fused.sites[0]
    address = site.stacked.weight.data_ptr()
    fused.fill()
    before = site.stacked.weight.clone()
    with torch.no_grad():
        site.originals[1].lora_B["default"].weight.add_(0.5)  # an optimizer step on k_proj's adapter
    fused.fill()
    start, end = site.stacked.bounds[1]
    assert not torch.equal(site.stacked.weight[start:end], before[start:end])
    assert torch.equal(site.stacked.weight[: site.stacked.bounds[0][1]], before[: site.stacked.bounds[0][1]])
    assert site.stacked.weight.data_ptr() == address  # a recorded CUDA graph keeps reading the same memory
    assert fused.matches(model)


def test_adapters_that_do_not_merge_as_a_delta_are_left_alone(tiny_dir):
    assert fusable_sites(_model(tiny_dir))
    assert not fusable_sites(_model(tiny_dir, use_dora=True))  # DoRA rescales columns: not W + B @ A


def test_an_adapter_peft_merged_itself_is_left_to_peft(tiny_dir):
    # After PEFT's `merge_adapter()` the delta is in the base weight and PEFT's forward owns that state: adding it
    # again (stacked copies) or toggling the layers' flags (merged_lora) would double it or unmerge mid-generation.
    from vlm_grpo.engine.lora_merge import merged_lora

    model = _model(tiny_dir)
    sites = len(fusable_sites(model))
    model.merge_adapter()
    assert sites and not fusable_sites(model)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    with merged_lora(model) as merged:
        assert not merged
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
