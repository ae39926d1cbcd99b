"""Soak benchmark: one long GRPO run, recording what drifts over thousands of steps (not a CI test).

    python benchmarks/soak.py                                   # tiny Qwen2.5-VL on CPU, 2000 steps
    python benchmarks/soak.py --steps 300 --compile_layers      # the layers compiled on CPU too (Dynamo recompiles)
    python benchmarks/soak.py --model qwen2.5-vl-3b --steps 200 # H100: the real architecture, random weights, 2x8

Per optimizer step it records the host's resident memory (RSS), the GPU's allocated and reserved memory (CUDA),
the step's wall time, Dynamo's compiled frames and graphs (a frame compiled after the first steps is a recompile)
and the fast generator's recorded CUDA graphs. It writes `<out>/soak.json` (every step, the settings, the checks)
and `<out>/soak.png` (the curves), and prints the checks of issue 50: RSS over steps 500-2000 (or the last 3/4 of a
shorter run) grows <= 5 %, no compile after step 10, the last 100 steps' median time within 10 % of steps 100-200's
(on a GPU, reserved memory flat after step 10). On a host shared with other jobs the wall time follows their load:
each step's CPU time and the load average are recorded beside it, and the time check is made on both.

The tiny model trains on the synthetic colour task (vlm_grpo.cli.task.synthetic_task); the real architecture on noise
images with a reward that differs within each group (benchmarks/real_arch.py builds the checkpoint, as
benchmarks/grpo_step.py does). Completions are sampled, so their lengths, and the step's shapes, vary from step to step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="tiny (CPU), or a benchmarks/real_arch.py name: qwen2.5-vl-3b ...")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: 2000 tiny, 200 real)")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (default: 4 tiny, 2 real)")
    p.add_argument("--num_generations", type=int, default=None, help="completions per prompt (default: 4 tiny, 8 real)")
    p.add_argument("--completion_length", type=int, default=None, help="most new tokens (default: 8 tiny, 256 real)")
    p.add_argument("--image_size", type=int, default=448, help="real architecture: side of the noise images")
    p.add_argument("--compile_layers", action="store_true", help="compile the layers on CPU too (GPU: the default)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (tiny)")
    p.add_argument("--checkpoint_dir", default="/tmp/vlm-grpo-bench", help="where models are built once")
    p.add_argument("--out", default="benchmarks/results/soak", help="folder for soak.json and soak.png")
    p.add_argument(
        "--max_seconds",
        type=float,
        default=None,
        help="stop after the step that passes this many seconds of training, and report what ran (a GPU "
        "call has a time limit: the H100's 200 steps of 256 tokens took about 560 s)",
    )
    args = p.parse_args(argv)
    tiny = args.model == "tiny"
    for name, small, real in (("steps", 2000, 200), ("prompts", 4, 2), ("num_generations", 4, 8),
                              ("completion_length", 8, 256)):  # fmt: skip
        if getattr(args, name) is None:
            setattr(args, name, small if tiny else real)
    return args


def _rss_bytes() -> int:
    """This process's resident set size, from /proc (Linux) or psutil."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # pragma: no cover
        import psutil

        return psutil.Process().memory_info().rss


def recorder(trainer_ref: dict, records: list, out: str | None = None, max_seconds: float | None = None):
    """A TrainerCallback appending one record per optimizer step to `records` and, as it goes, to `out/steps.jsonl`
    (a run cut off keeps every step it made); it stops training after the step that passes `max_seconds` (the
    trainer comes later, in `trainer_ref["trainer"]`: the fast generator's recordings live on it)."""
    import torch
    from torch._dynamo.utils import counters
    from transformers import TrainerCallback

    class SoakRecorder(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.train_start = time.perf_counter()
            if out is not None:
                open(os.path.join(out, "steps.jsonl"), "w").close()

        def on_step_begin(self, args, state, control, **kwargs):
            self.start, self.cpu_start = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            generator = getattr(trainer_ref.get("trainer"), "fast_generator", None)
            record = {
                "step": state.global_step,
                "seconds": time.perf_counter() - self.start,
                # This process's CPU time in the step: what the step costs on a host shared with other jobs, whose
                # load (the 1-minute load average, beside it) stretches the wall time.
                "cpu_seconds": time.process_time() - self.cpu_start,
                "load_avg": os.getloadavg()[0],
                "rss_mib": _rss_bytes() / 2**20,
                "compiled_frames": counters["frames"]["total"],
                "graphs": counters["stats"]["unique_graphs"],
                "cuda_graphs_recorded": getattr(getattr(generator, "_graphs", None), "recorded", 0),
            }
            if torch.cuda.is_available():
                record["allocated_mib"] = torch.cuda.memory_allocated() / 2**20
                record["reserved_mib"] = torch.cuda.memory_reserved() / 2**20
            records.append({k: round(v, 5) if isinstance(v, float) else v for k, v in record.items()})
            if out is not None:
                with open(os.path.join(out, "steps.jsonl"), "a") as f:
                    f.write(json.dumps(records[-1]) + "\n")
            if max_seconds is not None and time.perf_counter() - self.train_start > max_seconds:
                control.should_training_stop = True
            if state.global_step % 100 == 0 or state.global_step <= 3:
                print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in record.items()}),
                      flush=True)  # fmt: skip

    return SoakRecorder()


