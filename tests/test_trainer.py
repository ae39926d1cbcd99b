import importlib.util
import io
import math

import numpy as np
import pytest
import torch
from conftest import changed_weights, lora_b_weights, user_turn
from datasets import Dataset
from PIL import Image

from vlm_grpo.blocked_tokens import scoring_as_sampled
from vlm_grpo.compat import checkpointing_from_args, checkpointing_settings, enable_checkpointing
from vlm_grpo.data import answer_words, make_visual_reasoning_dataset
from vlm_grpo.engine.adapters_off import AdaptersOff
from vlm_grpo.models.loader import FastVisionModel
from vlm_grpo.models.modes import generating
from vlm_grpo.rewards import make_choice_reward
from vlm_grpo.rewards.checks import RewardFunctionError
from vlm_grpo.training.evaluation import evaluate
from vlm_grpo.training.trainer import VLMGRPOConfig, VLMGRPOTrainer

COLORS = answer_words("color", 1)
choice = make_choice_reward(COLORS)


def _config_kwargs(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4, max_completion_length=4,
        learning_rate=5e-4, max_steps=2, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True,
        disable_tqdm=True, seed=0,
    )  # fmt: skip
    return {**base, **kw}


def _config(tmp_path, **kw):
    return VLMGRPOConfig(**_config_kwargs(tmp_path, **kw))


def _model(tiny_dir, family="qwen2_5_vl", peft=False, **kw):
    model, processor = FastVisionModel.from_pretrained(tiny_dir(family, words=COLORS), full_finetuning=not peft)
    if peft:
        model = FastVisionModel.get_peft_model(model, r=4, **kw)
    return model, processor


def _finite_losses(trainer):
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses and all(math.isfinite(x) for x in losses)
    return losses


