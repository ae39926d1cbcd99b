"""Modules that moved into packages (design pass 4) still import from their old paths, as the modules they moved to,
with a DeprecationWarning naming the new path; the folder holds at most 10 modules beside its packages."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

import vlm_grpo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("old", sorted(vlm_grpo._MOVED))
def test_an_old_path_imports_the_module_it_moved_to_and_says_where(old):
    new = vlm_grpo._MOVED[old]
    code = (f"import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            f"try:\n    import {old}\nexcept DeprecationWarning as e:\n    print(e)\n")  # fmt: skip
    said = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert said.startswith(f"{old} moved to {new}: import it from there")
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)


def test_the_package_folder_holds_at_most_ten_modules_beside_its_packages():
    folder = os.path.join(ROOT, "vlm_grpo")
    modules = [f for f in os.listdir(folder) if f.endswith(".py")]
    assert len(modules) <= 10, sorted(modules)
    assert all(not os.path.exists(os.path.join(folder, old.split(".", 1)[1] + ".py")) for old in vlm_grpo._MOVED)


def test_the_command_runs_as_a_module_and_as_its_console_script():
    for cmd in ([sys.executable, "-m", "vlm_grpo.cli", "--help"], ["vlm-grpo", "--help"]):
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=True).stdout
        assert out.startswith("usage: vlm-grpo")
