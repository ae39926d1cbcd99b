"""Checkpoints of a real (tiny) GRPO run: which are complete, what a save cut short looks like, the full weights
resumed under the model's own names, and a Python-API resume that keeps its metrics record."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from vlm_grpo import FastVisionModel, VLMGRPOConfig, VLMGRPOTrainer
from vlm_grpo.data import answer_words, make_visual_reasoning_dataset
from vlm_grpo.rewards import make_choice_reward
from vlm_grpo.training.callbacks import MetricsJsonlCallback
from vlm_grpo.training.checkpoints import (
    checkpoint_dirs,
    incomplete_reason,
    load_full_weights,
    newest_complete_checkpoint,
)

COLORS = answer_words("color", 1)


def _trainer(base, out):
    model, processor = FastVisionModel.from_pretrained(base, full_finetuning=True)
    config = VLMGRPOConfig(output_dir=str(out), max_steps=2, per_device_train_batch_size=4, num_generations=2,
                           max_completion_length=4, learning_rate=5e-3, logging_steps=1, save_strategy="steps",
                           save_steps=1, report_to="none", use_cpu=True, dataloader_pin_memory=False,
                           disable_tqdm=True, seed=0)  # fmt: skip
    trainer = VLMGRPOTrainer(model, [make_choice_reward(COLORS)], args=config, processing_class=processor,
                             train_dataset=make_visual_reasoning_dataset("color", 16, seed=0))  # fmt: skip
    trainer.add_callback(MetricsJsonlCallback(out / "metrics.jsonl", trainer=trainer))
    return trainer


@pytest.fixture(scope="module")
def run(tiny_dir, tmp_path_factory):
    """Two steps of full fine-tuning, a checkpoint after each, the metrics record; and the trained weights."""
    base = tiny_dir("qwen2_5_vl", words=COLORS)
    out = tmp_path_factory.mktemp("checkpoints") / "run"
    trainer = _trainer(base, out)
    trainer.train()
    trained = {name: tensor.clone() for name, tensor in trainer.model.state_dict().items()}
    return base, out, trained


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.trains
def test_the_checkpoints_of_a_finished_run_are_complete(run):
    _, out, _ = run
    assert [c.rsplit("/", 1)[1] for c in checkpoint_dirs(out)] == ["checkpoint-1", "checkpoint-2"]
    assert [incomplete_reason(c) for c in checkpoint_dirs(out)] == [None, None]
    assert newest_complete_checkpoint(out) == str(out / "checkpoint-2")
    assert checkpoint_dirs(out / "nowhere") == []


def _cut(path, keep: float):
    path.write_bytes(path.read_bytes()[: int(path.stat().st_size * keep)])


# What a kill during transformers' save leaves (it writes weights, optimizer, scheduler, RNG state, then
# trainer_state.json), and files a full disk cuts short.
DAMAGE = {
    "killed before trainer_state.json": (lambda c: (c / "trainer_state.json").unlink(), "no trainer_state.json"),
    "trainer_state.json cut short": (lambda c: _cut(c / "trainer_state.json", 0.5), "trainer_state.json is truncated"),
    "weights empty": (lambda c: _cut(c / "model.safetensors", 0), "model.safetensors is empty"),
    "weights cut short": (lambda c: _cut(c / "model.safetensors", 0.9), "model.safetensors is truncated"),
    "weights header cut short": (lambda c: _cut(c / "model.safetensors", 0.0005), "model.safetensors is truncated"),
    "optimizer cut short": (lambda c: _cut(c / "optimizer.pt", 0.99), "optimizer.pt is truncated"),
    "no scheduler": (lambda c: (c / "scheduler.pt").unlink(), "no scheduler.pt"),
    "no optimizer": (lambda c: (c / "optimizer.pt").unlink(), "no optimizer state"),
    "no weights": (lambda c: (c / "model.safetensors").unlink(), "no model weights"),
    "another step's state": (
        lambda c: (c / "trainer_state.json").write_text(
            json.dumps({**json.loads((c / "trainer_state.json").read_text()), "global_step": 7})
        ),
        "trainer_state.json is for step 7, not 2",
    ),
}


@pytest.mark.trains
@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_a_checkpoint_cut_short_is_named_and_skipped_for_the_previous_one(run, tmp_path, damage):
    _, out, _ = run
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    harm, reason = DAMAGE[damage]
    harm(copy / "checkpoint-2")
    assert reason in incomplete_reason(copy / "checkpoint-2")
    assert newest_complete_checkpoint(copy) == str(copy / "checkpoint-1")


@pytest.mark.trains
def test_full_weights_resume_under_the_models_own_names(run):
    base, out, trained = run
    model, _ = FastVisionModel.from_pretrained(base, full_finetuning=True)
    saved = load_file(out / "checkpoint-2" / "model.safetensors")
    # Why transformers' own resume loads nothing but the LM head: the names are saved in the Hub's layout.
    assert set(saved) & set(model.state_dict()) == {"lm_head.weight"}
    assert any(not torch.equal(trained[name], tensor) for name, tensor in model.state_dict().items())
    assert load_full_weights(model, out / "checkpoint-2")
    assert all(torch.equal(trained[name], tensor) for name, tensor in model.state_dict().items())


@pytest.mark.trains
def test_a_checkpoint_of_another_model_is_refused(run, tiny_dir):
    _, out, _ = run
    other, _ = FastVisionModel.from_pretrained(tiny_dir("qwen2_vl"), full_finetuning=True)
    with pytest.raises(ValueError, match="12 saved weight.s. have no place in the model .visual.blocks.0.mlp"):
        load_full_weights(other, out / "checkpoint-2")


@pytest.mark.trains
def test_python_api_resume_picks_the_complete_checkpoint_and_keeps_the_metrics_record(run, tmp_path):
    base, out, trained = run
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    (copy / "checkpoint-2" / "trainer_state.json").unlink()  # killed while saving step 2
    trainer = _trainer(base, copy)
    trainer.train(resume_from_checkpoint=True)  # the newest complete checkpoint: checkpoint-1
    records = _records(copy)
    assert [r["step"] for r in records if "loss" in r] == [1, 2]  # step 1 kept, step 2 redone once
    assert ["train_runtime" in r for r in records] == [False, False, True]  # one final record, the last
    # Step 2 trained again from checkpoint-1's weights, optimizer and RNG: the same loss and the same weights.
    assert records[1]["loss"] == _records(out)[1]["loss"]
    assert all(torch.equal(trained[name], tensor) for name, tensor in trainer.model.state_dict().items())
