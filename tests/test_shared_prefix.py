"""Shared-prefix scoring matches TRL's per-row path: log-probs, entropies, loss and every gradient."""

import math

import pytest
import torch
from conftest import colour_rows, trl_logps
from datasets import Dataset
from PIL import Image
from trl.trainer.utils import shuffle_sequence_dict, split_pixel_values_by_grid, unsplit_pixel_values_by_grid

from vlm_grpo.compat import checkpointing_settings
from vlm_grpo.data import answer_words, make_visual_reasoning_dataset
from vlm_grpo.engine.adapters_off import AdaptersOff
from vlm_grpo.engine.shared_prefix import unsupported_reason
from vlm_grpo.families import family_of
from vlm_grpo.models.hooks import find_vision_tower
from vlm_grpo.models.loader import FastVisionModel
from vlm_grpo.models.modes import is_checkpointing
from vlm_grpo.tiny import TINY_FAMILIES
from vlm_grpo.training.trainer import VLMGRPOConfig, VLMGRPOTrainer

COLORS = answer_words("color", 1)
MULTIMODAL = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "token_type_ids",
              "mm_token_type_ids", "image_sizes", "spatial_shapes", "num_tiles")  # fmt: skip


def _trl_scores_it_right(model) -> bool:
    """Whether TRL's own per-row method scores this family right. Not PaliGemma's (its completion would join the
    bidirectional prompt) nor LLaVA-OneVision's (no per-forward image counts): their plain path is the trainer's
    per-row path, TRL's method with the fixes (tests/test_scoring_fixes.py checks those against TRL's)."""
    family = family_of(model)
    return not (family.prefix_lm or family.images_per_row_input or family.forward_drops)


def _zero_reward(prompts, completions, **kwargs):
    return [0.0] * len(completions)


def _rows(family):
    rows = colour_rows(family)
    text, one, two = rows["text"], rows["one"], rows["two"]
    # Same tokens as `one` / `two` (for Gemma3 / Idefics3 `swapped` too: they resize every image), other pixels:
    # the shared path must tell them apart by their pixels. Each appears once (a group of one).
    other_pixels = rows["other"]
    swapped = {"prompt": two["prompt"], "images": two["images"][::-1]}
    if family_of(family).prefix_lm:  # PaliGemma's processor takes no prompt without an image
        text = {"prompt": [{"role": "user", "content": [{"type": "image"}, *text["prompt"][0]["content"]]}],
                "images": other_pixels["images"]}  # fmt: skip
    # 9 images in 8 rows: TRL's split_pixel_values_by_grid takes Idefics3's per-row pixel_values for per-image ones
    # when the image count equals the row count, and then shuffles images away from their rows.
    return [text, text, one, one, two, two, other_pixels, swapped]


def _encoded(family):
    """`(row, unique)`: what the vision tower encodes for `_rows`' images in TRL's rows and in the distinct prompts:
    images, or LLaVA-OneVision's views (a row's only image is a base view and a tile, several images a view each), or
    with PaliGemma's image in the text prompt, two more images in the rows and one more distinct."""
    if family == "llava_onevision":
        return 12, 8
    return (ROW_IMAGES + 2, UNIQUE_IMAGES + 1) if family_of(family).prefix_lm else (ROW_IMAGES, UNIQUE_IMAGES)


ROW_IMAGES, UNIQUE_IMAGES = 9, 6  # images in TRL's rows, and in the distinct prompts (0 + 1 + 2 + 1 + 2)


