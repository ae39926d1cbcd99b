"""First-step time with no compile cache anywhere, then with the cache the first run left: one invocation, one table.

    python benchmarks/cold_start.py --model qwen2.5-vl-3b --out /tmp/cold              # 3B 2x8, beside TRL
    python benchmarks/cold_start.py --model qwen3.5-4b --out /tmp/cold-q35
    python benchmarks/cold_start.py --model tiny --out /tmp/cold-tiny                  # the CPU smoke run

Issue #48 asks for a first step of <= 30 s on a fresh machine and <= 10 s with the cache of an earlier process. A
machine is fresh for this when every cache a compilation reads is empty: Inductor's (`TORCHINDUCTOR_CACHE_DIR`),
Triton's (`TRITON_CACHE_DIR`), CUDA's JIT cache (`CUDA_CACHE_PATH`) and vlm-grpo's portable compile cache
(`VLM_GRPO_CACHE`). Each run here is a `grpo_step.py` invocation (its workers are fresh processes) with those four
pointed at folders under `--out`:

1. `fresh`: the folders new and empty; vlm-grpo, then TRL (which compiles nothing, so its first step is its own).
2. `cached`: a new process on the folders run 1 filled (what a second job on the machine, or a resumed one that
   carries `checkpoint-N/compile_cache/`, finds).
3. With `--precompiled`, on new empty folders: `shallow` (the model cut to one layer of each kind, TRL's generation
   path: only the training layers compile, one graph per layer class whatever the depth), then `precompiled` (the
   full model on what `shallow` left). On CPU (`precompile_probe.py`, tiny Qwen2.5-VL, compiled layers) the full
   model's step loaded all 6 of its training graphs from Inductor's cache after a one-layer run with another task and
   completion length: 3.5 s against 22.0 s on empty caches. With another batch size it loaded 2 of 6.

The table gives each run's first step split into generation, scoring and training (where compilation lands: the
decode step in generation, the training layers in training), the model load, one later step for scale, and the
worker's time in torch.compile by part (Dynamo's `compile_times`: its trace, AOTAutograd with Inductor, loads from
Inductor's cache, the Triton kernels' builds; every part over 0.1 s is in the worker's JSON, `compile_s`).
Results: `<out>/cold_start.json` and `<out>/cold_start.md`; each run's own report under `<out>/<run>/`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CACHES = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton", "CUDA_CACHE_PATH": "cuda",
          "VLM_GRPO_CACHE": "vlm_grpo"}  # fmt: skip


def _run(
    name: str,
    trainers: str,
    args: argparse.Namespace,
    forwarded: list[str],
    model: str | None = None,
    caches: str = "caches",
) -> dict:
    """One `grpo_step.py` invocation with the caches under `<out>/<caches>`; its results.json, and its wall time."""
    out = os.path.join(args.out, name)
    env = dict(os.environ)
    for variable, folder in CACHES.items():
        env[variable] = os.path.join(args.out, caches, folder)
        os.makedirs(env[variable], exist_ok=True)
    cmd = [sys.executable, os.path.join(HERE, "grpo_step.py"), "--model", model or args.model, "--trainers", trainers,
           "--steps", "2", "--steps_trl", "2", "--rounds", "1", "--out", out, *forwarded]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    print(f"[{name}] exit {proc.returncode} in {time.perf_counter() - start:.0f} s", flush=True)
    if proc.returncode != 0:
        print(proc.stdout[-2000:], proc.stderr[-4000:], flush=True)
    path = os.path.join(out, "results.json")
    results = {"runs": {}, "failures": {}}
    if os.path.exists(path):
        with open(path) as f:
            results = json.load(f)
    return {"wall_s": time.perf_counter() - start, "rc": proc.returncode, "results": results}


def rows(runs: dict) -> list[dict]:
    """One row per (run, trainer): the first step's parts, the load, and the step after it."""
    table = []
    for name, run in runs.items():
        for trainer, worker_runs in run["results"].get("runs", {}).items():
            if not worker_runs:
                continue
            steps, worker = worker_runs[0]["steps"], worker_runs[0]
            first = steps[0]
            table.append({"run": name, "trainer": trainer, "first_s": first["total_s"],
                          "generation_s": first["generation_s"], "scoring_s": first["scoring_s"],
                          "training_s": first["training_s"], "load_s": worker.get("load_s"),
                          "next_s": steps[1]["total_s"] if len(steps) > 1 else None,
                          "waited_s": next((s["background_compile_wait_s"] for s in steps
                                            if "background_compile_wait_s" in s), None),
                          "compiled_graphs": worker.get("compiled_graphs"),
                          # training layers ahead of time: loaded / compiled in the trainer, and why not as planned
                          "ahead_of_time": worker.get("ahead_of_time") or {},
                          "compile_s": worker.get("compile_s") or {},
                          "compile_frames": worker.get("compile_frames") or []})  # fmt: skip
        for trainer, why in run["results"].get("failures", {}).items():
            table.append({"run": name, "trainer": trainer, "failed": why})
    return table


# Dynamo's compile timers (`step_timing.compile_seconds`) the table splits a run's compiling into.
COMPILE_PARTS = ("_compile.compile_inner", "bytecode_tracing", "create_aot_dispatcher_function",
                 "AOTAutogradCache.inductor_load", "async_compile.wait")  # fmt: skip