def _real_dataset(args):
    import numpy as np
    from datasets import Dataset
    from PIL import Image

    rng = np.random.default_rng(0)
    return Dataset.from_list(
        [{"prompt": [{"role": "user", "content": "Describe the image in detail ."}],
          "image": Image.fromarray(rng.integers(0, 256, (args.image_size,) * 2 + (3,), dtype=np.uint8))}
         for _ in range(64)]
    )  # fmt: skip


def _length_reward(prompts, completions, **kwargs):
    # Differs within a group (a completion's length), so every step has advantages and a real backward.
    return [float(len(str(c)) % 7) for c in completions]


def build_trainer(args, records: list):
    """The trainer a soak runs: the tiny model on the colour task (CPU), or a real architecture with LoRA (GPU)."""
    import torch
    from transformers import PrinterCallback

    from vlm_grpo import FastVisionModel, VLMGRPOConfig, VLMGRPOTrainer

    on_gpu = torch.cuda.is_available()
    common = dict(
        output_dir=os.path.join(args.checkpoint_dir, f"soak-{args.model}"), max_steps=args.steps,
        per_device_train_batch_size=args.prompts * args.num_generations, num_generations=args.num_generations,
        max_completion_length=args.completion_length, logging_steps=1, save_strategy="no", report_to="none", seed=0,
        disable_tqdm=True, use_cpu=not on_gpu, bf16=on_gpu,
    )  # fmt: skip
    if args.compile_layers:
        common["compile_layers"] = True
    ref: dict = {}
    if args.model == "tiny":
        from vlm_grpo.cli.task import synthetic_task
        from vlm_grpo.tiny import build_tiny_vlm

        torch.set_num_threads(args.threads)
        task = synthetic_task("color", train_size=64, test_size=1, seed=0)
        path = build_tiny_vlm("qwen2_5_vl", os.path.join(args.checkpoint_dir, "soak-tiny"), words=task.answer_words)
        model, processor = FastVisionModel.from_pretrained(path, full_finetuning=True)
        config = VLMGRPOConfig(**common, learning_rate=5e-4)
        rewards, data = task.reward_funcs, task.train
    else:
        from real_arch import build_checkpoint

        path = build_checkpoint(args.model, os.path.join(args.checkpoint_dir, args.model))
        model, processor = FastVisionModel.from_pretrained(path)
        model = FastVisionModel.get_peft_model(model, r=16, lora_alpha=16)
        config = VLMGRPOConfig(**common, learning_rate=1e-6)
        rewards, data = [_length_reward], _real_dataset(args)
    trainer = VLMGRPOTrainer(model, rewards, args=config, train_dataset=data, processing_class=processor,
                             callbacks=[recorder(ref, records, args.out, args.max_seconds)])  # fmt: skip
    ref["trainer"] = trainer
    trainer.remove_callback(PrinterCallback)  # a dict per step: the records say what matters here
    return trainer


