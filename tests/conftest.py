"""Shared fixtures: tiny offline VLMs built once per test session."""

from __future__ import annotations

import os

import pytest
import torch

# Two busy threads on a shared 2-core machine made steps 10-100x slower; tiny models need only one.
torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