def test_config_defaults_are_vlm_friendly(tmp_path):
    config = VLMGRPOConfig(output_dir=str(tmp_path))
    assert config.beta == 0.04
    assert config.bf16 is (torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    # On by default (TRL's choice), non-reentrant (PyTorch's recommendation), under this transformers' own names.
    assert checkpointing_from_args(config) == (True, {"use_reentrant": False})
    with pytest.raises(ValueError, match="min_pixels"):
        VLMGRPOConfig(output_dir=str(tmp_path), min_pixels=100, max_pixels=10)


@pytest.mark.trains
@pytest.mark.parametrize(
    "family, steps, bar, schedule, lr, tokens",
    # The acceptance bar: tiny Qwen2.5-VL and Qwen3.5 go to >= 0.8; Idefics3 passes a looser bar. With a constant
    # learning rate Qwen2.5-VL reaches 1.0 by step 100 and Idefics3 0.98 by step 200 (measured on one CPU thread).
    # Tiny Qwen3.5's tokenizer is byte-level (transformers loads every Qwen3.5 tokenizer as one): 455 ids where the
    # word-level ones have ~120, so a random model finds the answers less often and needs more steps and a higher rate
    # (7e-4, decaying). Its pieces also join into one word: "yellow" then "yellow" reads "yellowyellow", no answer,
    # which the greedy model said for red and yellow images alike on one seed in four (0.61; CI's machine 0.72), and
    # more prompts per step, a KL term, temperature 1.5 or 2-token answers did not fix. The prompt asks for one word
    # and each colour is one token: with one-token answers seeds 0-2 reached 1.0 by step 300 of 400, 3-5 by 350 of 500.
    # Qwen2.5-VL's (~20 s) is the main suite's learning check; the others are in the slow tier.
    [("qwen2_5_vl", 150, 0.8, "constant", 5e-4, 4),
     pytest.param("idefics3", 200, 0.6, "constant", 5e-4, 4, marks=pytest.mark.slow),
     pytest.param("qwen3_5", 500, 0.8, "linear", 7e-4, 1, marks=pytest.mark.slow)],
)  # fmt: skip
def test_learns_colour_task_from_random_init(tiny_dir, tmp_path, family, steps, bar, schedule, lr, tokens):
    """Real training from random init: held-out accuracy <= 0.35 before (chance is 0.25), >= `bar` after."""
    train = make_visual_reasoning_dataset("color", 512, seed=0)
    test = make_visual_reasoning_dataset("color", 64, seed=0, split="test")
    model, processor = _model(tiny_dir, family)
    before = evaluate(model, processor, test, [choice], max_new_tokens=tokens)["accuracy"]
    # The demo's recipe (vlm_grpo.cli.demo.DEMO): 4 prompts x 16 generations, lr 5e-4.
    config = _config(tmp_path, per_device_train_batch_size=64, num_generations=16, max_steps=steps, logging_steps=50,
                     lr_scheduler_type=schedule, learning_rate=lr, max_completion_length=tokens)  # fmt: skip
    trainer = VLMGRPOTrainer(model, [choice], args=config, train_dataset=train, processing_class=processor)
    trainer.train()
    after = evaluate(trainer.model, processor, test, [choice], max_new_tokens=tokens)["accuracy"]
    assert before <= 0.35 and after >= bar, (before, after)


@pytest.mark.slow
@pytest.mark.trains
# Qwen3.5's video path (Qwen3-VL's processor and positions, its recurrent layers' fast paths) is checked against the
# plain path in tests/test_fast_generation.py and test_shared_prefix.py; with its byte-level tiny tokenizer it needs
# ~600 steps here (0.02 -> 1.0 measured), twice this test's time, so Qwen3-VL's video path is the one trained.
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_learns_the_video_task_from_random_init(tiny_dir, tmp_path, family):
    """Real training on clips (fast generation and the shared prefix on): which colour a shape turns to. Both
    colours are in every clip, so a model that reads the colours but not their order stays near 0.5; before: <= 0.35
    (chance 0.25), after 250 steps: >= 0.8 (runs reached 1.0 by step 200 on Qwen2.5-VL and 150 on Qwen3-VL, under a
    minute each on one CPU thread)."""
    words = answer_words("color_change", 1)
    reward = make_choice_reward(words)
    train = make_visual_reasoning_dataset("color_change", 512, seed=0)
    test = make_visual_reasoning_dataset("color_change", 64, seed=0, split="test")
    model, processor = FastVisionModel.from_pretrained(tiny_dir(family, words=words), full_finetuning=True)
    before = evaluate(model, processor, test, [reward], max_new_tokens=4)["accuracy"]
    config = _config(tmp_path, per_device_train_batch_size=64, num_generations=16, max_steps=250, logging_steps=50,
                     lr_scheduler_type="constant")  # fmt: skip
    trainer = VLMGRPOTrainer(model, [reward], args=config, train_dataset=train, processing_class=processor)
    trainer.train()
    after = evaluate(trainer.model, processor, test, [reward], max_new_tokens=4)["accuracy"]
    assert before <= 0.35 and after >= 0.8, (before, after)
    assert trainer.fast_generator.stats["calls"] == 250 and trainer.shared_prefix_calls >= 250


def _length(prompts, completions, **kwargs):
    return [float(len(str(c))) for c in completions]


@pytest.mark.trains
def test_vision_lora_changes_under_checkpointing_and_reference_is_the_base(tiny_dir, tmp_path):
    model, processor = _model(tiny_dir, peft=True, finetune_language_layers=False, use_gradient_checkpointing=True)
    before = lora_b_weights(model)
    assert before and all(".visual." in n for n in before)
    train = make_visual_reasoning_dataset("color", 16, seed=0)
    # Completion length varies within a group from the first step, so advantages (and updates) are non-zero.
    trainer = VLMGRPOTrainer(
        model, [_length], args=_config(tmp_path, max_steps=3, learning_rate=1e-2), train_dataset=train,
        processing_class=processor,
    )  # fmt: skip
    assert isinstance(trainer.ref_model, AdaptersOff)  # PEFT: the reference is the base with the adapter disabled
    assert list(trainer.model.peft_config) == ["default"]  # no second ("ref") copy of a fresh adapter
    assert trainer.beta == 0.04
    trainer.train()
    _finite_losses(trainer)
    assert changed_weights(trainer.model, before) == set(before)
    assert any(getattr(m, "gradient_checkpointing", False) for m in trainer.model.modules())


@pytest.mark.trains
def test_pretrained_adapter_keeps_trl_reference_copy(tiny_dir, tmp_path):
    # A non-zero adapter is not the identity, so the reference must be its frozen initial copy (TRL's "ref").
    model, processor = _model(tiny_dir, peft=True, init_lora_weights=False)
    train = make_visual_reasoning_dataset("color", 8, seed=0)
    trainer = VLMGRPOTrainer(model, [_length], args=_config(tmp_path, max_steps=1), train_dataset=train,
                             processing_class=processor)  # fmt: skip
    assert set(trainer.model.peft_config) == {"default", "ref"}
    trainer.train()
    _finite_losses(trainer)


# ----- TRL's settings reach TRL's loss, advantages and batching -----

# Two prompts as strings (TRL's standard format: the rewards get string completions), one image each.
STRING_ROWS = [{"prompt": f"What colour is shape {i}?", "image": Image.new("RGB", (56, 56), c), "answer": a}
               for i, (c, a) in enumerate([((255, 0, 0), "red"), ((0, 0, 255), "blue")])]  # fmt: skip


def _vowels(prompts, completions, **kwargs):
    return [float(sum(ch in "aeiou" for ch in c)) for c in completions]


def _generated_batch(trainer, generations=4):
    """TRL's training batch for STRING_ROWS (each prompt `generations` times, as TRL's sampler repeats them)."""
    torch.manual_seed(0)
    trainer.model.train()
    return trainer._generate_and_score_completions([row for row in STRING_ROWS for _ in range(generations)])


def _loss(trainer, inputs):
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train; the loss divides by it
    return trainer.compute_loss(trainer.model, inputs)


LOSS_SETTINGS = {  # TRL's default is dapo
    "grpo": {"loss_type": "grpo"},
    "bnpo": {"loss_type": "bnpo"},
    "dr_grpo": {"loss_type": "dr_grpo"},
    "dapo": {"loss_type": "dapo"},
    "gspo": {"loss_type": "grpo", "importance_sampling_level": "sequence"},
}


@pytest.mark.trains
def test_every_loss_setting_gives_trls_own_loss_on_the_same_batch(tiny_dir, tmp_path):
    """VLMGRPOTrainer's loss (shared-prefix log-probs, VLM config) equals trl.GRPOTrainer's on one batch, for each
    loss setting, and the batch tells the settings apart: a setting lost on the way to TRL's loss would show."""
    from trl import GRPOConfig, GRPOTrainer

    dataset = Dataset.from_list(STRING_ROWS)
    settings = {"beta": 0.04, "max_completion_length": 8, "per_device_train_batch_size": 8}

    def ours(**setting):
        model, processor = _model(tiny_dir, peft=True)
        args = _config(tmp_path, **settings, **setting)
        return VLMGRPOTrainer(model, [_length], args=args, train_dataset=dataset, processing_class=processor)

    def trls(**setting):
        model, processor = _model(tiny_dir, peft=True)
        # Checkpointing named as this transformers names it: TRL's own default sets the deprecated alias.
        args = GRPOConfig(**_config_kwargs(tmp_path, **settings, **setting), bf16=False, **checkpointing_settings(True))
        return GRPOTrainer(model, [_length], args=args, train_dataset=dataset, processing_class=processor)

    inputs = _generated_batch(ours())
    assert inputs["completion_mask"].sum(1).unique().numel() > 1  # lengths differ: the normalisations differ
    # Off-policy: the batch's old log-probs differ from the policy's (a fresh adapter: the policy is the reference),
    # so importance ratios, clipping and GSPO's sequence-level weights take part in the loss.
    noise = 0.3 * torch.randn(inputs["ref_per_token_logps"].shape, generator=torch.Generator().manual_seed(1))
    inputs["old_per_token_logps"] = inputs["ref_per_token_logps"] + noise
    losses = {}
    for name, setting in LOSS_SETTINGS.items():
        got = _loss(ours(**setting), inputs)
        trl_trainer = trls(**setting)
        with scoring_as_sampled(trl_trainer, trl_trainer.model):  # the sampler's blocked ids out of the softmax
            expected = _loss(trl_trainer, inputs)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6, msg=name)
        losses[name] = round(got.item(), 5)
    # dapo normalises by the generation batch's token count, which on one process with no accumulation is bnpo's.
    assert losses["dapo"] == losses["bnpo"]
    assert len({losses[name] for name in ("grpo", "bnpo", "dr_grpo", "gspo")}) == 4, losses


