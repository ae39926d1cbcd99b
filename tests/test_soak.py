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