def checks(records: list[dict], steps: int) -> dict:
    """Issue 50's acceptance checks on a soak's records (each None where the run is too short to say)."""

    def at(step: int) -> dict:
        return records[min(step, len(records)) - 1]

    start = 500 if steps >= 2000 else max(1, steps // 4)
    growth = at(steps)["rss_mib"] / at(start)["rss_mib"] - 1
    # The allocator hands memory back in steps (a sawtooth): the highest point after `start` says more than the end.
    peak = max(r["rss_mib"] for r in records[start - 1 : steps]) / at(start)["rss_mib"] - 1
    frames_after_10 = at(steps)["compiled_frames"] - at(10)["compiled_frames"] if steps > 10 else None
    # Step time flat: the last 100 steps against steps 100-200 (issue 50's CPU check); a run too short for that (the
    # GPU's 200 steps) compares its last quarter with its second quarter, past the first steps' compiles.
    if steps >= 300:
        early, late = [r for r in records if 100 < r["step"] <= 200], records[-100:]
    elif steps >= 20:
        early = [r for r in records if steps // 4 < r["step"] <= steps // 2]
        late = [r for r in records if r["step"] > steps - steps // 4]
    else:
        early = late = []

    def ratio(key: str) -> float | None:
        return statistics.median(r[key] for r in late) / statistics.median(r[key] for r in early) if early else None

    result = {
        "rss_window": [start, steps], "rss_growth": growth, "rss_peak_growth": peak, "rss_ok": max(growth, peak) <= 0.05,
        "compiles_after_step_10": frames_after_10, "compiles_ok": frames_after_10 == 0,
        "time_windows": [[early[0]["step"], early[-1]["step"]], [late[0]["step"], late[-1]["step"]]] if early else None,
        "late_over_early": ratio("seconds"), "cpu_late_over_early": ratio("cpu_seconds"),
        "time_ok": None if not early else abs(ratio("seconds") - 1) <= 0.10,
        "cpu_time_ok": None if not early else abs(ratio("cpu_seconds") - 1) <= 0.10,
    }  # fmt: skip
    if "reserved_mib" in records[0]:
        reserved = [r["reserved_mib"] for r in records if r["step"] > 10]
        result["reserved_growth_after_10_mib"] = max(reserved) - min(reserved) if reserved else None
    return result


def plot(records: list[dict], path: str, title: str) -> None:
    """Step time, RSS (and GPU memory) and compiles per step, one panel each, to a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    steps = [r["step"] for r in records]
    fig = Figure(figsize=(8, 7))
    FigureCanvasAgg(fig)
    time_ax, memory_ax, compile_ax = fig.subplots(3, 1, sharex=True)
    seconds = [r["seconds"] for r in records]
    time_ax.plot(steps, seconds, linewidth=0.4, color="C0", label="step time")
    median = [statistics.median(seconds[max(0, i - 50) : i + 1]) for i in range(len(seconds))]
    time_ax.plot(steps, median, color="C3", label="median of the last 50")
    cpu = [r["cpu_seconds"] for r in records]
    cpu_median = [statistics.median(cpu[max(0, i - 50) : i + 1]) for i in range(len(cpu))]
    time_ax.plot(steps, cpu_median, color="C2", label="CPU time, median of the last 50")
    time_ax.set_ylabel("seconds")
    time_ax.legend(fontsize=8)
    memory_ax.plot(steps, [r["rss_mib"] for r in records], label="host RSS")
    for key, label in (("allocated_mib", "GPU allocated"), ("reserved_mib", "GPU reserved")):
        if key in records[0]:
            memory_ax.plot(steps, [r[key] for r in records], label=label)
    memory_ax.set_ylabel("MiB")
    memory_ax.legend(fontsize=8)
    for key, label in (("compiled_frames", "Dynamo compiled frames"), ("graphs", "Dynamo graphs"),
                       ("cuda_graphs_recorded", "decode CUDA graphs recorded")):  # fmt: skip
        compile_ax.plot(steps, [r[key] for r in records], label=label)
    compile_ax.set_ylabel("count")
    compile_ax.set_xlabel("step")
    compile_ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    import peft
    import torch
    import transformers
    import trl

    args = parse_args(argv)
    if args.model != "tiny" and not torch.cuda.is_available():
        raise SystemExit("benchmarks/soak.py: a real architecture needs a CUDA GPU (--model tiny runs on CPU).")
    os.makedirs(args.out, exist_ok=True)
    records: list[dict] = []
    trainer = build_trainer(args, records)
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    env = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU",
           "torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
           "peft": peft.__version__, "threads": torch.get_num_threads()}  # fmt: skip
    result = {"args": vars(args), "env": env, "wall_seconds": wall, "checks": checks(records, len(records)),
              "steps": records}  # fmt: skip
    with open(os.path.join(args.out, "soak.json"), "w") as f:  # one line per step
        f.write(json.dumps({k: v for k, v in result.items() if k != "steps"}, indent=1)[:-2] + ',\n "steps": [\n')
        f.write(",\n".join(json.dumps(r) for r in records) + "\n ]\n}\n")
    title = f"soak: {args.model}, {len(records)} steps, {args.prompts}x{args.num_generations} on {env['device']}"
    plot(records, os.path.join(args.out, "soak.png"), title)
    print(json.dumps({"wall_seconds": round(wall), **result["checks"]}, indent=1), flush=True)


if __name__ == "__main__":
    main()