@pytest.mark.trains
@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_advantages_come_from_each_completions_own_weighted_rewards(tiny_dir, tmp_path, scale_rewards):
    model, processor = _model(tiny_dir, peft=True)
    args = _config(tmp_path, reward_weights=[1.0, 0.5], scale_rewards=scale_rewards, max_completion_length=8)
    trainer = VLMGRPOTrainer(model, [_length, _vowels], args=args, train_dataset=Dataset.from_list(STRING_ROWS),
                             processing_class=processor)  # fmt: skip
    inputs = _generated_batch(trainer)
    ids = [row[mask.bool()] for row, mask in zip(inputs["completion_ids"], inputs["completion_mask"])]
    texts = processor.batch_decode(ids, skip_special_tokens=True)
    # TRL's advantages, computed here from the completions the batch holds: weighted sum, centred per prompt group,
    # scaled by the group's or the batch's standard deviation (or not at all).
    lengths, vowels = (torch.tensor(f(None, texts)).view(2, 4) for f in (_length, _vowels))
    rewards = lengths + 0.5 * vowels
    centred = rewards - rewards.mean(1, keepdim=True)
    scale = {"group": rewards.std(1, keepdim=True) + 1e-4, "batch": rewards.std() + 1e-4, "none": 1.0}[scale_rewards]
    torch.testing.assert_close(inputs["advantages"], (centred / scale).flatten())
    assert centred.abs().sum() > 0 and not torch.allclose(vowels, lengths)  # both rewards and the weights matter


@pytest.mark.trains
def test_num_iterations_trains_twice_on_each_generated_batch(tiny_dir, tmp_path):
    model, processor = _model(tiny_dir, peft=True)
    trainer = VLMGRPOTrainer(model, [_length], args=_config(tmp_path, max_steps=4, num_iterations=2),
                             train_dataset=Dataset.from_list(STRING_ROWS), processing_class=processor)  # fmt: skip
    trainer.train()
    assert len(_finite_losses(trainer)) == 4
    assert trainer.fast_generator.stats["calls"] == 2  # steps 1 and 3 generate; steps 2 and 4 reuse their batch


@pytest.mark.trains
def test_log_completions_table_pairs_each_completion_with_its_rewards(tiny_dir, tmp_path):
    import pandas as pd

    model, processor = _model(tiny_dir, peft=True)
    trainer = VLMGRPOTrainer(model, [_length, _vowels], args=_config(tmp_path, max_steps=1, log_completions=True),
                             train_dataset=Dataset.from_list(STRING_ROWS), processing_class=processor)  # fmt: skip
    trainer.train()
    # TRL's table (what wandb / trackio show) holds the chat form the model saw; the rewards got the strings.
    table = pd.read_parquet(tmp_path / "out" / "completions" / "completions_00001.parquet")
    questions = [message[0]["content"][-1]["text"] for message in table["prompt"]]
    assert sorted(questions) == sorted(row["prompt"] for row in STRING_ROWS for _ in range(4))
    texts = [message[0]["content"] for message in table["completion"]]
    assert list(table["_length"]) == _length(None, texts) and list(table["_vowels"]) == _vowels(None, texts)


def _image_variants(tmp_path):
    red = Image.new("RGB", (40, 30), (255, 0, 0))
    path = tmp_path / "red.png"
    red.save(path)
    buf = io.BytesIO()
    red.save(buf, format="PNG")
    return {
        "pil": red,
        "path": str(path),
        "bytes": buf.getvalue(),
        "numpy": np.asarray(red),
        "dict": {"bytes": buf.getvalue(), "path": None},
        "rgba": Image.new("RGBA", (30, 30), (255, 0, 0, 128)),
        "palette": red.convert("P"),
        "gray16": Image.fromarray(np.full((28, 28), 60000, dtype=np.uint16)),
    }