def _compiling(seconds: dict) -> str:
    """`all / trace / AOT + Inductor / cache loads / Triton builds` seconds of one worker (`-` for a part not timed)."""
    return " / ".join(f"{seconds[part]:.1f}" if part in seconds else "-" for part in COMPILE_PARTS)


def _ahead(counts: dict) -> str:
    """`loaded / compiled` ahead-of-time functions of one worker (blank where it recorded none)."""
    if counts.get("loaded") is None:
        return ""
    return f"{counts['loaded']} / {counts['compiled']}"


def markdown(table: list[dict], args: argparse.Namespace, env: dict | None) -> str:
    head = (f"{args.model}, 2 prompts x 8 generations (grpo_step.py's defaults unless forwarded); "
            f"GPU: {(env or {}).get('gpu', '?')}; torch {(env or {}).get('torch', '?')}")  # fmt: skip
    lines = [head, "",
             ("| run | trainer | first step s | generation s | scoring s | training s | load s | next step s (+ s waited for a compile process) | compiled graphs "
              "| ahead-of-time layers: loaded / compiled here | compiling s: all / Dynamo's trace / AOTAutograd + Inductor / cache loads / Triton builds |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in table:
        if "failed" in r:
            lines.append(f"| {r['run']} | {r['trainer']} | failed: {r['failed']} |")
            continue
        nxt = f"{r['next_s']:.2f}" if r["next_s"] is not None else ""
        nxt += f" (+{r['waited_s']:.1f} waited)" if r.get("waited_s") else ""  # for another process's compile
        lines.append(f"| {r['run']} | {r['trainer']} | {r['first_s']:.1f} | {r['generation_s']:.1f} | "
                     f"{r['scoring_s']:.1f} | {r['training_s']:.1f} | {r['load_s']:.1f} | {nxt} | "
                     f"{r['compiled_graphs']} | {_ahead(r.get('ahead_of_time') or {})} | "
                     f"{_compiling(r.get('compile_s') or {})} |")  # fmt: skip
    events = [(r["run"], r["trainer"], e) for r in table for e in (r.get("ahead_of_time") or {}).get("events") or []]
    if events:  # why a layer was not served as planned (a refused load, a failed process, a compile given up)
        lines += ["", "| run | trainer | ahead-of-time layers: not as planned |", "|---|---|---|"]
        lines += [f"| {run} | {trainer} | {event.replace('|', '/')} |" for run, trainer, event in events]
    frames = [(r["run"], r["trainer"], f) for r in table for f in r.get("compile_frames") or []]
    if frames:  # which graph each run's compile time went to, the largest first
        lines += ["", "| run | trainer | compiled frame | backward | all s | Inductor s | code generation s | Triton s | ops |",
                  "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for run, trainer, f in sorted(frames, key=lambda x: -x[2]["compile_s"])[:12]:
            lines.append(f"| {run} | {trainer} | `{f['frame']}` | {'yes' if f.get('backward') else ''} | "
                         f"{f['compile_s']:.1f} | {f['inductor_s']:.1f} | {f['code_gen_s']:.1f} | "
                         f"{f.get('triton_s', 0.0):.1f} | {f.get('graph_ops') or ''} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-vl-3b")
    parser.add_argument("--out", required=True, help="a new folder: its caches/ must start empty for `fresh`")
    parser.add_argument("--no_trl", action="store_true", help="leave TRL's first step out of the fresh run")
    parser.add_argument("--trainer", default="vlm-grpo", help="the vlm-grpo variant started (grpo_step.py's trainers, "
                        "e.g. vlm-grpo-layers)")  # fmt: skip
    parser.add_argument("--precompiled", action="store_true",
                        help="two more runs on caches of their own: `shallow`, the model cut to one layer of each kind "
                        "(real_arch.py's `-shallow`) on TRL's generation path, so that only the training layers "
                        "compile; then `precompiled`, the full model on what it left (issue #48: what a background "
                        "compile of the training layers during the first generation would save)")  # fmt: skip
    args, forwarded = parser.parse_known_args(argv)  # the rest goes to grpo_step.py (e.g. --image_size 896)
    if os.path.isdir(os.path.join(args.out, "caches")) and any(
        os.listdir(os.path.join(args.out, "caches", folder)) for folder in os.listdir(os.path.join(args.out, "caches"))
    ):
        raise SystemExit(f"{args.out}/caches is not empty, so the first run would not be fresh: give a new --out.")
    runs = {"fresh": _run("fresh", args.trainer if args.no_trl else f"{args.trainer},trl", args, forwarded)}
    runs["cached"] = _run("cached", args.trainer, args, forwarded)
    if args.precompiled:  # the training layers compiled on a one-layer copy first, in empty caches of their own
        runs["shallow"] = _run("shallow", "vlm-grpo-plain", args, forwarded, args.model + "-shallow", "caches-pre")
        runs["precompiled"] = _run("precompiled", args.trainer, args, forwarded, caches="caches-pre")
    env = runs["fresh"]["results"].get("env")
    table = rows(runs)
    report = markdown(table, args, env)
    with open(os.path.join(args.out, "cold_start.json"), "w") as f:
        json.dump({"args": vars(args), "forwarded": forwarded, "env": env, "rows": table,
                   "wall_s": {name: run["wall_s"] for name, run in runs.items()}}, f, indent=1)  # fmt: skip
    with open(os.path.join(args.out, "cold_start.md"), "w") as f:
        f.write(report)
    print(report, flush=True)


if __name__ == "__main__":
    main()
