"""Shared fixtures: tiny offline VLMs built once per test session."""

from __future__ import annotations

import os

import pytest
import torch

# Two busy threads on a shared 2-core machine made steps 10-100x slower; tiny models need only one.
torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _trl_trains_here() -> bool:
    import trl
    from packaging.version import Version

    return torch.cuda.is_available() or Version(trl.__version__) >= Version("1.16")


# TRL 1.15 (the version Unsloth pins) has no CPU path for GRPO's log-probs; tests that run training steps are
# skipped there, and the trainer's own check (test_trainer.py) says so clearly to users.
TRL_TRAINS_HERE = _trl_trains_here()


def pytest_collection_modifyitems(config, items):
    if TRL_TRAINS_HERE:
        return
    skip = pytest.mark.skip(reason="TRL < 1.16 cannot run GRPO steps on CPU (Triton-only log-prob kernel)")
    for item in items:
        if "trains" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """`tiny_dir(family, **kwargs)` -> path of a tiny checkpoint, built once per (family, kwargs)."""
    from vlm_grpo.tiny import build_tiny_vlm

    cache: dict = {}

    def build(family: str, **kwargs) -> str:
        key = (family, tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in kwargs.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"tiny-{family}")
            cache[key] = build_tiny_vlm(family, out, **kwargs)
        return cache[key]

    return build
