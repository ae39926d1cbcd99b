"""The loss scores the sampler's distribution: the ids generation never samples are out of the scored softmax.

Each tiny model gets an LM-head bias that puts most of the probability on the image token, which generation
suppresses. Scored over the full softmax, every sampled token would be too low by -log(1 - p_image) (~2 here); the
scored log-probs must instead equal the sampler's (a plain forward's logits, temperature, the blocked ids at -inf),
for the policy and the reference, on every path.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import colour_rows
from datasets import Dataset
from transformers import GenerationConfig

from vlm_grpo.blocked_tokens import BLOCKED_LOGIT, blocked_ids, check_blocking_settings, excluded_from_scoring
from vlm_grpo.compat import checkpointing_settings
from vlm_grpo.data import answer_words
from vlm_grpo.families import core_model, family_of
from vlm_grpo.media.forward_inputs import completion_token_types, images_per_row_input
from vlm_grpo.media.processing import row_vision_inputs
from vlm_grpo.models.loader import FastVisionModel
from vlm_grpo.tiny import TINY_FAMILIES
from vlm_grpo.training.trainer import VISION_ROWS, VLMGRPOConfig, VLMGRPOTrainer

COLORS = answer_words("color", 1)
MULTIMODAL = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "token_type_ids", "mm_token_type_ids",
              "spatial_shapes", "image_sizes")  # fmt: skip
PATHS = [(True, True), (True, False), (False, True), (False, False)]  # (fast_generation, shared_prefix)


def _zero_reward(prompts, completions, **kwargs):
    return [0.0] * len(completions)


def _image_rows(family):
    rows = colour_rows(family)
    if family_of(family).prefix_lm:  # PaliGemma's processor takes no prompt without an image
        return [rows["one"], rows["one"], rows["two"], rows["two"], rows["other"], rows["other"]]
    return [rows["one"], rows["one"], rows["two"], rows["two"], rows["text"], rows["text"]]


def _trainer(tiny_dir, tmp_path, family, rows, fast, shared, **config):
    model, processor = FastVisionModel.from_pretrained(tiny_dir(family, words=COLORS), full_finetuning=False)
    model = FastVisionModel.get_peft_model(model, r=4)  # a fresh adapter: the reference is the policy, adapters off
    head = core_model(model).get_output_embeddings()
    bias = torch.zeros(head.weight.shape[0])
    # Most of the mass on a token generation suppresses: e^sink = 4x the vocabulary, so about 0.8 of it against
    # near-uniform other logits whatever the tokenizer's size (word-level ~120 ids, Qwen3.5's byte-level 455).
    bias[core_model(model).config.image_token_id] = math.log(4 * head.weight.shape[0])
    head.bias = torch.nn.Parameter(bias, requires_grad=False)
    args = VLMGRPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=len(rows), num_generations=2,
        max_completion_length=6, report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
        fast_generation=fast, shared_prefix=shared, **checkpointing_settings(False, {}), **config,
    )  # fmt: skip
    return VLMGRPOTrainer(model, [_zero_reward], args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=processor)  # fmt: skip


def _sampler_logps(trainer, batch):
    """The sampler's log-prob of each completion token, and its entropy, from a plain forward's full logits: divided
    by the temperature, the blocked ids at -inf (what `generate`'s processors do before drawing)."""
    model = core_model(trainer.model)
    width = batch["completion_ids"].size(1)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    if VISION_ROWS in batch:
        inputs = row_vision_inputs(batch[VISION_ROWS], ids, width, trainer.processing_class)
        inputs = {k: v for k, v in inputs.items() if k not in ("num_images", "num_videos")}
    else:
        inputs = {k: batch[k] for k in MULTIMODAL if k in batch}
    # As generation feeds the model: each row's image count (LLaVA-OneVision), a prefix-LM's completion causal.
    family = family_of(trainer.model)
    inputs.update(images_per_row_input(family, batch.get("num_images")))
    if family.prefix_lm:
        inputs["token_type_ids"] = completion_token_types(inputs["token_type_ids"], width)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, **inputs).logits[:, -width - 1 : -1].float()
    logits = logits / trainer.temperature
    blocked = list(blocked_ids(trainer.generation_config))
    full = logits.log_softmax(-1)
    logits[..., blocked] = -torch.inf
    logp = logits.log_softmax(-1)
    entropy = -torch.where(logp.isfinite(), logp.exp() * logp, 0.0).sum(-1)
    image_mass = full[..., trainer.model.config.image_token_id].exp()
    return logp.gather(-1, batch["completion_ids"][..., None]).squeeze(-1), entropy, image_mass


def _scored(trainer, model, batch):
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    inputs = {k: batch[k] for k in (*MULTIMODAL, "num_images", "num_tiles") if k in batch}
    trainer._vision_rows = batch.get(VISION_ROWS)
    try:
        with torch.no_grad():
            logps, entropy, _ = trainer._get_per_token_logps_and_entropies(
                model, ids, mask, batch["completion_ids"].size(1), compute_entropy=True, **inputs
            )
    finally:
        trainer._vision_rows = None
    return logps, entropy


