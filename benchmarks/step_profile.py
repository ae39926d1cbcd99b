"""Where a whole GRPO step's time goes: host and device time per phase, from one profiled step.

Used by `grpo_step.py --profile_step N`: step N of each worker runs under torch.profiler and step N + 1 under cProfile.
The step's phases are the labelled ranges `grpo_step.py`'s trainer opens (`step.generation`, `step.rollout` (generation
and scoring), `step.logps` (each log-prob forward: reference log-probs while scoring, the policy's in the loss),
`step.rewards`, `step.loss`, `step.backward`, `step.optimizer`). For each phase it reports:
- host ms: the labelled range's wall time on the host (Python included);
- kernels and device busy ms: the kernels *launched* inside the range (matched to their launch by correlation id,
  so a kernel that runs after the range closed still counts for it) and the union of their intervals on the device;
- the kernels and the host operators (self time) that take the most time.
A phase whose device busy time is far under its host time is host-bound: the device waits for launches.
Writes `profile-<trainer>.md` and the cProfile top functions (`cprofile-<trainer>.txt`) to the output folder.
"""

from __future__ import annotations

import cProfile
import gzip
import io
import json
import os
import pstats
from collections import defaultdict
from typing import Any

PHASES = ("step.generation", "step.rollout", "step.logps", "step.rewards", "step.loss", "step.backward",
          "step.optimizer")  # fmt: skip
_DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total / 1e3


def summarise_trace(path: str, top: int = 12) -> dict[str, Any]:
    """Per-phase host time, kernel count, device busy time, top kernels and top host operators of a Chrome trace."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    ranges: dict[str, list[tuple[float, float]]] = defaultdict(list)
    launches: dict[int, float] = {}
    kernels, host_ops = [], defaultdict(list)
    for e in events:
        cat, start, dur = e.get("cat", ""), float(e["ts"]), float(e.get("dur", 0))
        if cat == "user_annotation" and e["name"] in PHASES:
            ranges[e["name"]].append((start, start + dur))
        elif cat in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):  # Inductor: the driver
            launches[e["args"]["correlation"]] = start
        elif cat in _DEVICE_CATEGORIES:
            kernels.append(e)
        elif cat == "cpu_op":
            host_ops[(e["pid"], e["tid"])].append(e)
    # Host operators' self time (their duration less their children's), per thread.
    self_times: list[tuple[float, str, float]] = []  # (start, name, self us)
    for ops in host_ops.values():
        ops.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        stack: list[list[Any]] = []  # [end, name, start, child time]
        for e in ops:
            start, end = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))
            while stack and stack[-1][0] <= start:
                done = stack.pop()
                self_times.append((done[2], done[1], done[0] - done[2] - done[3]))
            if stack:
                stack[-1][3] += end - start
            stack.append([end, e["name"], start, 0.0])
        for done in stack:
            self_times.append((done[2], done[1], done[0] - done[2] - done[3]))

    def inside(t: float, spans: list[tuple[float, float]]) -> bool:
        return any(a <= t <= b for a, b in spans)

    # A phase entered again inside itself (the reference's log-probs call the method again with the policy) is one span.
    for name, spans in ranges.items():
        merged: list[tuple[float, float]] = []
        for start, end in sorted(spans):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((start, end))
        ranges[name] = merged

    step_spans = [s for spans in ranges.values() for s in spans]
    summary: dict[str, Any] = {}
    for name in PHASES:
        spans = ranges.get(name)
        if not spans:
            continue
        mine = [k for k in kernels if inside(launches.get(k.get("args", {}).get("correlation"), -1.0), spans)]
        by_name: dict[str, list[float]] = defaultdict(list)
        for k in mine:
            by_name[k["name"]].append(float(k.get("dur", 0)))
        ops: dict[str, float] = defaultdict(float)
        for start, op, us in self_times:
            if inside(start, spans):
                ops[op] += us
        summary[name] = {
            "calls": len(spans),
            "host_ms": sum(b - a for a, b in spans) / 1e3,
            "kernels": len(mine),
            "device_busy_ms": _union_ms([(float(k["ts"]), float(k["ts"]) + float(k.get("dur", 0))) for k in mine]),
            "top_kernels": sorted(([n[:100], len(d), sum(d) / 1e3] for n, d in by_name.items()), key=lambda r: -r[2])[
                :top
            ],
            "top_host_ops": sorted(([n[:80], us / 1e3] for n, us in ops.items()), key=lambda r: -r[1])[:top],
        }
    if step_spans:
        summary["whole step"] = {
            "device_busy_ms": _union_ms([(float(k["ts"]), float(k["ts"]) + float(k.get("dur", 0))) for k in kernels]),
            "kernels": len(kernels),
        }
    return summary


def markdown(name: str, summary: dict[str, Any]) -> str:
    """The summary as a table of phases, then each phase's top kernels and host operators."""
    lines = [f"### {name}", "", "| phase | calls | host ms | kernels | device busy ms |", "|---|---|---|---|---|"]
    for phase, s in summary.items():
        lines.append(f"| {phase} | {s.get('calls', '')} | {s.get('host_ms', 0):.1f} | {s['kernels']} | "
                     f"{s['device_busy_ms']:.1f} |")  # fmt: skip
    for phase, s in summary.items():
        if "top_kernels" not in s:
            continue
        lines += ["", f"{phase}: top kernels (calls, device ms) and host operators (self ms)", "",
                  "| kernel | calls | ms | host operator | self ms |", "|---|---|---|---|---|"]  # fmt: skip
        for i in range(max(len(s["top_kernels"]), len(s["top_host_ops"]))):
            k = s["top_kernels"][i] if i < len(s["top_kernels"]) else ["", "", 0.0]
            o = s["top_host_ops"][i] if i < len(s["top_host_ops"]) else ["", 0.0]
            lines.append(f"| `{k[0]}` | {k[1]} | {k[2]:.1f} | `{o[0]}` | {o[1]:.1f} |")
    return "\n".join(lines) + "\n"


