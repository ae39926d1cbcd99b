"""`benchmarks/memory_peak.py`: a step's peak memory grouped by the code that allocated it, from torch's allocator
trace (a trace written here in torch's snapshot format; the GPU run records a real one)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from memory_peak import markdown, owner, peak_owners


def _frames(*where):
    return [{"filename": f, "line": 1, "name": n} for f, n in where]


TORCH = ("/usr/lib/python3/site-packages/torch/nn/modules/linear.py", "forward")
CACHE = ("/repo/vlm_grpo/engine/decode_cache.py", "allocate")
LOGITS = ("/site-packages/transformers/models/qwen3_5/modeling_qwen3_5.py", "forward")


def test_the_innermost_frame_of_ours_or_a_library_names_the_owner():
    assert owner(_frames(TORCH, CACHE, LOGITS)) == "vlm_grpo/engine/decode_cache.py:allocate"
    assert owner(_frames(TORCH, LOGITS)) == "transformers/models/qwen3_5/modeling_qwen3_5.py:forward"
    assert owner(_frames(TORCH)) == "other"


def test_the_blocks_alive_at_the_peak_are_grouped_and_freed_ones_left_out():
    gib = 2**30
    trace = [
        {"action": "alloc", "addr": 1, "size": 2 * gib, "frames": _frames(TORCH, CACHE)},
        {"action": "alloc", "addr": 2, "size": 3 * gib, "frames": _frames(LOGITS)},
        {"action": "free_completed", "addr": 2, "size": 3 * gib},  # gone before the peak
        {"action": "alloc", "addr": 3, "size": 4 * gib, "frames": _frames(LOGITS)},
        {"action": "alloc", "addr": 4, "size": 1 * gib, "frames": _frames(CACHE)},  # the peak: 2 + 4 + 1
        {"action": "free_completed", "addr": 3, "size": 4 * gib},
        {"action": "alloc", "addr": 5, "size": 1 * gib, "frames": _frames(TORCH)},
    ]
    result = peak_owners({"device_traces": [trace]}, start_bytes=5 * gib, top=1)
    assert result["peak_gib"] == 12 and result["before_step_gib"] == 5
    assert result["owners"] == [("transformers/models/qwen3_5/modeling_qwen3_5.py:forward", 4.0)]
    assert result["others_gib"] == 3.0  # the decode cache's two blocks, below the top 1
    table = markdown("vlm-grpo", result)
    assert "12.00 GiB at the step's peak" in table and "| (the rest) | 3.00 |" in table
