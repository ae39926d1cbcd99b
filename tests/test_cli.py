"""The `vlm-grpo` command as a user meets it: the installed console script in a subprocess (exit status, output,
file modes, own data in every supported format) and in-process `main` for argument errors."""

import io
import json
import os
import shutil
import stat
import subprocess

import pytest
from datasets import Dataset, DatasetDict, Features, Value
from datasets import Image as ImageFeature
from PIL import Image
from transformers import AutoModelForImageTextToText

from vlm_grpo.cli import UsageError, main, parse_args, run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_RUN = ["--max_steps", "2", "--per_device_train_batch_size", "4", "--num_generations", "2",
            "--max_completion_length", "4", "--logging_steps", "1"]  # fmt: skip


def vlm_grpo(*args: str) -> subprocess.CompletedProcess:
    """The installed console script, importing this checkout, under umask 022."""
    exe = shutil.which("vlm-grpo")
    assert exe, "the vlm-grpo console script is not installed (pip install -e .)"
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([exe, *args], check=False, capture_output=True, text=True, env=env, timeout=900,
                          preexec_fn=lambda: os.umask(0o022))  # fmt: skip


def _assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def _metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _image(i: int, size: int = 32) -> Image.Image:
    return Image.new("RGB", (size, size), ((60 * i) % 256, (90 * i) % 256, 40))


def _png_bytes(i: int) -> bytes:
    buffer = io.BytesIO()
    _image(i).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.trains
def test_console_script_succeeds_quietly_and_writes_readable_outputs(tmp_path):
    out = tmp_path / "run"
    proc = vlm_grpo("--output_dir", str(out), "--train_size", "8", "--test_size", "4", *TINY_RUN)
    _assert_ok(proc)
    assert "held-out accuracy before training" in proc.stdout and "held-out accuracy after training" in proc.stdout
    # Progress is one bar with the reward in its postfix, not a raw dict per logging step; no dict of results.
    assert "{'loss'" not in proc.stdout + proc.stderr and "{'before/" not in proc.stderr
    assert "reward=" in proc.stderr
    # Warnings that are ours to fix are gone.
    assert "FutureWarning" not in proc.stderr and "pin_memory" not in proc.stderr, proc.stderr[-3000:]
    records = _metrics(out)
    assert [r["step"] for r in records if "reward" in r] == [1, 2]
    assert all("loss" in r and "kl" in r for r in records if "reward" in r)
    assert (out / "reward_curve.png").stat().st_size > 1000
    assert set(json.loads((out / "eval.json").read_text())) >= {"before/accuracy", "after/accuracy"}
    assert AutoModelForImageTextToText.from_pretrained(out / "final").config.model_type == "qwen2_5_vl"
    # The checkpoint follows the umask (022) like any file the user writes: not private to its owner.
    assert stat.S_IMODE((out / "final").stat().st_mode) == 0o755
    assert stat.S_IMODE((out / "final" / "model.safetensors").stat().st_mode) == 0o644
    assert not [p for p in os.listdir(out) if ".tmp" in p]


