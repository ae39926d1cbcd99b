"""`benchmarks/cold_start.py`: a fresh run on empty caches, then a cached one on the caches it filled, each worker a
new process, on the tiny model (CPU); a folder whose caches are not empty is refused (the run would not be fresh)."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import cold_start


@pytest.mark.trains
def test_fresh_then_cached_first_steps_on_their_own_caches(tmp_path):
    out = tmp_path / "cold"
    cold_start.main(["--model", "tiny", "--out", str(out), "--no_trl", "--completion_length", "8"])
    table = json.loads((out / "cold_start.json").read_text())["rows"]
    rows = {(r["run"], r["trainer"]): r for r in table}
    assert set(rows) == {("fresh", "vlm-grpo"), ("cached", "vlm-grpo")}
    for row in rows.values():
        assert row["first_s"] > 0 and row["next_s"] is not None
        assert abs(row["first_s"] - row["generation_s"] - row["scoring_s"] - row["training_s"]) < 1e-6
    assert sorted(os.listdir(out / "caches")) == ["cuda", "inductor", "triton", "vlm_grpo"]
    assert "| cached | vlm-grpo |" in (out / "cold_start.md").read_text()


def test_caches_left_from_an_earlier_run_are_refused(tmp_path):
    (tmp_path / "caches" / "inductor").mkdir(parents=True)
    (tmp_path / "caches" / "inductor" / "entry").write_text("x")
    with pytest.raises(SystemExit, match="not be fresh"):
        cold_start.main(["--model", "tiny", "--out", str(tmp_path)])