def _trainer(tiny_dir, tmp_path, family, lora=None, gc=False, attn=None, **config):
    model, processor = FastVisionModel.from_pretrained(
        tiny_dir(family, words=COLORS),
        full_finetuning=lora is None,
        attn_implementation=attn,
        use_gradient_checkpointing=gc,
    )
    if lora is not None:
        model = FastVisionModel.get_peft_model(
            model, r=4, finetune_vision_layers=lora in ("vision", "both"),
            finetune_language_layers=lora in ("language", "both"), use_gradient_checkpointing=gc,
            init_lora_weights=False,  # non-zero B: every LoRA matrix gets a gradient
        )  # fmt: skip
    args = VLMGRPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=2, max_completion_length=6,
        report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
        **checkpointing_settings(bool(gc), {"use_reentrant": gc == "reentrant"}), **config,
    )  # fmt: skip
    dataset = Dataset.from_list(_rows(family))
    return VLMGRPOTrainer(model, [_zero_reward], args=args, train_dataset=dataset, processing_class=processor)


def _batch(trainer, family):
    """TRL's own training batch for `_rows`: generated, completions cut to mixed lengths, shuffled like TRL does."""
    torch.manual_seed(0)
    inputs = trainer._generate_and_score_completions(_rows(family))
    lengths = torch.tensor([6, 3, 1, 5, 0, 4, 2, 6])  # 0: a fully masked completion (TRL's masked truncation)
    inputs["completion_mask"] = inputs["completion_mask"] * (torch.arange(6)[None] < lengths[:, None]).int()
    inputs["advantages"] = torch.randn(len(lengths))  # the zero reward gives zero advantages: nothing to compare
    return unsplit_pixel_values_by_grid(shuffle_sequence_dict(split_pixel_values_by_grid(inputs)))


def _logps(trainer, inputs, plain, batch_size=None):
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    method = trl_logps if plain else VLMGRPOTrainer._get_per_token_logps_and_entropies
    shared = trainer.args.shared_prefix
    if plain and not _trl_scores_it_right(trainer.model):
        method, trainer.args.shared_prefix = VLMGRPOTrainer._get_per_token_logps_and_entropies, False
    try:
        logps, entropies, _ = method(
            trainer, trainer.model, input_ids, attention_mask, inputs["completion_ids"].size(1),
            batch_size=batch_size, compute_entropy=True, **{k: inputs[k] for k in MULTIMODAL if k in inputs},
        )  # fmt: skip
    finally:
        trainer.args.shared_prefix = shared
    return logps, entropies


class _CountImages:
    """Counts the images each vision-tower call encodes."""

    def __init__(self, model):
        self.counts = []
        self.handle = find_vision_tower(model).register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        grid = kwargs.get("grid_thw")
        pixels = args[0] if args else kwargs["pixel_values"]
        self.counts.append(len(grid) if grid is not None else len(pixels))


@pytest.mark.trains
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_logps_and_entropies_match_the_plain_path(tiny_dir, tmp_path, family):
    # Gemma3 runs with eager attention (the additive-mask branch) and a sliding window shorter than its prompts.
    trainer = _trainer(tiny_dir, tmp_path, family, attn="eager" if family == "gemma3" else None)
    if family == "gemma3":
        trainer.model.config.text_config.sliding_window = 6
    inputs = _batch(trainer, family)
    mask = inputs["completion_mask"].bool()
    counter = _CountImages(trainer.model)
    with torch.no_grad():
        plain, plain_entropy = _logps(trainer, inputs, plain=True)
        calls = trainer.shared_prefix_calls
        for batch_size in (None, 3):  # 3: whole groups per forward, several forwards
            shared, shared_entropy = _logps(trainer, inputs, plain=False, batch_size=batch_size)
            assert (shared - plain)[mask].abs().max() < 1e-4
            assert (shared_entropy - plain_entropy)[mask].abs().max() < 1e-4
            assert not shared[~mask].any() and not shared_entropy[~mask].any()  # zeros, as TRL's
    assert trainer.shared_prefix_calls == calls + 2 and not getattr(trainer, "shared_prefix_fallbacks", {})
    # TRL encodes every row's images; the shared path each group's once (the pixel-only twins kept apart).
    row_images, unique_images = _encoded(family)
    assert sum(counter.counts[:1]) == row_images and sum(counter.counts[1:2]) == unique_images
    assert sum(counter.counts[2:]) == unique_images
    assert plain[mask].std() > 0.1  # the comparison is not between constants