def test_help_starts_with_what_the_command_does(tmp_path):
    proc = vlm_grpo("--help")
    _assert_ok(proc)
    text = proc.stdout
    assert text.index("reinforcement learning") < text.index("--model") < text.index("--learning_rate")
    assert text.count("  vlm-grpo ") >= 2  # two example commands
    for flag in ("--config", "--dataset", "--reward_funcs", "--prompt_column", "--help-all", "--max_steps"):
        assert flag in text
    assert len(text.splitlines()) < 300
    no_vision = text[text.index("--no_finetune_vision_layers") :].split("\n  --")[0]
    assert "Turn off" in no_vision and "default: False" not in no_vision
    full = vlm_grpo("--help-all").stdout
    assert "--gradient_accumulation_steps" in full and full.index("--model") < full.index("--learning_rate")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--task", "nonsense"], "unknown --task 'nonsense'"),
        (["--load_in_4bit", "--load_in_8bit"], "Choose one of load_in_4bit=True or load_in_8bit=True"),
        (["--model", "tiny:nope"], "Unknown tiny family 'nope'"),
        (["--reward_funcs", "no_such_reward"], "answer_accuracy"),  # the valid names are listed
        (["--dataset", "missing/data/train.jsonl"], "no such file"),
        (["--dataset", "nobody/no-such-dataset"], "cannot load"),  # the Hub path, offline here
        (["--per_device_train_batch_size", "3", "--num_generations", "2"], "divisible"),
        # Abbreviations and misspellings are refused with the flag meant, never applied to whichever flag they prefix.
        (["--learning_rat", "1e-4"], "unknown flag --learning_rat; did you mean --learning_rate?"),
        (["--max_stpes=3"], "unknown flag --max_stpes; did you mean --max_steps?"),
        # Refused before a model is built: torch's optimizer would only fail after the baseline evaluation.
        (["--learning_rate=-1e-4"], "--learning_rate must be >= 0, got -0.0001"),
        (["--learning_rate", "-1e-4"], "--learning_rate must be >= 0, got -0.0001"),  # a negative value after a space
        (["--adam_beta2", "1.5"], "--adam_beta2 must be in [0, 1)"),
        (["--task", "color_change", "--model", "tiny:gemma3"], "video task and tiny:gemma3 takes no video"),
    ],
)
def test_bad_input_is_one_line_and_exit_status_2_with_nothing_written(tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    assert main(["--output_dir", str(out), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("vlm-grpo: error:") and message in err and "\n" not in err, err
    assert not out.exists()


def test_bad_input_through_the_console_script(tmp_path):
    proc = vlm_grpo("--task", "nonsense", "--output_dir", str(tmp_path / "run"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("vlm-grpo: error: unknown --task 'nonsense'")
    assert not (tmp_path / "run").exists()


@pytest.mark.trains
def test_flags_load_from_yaml_and_reach_the_run(tmp_path, capsys):
    config = tmp_path / "recipe.yaml"
    out = tmp_path / "run"
    config.write_text(
        f"model: tiny:gemma3\noutput_dir: {out}\nmax_steps: 2\ntrain_size: 8\ntest_size: 4\nuse_peft: true\n"
        "lora_r: 4\nfinetune_language_layers: false\nfinetune_mlp_modules: false\nlearning_rate: 0.001\n"
        "logging_steps: 1\ndisable_tqdm: true\nper_device_train_batch_size: 8\nnum_generations: 4\n"
    )
    results = run(*parse_args(["--config", str(config)]))
    assert "(synthetic task 'color', 4 prompts)" in capsys.readouterr().out  # test_size
    assert {"before/accuracy", "after/accuracy"} <= set(results)
    steps = [r for r in _metrics(out) if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(r["learning_rate"] == 0.001 for r in steps)
    # LoRA of rank 4 on the vision tower's attention only: the two finetune_* flags reached get_peft_model.
    adapter = json.loads((out / "final" / "adapter_config.json").read_text())
    targets = str(adapter["target_modules"])
    assert adapter["r"] == 4 and "vision_tower" in targets and "self_attn" in targets
    assert "language_model" not in targets and "mlp" not in targets


# Your own data: one console-script run per format, each folding in a few checks.


@pytest.mark.trains
def test_jsonl_in_the_easyr1_layout_needs_no_column_flags(tmp_path):
    (tmp_path / "data" / "img").mkdir(parents=True)
    with open(tmp_path / "data" / "train.jsonl", "w") as f:
        for i in range(10):
            _image(i).save(tmp_path / "data" / "img" / f"{i}.png")
            f.write(
                json.dumps(
                    {"problem": f"<image>What is {i} plus one?", "answer": str(i + 1), "images": [f"img/{i}.png"]}
                )
                + "\n"
            )
    out = tmp_path / "run"
    proc = vlm_grpo(
        "--dataset", str(tmp_path / "data" / "train.jsonl"), "--test_size", "2", "--output_dir", str(out),
        "--reward_funcs", "think_answer_format", "answer_accuracy", "--reward_weights", "0.5", "1.0",
        "--system_prompt", "You are a helpful assistant.", "--prompt_template", "{prompt} Answer in <answer></answer>.",
        *TINY_RUN,
    )  # fmt: skip
    _assert_ok(proc)
    assert "(train.jsonl, 2 prompts)" in proc.stdout
    steps = [r for r in _metrics(out) if "reward" in r]
    assert len(steps) == 2
    assert {"rewards/think_answer_format/mean", "rewards/answer_accuracy/mean"} <= set(steps[0])
    assert set(json.loads((out / "eval.json").read_text())) >= {"before/reward/answer_accuracy", "after/accuracy"}


@pytest.mark.trains
def test_csv_with_column_mapping_and_jpeg_paths(tmp_path):
    lines = ["question,picture,label"]
    for i in range(8):
        _image(i).save(tmp_path / f"{i}.jpg", format="JPEG")
        lines.append(f"How many shapes are there?,{i}.jpg,{i % 3}")
    (tmp_path / "train.csv").write_text("\n".join(lines) + "\n")
    out = tmp_path / "run"
    proc = vlm_grpo("--dataset", str(tmp_path / "train.csv"), "--prompt_column", "question", "--image_column", "picture",
                    "--answer_column", "label", "--test_size", "0.25", "--output_dir", str(out), *TINY_RUN)  # fmt: skip
    _assert_ok(proc)
    assert "(train.csv, 2 prompts)" in proc.stdout
    assert "rewards/answer_accuracy/mean" in _metrics(out)[0]  # the default reward for a dataset


@pytest.mark.trains
def test_parquet_with_image_bytes(tmp_path):
    rows = {"prompt": [f"Which colour is image {i}?" for i in range(8)], "image": [_png_bytes(i) for i in range(8)],
            "answer": ["red", "green"] * 4}  # fmt: skip
    Dataset.from_dict(rows).to_parquet(str(tmp_path / "train.parquet"))
    out = tmp_path / "run"
    proc = vlm_grpo("--dataset", str(tmp_path / "train.parquet"), "--test_size", "0", "--output_dir", str(out),
                    "--reward_funcs", "vlm_grpo.rewards:anls", *TINY_RUN)  # fmt: skip
    _assert_ok(proc)
    assert "held-out accuracy" not in proc.stdout  # --test_size 0: no held-out set
    assert "rewards/anls/mean" in _metrics(out)[0]


@pytest.mark.trains
def test_save_to_disk_directory_with_an_eval_split(tmp_path):
    features = Features({"prompt": Value("string"), "image": ImageFeature(), "answer": Value("string")})

    def split(n: int, offset: int) -> Dataset:
        return Dataset.from_dict({"prompt": [f"Count the shapes ({i})." for i in range(n)],
                                  "image": [_image(offset + i) for i in range(n)],
                                  "answer": [str(i % 4) for i in range(n)]}, features=features)  # fmt: skip

    DatasetDict({"train": split(8, 0), "test": split(3, 100)}).save_to_disk(str(tmp_path / "saved"))
    out = tmp_path / "run"
    proc = vlm_grpo("--dataset", str(tmp_path / "saved"), "--eval_split", "test", "--output_dir", str(out),
                    "--reward_funcs", "counting", *TINY_RUN)  # fmt: skip
    _assert_ok(proc)
    assert "(saved, 3 prompts)" in proc.stdout
    assert "rewards/counting/mean" in _metrics(out)[0]


@pytest.mark.trains
def test_image_folder_with_metadata(tmp_path):
    folder = tmp_path / "shapes"
    folder.mkdir()
    with open(folder / "metadata.jsonl", "w") as f:
        for i in range(8):
            _image(i).save(folder / f"{i}.jpg", format="JPEG")
            f.write(json.dumps({"file_name": f"{i}.jpg", "question": "What colour is it?", "answer": "red"}) + "\n")
    out = tmp_path / "run"
    proc = vlm_grpo("--dataset", str(folder), "--test_size", "2", "--output_dir", str(out), *TINY_RUN)
    _assert_ok(proc)
    assert "(shapes, 2 prompts)" in proc.stdout
    assert len([r for r in _metrics(out) if "reward" in r]) == 2


def test_system_prompt_and_template_reach_the_synthetic_task_prompts(tmp_path):
    from vlm_grpo.cli import build_task

    script, config = parse_args(["--train_size", "2", "--test_size", "2", "--output_dir", str(tmp_path / "run"),
                                 "--system_prompt", "Be brief.", "--prompt_template", "{prompt} Think first."])  # fmt: skip
    task = build_task(script, config)
    train, test = task.train, task.test
    for prompt in list(train["prompt"]) + list(test["prompt"]):
        assert prompt == [{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": "What colour is the shape? Answer with one word. Think first."}]  # fmt: skip
    with pytest.raises(UsageError, match=r"must contain \{prompt\}"):
        run(*parse_args(["--prompt_template", "no placeholder", "--output_dir", str(tmp_path / "bad")]))
    assert not (tmp_path / "bad").exists()


@pytest.mark.trains
def test_checkpointing_off_holds_through_the_held_out_evaluation(tmp_path, monkeypatch):
    # Issue 26: the baseline evaluation before training used to switch checkpointing back on for the whole run.
    from vlm_grpo.compat import CHECKPOINTING_ARG
    from vlm_grpo.modes import checkpointing_mode
    from vlm_grpo.trainer import VLMGRPOTrainer

    seen = []
    compute_loss = VLMGRPOTrainer.compute_loss

    def recording_compute_loss(self, model, inputs, *args, **kwargs):  # the real loss, with the mode noted
        seen.append(checkpointing_mode(self.accelerator.unwrap_model(model)))
        return compute_loss(self, model, inputs, *args, **kwargs)

    monkeypatch.setattr(VLMGRPOTrainer, "compute_loss", recording_compute_loss)
    results = run(*parse_args(["--output_dir", str(tmp_path / "run"), "--train_size", "8", "--test_size", "4",
                               f"--{CHECKPOINTING_ARG}", "false", *TINY_RUN]))  # fmt: skip
    assert "before/accuracy" in results  # the held-out set was evaluated before training
    assert seen == [False, False]


def test_accuracy_reward_is_chosen_by_flag_or_by_what_the_rewards_read():
    from vlm_grpo.cli import build_task
    from vlm_grpo.rewards import answer_accuracy, think_answer_format

    def task_of(*flags: str):
        return build_task(*parse_args(["--train_size", "2", "--test_size", "2", *flags]))

    assert task_of().accuracy.__name__ == "choice_accuracy"  # the synthetic task's own reward
    # Without the flag, the format reward (it reads no gold answer) is not the judge, wherever it is listed.
    assert task_of("--reward_funcs", "think_answer_format", "answer_accuracy").accuracy is answer_accuracy
    chosen = task_of("--reward_funcs", "think_answer_format", "--accuracy_reward", "answer_accuracy")
    assert chosen.reward_funcs == [think_answer_format] and chosen.eval_funcs == [answer_accuracy, think_answer_format]


def test_rewards_reading_columns_the_data_lacks_are_refused_with_nothing_written(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    assert main(["--output_dir", str(out), "--reward_funcs", "iou"]) == 2  # the colour task has no boxes
    err = capsys.readouterr().err.strip()
    assert err.startswith("vlm-grpo: error: iou reads `bbox`, which the training rows lack") and "\n" not in err
    assert main(["--output_dir", str(out), "--accuracy_reward", "no_such_reward"]) == 2
    assert "unknown reward 'no_such_reward'" in capsys.readouterr().err
    assert not out.exists()


def test_an_output_dir_that_is_a_file_is_refused_and_left_alone(tmp_path, capsys):
    target = tmp_path / "notes.txt"
    target.write_text("mine")
    assert main(["--output_dir", str(target)]) == 2
    assert "is a file; name a directory" in capsys.readouterr().err
    assert target.read_text() == "mine"


def test_negative_values_reach_the_config_with_or_without_an_equals_sign():
    for argv in (["--beta", "-0.5"], ["--beta=-0.5"], ["--beta", "-5e-1"]):
        _, config = parse_args(argv)
        assert config.beta == -0.5


@pytest.mark.trains
def test_video_folder_and_the_video_task(tmp_path):
    from conftest import write_video

    folder = tmp_path / "clips"
    folder.mkdir()
    lines = []
    for i in range(6):
        write_video(folder / f"{i}.mp4", n=8, fps=4)
        lines.append(json.dumps({"prompt": "<video> Which way?", "video": f"{i}.mp4", "answer": "left"}))
    (folder / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "run"
    proc = vlm_grpo("--dataset", str(folder), "--test_size", "2", "--output_dir", str(out), "--video_max_frames", "4",
                    *TINY_RUN)  # fmt: skip
    _assert_ok(proc)
    assert "(clips, 2 prompts)" in proc.stdout
    out = tmp_path / "task"
    proc = vlm_grpo("--task", "color_change", "--model", "tiny:qwen3_vl", "--train_size", "8", "--test_size", "4",
                    "--output_dir", str(out), *TINY_RUN)  # fmt: skip
    _assert_ok(proc)
    assert "synthetic task 'color_change'" in proc.stdout
