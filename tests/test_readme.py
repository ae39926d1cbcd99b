"""The README's quickstart runs as pasted, and its commands match what CI runs."""

import os
import re
import stat
import warnings

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


@pytest.mark.trains
def test_quickstart_runs_as_pasted(tmp_path, monkeypatch, capsys):
    code = re.search(r"## Quickstart\s+```python\n(.*?)```", _readme(), re.DOTALL).group(1)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.filterwarnings("always", message=".*pin_memory.*")  # shown however often it came before
        exec(compile(code, "README-quickstart", "exec"), namespace)  # noqa: S102  (the README's code, run as pasted)
    trainer = namespace["trainer"]
    assert trainer.state.global_step == 5
    assert (tmp_path / "runs" / "quickstart" / "merged" / "config.json").exists()
    # Quiet: no pin_memory warning on a CPU, no dict of training results printed, only the bar.
    assert not [w for w in caught if "pin_memory" in str(w.message)]
    output = capsys.readouterr()
    assert "{'train_runtime'" not in output.out + output.err and "{'loss'" not in output.out + output.err
    # Its result printed; transformers' loading and writing bars off (the training bar is the one bar).
    assert re.search(r"held-out accuracy: \d\.\d\d before, \d\.\d\d after 5 steps", output.out)
    assert "Loading weights" not in output.err and "Writing model shards" not in output.err
    # Nothing written that was not asked for: no checkpoint-5/ (issue 46), and so no model card beside it.
    assert sorted(p.name for p in (tmp_path / "runs" / "quickstart").iterdir()) == ["merged", "tiny-base"]
    # The tiny model is written where the quickstart says, not left in a private temporary directory.
    weights = tmp_path / "runs" / "quickstart" / "tiny-base" / "model.safetensors"
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(weights.stat().st_mode) == 0o666 & ~umask


def test_setup_takes_a_newcomer_from_clone_to_the_demo():
    setup = re.search(r"```bash\n(.*?)```", _readme(), re.DOTALL).group(1)
    assert "git clone" in setup and "cd vlm-grpo" in setup and "python3 -m venv .venv" in setup
    assert "Python >= 3.10" in setup and "pip install -e ." in setup and "vlm-grpo --output_dir runs/demo" in setup
    with open(os.path.join(ROOT, "setup.cfg")) as f:
        assert "python_requires = >=3.10" in f.read()
    # A machine without a GPU: PyTorch's CPU wheel index, as PyTorch's install instructions give it, as a command of
    # the setup block (issue 46: it was only in the prose under a block that installed the CUDA build).
    cpu = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    assert any(line.startswith(cpu) for line in setup.splitlines())
    # Every output the command writes is listed, tiny-base/ too (cli.py's "wrote ..." line names the same).
    outputs = _readme()[_readme().index("| output | what it is |") :].split("\n\n")[0]
    for name in ("metrics.jsonl", "reward_curve.png", "eval.json", "final/", "tiny-base/"):
        assert f"| `{name}` |" in outputs


def test_ci_runs_the_readme_test_command():
    commands = re.search(r"```bash\n(.*?)```", _readme(), re.DOTALL).group(1)
    test_commands = [line for line in commands.splitlines() if "python -m pytest" in line]
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = f.read()
    assert re.search(r"pip install (-q )?torch==2\.13\.0", ci)
    assert [c[c.index("python -m pytest") :].strip() for c in test_commands] == [
        'python -m pytest -q -n 2 -m "not slow" --durations=20',  # the main suite
        "python -m pytest -q -n 2 -m slow --durations=10",  # the slow tier: nothing is left out of CI
    ]
    for command in test_commands:
        assert f"\n{command[command.index('python -m pytest') :].strip()}\n" in ci


def test_the_readme_lists_every_tiny_model_name():
    from vlm_grpo.families import model_types

    names = model_types(lambda family: family.tiny)
    assert len(names) >= 10
    for name in names:
        assert f"`tiny:{name}`" in _readme(), name
