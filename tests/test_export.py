import os
import stat

import pytest
import torch
from safetensors.torch import save_file

from vlm_grpo.export import atomic_directory


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_atomic_directory_output_follows_the_umask(tmp_path, umask_022):
    target = tmp_path / "final"
    with atomic_directory(target) as tmp:
        save_file({"w": torch.zeros(2)}, os.path.join(tmp, "model.safetensors"))  # safetensors writes 0600
        with open(os.path.join(tmp, "config.json"), "w") as f:
            f.write("{}")
    assert stat.S_IMODE(target.stat().st_mode) == 0o755  # mkdtemp's 0700 must not leak
    assert stat.S_IMODE((target / "model.safetensors").stat().st_mode) == 0o644
    assert stat.S_IMODE((target / "config.json").stat().st_mode) == 0o644


def test_atomic_directory_replaces_the_old_version_and_keeps_it_on_failure(tmp_path):
    target = tmp_path / "final"
    with atomic_directory(target) as tmp:
        open(os.path.join(tmp, "a"), "w").close()
    with pytest.raises(RuntimeError), atomic_directory(target) as tmp:
        open(os.path.join(tmp, "b"), "w").close()
        raise RuntimeError("crash mid-write")
    assert sorted(os.listdir(target)) == ["a"] and sorted(os.listdir(tmp_path)) == ["final"]
