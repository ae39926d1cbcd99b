"""Callbacks on a real (tiny) GRPO run: sample completions read from TRL's buffers, the metrics JSONL, the live
plot's text fallback and its PNG; the command's progress bar / printer and its reward-curve PNG."""

import io
import json

import pytest
from datasets import Dataset, Features, List, Value
from datasets import Image as ImageFeature
from PIL import Image

from vlm_grpo import FastVisionModel, VLMGRPOConfig, VLMGRPOTrainer
from vlm_grpo.data import answer_words
from vlm_grpo.rewards import make_choice_reward, think_answer_format
from vlm_grpo.training.callbacks import (
    LivePlotCallback,
    MetricsJsonlCallback,
    RewardPrinter,
    RewardProgressBar,
    completion_samples,
    in_notebook,
    keep_records_up_to,
    library_bars_off,
    plot_reward_curve,
    reward_curve_figure,
    reward_summary,
)

COLOURS = ["red", "green", "blue", "yellow"]


def _dataset() -> Dataset:
    """Two prompts with different questions, so samples show which group they came from."""
    rows = {
        "prompt": [[{"role": "user", "content": f"What colour is shape {i}?"}] for i in range(2)],
        "image": [Image.new("RGB", (28, 28), (200, 30, 30)), Image.new("RGB", (28, 28), (30, 30, 200))],
        "answer": ["red", "blue"],
    }
    features = Features({"prompt": List({"role": Value("string"), "content": Value("string")}), "image": ImageFeature(),
                         "answer": Value("string")})  # fmt: skip
    return Dataset.from_dict(rows, features=features)


@pytest.fixture(scope="module")
def trained(tiny_dir, tmp_path_factory):
    """One logged GRPO step (2 prompts x 2 samples) with both callbacks attached."""
    out = tmp_path_factory.mktemp("callbacks")
    model, processor = FastVisionModel.from_pretrained(
        tiny_dir("qwen2_5_vl", words=answer_words("color", 1)), full_finetuning=True
    )
    config = VLMGRPOConfig(output_dir=str(out), max_steps=1, per_device_train_batch_size=4, num_generations=2,
                           max_completion_length=4, logging_steps=1, report_to="none", save_strategy="no",
                           use_cpu=True, dataloader_pin_memory=False, disable_tqdm=True, seed=0)  # fmt: skip
    plot = LivePlotCallback(title="test", notebook=False)
    rewards = [make_choice_reward(COLOURS), think_answer_format]
    trainer = VLMGRPOTrainer(model=model, reward_funcs=rewards, args=config, train_dataset=_dataset(),
                             processing_class=processor, callbacks=[plot])  # fmt: skip
    trainer.add_callback(MetricsJsonlCallback(out / "metrics.jsonl", trainer=trainer, num_samples=3))
    trainer.train()
    return trainer, plot, out


@pytest.mark.trains
def test_completion_samples_take_one_completion_per_prompt_first(trained):
    trainer, _, _ = trained
    samples = completion_samples(trainer, num_samples=4)
    prompts = [s["prompt"] for s in samples]
    # Rows in TRL's buffer are grouped per prompt (2 samples each): the first two samples are two prompts.
    assert sorted(prompts[:2]) == ["What colour is shape 0?", "What colour is shape 1?"] and prompts[2:] == prompts[:2]
    for sample in samples:
        assert set(sample["rewards"]) == {"choice_accuracy", "think_answer_format"}
        assert sample["rewards"]["choice_accuracy"] in (0.0, 1.0)
        assert isinstance(sample["completion"], str) and isinstance(sample["advantage"], float)
        assert "choice_accuracy_pred" in sample  # the reward's own parse, logged with TRL's log_extra
    assert len(completion_samples(trainer, num_samples=2)) == 2 and len(completion_samples(trainer, 10)) == 4


@pytest.mark.trains
def test_metrics_jsonl_writes_records_with_samples_and_no_nan(trained):
    _, _, out = trained
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in records if "reward" in r)
    assert step["step"] == 1 and len(step["samples"]) == 3
    assert "samples" not in records[-1] and "train_runtime" in records[-1]  # the end-of-training summary
    assert "NaN" not in (out / "metrics.jsonl").read_text()


@pytest.mark.trains
def test_live_plot_records_every_reward_curve_and_draws_a_png(trained):
    _, plot, _ = trained
    assert not in_notebook()
    assert set(plot.history) == {"mean reward", "choice_accuracy", "think_answer_format"}
    assert [step for step, _ in plot.history["mean reward"]] == [1]
    plot.add_reference("held-out accuracy before", 0.25)
    image = Image.open(io.BytesIO(plot.figure_png()))
    assert image.format == "PNG" and image.size == (640, 360)