@pytest.mark.parametrize("kind", ["pil", "path", "bytes", "numpy", "dict", "rgba", "palette", "gray16"])
@pytest.mark.trains
def test_every_image_format_trains(tiny_dir, tmp_path, kind):
    image = _image_variants(tmp_path)[kind]
    dataset = Dataset.from_list(
        [{"prompt": "What colour is the shape?", "image": image, "answer": "red", "kind": kind}] * 4
    )
    seen = []

    def record(prompts, completions, kind, answer, **kwargs):
        seen.extend(kind)  # dataset columns arrive as keyword arguments
        return [0.0] * len(completions)

    model, processor = _model(tiny_dir, peft=True)
    trainer = VLMGRPOTrainer(
        model, [choice, record], args=_config(tmp_path, max_steps=1), train_dataset=dataset, processing_class=processor
    )
    trainer.train()
    _finite_losses(trainer)
    assert seen and set(seen) == {kind}


@pytest.mark.trains
def test_mixed_zero_one_and_several_images_per_row(tiny_dir, tmp_path):
    red, blue = Image.new("RGB", (56, 56), (255, 0, 0)), Image.new("RGB", (84, 56), (0, 0, 255))
    rows = [
        {"prompt": user_turn("Say red."), "images": [], "answer": "red"},
        {"prompt": user_turn(None, "What colour?"), "images": [red], "answer": "red"},
        {"prompt": user_turn(None, "and", None, "first?"), "images": [red, blue], "answer": "red"},
        {"prompt": user_turn(None, "What colour?"), "images": [blue], "answer": "blue"},
    ]
    dataset = Dataset.from_list(rows)
    model, processor = _model(tiny_dir, peft=True)
    generated = []  # (question, its images' sizes in order) for every prompt generated from

    class Spy(VLMGRPOTrainer):
        def _generate(self, prompts):
            for prompt in prompts:
                parts = prompt[0]["content"]
                question = " ".join(p["text"] for p in parts if p.get("type") == "text")
                generated.append((question, tuple(p["image"].size for p in parts if p.get("type") == "image")))
            return super()._generate(prompts)

    trainer = Spy(
        model, [choice], args=_config(tmp_path, per_device_train_batch_size=16), train_dataset=dataset,
        processing_class=processor,
    )  # fmt: skip
    trainer.train()
    _finite_losses(trainer)
    # Every row reached generation with its own images, in its order (none dropped, none moved to another row).
    assert len(generated) == 32 and set(generated) == {
        ("Say red.", ()),
        ("What colour?", ((56, 56),)),
        ("What colour?", ((84, 56),)),
        ("and first?", ((56, 56), (84, 56))),
    }


@pytest.mark.trains
def test_pixel_budget_bounds_images_for_processors_without_one(tiny_dir, tmp_path):
    # Idefics3 resizes every image to its own input size, so the budget is applied before it, by the trainer.
    big = Image.new("RGB", (448, 224), (0, 255, 0))
    dataset = Dataset.from_list([{"prompt": "What colour?", "image": big, "answer": "green"}] * 4)
    model, processor = _model(tiny_dir, "idefics3", peft=True)
    sizes = []

    class Spy(VLMGRPOTrainer):  # records the images that reach generation (and so the processor)
        def _generate(self, prompts):
            sizes.extend(p["image"].size for m in prompts[0] for p in m["content"] if p.get("type") == "image")
            return super()._generate(prompts)

    trainer = Spy(
        model, [choice], args=_config(tmp_path, max_steps=1, max_pixels=56 * 56), train_dataset=dataset,
        processing_class=processor,
    )  # fmt: skip
    trainer.train()
    assert trainer.pixel_budget.max_pixels == 56 * 56
    assert sizes and all(w * h <= 56 * 56 and abs(w / h - 2.0) < 0.2 for w, h in sizes)


@pytest.mark.trains
def test_qwen_images_are_resized_once_by_the_processors_budget(tiny_dir, tmp_path, caplog):
    """The pixel_values / image_grid_thw training uses are what the processor alone makes of the image, with the
    config's budget, which replaces from_pretrained's (logged) and lives in the processor, not in a private copy."""
    from vlm_grpo.media.processor import load_processor

    big = Image.fromarray(np.random.default_rng(0).integers(0, 256, (224, 448, 3), dtype=np.uint8))
    dataset = Dataset.from_list([{"prompt": "What colour?", "image": big, "answer": "green"}] * 4)
    path = tiny_dir("qwen2_5_vl", words=COLORS)
    model, processor = FastVisionModel.from_pretrained(path, max_pixels=112 * 112)
    model = FastVisionModel.get_peft_model(model, r=4)
    seen = []

    class Spy(VLMGRPOTrainer):  # records the image inputs of every log-prob forward
        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kw):
            seen.append((kw["pixel_values"].detach().cpu(), kw["image_grid_thw"].cpu()))
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kw
            )

    with caplog.at_level("WARNING", logger="vlm_grpo.media.pixel_budget"):
        trainer = Spy(
            model, [choice], args=_config(tmp_path, max_steps=1, max_pixels=56 * 56), train_dataset=dataset,
            processing_class=processor,
        )  # fmt: skip
    assert "VLMGRPOConfig.max_pixels=3136 replaces the processor's max_pixels=12544" in caplog.text
    assert processor.image_processor.size["longest_edge"] == 56 * 56 == trainer.pixel_budget.max_pixels
    trainer.train()

    reference = load_processor(path, "qwen2_5_vl").image_processor
    budget = {"shortest_edge": processor.image_processor.size["shortest_edge"], "longest_edge": 56 * 56}
    alone = reference(images=[big], size=budget, return_tensors="pt")
    (_, grid_h, grid_w), patches = alone["image_grid_thw"][0].tolist(), alone["pixel_values"].shape[0]
    assert grid_h * grid_w * reference.patch_size**2 <= 56 * 56  # the budget holds
    assert seen
    for pixel_values, grids in seen:
        assert all(g.tolist() == [1, grid_h, grid_w] for g in grids)
        torch.testing.assert_close(pixel_values[:patches], alone["pixel_values"], rtol=0, atol=0)


