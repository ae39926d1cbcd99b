"""The README's quickstart runs as pasted, and its commands match what CI runs."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


@pytest.mark.trains
def test_quickstart_runs_as_pasted(tmp_path, monkeypatch):
    code = re.search(r"## Quickstart\s+```python\n(.*?)```", _readme(), re.DOTALL).group(1)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(code, "README-quickstart", "exec"), namespace)  # noqa: S102  (the README's code, run as pasted)
    trainer = namespace["trainer"]
    assert trainer.state.global_step == 5
    assert (tmp_path / "runs" / "quickstart" / "merged" / "config.json").exists()


def test_ci_runs_the_readme_test_command():
    commands = re.search(r"```bash\n(.*?)```", _readme(), re.DOTALL).group(1)
    test_command = next(line for line in commands.splitlines() if "pytest" in line)
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = f.read()
    assert re.search(r"pip install (-q )?torch==2\.13\.0", ci)
    assert "python -m pytest -q" in test_command and "python -m pytest -q" in ci
