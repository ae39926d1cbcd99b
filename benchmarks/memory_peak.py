"""What holds the GPU memory at a step's peak, by the code that allocated it (`grpo_step.py --memory_peak STEP`).

torch's allocator records every allocation and free with its Python stack while `_record_memory_history` is on. Over
one step this replays the trace, finds the moment the most memory was allocated, and groups the blocks alive then by
the innermost frame in our code, TRL, transformers or peft (`owner`), beside what was already allocated when the step
began (weights, optimizer state, caches kept across steps). Issue #49 asks where Qwen3.5's extra 8 GiB over TRL goes;
this is the table that says.

On torch 2.11 the recorder crashes a compiled block's backward under activation checkpointing (pytorch/pytorch#179536:
`SystemError: ... returned NULL without setting an exception`), which is how vlm-grpo trains: there, read
`grpo_step.py`'s peak by phase instead, or record with `compile_layers` off.
"""

from __future__ import annotations

from typing import Any

# Frames from these packages name an owner; the innermost such frame wins (torch's own frames say nothing useful).
_PACKAGES = ("vlm_grpo/", "/trl/", "/transformers/", "/peft/", "/benchmarks/")


def owner(frames: list[dict[str, Any]]) -> str:
    """The innermost frame of `frames` (innermost first, as torch records them) in one of `_PACKAGES`, as
    `package/file.py:function`; `other` when none is."""
    for frame in frames:
        name = frame.get("filename", "")
        for package in _PACKAGES:
            if package in name:
                short = package.strip("/") + "/" + name.split(package, 1)[1]
                return f"{short}:{frame.get('name', '?')}"
    return "other"


def peak_owners(snapshot: dict[str, Any], start_bytes: int, device: int = 0, top: int = 15) -> dict[str, Any]:
    """Replay `snapshot`'s trace for `device` (alloc / free_completed events) from `start_bytes` allocated when the
    recording began: the peak, and the bytes alive at it grouped by `owner`, largest first (`top` of them)."""
    traces = snapshot.get("device_traces", [])
    events = traces[device] if device < len(traces) else []
    live: dict[int, tuple[int, str]] = {}
    current = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for event in events:
        action, addr, size = event.get("action"), event.get("addr"), int(event.get("size", 0))
        if action == "alloc":
            live[addr] = (size, owner(event.get("frames") or []))
            current += size
            if current > peak:
                peak, at_peak = current, dict(live)
        elif action == "free_completed" and addr in live:
            current -= live.pop(addr)[0]
    groups: dict[str, int] = {}
    for size, who in at_peak.values():
        groups[who] = groups.get(who, 0) + size
    ranked = sorted(groups.items(), key=lambda item: -item[1])
    return {
        "peak_gib": (start_bytes + peak) / 2**30,
        "before_step_gib": start_bytes / 2**30,
        "owners": [(who, size / 2**30) for who, size in ranked[:top]],
        "others_gib": sum(size for _, size in ranked[top:]) / 2**30,
    }


def markdown(name: str, result: dict[str, Any]) -> str:
    """One trainer's table: what was alive at its step's peak."""
    lines = [f"\n{name}: {result['peak_gib']:.2f} GiB at the step's peak\n", "| allocated by | GiB |", "|---|---|",
             f"| (allocated before the step: weights, optimizer state, kept caches) | {result['before_step_gib']:.2f} |"]  # fmt: skip
    lines += [f"| {who} | {gib:.2f} |" for who, gib in result["owners"]]
    if result["others_gib"]:
        lines.append(f"| (the rest) | {result['others_gib']:.2f} |")
    return "\n".join(lines) + "\n"


def memory_peak_callback(step: int, sink: dict[str, Any]):
    """A trainer callback recording allocations over step `step` and putting `peak_owners` into `sink["result"]`."""
    import torch
    from transformers import TrainerCallback

    class MemoryPeak(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step + 1 == step:
                torch.cuda.synchronize()
                self.start = torch.cuda.memory_allocated()
                torch.cuda.memory._record_memory_history(max_entries=2_000_000)

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == step:
                torch.cuda.synchronize()
                snapshot = torch.cuda.memory._snapshot()
                torch.cuda.memory._record_memory_history(enabled=None)
                sink["result"] = peak_owners(snapshot, self.start, torch.cuda.current_device())

    return MemoryPeak()
