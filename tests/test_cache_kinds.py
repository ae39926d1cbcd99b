"""The fast generator's caches by kind: attention keys / values and linear-attention states copied per row of a
group, and a cache layer it does not know turned into a logged fallback to TRL's generate, never a crash."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import colour_rows
from datasets import Dataset
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import DynamicLayer, LinearAttentionLayer, StaticLayer

from vlm_grpo.compat import cache_kwarg
from vlm_grpo.engine.cache_kinds import UnservableCache, copy_prefill, layer_kind, state_tensors
from vlm_grpo.models.loader import FastVisionModel
from vlm_grpo.training.trainer import VLMGRPOConfig, VLMGRPOTrainer


class _NewKindLayer(StaticLayer):
    """A layer kind a future model might bring: it subclasses a known one, so it may store more than it."""


def test_layer_kinds_are_matched_by_exact_class():
    assert layer_kind(DynamicLayer()) == "attention"
    assert layer_kind(LinearAttentionLayer()) == "state"
    with pytest.raises(UnservableCache, match="_NewKindLayer"):
        layer_kind(_NewKindLayer(max_cache_len=8))


@pytest.mark.parametrize("family", ["qwen3_5", "lfm2_vl"])
def test_a_prefill_is_copied_to_every_row_of_its_group(tiny_dir, family):
    model, processor = FastVisionModel.from_pretrained(tiny_dir(family))
    ids = processor.tokenizer(["what shape is it", "which image"], return_tensors="pt", padding=True)
    prefill = DynamicCache(config=model.config)
    with torch.no_grad():
        model(**ids, use_cache=True, **{cache_kwarg(model): prefill})
    cache = StaticCache(config=model.config, max_cache_len=16)
    index = torch.tensor([0, 0, 1, 1])
    copy_prefill(prefill, cache, index)
    kinds = [layer_kind(layer) for layer in cache.layers]
    assert "state" in kinds and "attention" in kinds  # a hybrid model: both kinds served
    for source, target, kind in zip(prefill.layers, cache.layers, kinds, strict=True):
        if kind == "state":
            assert torch.equal(target.conv_states[0], source.conv_states[0][index])
            assert all(target.has_previous_state.values())  # the next forward continues (single-token step)
            if source.recurrent_states[0] is not None:
                assert torch.equal(target.recurrent_states[0], source.recurrent_states[0][index])
        else:
            length = source.keys.shape[-2]
            assert torch.equal(target.keys[..., :length, :], source.keys[index])
    addresses = [t.data_ptr() for t in state_tensors(cache)]
    copy_prefill(prefill, cache, index.flip(0))  # a later generation writes into the same tensors
    assert [t.data_ptr() for t in state_tensors(cache)] == addresses


@pytest.mark.trains
def test_an_unknown_cache_layer_falls_back_to_trls_generate_with_its_reason(tiny_dir, tmp_path, caplog):
    rows = [colour_rows("qwen3_vl")["one"]] * 2
    model, processor = FastVisionModel.from_pretrained(tiny_dir("qwen3_5"), full_finetuning=False)
    model = FastVisionModel.get_peft_model(model, r=4)
    args = VLMGRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2,
                         max_completion_length=4, report_to="none", use_cpu=True, disable_tqdm=True)  # fmt: skip
    trainer = VLMGRPOTrainer(model, [lambda completions, **k: [0.0] * len(completions)], args=args,
                             train_dataset=Dataset.from_list(rows), processing_class=processor)  # fmt: skip
    caches = trainer.fast_generator._decode_caches
    plain_get = caches.get

    def with_a_new_kind(model, batch, cache_len):
        cache = plain_get(model, batch, cache_len)
        cache.layers[-1] = _NewKindLayer(max_cache_len=cache_len)
        return cache

    caches.get = with_a_new_kind
    with caplog.at_level(logging.WARNING, logger="vlm_grpo.training.generation_route"):
        batch = trainer._generate_and_score_completions(rows)
    assert batch["completion_ids"].shape[0] == 2  # TRL's generate served the batch
    assert trainer.fast_generator.stats["calls"] == 0
    assert "Fast generation is off for this batch (cache layer _NewKindLayer" in caplog.text
    assert all(not getattr(p, "merged", False) for p in trainer.model.modules())  # LoRA put back, nothing merged