@pytest.mark.trains
def test_model_path_is_loaded_for_you(tiny_dir, tmp_path):
    dataset = make_visual_reasoning_dataset("color", 8, seed=0)
    trainer = VLMGRPOTrainer(
        tiny_dir("qwen2_5_vl", words=COLORS), [choice], args=_config(tmp_path), train_dataset=dataset
    )
    assert trainer.ref_model is not None  # full fine-tuning with beta > 0 keeps a frozen reference copy
    trainer.train()
    _finite_losses(trainer)


# ----- bad input: clear errors before training, or logged per-row skips -----


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_old_trl_on_cpu_is_refused_before_training(tiny_dir, tmp_path, monkeypatch):
    import trl

    model, processor = _model(tiny_dir, peft=True)
    trainer = VLMGRPOTrainer(model, [choice], args=_config(tmp_path), train_dataset=make_visual_reasoning_dataset("color", 8),
                             processing_class=processor)  # fmt: skip
    monkeypatch.setattr(trl, "__version__", "1.15.0")
    with pytest.raises(RuntimeError, match=r"trl>=1.16"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_unreadable_images_are_skipped_and_counted(tiny_dir, tmp_path, caplog):
    good = make_visual_reasoning_dataset("color", 6, seed=0).to_list()
    png = io.BytesIO()
    Image.new("RGB", (56, 56), (255, 0, 0)).save(png, format="PNG")
    truncated = {"bytes": png.getvalue()[:40], "path": None}
    rows = (
        good[:3]
        + [{**good[0], "image": truncated}]
        + good[3:]
        + [{**good[1], "image": {"bytes": b"junk", "path": None}}]
    )
    from datasets import Image as ImageFeature

    dataset = Dataset.from_list(rows).cast_column("image", ImageFeature())
    model, processor = _model(tiny_dir, peft=True)
    with caplog.at_level("WARNING"):
        trainer = VLMGRPOTrainer(
            model, [choice], args=_config(tmp_path), train_dataset=dataset, processing_class=processor
        )
    assert trainer.skipped_rows["train"].indices == [3, 7]
    assert len(trainer.train_dataset) == 6
    assert "skipped 2 of 8 rows" in caplog.text
    with pytest.raises(ValueError, match="row 3"):
        VLMGRPOTrainer(
            model,
            [choice],
            args=_config(tmp_path, skip_bad_rows=False),
            train_dataset=dataset,
            processing_class=processor,
        )


@pytest.mark.parametrize(
    "rows, message",
    [
        ([], "empty"),
        ([{"question": "hi", "image": Image.new("RGB", (8, 8))}], "no `prompt` column"),
        (
            [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}]}],
            "no `image` or `images` column",
        ),
        (
            [
                {
                    "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}],
                    "images": [Image.new("RGB", (8, 8))] * 2,
                }
            ],
            r"1 image placeholder.*2 image",
        ),
        (
            [{"prompt": "<|im_start|>user\nWhat?<|im_end|>", "image": Image.new("RGB", (8, 8))}],
            "chat template already applied",
        ),
        (
            [{"prompt": "a", "image": Image.new("RGB", (8, 8)), "images": [Image.new("RGB", (8, 8))]}],
            "both `image` and `images`",
        ),
    ],
    ids=["empty", "no_prompt", "no_image_column", "placeholder_mismatch", "templated_string", "both_columns"],
)
def test_bad_datasets_fail_before_training(tiny_dir, tmp_path, rows, message):
    dataset = Dataset.from_list(rows) if rows else Dataset.from_dict({"prompt": [], "image": []})
    model, processor = _model(tiny_dir, peft=True)
    with pytest.raises(ValueError, match=message):
        VLMGRPOTrainer(model, [choice], args=_config(tmp_path), train_dataset=dataset, processing_class=processor)


def _raises_on_blue(prompts, completions, answer, **kwargs):
    return [1 / 0 if a == "blue" else 0.0 for a in answer]


def _wrong_length(prompts, completions, **kwargs):
    return [0.0]


def _nan_reward(prompts, completions, **kwargs):
    return [float("nan")] + [0.0] * (len(completions) - 1)


@pytest.mark.parametrize(
    "func, message",
    [(_raises_on_blue, r"'_raises_on_blue' raised ZeroDivisionError.*row \d+"),
     (_wrong_length, r"'_wrong_length' returned 1 value for 8 completions"),
     (_nan_reward, r"'_nan_reward' returned nan for row 0")],
    ids=["raises", "wrong_length", "nan"],
)  # fmt: skip
@pytest.mark.trains
def test_bad_reward_functions_are_named_with_the_row(tiny_dir, tmp_path, func, message):
    dataset = Dataset.from_list(
        [{"prompt": "What colour?", "image": Image.new("RGB", (56, 56), c), "answer": a}
         for c, a in [((255, 0, 0), "red"), ((0, 0, 255), "blue")]]
    )  # fmt: skip
    model, processor = _model(tiny_dir, peft=True)
    trainer = VLMGRPOTrainer(model, [func], args=_config(tmp_path), train_dataset=dataset, processing_class=processor)
    with pytest.raises(RewardFunctionError, match=message):
        trainer.train()