GRADIENT_SETTINGS = [(family, "both", True) for family in TINY_FAMILIES] + [
    ("qwen2_5_vl", "vision", "reentrant"),
    ("qwen2_5_vl", "language", False),
    ("qwen2_5_vl", None, False),  # full fine-tuning
    ("gemma3", "vision", "reentrant"),
    ("qwen3_vl", "language", "reentrant"),
    ("idefics3", "vision", False),
]


@pytest.mark.trains
@pytest.mark.parametrize("family, lora, gc", GRADIENT_SETTINGS)
def test_loss_and_every_gradient_match_the_plain_path(tiny_dir, tmp_path, family, lora, gc):
    trainer = _trainer(tiny_dir, tmp_path, family, lora=lora, gc=gc)
    inputs = _batch(trainer, family)
    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train; the loss normalises by it
    assert is_checkpointing(model) == bool(gc)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    results = {}
    for shared in (False, True):
        trainer.args.shared_prefix = shared
        model.zero_grad()
        loss = trainer.compute_loss(model, inputs)
        loss.backward()
        results[shared] = loss.detach(), {n: p.grad.clone() for n, p in params.items() if p.grad is not None}
    assert trainer.shared_prefix_calls >= 1
    (plain_loss, plain_grads), (shared_loss, shared_grads) = results[False], results[True]
    assert torch.isfinite(plain_loss) and abs(shared_loss - plain_loss) <= 1e-3 * abs(plain_loss) + 1e-6
    assert set(shared_grads) == set(plain_grads) == set(params)
    # A gradient that cancels to float32 noise is held to the largest one's precision: Pixtral's key projections over a
    # plain-colour image (every patch the same input, only their rotary positions apart: the key gradients sum to ~0).
    floor = 1e-6 * max(grad.norm() for grad in plain_grads.values())
    for name, grad in plain_grads.items():
        assert grad.norm() > 0, name
        assert (shared_grads[name] - grad).norm() <= 1e-3 * grad.norm() + floor, name
    if lora in ("vision", "both"):
        assert any(".visual." in n or "vision" in n for n in plain_grads)


@pytest.mark.trains
def test_training_takes_the_shared_path(tiny_dir, tmp_path):
    # beta > 0 with a fresh adapter: the reference is the adapter-disabled base; num_iterations=2: old log-probs too.
    model, processor = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl", words=COLORS), full_finetuning=False)
    model = FastVisionModel.get_peft_model(model, r=4)
    args = VLMGRPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4, max_completion_length=4,
        max_steps=2, num_iterations=2, beta=0.04, learning_rate=1e-3, logging_steps=1, report_to="none",
        save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
    )  # fmt: skip
    trainer = VLMGRPOTrainer(model, [_zero_reward], args=args, train_dataset=make_visual_reasoning_dataset("color", 8),
                             processing_class=processor)  # fmt: skip
    assert isinstance(trainer.ref_model, AdaptersOff) and trainer.beta == 0.04  # the base: the adapter switched off
    trainer.train()
    # Step 1 generates: old and reference log-probs, then the policy; step 2 reuses the batch: the policy only.
    assert trainer.shared_prefix_calls == 4 and not getattr(trainer, "shared_prefix_fallbacks", {})
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)


@pytest.mark.trains
def test_unservable_batch_falls_back_to_trl_logged_once(tiny_dir, tmp_path, caplog):
    trainer = _trainer(tiny_dir, tmp_path, "qwen2_5_vl")
    inputs = _batch(trainer, "qwen2_5_vl")
    # Without mm_token_type_ids (older processors) the 3-D positions cannot be built: TRL's path serves the call.
    del inputs["mm_token_type_ids"]
    calls = trainer.shared_prefix_calls
    with torch.no_grad(), caplog.at_level("WARNING"):
        expected, _ = _logps(trainer, inputs, plain=True)
        for _ in range(2):
            got, _ = _logps(trainer, inputs, plain=False)
            assert torch.equal(got, expected)
    assert trainer.shared_prefix_calls == calls
    assert list(trainer.shared_prefix_fallbacks.values()) == [2]
    assert caplog.text.count("mm_token_type_ids") == 1