def _check(trainer, batch, fast):
    mask = batch["completion_mask"].bool()
    truth, truth_entropy, image_mass = _sampler_logps(trainer, batch)
    assert image_mass[mask].mean() > 0.5  # the suppressed token holds most of the full softmax's mass
    policy, entropy = _scored(trainer, trainer.model, batch)
    assert (policy - truth)[mask].abs().max() < 1e-4
    assert (entropy - truth_entropy)[mask].abs().max() < 1e-4
    # TRL's reference (a fresh adapter: the policy with its adapters off), computed while scoring the rollouts.
    assert (batch["ref_per_token_logps"] - truth)[mask].abs().max() < 1e-4
    if fast:  # the fast generator's own log-probs, returned with its tokens
        assert (batch["sampling_per_token_logps"] - truth)[mask].abs().max() < 1e-4
    else:
        assert "sampling_per_token_logps" not in batch  # TRL's generate returns none
    assert truth[mask].std() > 0.05  # not a comparison between constants


@pytest.mark.trains
@pytest.mark.parametrize("fast, shared", PATHS, ids=lambda v: "on" if v else "off")
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_scored_logps_are_the_samplers(tiny_dir, tmp_path, family, fast, shared):
    rows = _image_rows(family)
    trainer = _trainer(tiny_dir, tmp_path, family, rows, fast, shared)
    torch.manual_seed(0)
    batch = trainer._generate_and_score_completions(rows)
    _check(trainer, batch, fast)
    assert bool(trainer.shared_prefix_calls) == shared  # the path asked for is the one taken
    assert bool(trainer.fast_generator.stats["calls"]) == fast


@pytest.mark.trains
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "per-row"])
def test_scored_logps_are_the_samplers_with_clips(tiny_dir, tmp_path, shared):
    from PIL import Image

    clip = [Image.new("RGB", (56, 56), (200, 0, 0))] * 4
    rows = [{"prompt": "<video> Which colour?", "video": clip, "image": None}] * 2 + [
        {"prompt": "Say red.", "video": None, "image": None}
    ] * 2
    trainer = _trainer(tiny_dir, tmp_path, "qwen2_5_vl", rows, True, shared, video_max_frames=4)
    video_token = trainer.model.config.video_token_id
    assert video_token in blocked_ids(trainer.generation_config)  # the trainer blocks the video pad token too
    torch.manual_seed(0)
    batch = trainer._generate_and_score_completions(rows)
    assert VISION_ROWS in batch
    _check(trainer, batch, fast=True)


@pytest.mark.trains
def test_blocked_ids_get_no_gradient_and_the_rest_renormalise(tiny_dir, tmp_path):
    # The fused head with the blocking bias gives the masked log-softmax's values and gradients.
    trainer = _trainer(tiny_dir, tmp_path, "qwen2_5_vl", _image_rows("qwen2_5_vl")[:2], True, False)
    model = core_model(trainer.model)
    head = model.get_output_embeddings()
    head.weight.requires_grad_(True)
    ids = torch.tensor([[3, 4, 5, 7, 8, 9]])
    labels = torch.tensor([[-100, 4, 5, 7, 8, 9]])
    blocked = (6, 10)
    with excluded_from_scoring(model, blocked):
        fused = model(input_ids=ids, labels=labels, fused_lm_head=True).log_probs
    (fused_grad,) = torch.autograd.grad(fused.sum(), head.weight)
    logits = model(input_ids=ids).logits[:, :-1].float()
    logits[..., list(blocked)] = -torch.inf
    plain = logits.log_softmax(-1).gather(-1, labels[:, 1:, None]).squeeze(-1)
    (plain_grad,) = torch.autograd.grad(plain.sum(), head.weight)
    assert (fused - plain).abs().max() < 1e-5
    assert (fused_grad - plain_grad).abs().max() < 1e-5
    assert not fused_grad[list(blocked)].any()  # a blocked row is never pushed: its probability is exactly 0
    assert "get_output_embeddings" not in vars(model)  # the head is the model's own again


def test_blocked_ids_and_refusals():
    config = GenerationConfig(suppress_tokens=[9], bad_words_ids=[[4], [2]])
    assert blocked_ids(config) == (2, 4, 9)
    with pytest.raises(ValueError, match="single tokens"):
        check_blocking_settings(GenerationConfig(bad_words_ids=[[4, 5]]))
    with pytest.raises(ValueError, match="begin_suppress_tokens"):
        check_blocking_settings(GenerationConfig(begin_suppress_tokens=[3]))
    assert BLOCKED_LOGIT * 2 > torch.finfo(torch.float16).min  # representable in an fp16 tile