@pytest.mark.trains
def test_stop_and_resume_continues_the_run(tiny_dir, tmp_path):
    dataset = make_visual_reasoning_dataset("color", 32, seed=0)
    out = tmp_path / "out"

    def make(max_steps):
        model, processor = _model(tiny_dir, peft=True)
        config = _config(tmp_path, max_steps=max_steps, save_strategy="steps", save_steps=2, output_dir=str(out))
        return VLMGRPOTrainer(model, [_length], args=config, train_dataset=dataset, processing_class=processor)

    first = make(2)
    first.train()
    checkpoint = out / "checkpoint-2"
    assert (checkpoint / "adapter_model.safetensors").exists() and (checkpoint / "trainer_state.json").exists()
    saved = {n: p.detach().clone() for n, p in first.model.named_parameters() if p.requires_grad}

    resumed = make(4)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 4
    steps = [h["step"] for h in resumed.state.log_history if "loss" in h]
    assert steps[-2:] == [3, 4]  # continued from step 2, did not restart at 1
    assert (out / "checkpoint-4").exists()
    assert changed_weights(resumed.model, saved)


# ----- issue 8: no silent failures -----


def test_frozen_model_is_refused_naming_both_fixes(tiny_dir, tmp_path):
    # from_pretrained without full_finetuning is frozen until get_peft_model: training it would change nothing.
    model, processor = FastVisionModel.from_pretrained(tiny_dir("qwen2_5_vl", words=COLORS))
    dataset = make_visual_reasoning_dataset("color", 8, seed=0)
    with pytest.raises(ValueError, match=r"(?s)no trainable parameters.*get_peft_model\(model.*full_finetuning=True"):
        VLMGRPOTrainer(model, [choice], args=_config(tmp_path), train_dataset=dataset, processing_class=processor)