def test_unsupported_models_and_settings_are_named(tiny_dir):
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))  # fmt: skip
    assert "model type 'llama'" in unsupported_reason(llama)
    model, _ = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl", words=COLORS), full_finetuning=True)
    assert unsupported_reason(model) is None
    assert "load-balancing" in unsupported_reason(model, compute_aux_loss=True)
    assert "spatial_shapes" in unsupported_reason(model, spatial_shapes=torch.ones(1, 2))
    model.config.get_text_config()._attn_implementation = "flash_attention_2"
    assert "flash_attention_2" in unsupported_reason(model)


# ----- clips (Qwen-VL): the rows' vision inputs travel with the batch; the plain path is TRL's per-row forward -----

VIDEO_FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5"]


def _clip(color, frames=4, size=(56, 56)):
    return [Image.new("RGB", size, tuple(min(255, c + 30 * t) for c in color)) for t in range(frames)]


def _clip_rows():
    red, blue = _clip((200, 0, 0)), _clip((0, 0, 200), 3, (48, 56))
    text = {"prompt": "Say red.", "video": None, "image": None}
    clip = {"prompt": "<video> Which way?", "video": red, "image": None}
    both = {"prompt": "<image> and <video>?", "video": blue, "image": Image.new("RGB", (56, 56), (0, 255, 0))}
    # Same tokens as `clip`, other frames: a group of one the shared path must keep apart.
    other_frames = {"prompt": "<video> Which way?", "video": _clip((0, 200, 0)), "image": None}
    return [text, text, clip, clip, both, both, other_frames, clip]


def _clip_trainer(tiny_dir, tmp_path, family, lora="both"):
    model, processor = FastVisionModel.from_pretrained(tiny_dir(family, words=COLORS), full_finetuning=False)
    model = FastVisionModel.get_peft_model(model, r=4, init_lora_weights=False)
    args = VLMGRPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=2, max_completion_length=6,
        report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0, video_max_frames=4,
        **checkpointing_settings(False, {}),
    )  # fmt: skip
    return VLMGRPOTrainer(model, [_zero_reward], args=args, train_dataset=Dataset.from_list(_clip_rows()),
                          processing_class=processor)  # fmt: skip


def _clip_batch(trainer):
    from vlm_grpo.training.trainer import VISION_ROWS

    torch.manual_seed(0)
    inputs = trainer._generate_and_score_completions(_clip_rows())
    assert len(inputs[VISION_ROWS]) == 8 and sum(r["num_videos"] for r in inputs[VISION_ROWS]) == 6
    lengths = torch.tensor([6, 3, 1, 5, 0, 4, 2, 6])
    inputs["completion_mask"] = inputs["completion_mask"] * (torch.arange(6)[None] < lengths[:, None]).int()
    inputs["advantages"] = torch.randn(len(lengths))
    return shuffle_sequence_dict(inputs)  # the rows' vision inputs are shuffled with them, as TRL shuffles


