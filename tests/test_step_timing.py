"""`benchmarks/step_timing.py`'s compile report: which compiled frame a first step's compile went to (issue #48), read
from a real `torch.compile` in this process, and `cold_start.py`'s table of them."""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import cold_start
from step_timing import compile_frames


def _scaled_tanh(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x * w).sum()


def test_each_compiled_frame_is_reported_with_its_time():
    torch._dynamo.reset()
    compiled = torch.compile(_scaled_tanh)
    w = torch.randn(8, requires_grad=True)
    compiled(torch.randn(8) + 0.123, w).backward()  # the backward compiles on its first call
    frames = [f for f in compile_frames(least=0.0) if f["frame"].endswith(" _scaled_tanh")]
    assert frames, compile_frames(least=0.0)
    frame = frames[-1]
    assert frame["frame"].startswith("test_step_timing.py:")
    assert frame["compile_s"] > 0 and frame["compile_s"] >= frame["backend_s"] >= 0
    assert frame["graph_ops"] and frame["graph_ops"] >= 2  # mul, tanh, sum
    assert all(f["compile_s"] >= 1e6 for f in compile_frames(least=1e6)) and not compile_frames(least=1e6)


def test_cold_start_table_lists_the_largest_compiles_first():
    frame = {"frame": "decoder.py:10 forward", "compile_s": 3.0, "inductor_s": 2.0, "code_gen_s": 1.5, "triton_s": 0.5,
             "graph_ops": 40, "backward": False}  # fmt: skip
    row = {"run": "fresh", "trainer": "vlm-grpo", "first_s": 9.0, "generation_s": 5.0, "scoring_s": 1.0,
           "training_s": 3.0, "load_s": 1.0, "next_s": 1.0, "compiled_graphs": 2, "compile_s": {},
           "compile_frames": [frame, {**frame, "frame": "layer.py:5 forward", "compile_s": 7.0, "backward": True}]}  # fmt: skip
    report = cold_start.markdown([row], argparse.Namespace(model="tiny"), None)
    lines = [line for line in report.splitlines() if "forward` |" in line]
    assert lines[0].startswith("| fresh | vlm-grpo | `layer.py:5 forward` | yes | 7.0 |")
    assert lines[1].startswith("| fresh | vlm-grpo | `decoder.py:10 forward` |  | 3.0 | 2.0 | 1.5 | 0.5 | 40 |")
