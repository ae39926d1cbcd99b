"""Long runs and bad days (issue 50), each through the installed `vlm-grpo` command on the tiny model and real files:
SIGTERM, a checkpoint that cannot be written, non-finite steps, rewards that fail. Each stops with one line and its
exit status, leaves the last complete checkpoint intact and finite, and a resumed run logs every step once."""

import errno
import json
import os
import re
import resource
import shlex
import shutil
import signal
import subprocess
import time

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from test_cli import RESUMABLE, TINY_RUN, _assert_continues, _assert_ok, _console_script, _metrics, _tree, vlm_grpo

from vlm_grpo.training.checkpoint_writes import explain_write_failure
from vlm_grpo.training.checkpoints import checkpoint_dirs, incomplete_reason


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run the resumed ones are compared with: 6 steps, a checkpoint every 2 (as tests/test_cli.py's)."""
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    _assert_ok(vlm_grpo("--output_dir", str(out), *RESUMABLE))
    return out


def _up_to(uninterrupted, tmp_path, step: int):
    """A copy of the uninterrupted run as it was when `checkpoint-<step>` had just been written."""
    out = tmp_path / "run"
    shutil.copytree(uninterrupted, out)
    for later in [c for c in checkpoint_dirs(out) if int(c.rsplit("-", 1)[1]) > step]:
        shutil.rmtree(later)
    shutil.rmtree(out / "final")
    for name in ("eval.json", "reward_curve.png"):
        (out / name).unlink()
    return out


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def _finite_weights(checkpoint) -> bool:
    return all(torch.isfinite(t).all() for t in load_file(os.path.join(checkpoint, "model.safetensors")).values())


# ----- preemption


@pytest.mark.slow  # two runs: the fault, then the resume compared with a run that had none
@pytest.mark.trains
def test_sigterm_saves_a_complete_checkpoint_exits_0_and_says_how_to_resume(tmp_path, uninterrupted):
    out = tmp_path / "run"
    command = ["--output_dir", str(out), *RESUMABLE, "--resume_from_checkpoint"]  # what a preemptible job repeats
    exe, env = _console_script()
    log_path = tmp_path / "first.log"
    with open(log_path, "w") as log:
        first = subprocess.Popen([exe, *command], env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            metrics = out / "metrics.jsonl"
            while not metrics.exists() or metrics.read_text().count("\n") < 2:  # step 2 logged: mid-run
                assert first.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
                time.sleep(0.02)
            sent = time.monotonic()
            first.send_signal(signal.SIGTERM)  # what a cloud scheduler sends before it takes the machine
            status = first.wait(timeout=120)
            seconds = time.monotonic() - sent
        finally:
            first.kill()
            first.wait()
    output = log_path.read_text()
    assert status == 0 and "Traceback" not in output, output[-3000:]
    assert seconds < 30, f"{seconds:.1f} s from SIGTERM to exit"  # the step in progress and one save, on CPU ~0.3 s
    stopped = int(re.search(r"stopped by SIGTERM at step (\d+)", output).group(1))
    assert 2 <= stopped < 6  # mid-run, not at its end
    checkpoint = out / f"checkpoint-{stopped}"
    assert incomplete_reason(checkpoint) is None  # written whatever --save_steps says (2: not step 3 or 5)
    pattern = (rf"vlm-grpo: stopped by SIGTERM at step {stopped} \(\d+\.\d\d s after it\): checkpoint {checkpoint} is "
               rf"complete; resume with: (.*)")  # fmt: skip
    said = re.fullmatch(pattern, _last_line(output))
    assert said, _last_line(output)
    resume = shlex.split(said.group(1))
    assert resume == ["vlm-grpo", *command]  # the flag was there already: the same command again
    assert not (out / "final").exists() and not (out / "eval.json").exists()  # not written for an unfinished run

    proc = subprocess.run([exe, *resume[1:]], env=env, capture_output=True, text=True, timeout=600, check=False)
    _assert_ok(proc)
    assert f"resuming from {checkpoint}" in proc.stdout
    _assert_continues(out, uninterrupted, resumed_from=stopped)  # every step once; the same losses and weights


# ----- a checkpoint that cannot be written


def _file_size_limit(limit: int):
    """For `preexec_fn`: writes past `limit` bytes fail with EFBIG (SIGXFSZ ignored, else it kills the process)."""

    def apply() -> None:
        os.umask(0o022)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    return apply


@pytest.mark.slow  # two runs: the fault, then the resume compared with a run that had none
@pytest.mark.trains
def test_a_checkpoint_that_cannot_be_written_stops_the_run_and_the_previous_one_resumes(tmp_path, uninterrupted):
    out = _up_to(uninterrupted, tmp_path, 2)
    before = _tree(out / "checkpoint-2")
    weights, optimizer = (os.path.getsize(out / "checkpoint-2" / n) for n in ("model.safetensors", "optimizer.pt"))
    limit = (weights + optimizer) // 2  # the weights fit, the optimizer state does not
    exe, env = _console_script()
    command = ["--output_dir", str(out), *RESUMABLE, "--resume_from_checkpoint"]
    proc = subprocess.run([exe, *command], env=env, capture_output=True, text=True, timeout=600, check=False,
                          preexec_fn=_file_size_limit(limit))  # fmt: skip
    assert proc.returncode == 74 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"resuming from {out / 'checkpoint-2'}" in proc.stdout
    line = _last_line(proc.stderr)
    size = r"\d+\.\d (KiB|MiB)"
    assert re.fullmatch(
        rf"vlm-grpo: error: could not write checkpoint {out / 'checkpoint-4'}: a file would exceed this process's "
        rf"file-size limit \(ulimit -f: {size}\) \(about {size} for its largest file, the size of checkpoint-2\); "
        r"raise the limit \(ulimit -f unlimited\) or ask the scheduler for a larger one\. The incomplete checkpoint "
        rf"was removed\. The newest complete checkpoint, {out / 'checkpoint-2'}, is intact: resume from it with "
        r"--resume_from_checkpoint\.",
        line,
    ), line
    assert [os.path.basename(c) for c in checkpoint_dirs(out)] == ["checkpoint-2"]
    assert _tree(out / "checkpoint-2") == before  # not a byte or a timestamp changed

    _assert_ok(resumed := vlm_grpo(*command))
    assert f"resuming from {out / 'checkpoint-2'}" in resumed.stdout
    _assert_continues(out, uninterrupted, resumed_from=2)


@pytest.mark.parametrize(
    "error, because",
    [(OSError(errno.ENOSPC, "No space left on device"), ("the disk holding {dir} is full ({free} free; a checkpoint "
      "needs about 2.0 GiB (the size of checkpoint-50)): free space or use a larger --output_dir")),
     # torch.save's zip writer says only this; the disk's free space tells why
     (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"), ("the disk holding {dir} "
      "is full ({free} free; a checkpoint needs about 8388608.0 GiB (the size of checkpoint-50)): free space")),
     (PermissionError(errno.EACCES, "Permission denied"), "PermissionError: [Errno 13] Permission denied")],
    ids=["no_space", "no_space_without_errno", "other"],
)  # fmt: skip
def test_a_failed_write_is_explained_by_its_errno_or_else_by_the_disk(tmp_path, error, because):
    need = 2**31 if isinstance(error, OSError) else 2**53, 2**30, "the size of checkpoint-50"
    said = explain_write_failure(error, str(tmp_path / "checkpoint-100"), need)
    free = said.split("(")[1].split(" free")[0] if "free" in said else ""
    assert said.startswith(because.format(dir=tmp_path, free=free)), said


# ----- non-finite steps

# Unscaled advantages (Dr. GRPO's `--scale_rewards none`, reward - group mean) and a reward near float32's limit: a
# group of two such rewards sums to inf in TRL's float32 mean, the advantage becomes -3.4e38 and the loss inf.
REWARDS = """
def overflow_on_green(prompts, completions, answer, **kwargs):
    return [2e38 if a == "green" else float(len(c) % 3) for c, a in zip(completions, answer)]


def overflow(prompts, completions, **kwargs):
    return [2e38] * len(completions)


def fixed(prompts, completions, **kwargs):
    return [float(len(c) % 3) for c in completions]
"""
NONFINITE = ["--output_dir", "run", "--train_size", "32", "--test_size", "4", "--max_steps", "6", "--save_strategy",
             "steps", "--save_steps", "1", "--disable_tqdm", "true", *TINY_RUN[2:], "--scale_rewards", "none"]  # fmt: skip


def _rewards_module(folder):
    (folder / "overflowing.py").write_text(REWARDS)


def _weights(checkpoint) -> dict:
    return load_file(os.path.join(checkpoint, "model.safetensors"))


def _moments(checkpoint) -> dict:
    """AdamW's state of a checkpoint, one tensor per (parameter, moment)."""
    state = torch.load(os.path.join(checkpoint, "optimizer.pt"), weights_only=True)["state"]
    return {f"{i}.{k}": v for i, moments in state.items() for k, v in moments.items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow  # two runs: the fault, then the resume compared with a run that had none
@pytest.mark.trains
def test_steps_with_an_infinite_loss_are_skipped_counted_and_a_resume_goes_on_across_them(tmp_path):
    _rewards_module(tmp_path)
    flags = [*NONFINITE, "--reward_funcs", "overflowing:overflow_on_green", "--max_nonfinite_steps", "3"]
    _assert_ok(proc := vlm_grpo(*flags, cwd=tmp_path))
    out = tmp_path / "run"
    steps = [r for r in _metrics(out) if "loss" in r]
    # A step's rewards overflow exactly when it holds a green prompt (their mean is then inf, logged as null).
    overflowed = [r["step"] for r in steps if r["rewards/overflow_on_green/mean"] is None]
    assert overflowed and len(overflowed) < 6, overflowed  # the data's order gives both kinds of step
    skipped = [int(n) for n in re.findall(r"Step (\d+) skipped: loss inf, gradient norm nan", proc.stderr)]
    assert skipped == overflowed
    count = [r.get("nonfinite_steps") for r in steps]  # from the first skip on: the run's count so far
    assert count == [sum(s <= r["step"] for s in skipped) or None for r in steps]
    weights = {r["step"]: _weights(out / f"checkpoint-{r['step']}") for r in steps}
    weights[0] = load_file(out / "tiny-base" / "model.safetensors")
    for step in skipped:  # the weights and AdamW's moments exactly as the step before left them
        assert _same(weights[step], weights[step - 1]), step
        if step > 1:
            assert _same(*(_moments(out / f"checkpoint-{s}") for s in (step, step - 1))), step
    assert not _same(weights[6], weights[0])  # the other steps trained
    assert all(_finite_weights(c) for c in checkpoint_dirs(out))

    # Resumed from the checkpoint written after the first skipped step: its count goes on, and the steps after it
    # are logged as the uninterrupted run logged them, to the same final weights.
    first = skipped[0]
    copy = tmp_path / "copy"
    (copy / "run").parent.mkdir()
    shutil.copytree(out, copy / "run")
    for later in [c for c in checkpoint_dirs(copy / "run") if int(c.rsplit("-", 1)[1]) > first]:
        shutil.rmtree(later)
    shutil.rmtree(copy / "run" / "final")
    _rewards_module(copy)
    _assert_ok(resumed := vlm_grpo(*flags, "--resume_from_checkpoint", cwd=copy))
    assert f"resuming from run/checkpoint-{first}" in resumed.stdout

    def timeless(records):
        return [{k: v for k, v in r.items() if k != "step_time"} for r in records if "loss" in r]

    assert timeless(_metrics(copy / "run")) == timeless(_metrics(out))
    assert _same(_weights(copy / "run" / "final"), _weights(out / "final"))


@pytest.mark.trains
def test_infinite_steps_in_a_row_stop_the_run_with_one_line_and_a_fixed_run_resumes(tmp_path):
    _rewards_module(tmp_path)
    proc = vlm_grpo(*NONFINITE, "--reward_funcs", "overflowing:overflow", "--max_nonfinite_steps", "2", cwd=tmp_path)
    assert proc.returncode == 65 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert _last_line(proc.stderr) == (
        "vlm-grpo: error: 2 step(s) in a row had a non-finite loss or gradient norm (steps 1-2; the last: loss inf, "
        "gradient norm nan) and were skipped, so training stops (--max_nonfinite_steps 2). The rewards of overflow "
        "reach 2e+38: a group of 2 sums past float32's 3.4e+38 (TRL keeps rewards as float32); scale the reward down. "
        "The newest complete checkpoint, run/checkpoint-1, is intact: fix this, then resume with "
        "--resume_from_checkpoint."
    )
    out = tmp_path / "run"
    assert [os.path.basename(c) for c in checkpoint_dirs(out)] == ["checkpoint-1"]  # none for the stopping step
    assert _same(_weights(out / "checkpoint-1"), load_file(out / "tiny-base" / "model.safetensors"))
    assert [r["nonfinite_steps"] for r in _metrics(out)] == [1.0]

    _assert_ok(resumed := vlm_grpo(*NONFINITE, "--reward_funcs", "overflowing:fixed", "--resume_from_checkpoint",
                                   cwd=tmp_path))  # fmt: skip
    assert "resuming from run/checkpoint-1" in resumed.stdout
    records = _metrics(out)
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]  # every step once
    assert [r.get("nonfinite_steps") for r in records if "loss" in r] == [1.0] * 6  # the count went on, no new skip
    assert all(_finite_weights(c) for c in checkpoint_dirs(out))


@pytest.mark.trains
def test_weights_an_update_makes_infinite_stop_the_run_before_anything_uses_them(tmp_path):
    proc = vlm_grpo(*NONFINITE[:-2], "--learning_rate", "1e39", "--save_steps", "2", cwd=tmp_path)  # > float32's max
    assert proc.returncode == 65 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert _last_line(proc.stderr) == (
        "vlm-grpo: error: The weights turned non-finite in step 1's optimizer update, from finite gradients: the "
        "learning rate (or adam_epsilon 0) overflows it; lower --learning_rate. Nothing of this step was saved."
    )
    assert checkpoint_dirs(tmp_path / "run") == []  # no checkpoint holds them (nor does a sampler read them)


# ----- rewards that fail

# Each misbehaves in training only (TRL passes `trainer_state`; the held-out evaluation before training does not), so
# a run resumed from checkpoint-2 fails at step 3.
BAD_REWARDS = """
def raises_on_blue(prompts, completions, answer, trainer_state=None, **kwargs):
    return [1.0 if a != "blue" or trainer_state is None else float("no score for " + a) for a in answer]


def too_few(prompts, completions, trainer_state=None, **kwargs):
    return [0.0] * (len(completions) - (trainer_state is not None))


def not_a_number(prompts, completions, trainer_state=None, **kwargs):
    return [{"score": 1.0} if trainer_state is not None else 0.0] * len(completions)
"""


@pytest.mark.trains
def test_a_reward_that_raises_names_itself_the_row_its_file_line_and_the_exception(tmp_path):
    (tmp_path / "img").mkdir()
    colours = {"red": (220, 30, 30), "green": (30, 180, 40), "blue": (30, 60, 220)}
    lines = []
    for i in range(12):
        name = list(colours)[i % 3]
        Image.new("RGB", (56, 56), colours[name]).save(tmp_path / "img" / f"{i}.png")
        lines.append({"prompt": f"Picture {i}: which colour?", "image": f"img/{i}.png", "answer": name})
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (tmp_path / "my_rewards.py").write_text(BAD_REWARDS)
    proc = vlm_grpo("--dataset", "data.jsonl", "--reward_funcs", "my_rewards:raises_on_blue", "--test_size", "0",
                    "--output_dir", "run", *TINY_RUN, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 70 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = _last_line(proc.stderr)
    said = re.fullmatch(
        r"vlm-grpo: error: Reward function 'raises_on_blue' raised ValueError: could not convert string to float: "
        r"'no score for blue' \(my_rewards.py line 3\) on row \d+ of the batch \(completion '.*'; prompt "
        r"'Picture (\d+): which colour\?'; data.jsonl line (\d+)\); fix the function, or return None for rows it "
        r"cannot score\.",
        line,
    )  # fmt: skip
    assert said, line
    picture, number = int(said.group(1)), int(said.group(2))
    assert number == picture + 1 and lines[picture]["answer"] == "blue"  # the file's own line for that row


@pytest.mark.trains
@pytest.mark.parametrize(
    "reward, message",
    [pytest.param("raises_on_blue", (r"raised ValueError: could not convert string to float: 'no score for blue' "
                                   r"\(my_rewards.py line 3\) on row \d+ of the batch \(completion '.*'; prompt "
                                   r"'What colour is the shape\?.*'\); fix the function"),
                  marks=pytest.mark.slow),  # with its resume: two runs
     ("too_few", (r"returned 3 values for 4 completions \(the first prompt: 'What colour is the shape\?.*'\); it "
                  r"must return one float \(or None\) per completion")),
     ("not_a_number", (r"returned \{'score': 1.0\} for row 0 of the batch \(completion '.*'; prompt 'What colour "
                       r"is the shape\?.*'\); rewards must be numbers or None\."))],
    ids=["raises", "wrong_length", "not_a_number"],
)  # fmt: skip
def test_a_failing_reward_stops_with_one_line_and_the_last_checkpoint_intact(tmp_path, uninterrupted, reward, message):
    out = _up_to(uninterrupted, tmp_path, 2)
    before = _tree(out)
    (tmp_path / "my_rewards.py").write_text(BAD_REWARDS)
    command = ["--output_dir", str(out), *RESUMABLE, "--resume_from_checkpoint"]
    proc = vlm_grpo(*command, "--reward_funcs", f"my_rewards:{reward}", cwd=tmp_path)
    assert proc.returncode == 70 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = _last_line(proc.stderr)
    assert re.fullmatch(
        rf"vlm-grpo: error: Reward function '{reward}' {message}.* The newest complete checkpoint, "
        rf"{out / 'checkpoint-2'}, is intact: fix this, then resume with --resume_from_checkpoint\.",
        line,
    ), line
    after = _tree(out)
    assert {k: v for k, v in after.items() if k.startswith("checkpoint-")} == {
        k: v for k, v in before.items() if k.startswith("checkpoint-")
    }  # the checkpoint as it was (metrics.jsonl was cut back to its step, as any resume does)
    assert after.keys() - {"."} <= before.keys() | {"tiny-base", "README.md"}
    if reward == "raises_on_blue":  # once fixed (the task's own reward again), the run goes on from that checkpoint
        _assert_ok(vlm_grpo(*command))
        _assert_continues(out, uninterrupted, resumed_from=2)