def test_the_blocking_bias_is_made_once_per_head_and_ids():
    from vlm_grpo.blocked_tokens import _blocking_bias

    head = torch.nn.Linear(4, 10, bias=False)
    bias = _blocking_bias(head, (2, 7))
    assert bias.tolist() == [BLOCKED_LOGIT if i in (2, 7) else 0.0 for i in range(10)]
    # Made first under inference mode (an evaluation, say), it is still a tensor autograd can save for training.
    with torch.inference_mode():
        first = _blocking_bias(torch.nn.Linear(4, 11, bias=False), (1,))
    assert not first.is_inference()
    # The next forward reuses it (writing it from a host list would wait for the GPU), other ids get their own.
    assert _blocking_bias(head, (2, 7)) is bias
    assert _blocking_bias(head, (3,)).tolist() == [BLOCKED_LOGIT if i == 3 else 0.0 for i in range(10)]
    # A head with its own bias gets a sum made per call (it carries the head's gradient), the cached rows unchanged.
    own = torch.nn.Linear(4, 10)
    summed = _blocking_bias(own, (2, 7))
    assert summed.requires_grad and summed is not bias
    torch.testing.assert_close(summed.detach(), own.bias.detach() + bias)
    assert bias.tolist() == [BLOCKED_LOGIT if i in (2, 7) else 0.0 for i in range(10)]
    # Made first under inference mode (an evaluation, say), it is still a tensor autograd can save for training.
    with torch.inference_mode():
        first = _blocking_bias(torch.nn.Linear(4, 11, bias=False), (1,))
    assert not first.is_inference()


def test_a_zero3_partitioned_head_is_checked_by_its_whole_shape():
    # ZeRO-3 leaves a partitioned weight empty outside a gather (shape (0,)) and keeps its shape in `ds_shape`: the
    # check and the blocking bias read the whole vocabulary, as the 3B ZeRO-3 run on two H100s needed.
    class Partitioned(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm_head = torch.nn.Linear(4, 12, bias=False)
            self.lm_head.weight.data = torch.empty(0)
            self.lm_head.weight.ds_shape = torch.Size([12, 4])

        def get_output_embeddings(self) -> torch.nn.Module:
            return self.lm_head

    model = Partitioned()
    with excluded_from_scoring(model, (3, 11)):
        bias = model.get_output_embeddings().bias
    assert bias.shape == (12,) and bias[[3, 11]].eq(BLOCKED_LOGIT).all() and not bias[:3].any()
    with pytest.raises(ValueError, match="outside the LM head's 12 rows"), excluded_from_scoring(model, (12,)):
        pass


def test_settings_that_reweight_by_context_are_said(caplog):
    with caplog.at_level("WARNING", logger="vlm_grpo.blocked_tokens"):
        check_blocking_settings(GenerationConfig(repetition_penalty=1.0, no_repeat_ngram_size=0))
        assert not caplog.records  # neutral values: the sampler's distribution is the policy's
        check_blocking_settings(GenerationConfig(repetition_penalty=1.2, sequence_bias=[[[5, 6], 2.0]]))
    (record,) = caplog.records
    assert "sequence_bias=[[[5, 6], 2.0]]" in record.getMessage() and "repetition_penalty=1.2" in record.getMessage()
    assert "sampling/sampling_logp_difference" in record.getMessage()


@pytest.mark.trains
def test_a_multi_token_bad_word_is_refused_at_init(tiny_dir, tmp_path):
    with pytest.raises(ValueError, match="single tokens"):
        _trainer(tiny_dir, tmp_path, "qwen2_5_vl", _image_rows("qwen2_5_vl"), True, True,
                 generation_kwargs={"bad_words_ids": [[4, 5]]})  # fmt: skip


@pytest.mark.trains
@pytest.mark.slow
def test_training_logs_the_sampler_gap_and_corrects_it_on_request(tiny_dir, tmp_path):
    rows = _image_rows("qwen2_5_vl")
    trainer = _trainer(tiny_dir, tmp_path, "qwen2_5_vl", rows, True, True, max_steps=2, logging_steps=1)
    trainer.train()
    logs = [r for r in trainer.state.log_history if "sampling/sampling_logp_difference/mean" in r]
    assert len(logs) == 2 and all(r["sampling/sampling_logp_difference/max"] < 1e-4 for r in logs)
    assert all("sampling/importance_sampling_ratio/mean" not in r for r in trainer.state.log_history)

    trainer = _trainer(tiny_dir, tmp_path, "qwen2_5_vl", rows, True, True, max_steps=2, logging_steps=1,
                       fast_generation_importance_sampling=True, vllm_importance_sampling_mode="token_truncate")  # fmt: skip
    trainer.train()
    logs = [r for r in trainer.state.log_history if "sampling/importance_sampling_ratio/mean" in r]
    assert len(logs) == 2 and all(abs(r["sampling/importance_sampling_ratio/mean"] - 1) < 1e-3 for r in logs)
    assert trainer.use_vllm is False  # TRL's flag reads as vLLM only inside scoring and the loss


def test_importance_sampling_needs_trls_correction_on(tmp_path):
    with pytest.raises(ValueError, match="vllm_importance_sampling_correction"):
        VLMGRPOConfig(output_dir=str(tmp_path), fast_generation_importance_sampling=True,
                      vllm_importance_sampling_correction=False)  # fmt: skip