def test_live_plot_text_fallback_line(capsys):
    from transformers import TrainerControl, TrainerState, TrainingArguments

    plot = LivePlotCallback(notebook=False)
    state = TrainerState(global_step=10, max_steps=400)
    logs = {"loss": 0.1, "rewards/choice_accuracy/mean": 0.5, "rewards/choice_accuracy/std": 0.2, "reward": 0.5,
            "rewards/think_answer_format/mean": float("nan")}  # fmt: skip
    plot.on_log(TrainingArguments(output_dir="unused", report_to="none"), state, TrainerControl(), logs=logs)
    plot.on_log(
        TrainingArguments(output_dir="unused", report_to="none"), state, TrainerControl(), logs={"train_runtime": 1.0}
    )
    assert capsys.readouterr().out == "step 10/400  choice_accuracy 0.500  mean reward 0.500\n"
    assert plot.history == {"choice_accuracy": [(10, 0.5)], "mean reward": [(10, 0.5)]}  # NaN is not plotted


LOGS = {"loss": 0.1, "reward": 0.75, "rewards/choice_accuracy/mean": 0.5, "rewards/choice_accuracy/std": 0.2,
        "rewards/think_answer_format_long_name/mean": 1.0, "kl": 0.00123}  # fmt: skip


def test_reward_summary_shows_each_training_number_once_under_its_own_name():
    # Several rewards: each under its own (shortened) name, the accuracy reward first; never `acc`, which read as the
    # held-out accuracy (issue 46).
    assert reward_summary(LOGS, accuracy="think_answer_format_long_name") == {
        "reward": "0.750", "think_answer_for": "1.000", "choice_accuracy": "0.500", "kl": "0.00123"
    }  # fmt: skip
    assert list(reward_summary(LOGS)) == ["reward", "choice_accuracy", "think_answer_for", "kl"]
    # One reward: its mean is the reward, shown once (the bar showed `reward=0.973, acc=0.973`).
    one = {"reward": 0.973, "rewards/choice_accuracy/mean": 0.973, "kl": 0.001}
    assert reward_summary(one, accuracy="choice_accuracy") == {"reward": "0.973", "kl": "0.001"}
    # With tools: calls per rollout and the malformed ones, what GRPO's sampling breaks first (issue 47).
    tools = one | {"tools/call_frequency": 0.875, "tools/malformed_frequency": 0.125, "tools/failure_frequency": 0.0}
    assert reward_summary(tools) == {"reward": "0.973", "kl": "0.001", "calls": "0.88", "malformed": "0.12"}


def _args():
    from transformers import TrainingArguments

    return TrainingArguments(output_dir="unused", report_to="none")


def test_reward_printer_prints_one_line_per_training_record(capsys):
    from transformers import TrainerControl, TrainerState

    printer, state = RewardPrinter("choice_accuracy"), TrainerState(global_step=10, max_steps=400)
    printer.on_log(_args(), state, TrainerControl(), logs=LOGS)
    printer.on_log(_args(), state, TrainerControl(), logs={"train_runtime": 1.0})  # not a training record
    assert (
        capsys.readouterr().out
        == "step 10/400  reward 0.750  choice_accuracy 0.500  think_answer_for 1.000  kl 0.00123\n"
    )


def test_reward_progress_bar_shows_the_summary_in_its_postfix():
    from transformers import TrainerControl, TrainerState

    bar, state = RewardProgressBar("choice_accuracy"), TrainerState(global_step=1, max_steps=4)
    bar.on_train_begin(_args(), state, TrainerControl())
    try:
        bar.on_log(_args(), state, TrainerControl(), logs=LOGS)
        assert "reward=0.750, choice_accuracy=0.500" in str(bar.training_bar) and "acc=" not in str(bar.training_bar)
    finally:
        bar.on_train_end(_args(), state, TrainerControl())


def test_reward_curve_png_is_written_whole_from_the_metrics_file(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    records = [{"step": s, "reward": s / 10} for s in (1, 2, 3)] + [{"step": 3, "train_runtime": 1.0}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    plot_reward_curve(metrics, tmp_path / "curve.png", title="test", before=0.25, after=0.75)
    image = Image.open(tmp_path / "curve.png")
    assert image.format == "PNG" and image.size == (720, 420)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curve.png", "metrics.jsonl"]  # no temporary left
    plot_reward_curve(metrics, tmp_path / "no-eval.png", title="no held-out set")  # NaN before/after: no lines
    assert Image.open(tmp_path / "no-eval.png").size == (720, 420)


def test_a_one_point_reward_curve_is_drawn_from_step_0_and_reward_0_to_1(tmp_path):
    # Issue 46: with --max_steps below --logging_steps, one point at step 5 on a 4.8-5.2 axis.
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 5, "reward": 0.25}) + "\n")
    [axes] = reward_curve_figure(metrics, title="t", before=0.1, max_steps=5).axes
    assert axes.get_xlim() == (0, 5) and axes.get_ylim()[0] <= 0 and axes.get_ylim()[1] >= 1
    [axes] = reward_curve_figure(metrics, title="t", after=1.4).axes  # an accuracy above 1 stays in view
    assert axes.get_xlim() == (0, 5) and axes.get_ylim()[1] > 1.4