def profiling_callback(trainer_name: str, step: int, out_dir: str) -> Any:
    """A TrainerCallback that runs step `step` under torch.profiler and step `step + 1` under cProfile, writing
    `profile-<trainer>.md` / `.json` and `cprofile-<trainer>.txt` to `out_dir`. Step 1 (compiling, recording graphs,
    first launches: issue #48's first step) is only cProfiled, its host time by cumulative time, deeper listed."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import TrainerCallback

    class StepProfiler(TrainerCallback):
        def __init__(self) -> None:
            self.torch_profile = self.python_profile = None

        def on_step_begin(self, args, state, control, **kwargs):
            if step == 1 and state.global_step == 0:
                self.python_profile = cProfile.Profile()
                self.python_profile.enable()
            elif state.global_step + 1 == step:
                self.torch_profile = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                self.torch_profile.__enter__()
            elif state.global_step + 1 == step + 1 and step != 1:
                self.python_profile = cProfile.Profile()
                self.python_profile.enable()

        def on_step_end(self, args, state, control, **kwargs):
            if self.torch_profile is not None:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                self.torch_profile.__exit__(None, None, None)
                trace = os.path.join("/tmp", f"trace-{trainer_name}.json")
                self.torch_profile.export_chrome_trace(trace)
                self.torch_profile = None
                summary = summarise_trace(trace)
                with open(os.path.join(out_dir, f"profile-{trainer_name}.json"), "w") as f:
                    json.dump(summary, f, indent=1)
                with open(os.path.join(out_dir, f"profile-{trainer_name}.md"), "w") as f:
                    f.write(markdown(trainer_name, summary))
            elif self.python_profile is not None:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                self.python_profile.disable()
                text = io.StringIO()
                stats = pstats.Stats(self.python_profile, stream=text).sort_stats("tottime")
                stats.print_stats(40)
                stats.sort_stats("cumulative").print_stats(150 if step == 1 else 60)
                # who calls the hottest functions, and who walks the module tree (a walk per layer call is host time)
                stats.sort_stats("tottime").print_callers(12)
                stats.print_callers(r"named_modules|\(modules\)|\(train\)")
                name = f"cprofile-{trainer_name}{'-first' if step == 1 else ''}.txt"
                with open(os.path.join(out_dir, name), "w") as f:
                    f.write(text.getvalue())
                self.python_profile = None

    return StepProfiler()
