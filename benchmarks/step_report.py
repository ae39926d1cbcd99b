"""`grpo_step.py`'s report: each trainer's step medians, and the table with the ratios vlm-grpo / TRL."""

from __future__ import annotations

import statistics


def summary(run: dict, args) -> dict:
    # `run["steps"]`: the warm-up step (compilation, allocator growth), then the measured ones; steps run under a
    # profiler are not timed.
    measured = [r for r in run["steps"][1:] if not r.get("profiled")] or run["steps"]
    tokens = args.prompts * args.num_generations * args.completion_length
    med = {
        k: statistics.median(r[k] for r in measured)
        for k in ("total_s", "generation_s", "scoring_s", "training_s", "peak_gib")
    }
    med["tokens_per_s"] = tokens / med["generation_s"] if med["generation_s"] else float("nan")
    med["peak_gib"] = max(r["peak_gib"] for r in run["steps"])  # the warm-up's included: it is where a run runs out
    # The measured steps' own: the first step can hold what later ones do not (compiles, the merge's GPU backup
    # while its pinned host copy is made, `engine.pinned_pool`).
    med["later_peak_gib"] = max(r["peak_gib"] for r in measured)
    med["warmup_s"] = run["steps"][0]["total_s"]
    med["ms_per_token"] = 1000 * med["generation_s"] / args.completion_length  # prefill included: an upper bound
    peak_step = max(run["steps"], key=lambda r: r["peak_gib"])
    med["peak_phases_gib"] = peak_step.get("peak_phases_gib") or {}  # the peakiest step's peak by phase
    later = [r.get("peak_phases_gib") or {} for r in measured]
    med["later_phases_gib"] = {k: max(p[k] for p in later if k in p) for k in {k for p in later for k in p}}
    # Every step's time, warm-up first: a median hides one slow step (a pause, a recompile) that the phases miss.
    med["step_times_s"] = [round(r["total_s"], 2) for r in run["steps"]]
    med["profiled_steps"] = [i for i, r in enumerate(run["steps"]) if r.get("profiled")]
    med["graphs"] = run.get("compiled_graphs", 0)
    med["steps"] = len(run["steps"])
    return med


def markdown(summaries: dict, args, env: dict, variants: dict) -> str:
    """The results table; `variants`: the vlm-grpo trainers, each compared with every baseline run."""
    media = (
        f"{args.video_frames}-frame clip of {args.image_size}x{args.image_size}"
        if args.video_frames
        else (f"{args.image_size}x{args.image_size} image")
    )
    head = (f"{args.model}, {media}, {args.prompts} prompts x {args.num_generations} "
            f"generations, {args.completion_length} new tokens, {'full' if args.full else 'LoRA r=16 all linear'}, "
            f"gradient checkpointing {'off' if args.no_gradient_checkpointing else 'on'}, "
            f"{'4-bit' if args.load_in_4bit else '8-bit' if args.load_in_8bit else 'bf16'}, beta {args.beta}"
            f"{f', GPU memory capped at {args.memory_cap_gib:g} GiB' if args.memory_cap_gib else ''}; "
            f"median of steps {args.warmup_steps + 1}..{args.steps} (TRL: {args.warmup_steps + 1}..{args.steps_trl or max(args.steps, args.warmup_steps + 3)})"
            f"{f', step {args.profile_step}+ profiled, not timed' if args.profile_step else ''}")  # fmt: skip
    versions = f"torch {env['torch']}, transformers {env['transformers']}, trl {env['trl']}, peft {env['peft']}"
    columns = ("| trainer | step s | generation s | scoring s | training s | gen tok/s | ms/token | peak GiB "
               "| peak GiB after the first step | warm-up step s | compiled graphs / steps |")  # fmt: skip
    lines = [head, "", f"GPU: {env['gpu']}; {versions}", "", columns,
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, s in summaries.items():
        lines.append(f"| {name} | {s['total_s']:.2f} | {s['generation_s']:.2f} | {s['scoring_s']:.2f} | "
                     f"{s['training_s']:.2f} | {s['tokens_per_s']:.0f} | {s['ms_per_token']:.1f} | {s['peak_gib']:.1f} | "
                     f"{s['later_peak_gib']:.1f} | {s['warmup_s']:.1f} | {s['graphs']} / {s['steps']} |")  # fmt: skip

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}" if b else "n/a"

    for mine in (n for n in summaries if n in variants):
        ours = summaries[mine]
        for base in ("trl", "trl-static", "trl-bf16", "vlm-grpo-off", "trl-vllm", "trl-vllm-blocked"):
            if base in summaries and base != mine:
                b = summaries[base]
                keys = (
                    "total_s",
                    "generation_s",
                    "scoring_s",
                    "training_s",
                    "tokens_per_s",
                    "ms_per_token",
                    "peak_gib",
                    "later_peak_gib",
                )
                lines.append(f"| ratio {mine} / {base} | " + " | ".join(ratio(ours[k], b[k]) for k in keys) + " | | |")
    if any(s["peak_phases_gib"] for s in summaries.values()):  # where each trainer's peak falls
        lines += ["", "| trainer | peak GiB in generation | in scoring | in training |", "|---|---|---|---|"]
        for name, s in summaries.items():
            p = s["peak_phases_gib"]
            lines.append(f"| {name} | " + " | ".join(f"{p[k]:.1f}" if k in p else "" for k in ("generation", "scoring", "training")) + " |")  # fmt: skip
        lines += ["", "| trainer | after the first step: peak GiB in generation | in scoring | in training |",
                  "|---|---|---|---|"]  # fmt: skip
        for name, s in summaries.items():
            p = s["later_phases_gib"]
            lines.append(f"| {name} | " + " | ".join(f"{p[k]:.1f}" if k in p else "" for k in ("generation", "scoring", "training")) + " |")  # fmt: skip
    lines += ["", "| trainer | every step s, the warm-up first (* under the profiler) |", "|---|---|"]
    for name, s in summaries.items():
        marked = (f"{t:.2f}{'*' if i in s.get('profiled_steps', ()) else ''}" for i, t in enumerate(s["step_times_s"]))
        lines.append(f"| {name} | {' '.join(marked)} |")
    return "\n".join(lines) + "\n"


def failure_line(stderr: str) -> str:
    """The line that says why a worker failed: its last error line, not a warning printed at exit."""
    if "OutOfMemoryError" in stderr:
        return "out of memory"
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line and "Warning" not in line]
    return (errors or lines or ["no output"])[-1][-200:]