def test_metrics_of_a_resumed_run_are_cut_back_to_its_checkpoint(tmp_path):
    from transformers import TrainerControl, TrainerState

    # A run killed after step 4's checkpoint while logging step 6; an earlier attempt had ended (its final record).
    metrics = tmp_path / "metrics.jsonl"
    records = [{"step": s, "loss": s / 10} for s in range(1, 6)] + [{"step": 5, "train_runtime": 1.0}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 6, "lo')
    callback = MetricsJsonlCallback(metrics)
    callback.on_train_begin(None, TrainerState(global_step=4), TrainerControl())  # the state restored: resumed
    assert [json.loads(line) for line in metrics.read_text().splitlines()] == records[:4]
    callback.on_log(None, TrainerState(global_step=5), TrainerControl(), logs={"loss": 0.25})
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3, 4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # rewritten through a temporary
    callback.on_train_begin(None, TrainerState(global_step=0), TrainerControl())  # a new run starts it empty
    assert metrics.read_text() == ""
    keep_records_up_to(tmp_path / "new.jsonl", 3)  # resuming with no record yet: an empty file to append to
    assert (tmp_path / "new.jsonl").read_text() == ""


def test_metrics_file_is_not_touched_before_training_begins(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1}\n')
    MetricsJsonlCallback(metrics)
    assert metrics.read_text() == '{"step": 1}\n'


def test_library_bars_off_hides_transformers_bars_inside_and_restores_them_after(capsys):
    from transformers.utils import logging as transformers_logging

    assert transformers_logging.is_progress_bar_enabled()
    with library_bars_off():
        for _ in transformers_logging.tqdm(range(3), desc="Writing model shards"):
            pass
        assert not transformers_logging.is_progress_bar_enabled()
    assert "Writing model shards" not in capsys.readouterr().err
    assert transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:  # a caller's own choice (bars off) is kept
        with library_bars_off():
            pass
        assert not transformers_logging.is_progress_bar_enabled()
    finally:
        transformers_logging.enable_progress_bar()


def test_summaries_show_none_and_nan_as_a_dash(capsys, tmp_path):
    # TRL logs `reward` None (NaN before logging) when no reward function scored a step.
    logs = {"reward": None, "rewards/choice/mean": float("nan"), "rewards/format/mean": 0.5, "kl": None}
    assert reward_summary(logs, "choice") == {"reward": "–", "choice": "–", "format": "0.500", "kl": "–"}
    state = type("State", (), {"is_world_process_zero": True, "global_step": 3, "max_steps": 9})()
    RewardPrinter().on_log(None, state, None, logs=logs)
    assert capsys.readouterr().out.strip() == "step 3/9  reward –  choice –  format 0.500  kl –"
    plot = LivePlotCallback(notebook=False)
    plot.on_log(None, state, None, logs=logs)
    assert list(plot.history) == ["format"]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 1, "reward": None}) + "\n" + json.dumps({"step": 2, "reward": 0.5}) + "\n")
    plot_reward_curve(metrics, tmp_path / "curve.png", title="t")
    assert Image.open(tmp_path / "curve.png").size[0] > 100


def _none_reward_trainer(tiny_dir, tmp_path, reward_funcs, **config):
    model, processor = FastVisionModel.from_pretrained(
        tiny_dir("qwen2_5_vl", words=answer_words("color", 1)), full_finetuning=True
    )
    args = VLMGRPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=3, num_generations=3, max_completion_length=8,
        learning_rate=0.1, max_steps=2, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, seed=0,
        **config,
    )  # fmt: skip
    # The progress bar on (TRL's tests run with it): the callback that formats the logged reward.
    assert not args.disable_tqdm
    return VLMGRPOTrainer(model, reward_funcs, args=args, train_dataset=_dataset(), processing_class=processor)


def _applicable_reward_func(completions, **kwargs):
    """Rewards longer completions."""
    return [float(len(str(completion))) for completion in completions]


def _non_applicable_reward_func(completions, **kwargs):
    """Not applicable to any sample."""
    return [None] * len(completions)


@pytest.mark.trains
def test_trl_multiple_reward_funcs_with_none_output_train(tiny_dir, tmp_path):
    # TRL's `test_train_multiple_reward_funcs_with_None_output`, on this trainer.
    trainer = _none_reward_trainer(
        tiny_dir, tmp_path, [_applicable_reward_func, _non_applicable_reward_func], reward_weights=[0.7, 0.3]
    )
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert any(not p.equal(trainer.model.get_parameter(n)) for n, p in before.items())


@pytest.mark.trains
def test_trl_warning_raised_all_rewards_none(tiny_dir, tmp_path, caplog):
    # TRL's `test_warning_raised_all_rewards_none`: a warning, and the run (with its progress bar) finishes.
    trainer = _none_reward_trainer(tiny_dir, tmp_path, [_non_applicable_reward_func])
    with caplog.at_level("WARNING", logger="trl.trainer.grpo_trainer"):
        trainer.train()
    assert "All reward functions returned None for the following kwargs:" in caplog.text
    assert trainer.state.global_step == 2
