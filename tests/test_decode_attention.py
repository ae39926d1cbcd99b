"""`vlm_grpo.engine.decode_attention`: grouped-query decode attention equals transformers' `sdpa` (which copies the
key/value heads), and the switch gives the model back as it found it."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from vlm_grpo.engine.decode_attention import DECODE_ATTENTION, decode_attention, grouped_decode_sdpa
from vlm_grpo.models.loader import FastVisionModel


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
def test_grouped_decode_attention_equals_sdpa_with_copied_heads(mask_dtype):
    torch.manual_seed(0)
    module = nn.Module()
    module.num_key_value_groups = 4
    batch, kv_heads, length, dim = 3, 2, 11, 8
    query = torch.randn(batch, kv_heads * 4, 1, dim, dtype=torch.float64)
    key, value = (torch.randn(batch, kv_heads, length, dim, dtype=torch.float64) for _ in range(2))
    visible = torch.rand(batch, 1, 1, length) > 0.3  # left padding and unwritten cache slots, per row
    visible[..., 0] = True
    mask = visible if mask_dtype is torch.bool else torch.where(visible, 0.0, -1e9).to(torch.float64)
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    got, _ = grouped_decode_sdpa(module, query, key, value, mask, scaling=0.3)
    assert got.shape == expected.shape == (batch, 1, kv_heads * 4, dim)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_fp16_scores_do_not_overflow_before_scaling():
    # q . k of 8e4 overflows fp16 (max 65504); scaled by 1/sqrt(128) it is 7e3. The query is scaled first.
    module = nn.Module()
    module.num_key_value_groups = 2
    query = torch.full((1, 2, 1, 128), 25.0, dtype=torch.float64)
    key = torch.full((1, 1, 3, 128), 25.0, dtype=torch.float64)
    key[..., 1, :] = 24.0
    value = torch.randn(1, 1, 3, 128, dtype=torch.float64)
    expected, _ = sdpa_attention_forward(module, query, key, value, None)
    got, _ = grouped_decode_sdpa(module, query.half(), key.half(), value.half(), None)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), expected, rtol=2e-2, atol=2e-2)


def test_a_prefill_goes_to_sdpa_unchanged():
    module = nn.Module()
    module.num_key_value_groups = 2
    query, key, value = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    expected, _ = sdpa_attention_forward(module, query, key, value, None)
    got, _ = grouped_decode_sdpa(module, query, key, value, None)
    assert torch.equal(got, expected)


def test_the_switch_covers_the_text_model_and_gives_it_back(tiny_dir):
    model, _ = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl"))
    text = model.config.get_text_config(decoder=True)
    assert text._attn_implementation == "sdpa"
    with decode_attention(model) as switched:
        assert switched and text._attn_implementation == DECODE_ATTENTION
    assert text._attn_implementation == "sdpa"
    model.config.get_text_config(decoder=True)._attn_implementation = "eager"
    with decode_attention(model) as switched:  # not sdpa: left alone
        assert not switched and text._attn_implementation == "eager"