@pytest.mark.trains
def test_checkpointing_is_back_for_training_after_evaluation(tiny_dir, tmp_path):
    from vlm_grpo.models.modes import is_checkpointing

    model, processor = _model(tiny_dir, peft=True)
    dataset = make_visual_reasoning_dataset("color", 16, seed=0)
    forwards = []  # (training?, checkpointing?) at every loss forward, training and evaluation

    class Recorder(VLMGRPOTrainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            unwrapped = self.accelerator.unwrap_model(model)
            forwards.append((unwrapped.training, is_checkpointing(unwrapped)))
            return super().compute_loss(model, inputs, *args, **kwargs)

    config = _config(tmp_path, max_steps=3, eval_strategy="steps", eval_steps=1, eval_on_start=True,
                     per_device_eval_batch_size=8)  # fmt: skip
    assert checkpointing_from_args(config)[0]
    trainer = Recorder(model, [_length], args=config, train_dataset=dataset, eval_dataset=dataset.select(range(2)),
                       processing_class=processor)  # fmt: skip
    trainer.train()
    training = [checkpointing for is_training, checkpointing in forwards if is_training]
    evaluating = [f for f in forwards if not f[0]]
    assert len(training) == 3 and len(evaluating) >= 3  # evaluation ran (on start and between steps), in eval mode
    assert all(training), forwards  # every training step after an evaluation checkpoints, as configured


def _checkpointing_recorder(forwards: list):
    """A VLMGRPOTrainer that records (training?, checkpointing mode) at every loss forward."""
    from vlm_grpo.models.modes import checkpointing_mode

    class Recorder(VLMGRPOTrainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            unwrapped = self.accelerator.unwrap_model(model)
            forwards.append((unwrapped.training, checkpointing_mode(unwrapped)))
            return super().compute_loss(model, inputs, *args, **kwargs)

    return Recorder


@pytest.mark.trains
def test_checkpointing_off_survives_evaluate_and_training(tiny_dir, tmp_path):
    # Issue 26: evaluate() used to hand the model back with checkpointing on, and the trainer then read it off the model.
    from vlm_grpo.models.modes import checkpointing_mode

    model, processor = FastVisionModel.from_pretrained(
        tiny_dir("qwen2_5_vl", words=COLORS), full_finetuning=True, use_gradient_checkpointing=False
    )
    dataset = make_visual_reasoning_dataset("color", 8, seed=0)
    assert checkpointing_mode(model) is False and model.training
    evaluate(model, processor, dataset.select(range(4)), [choice], max_new_tokens=2)
    assert checkpointing_mode(model) is False and model.training  # found in train mode, given back in train mode
    forwards: list = []
    trainer = _checkpointing_recorder(forwards)(
        model, [choice], args=_config(tmp_path, max_steps=2, **checkpointing_settings(False)), train_dataset=dataset,
        processing_class=processor,
    )  # fmt: skip
    trainer.train()
    assert forwards == [(True, False)] * 2


def test_reentrant_checkpointing_survives_evaluate_unchanged(tiny_dir):
    from vlm_grpo.models.modes import ModelMode, checkpointing_mode

    model, processor = _model(tiny_dir, peft=True, use_gradient_checkpointing="reentrant")
    model.eval()
    before = ModelMode.of(model)
    assert checkpointing_mode(model) == "reentrant"
    evaluate(model, processor, make_visual_reasoning_dataset("color", 2, seed=0), [choice], max_new_tokens=2)
    assert ModelMode.of(model) == before  # eval mode, reentrant checkpointing, KV cache setting, padding side


def test_the_configs_checkpointing_wins_over_the_models(tiny_dir, tmp_path, caplog):
    # The args are the truth (as transformers' Trainer treats them): a model that arrives checkpointing trains
    # without it when the config says off, said in one log line; and generation gives that mode back.
    from vlm_grpo.models.modes import checkpointing_mode

    model, processor = _model(tiny_dir, peft=True, use_gradient_checkpointing=False)
    enable_checkpointing(model, {"use_reentrant": True})  # switched on outside FastVisionModel
    with caplog.at_level("WARNING", logger="vlm_grpo.training.trainer"):
        trainer = VLMGRPOTrainer(
            model, [choice], args=_config(tmp_path, **checkpointing_settings(False)),
            train_dataset=make_visual_reasoning_dataset("color", 8, seed=0), processing_class=processor,
        )  # fmt: skip
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    assert checkpointing_mode(unwrapped) is False
    assert "came with it on (reentrant); training with it off" in caplog.text
    with generating(unwrapped):
        assert checkpointing_mode(unwrapped) is False and not unwrapped.training
    assert checkpointing_mode(unwrapped) is False


@pytest.mark.trains
def test_string_prompts_reach_rewards_as_strings(tiny_dir, tmp_path):
    # TRL's standard format: a reward written for strings must see strings, prompt and completion, as without images.
    rows = [{"prompt": f"What colour is shape {i}?", "image": Image.new("RGB", (56, 56), (255, 0, 0)), "answer": "red"}
            for i in range(4)]  # fmt: skip
    seen = {"prompts": [], "completions": [], "keys": set()}

    def string_reward(prompts, completions, **kwargs):
        seen["prompts"] += prompts
        seen["completions"] += completions
        seen["keys"] |= set(kwargs)
        return [float(len(c)) for c in completions]

    model, processor = _model(tiny_dir, peft=True)
    trainer = VLMGRPOTrainer(
        model, [string_reward], args=_config(tmp_path, max_steps=1), train_dataset=Dataset.from_list(rows),
        processing_class=processor,
    )  # fmt: skip
    trainer.train()
    assert seen["completions"] and all(isinstance(c, str) for c in seen["completions"]), seen["completions"][:2]
    assert set(seen["prompts"]) <= {r["prompt"] for r in rows}
    # The dataset's own columns: `image` as given (not TRL's `images` list), nothing internal.
    assert {"image", "answer"} <= seen["keys"] and "images" not in seen["keys"]
    assert not any(k.startswith("_vlm_grpo") for k in seen["keys"])


@pytest.mark.trains
def test_string_prompt_image_placeholder_trains_with_the_image_in_place(tiny_dir, tmp_path):
    # geometry3k / EasyR1 style: `problem` strings carry `<image>` where the image goes.
    image = Image.new("RGB", (56, 56), (0, 0, 255))
    rows = [{"prompt": "Look: <image>\nWhat colour is the shape?", "image": image, "answer": "blue"}] * 4
    generated, rewarded = [], []

    class Spy(VLMGRPOTrainer):
        def _generate(self, prompts):
            generated.extend(prompts)
            return super()._generate(prompts)

    def record(prompts, completions, **kwargs):
        rewarded.extend(prompts)
        return [0.0] * len(prompts)

    model, processor = _model(tiny_dir, peft=True)
    trainer = Spy(model, [choice, record], args=_config(tmp_path, max_steps=1), train_dataset=Dataset.from_list(rows),
                  processing_class=processor)  # fmt: skip
    trainer.train()
    _finite_losses(trainer)
    content = generated[0][0]["content"]
    assert [p["type"] for p in content] == ["text", "image", "text"] and content[1]["image"].size == (56, 56)
    assert content[0]["text"] == "Look: " and content[2]["text"] == "\nWhat colour is the shape?"
    assert set(rewarded) == {rows[0]["prompt"]}


@pytest.mark.trains
def test_image_column_with_none_trains_through_an_all_text_batch(tiny_dir, tmp_path):
    red = Image.new("RGB", (56, 56), (255, 0, 0))
    # In order (no shuffling), 2 prompts per batch: the first batch is all text-only, the second all images.
    rows = [{"prompt": "Say red.", "image": None, "answer": "red"}] * 2 + [
        {"prompt": "What colour?", "image": red, "answer": "red"}] * 2  # fmt: skip
    model, processor = _model(tiny_dir, peft=True)
    trainer = VLMGRPOTrainer(
        model, [choice], args=_config(tmp_path, max_steps=2, shuffle_dataset=False),
        train_dataset=Dataset.from_list(rows), processing_class=processor,
    )  # fmt: skip
    trainer.train()
    assert len(_finite_losses(trainer)) == 2


# With bitsandbytes installed (Unsloth's environment) 4-bit may load on CPU; these tests check the refusal without it.
_HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None


def _remote_code_checkpoint(tiny_dir, tmp_path):
    """A tiny checkpoint whose config.json points at its own model class (`auto_map`), as Hub repos with code do."""
    import json
    import shutil

    path = tmp_path / "remote-code"
    shutil.copytree(tiny_dir("qwen2_5_vl", words=COLORS), path)
    (path / "configuration_marked.py").write_text(
        "from transformers import Qwen2_5_VLConfig\n\n\nclass MarkedConfig(Qwen2_5_VLConfig):\n    pass\n"
    )
    (path / "modeling_marked.py").write_text(
        "from transformers import Qwen2_5_VLForConditionalGeneration\n\nfrom .configuration_marked import MarkedConfig"
        "\n\n\nclass MarkedVLM(Qwen2_5_VLForConditionalGeneration):\n    config_class = MarkedConfig\n"
    )
    config = json.loads((path / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_marked.MarkedConfig",
                          "AutoModelForImageTextToText": "modeling_marked.MarkedVLM"}  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_model_name_honours_trust_remote_code_and_dtype_auto(tiny_dir, tmp_path):
    path = _remote_code_checkpoint(tiny_dir, tmp_path)
    dataset = make_visual_reasoning_dataset("color", 8, seed=0)
    config = _config(tmp_path, beta=0.0, trust_remote_code=True)
    trusted = VLMGRPOTrainer(path, [choice], args=config, train_dataset=dataset)
    assert type(trusted.model).__name__ == "MarkedVLM"  # the repository's own code, as TRL loads it
    plain = VLMGRPOTrainer(path, [choice], args=_config(tmp_path, beta=0.0), train_dataset=dataset)
    assert type(plain.model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    auto = VLMGRPOTrainer(path, [choice], args=_config(tmp_path, beta=0.0, model_init_kwargs={"dtype": "auto"}),
                          train_dataset=dataset)  # fmt: skip
    assert auto.model.dtype == torch.float32  # the checkpoint's dtype (this tiny one is saved in float32)


@pytest.mark.skipif(torch.cuda.is_available() or _HAS_BNB, reason="checks the errors without a GPU and bitsandbytes")
def test_quantization_config_reaches_the_policy_model(tiny_dir, tmp_path):
    """Could not load 4-bit here (no GPU, no bitsandbytes): transformers' own bitsandbytes error proves it got there."""
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig

    path = tiny_dir("qwen2_5_vl", words=COLORS)
    dataset = make_visual_reasoning_dataset("color", 8, seed=0)
    bnb, lora = BitsAndBytesConfig(load_in_4bit=True), LoraConfig(r=4, target_modules=["q_proj"])
    refused = r"(?i)bitsandbytes|gpu|cuda"
    with pytest.raises((ImportError, RuntimeError), match=refused):  # TRL's trainer argument
        VLMGRPOTrainer(path, [choice], args=_config(tmp_path), train_dataset=dataset, peft_config=lora,
                       quantization_config=bnb)  # fmt: skip
    with pytest.raises((ImportError, RuntimeError), match=refused):  # in model_init_kwargs
        VLMGRPOTrainer(path, [choice], args=_config(tmp_path, model_init_kwargs={"quantization_config": bnb}),
                       train_dataset=dataset, peft_config=lora)  # fmt: skip
    with pytest.raises(ValueError, match="full_finetuning needs 16/32-bit"):  # no adapter: full fine-tuning of 4-bit
        VLMGRPOTrainer(path, [choice], args=_config(tmp_path, model_init_kwargs={"quantization_config": bnb}),
                       train_dataset=dataset)  # fmt: skip


# ----- clips -----


def _moving_square(direction: str, frames: int = 4, side: int = 56):
    """Frames of a red square moving left or right across a grey field."""
    out = []
    for t in range(frames):
        image = Image.new("RGB", (side, side), (128, 128, 128))
        x = 4 + 10 * t if direction == "right" else side - 14 - 10 * t
        image.paste((220, 20, 20), (x, 20, x + 10, 30))
        out.append(image)
    return out


# Clips alone, a clip with an image, an image alone and text alone: every row kind in one batch.
CLIP_ROWS = [
    {"prompt": "Which way does it move? <video>", "video": _moving_square("left"), "image": None, "answer": "left"},
    {"prompt": "Which way?", "video": _moving_square("right", 3), "image": None, "answer": "right"},
    {"prompt": "<image> then <video>: same colour?", "video": _moving_square("right"),
     "image": Image.new("RGB", (40, 56), (220, 20, 20)), "answer": "yes"},
    {"prompt": "<image> What colour?", "video": None, "image": Image.new("RGB", (56, 56), (0, 0, 255)),
     "answer": "blue"},
    {"prompt": "Say red.", "video": None, "image": None, "answer": "red"},
]  # fmt: skip


@pytest.mark.trains
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_a_batch_of_clips_images_and_text_trains_on_the_plain_path(tiny_dir, tmp_path, family):
    model, processor = _model(tiny_dir, family, peft=True)
    before = lora_b_weights(model)
    config = _config(tmp_path, per_device_train_batch_size=10, num_generations=2, max_steps=2, learning_rate=1e-2,
                     fast_generation=False, shared_prefix=False, video_max_frames=4)  # fmt: skip
    trainer = VLMGRPOTrainer(model, [_length], args=config, train_dataset=Dataset.from_list(CLIP_ROWS),
                             processing_class=processor)  # fmt: skip
    assert model.config.video_token_id in trainer.generation_config.suppress_tokens  # never sampled into completions
    trainer.train()
    _finite_losses(trainer)
    assert changed_weights(trainer.model, before)
    assert trainer.shared_prefix_calls == 0 and trainer.fast_generator.stats["calls"] == 0


def test_clips_are_refused_for_a_family_without_video_and_for_paths_that_drop_them(tiny_dir, tmp_path):
    dataset = Dataset.from_list(CLIP_ROWS[:2])
    model, processor = FastVisionModel.from_pretrained(tiny_dir("gemma3"), full_finetuning=True)
    with pytest.raises(ValueError, match=r"gemma3 models take no video.*qwen2_5_vl, qwen3_vl"):
        VLMGRPOTrainer(model, [_length], args=_config(tmp_path), train_dataset=dataset, processing_class=processor)
    model, processor = _model(tiny_dir)
    with pytest.raises(ValueError, match="use_liger_kernel=True: Liger's GRPO loss takes images only"):
        VLMGRPOTrainer(model, [_length], args=_config(tmp_path, use_liger_kernel=True), train_dataset=dataset,
                       processing_class=processor)  # fmt: skip
