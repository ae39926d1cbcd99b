"""`benchmarks/soak.py`: every step is on disk as it is made (a run cut off by a time limit keeps its steps), and
`--max_seconds` ends the run after the step that passes it, with the report written."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import soak


@pytest.mark.trains
def test_max_seconds_stops_the_soak_with_every_step_written_as_it_went(tmp_path):
    out = tmp_path / "soak"
    soak.main(["--steps", "2000", "--max_seconds", "2", "--out", str(out), "--checkpoint_dir", str(tmp_path / "m")])
    streamed = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    report = json.loads((out / "soak.json").read_text())
    assert 1 <= len(streamed) < 2000 and [r["step"] for r in streamed] == list(range(1, len(streamed) + 1))
    assert report["steps"] == streamed and (out / "soak.png").exists()


def _records(seconds: list[float]) -> list[dict]:
    return [{"step": i + 1, "seconds": s, "cpu_seconds": s, "rss_mib": 100.0, "compiled_frames": 4,
             "reserved_mib": 10.0} for i, s in enumerate(seconds)]  # fmt: skip


def test_a_gpu_length_soak_compares_its_last_quarter_with_its_second():
    # 200 steps (the GPU soak) is too short for steps 100-200 against the last 100: quarters 51-100 and 151-200.
    flat = soak.checks(_records([20.0] + [2.0] * 199), 200)
    assert flat["time_windows"] == [[51, 100], [151, 200]] and flat["late_over_early"] == 1.0 and flat["time_ok"]
    slowing = soak.checks(_records([20.0] + [2.0] * 149 + [2.5] * 50), 200)
    assert slowing["late_over_early"] == 1.25 and slowing["time_ok"] is False
    long = soak.checks(_records([2.0] * 300 + [2.1] * 100), 400)
    assert long["time_windows"] == [[101, 200], [301, 400]] and long["time_ok"]
    assert soak.checks(_records([2.0] * 10), 10)["time_ok"] is None