@pytest.mark.trains
@pytest.mark.parametrize("family", VIDEO_FAMILIES)
def test_clips_logps_loss_and_every_gradient_match_the_plain_path(tiny_dir, tmp_path, family):
    from vlm_grpo.training.trainer import VISION_ROWS

    trainer = _clip_trainer(tiny_dir, tmp_path, family)
    inputs = _clip_batch(trainer)
    mask = inputs["completion_mask"].bool()
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    results, encoded = {}, {}
    with torch.no_grad():
        for shared in (False, True):
            trainer.args.shared_prefix = shared
            trainer._vision_rows = inputs[VISION_ROWS]
            counter = _CountImages(trainer.model)
            results[shared] = trainer._get_per_token_logps_and_entropies(
                trainer.model, input_ids, attention_mask, 6, batch_size=3, compute_entropy=True
            )[:2]
            counter.handle.remove()
            encoded[shared] = sum(counter.counts)
            trainer._vision_rows = None
    (plain, plain_entropy), (shared, shared_entropy) = results[False], results[True]
    assert (shared - plain)[mask].abs().max() < 1e-4 and (shared_entropy - plain_entropy)[mask].abs().max() < 1e-4
    assert plain[mask].std() > 0.1 and not getattr(trainer, "shared_prefix_fallbacks", {})
    # Every row's clips and images reach the vision tower on the plain path (6 clips, 2 images); each group's once on
    # the shared path (the three `clip` rows, the two `both` rows and the frames-only twin: 3 clips, 1 image).
    assert encoded == {False: 8, True: 4}

    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = 1
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    grads = {}
    for shared in (False, True):
        trainer.args.shared_prefix = shared
        model.zero_grad()
        loss = trainer.compute_loss(model, inputs)
        loss.backward()
        grads[shared] = loss.detach(), {n: p.grad.clone() for n, p in params.items() if p.grad is not None}
    (plain_loss, plain_grads), (shared_loss, shared_grads) = grads[False], grads[True]
    assert torch.isfinite(plain_loss) and abs(shared_loss - plain_loss) <= 1e-3 * abs(plain_loss) + 1e-6
    assert set(shared_grads) == set(plain_grads) == set(params)
    # A gradient that cancels to float32 noise is held to the largest one's precision: Pixtral's key projections over a
    # plain-colour image (every patch the same input, only their rotary positions apart: the key gradients sum to ~0).
    floor = 1e-6 * max(grad.norm() for grad in plain_grads.values())
    for name, grad in plain_grads.items():
        assert grad.norm() > 0, name
        assert (shared_grads[name] - grad).norm() <= 1e-3 * grad.norm() + floor, name
    assert any(".visual." in n for n in plain_grads)  # the vision tower learns from the clips


@pytest.mark.trains
def test_one_mask_sliding_window_model_falls_back_beyond_its_window(tiny_dir, tmp_path, caplog):
    # PaliGemma 2 builds its sliding-window layers' masks from the one 4-D mask it is given: exact while no row is
    # longer than the window; beyond it TRL's per-row path serves, logged once.
    trainer = _trainer(tiny_dir, tmp_path, "paligemma")
    inputs = _batch(trainer, "paligemma")
    trainer.model.config.text_config.sliding_window = 6
    with torch.no_grad(), caplog.at_level("WARNING"):
        expected, _ = _logps(trainer, inputs, plain=True)
        got, _ = _logps(trainer, inputs, plain=False)
    assert torch.equal(got, expected)
    assert list(trainer.shared_prefix_fallbacks) and "sliding window (6)" in caplog.text


@pytest.mark.trains
def test_tiled_images_are_served(tiny_dir, tmp_path):
    # InternVL's processor cuts an image into tiles (pixel_values [tiles, C, H, W]); TRL counts each row's (`num_tiles`).
    trainer = _trainer(tiny_dir, tmp_path, "internvl")
    trainer.processing_class.image_processor.max_patches = 4  # the wide image: 2 tiles and a thumbnail
    inputs = _batch(trainer, "internvl")
    assert inputs["pixel_values"].size(0) > ROW_IMAGES and "num_tiles" in inputs
    mask, calls = inputs["completion_mask"].bool(), trainer.shared_prefix_calls
    with torch.no_grad():
        plain, _ = _logps(trainer, inputs, plain=True)
        for batch_size in (None, 3):
            shared, _ = _logps(trainer, inputs, plain=False, batch_size=batch_size)
            assert (shared - plain)[mask].abs().max() < 1e-4
    assert trainer.shared_prefix_calls == calls + 2 and not getattr(trainer, "shared_prefix_fallbacks", {})
