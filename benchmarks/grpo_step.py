"""GRPO step benchmark: vlm-grpo against plain TRL on the same model, data and config.

    python benchmarks/grpo_step.py --model qwen2.5-vl-3b --image_size 448 --steps 3
    python benchmarks/grpo_step.py --model qwen2.5-vl-3b --image_size 896 --load_in_4bit
    python benchmarks/grpo_step.py --model qwen2.5-vl-3b --image_size 448 --video_frames 16   # clips, see below
    python benchmarks/grpo_step.py --model qwen2.5-vl-3b --tools 2 --completion_length 64    # 2 crop calls a rollout

Runs each trainer in its own process (so neither inherits the other's CUDA caches or compiled graphs),
alternating: `vlm-grpo` (VLMGRPOTrainer with FastVisionModel, its defaults), `trl` (trl.GRPOTrainer
as users get it) and `trl-static` (trl.GRPOTrainer with cache_implementation="static", TRL's best
setting for generation). The model is a real architecture with random weights (benchmarks/real_arch.py);
completions are forced to `--completion_length` tokens with min_new_tokens so every trainer generates
the same amount. Per step it records wall time split into generation / scoring (old and reference
log-probs, rewards) / training (forward, backward, optimizer), generated tokens per second and peak GPU
memory; the first step is warm-up and excluded; medians are reported with ratios vlm-grpo / TRL.
Writes `<out>/results.json` and `<out>/results.md`.

With `--video_frames N` every prompt holds an N-frame clip of `--image_size`² noise frames instead of an image (the
video processor's budget applies). TRL cannot take video, so the comparison is vlm-grpo against itself with both
fast paths off (`vlm-grpo-off`: TRL's `model.generate` and TRL's per-row forward, with the clips passed beside it);
those two are the default trainers then.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import forced_tools  # benchmarks/ is on the path from here
from inductor_settings import apply_inductor_settings
from step_report import failure_line

TRAINERS = ("vlm-grpo", "trl", "trl-static", "vlm-grpo-host", "vlm-grpo-unpacked", "vlm-grpo-unmerged", "vlm-grpo-plain",
            "vlm-grpo-light", "trl-bf16", "vlm-grpo-off")  # fmt: skip
# Rollouts through vLLM (colocate, 0.3 of the GPU, as TRL documents it): TRL's own path, TRL's with the pad tokens kept
# out through `generation_kwargs` as a user would (its path does not block them: a sampled one crashes scoring), and
# ours (`use_vllm=True`). Not in the default set: they need vLLM installed (pip install 'vlm-grpo[vllm]').
VLLM_TRAINERS = ("vlm-grpo-vllm", "trl-vllm", "trl-vllm-blocked")
VLLM_SETTINGS = {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3,
                 "vllm_max_model_length": 4096}  # fmt: skip
VIDEO_TRAINERS = ("vlm-grpo", "vlm-grpo-off")
# vlm-grpo variants: the default (fast generation with LoRA merged while generating), the base weights kept in host
# memory while merged (no GPU copy; fast_generation_merge_backup="host"), the vision tower attending window by window
# (packed_vision_attention=False), LoRA left unmerged while generating, TRL's plain generation path (what vlm-grpo
# did before vlm_grpo.engine.fast_generation), and, for 4-bit / 8-bit
# models, the memory-light quantised mode (the default "auto" picks "copy" when it fits). `trl-bf16` is plain TRL on
# the 16-bit model even with --load_in_4bit: the memory reference a quantised run is held against.
VLM_VARIANTS = {
    "vlm-grpo": {},
    "vlm-grpo-host": {"fast_generation_merge_backup": "host"},
    "vlm-grpo-device": {"fast_generation_merge_backup": "device"},  # a GPU copy: no host-to-device restore to hide
    "vlm-grpo-free-decode": {"fast_generation_keep_decode_memory": False},  # decode caches freed after generating
    "vlm-grpo-gc-freeze": {"gc_freeze": True},  # long-lived objects frozen out of Python's full collections
    "vlm-grpo-unpacked": {"packed_vision_attention": False},
    "vlm-grpo-unmerged": {"fast_generation_merge_lora": False},
    "vlm-grpo-plain": {"fast_generation": False},
    "vlm-grpo-light": {"fast_generation_quantized": "light"},
    "vlm-grpo-off": {"fast_generation": False, "shared_prefix": False},  # both fast paths off: the video baseline
    "vlm-grpo-rowwise": {"shared_prefix": False},  # fast generation, but every row scored whole (TRL's per-row path)
    "vlm-grpo-vllm": VLLM_SETTINGS,  # rollouts through vLLM (engine/vllm_rollouts.py); min_new_tokens renamed for it
    "vlm-grpo-round3": {},  # the engine as the third decode round left it (GENERATOR_VARIANTS)
    "vlm-grpo-whole": {},  # the decode step compiled as one whole graph, not per decoder layer (GENERATOR_VARIANTS)
    "vlm-grpo-eager-layers": {"compile_layers": False},  # the layers' training forward and backward run eagerly
    "vlm-grpo-compiled": {"compile_layers": True},  # compiled layers asked for by name (on CPU too: the smoke test)
    "vlm-grpo-compiled-la": {"compile_linear_attention": True},  # Qwen3.5's linear-attention layers compiled (default)
    "vlm-grpo-eager-la": {"compile_linear_attention": False},  # ... their training forward eager (the default before)
    "vlm-grpo-lean-la": {"compile_linear_attention": True, "fast_generation_keep_decode_memory": False},  # both
    "vlm-grpo-dynamic": {"compile_layers_dynamic": "all"},  # the layers compiled with dynamic shapes from the start
    "vlm-grpo-length": {"compile_layers_dynamic": "length"},  # ... with the rows' length a symbol from the start
    "vlm-grpo-auto": {"compile_layers_dynamic": "auto"},  # ... torch's default: static, then dynamic at a new length
    # Each decoder layer's training forward one compiled graph (the default unit since the eleventh session; named, on
    # CPU too), the same with gc_freeze, and the attention and MLP compiled apart (the default before it).
    "vlm-grpo-layers": {"compile_layers": True, "compile_layers_unit": "layers"},
    "vlm-grpo-modules": {"compile_layers_unit": "modules"},
    # Ahead of time and kept (the default since the twelfth session), compiled in the training process (CPU too);
    # compiled by torch.compile and not kept (the default before it).
    "vlm-grpo-aot": {"compile_layers": True, "compile_layers_in_background": False},
    "vlm-grpo-torch-compile": {"compile_layers_ahead_of_time": False},
    "vlm-grpo-layers-gc": {"compile_layers": True, "compile_layers_unit": "layers", "gc_freeze": True},
}
# Variants set on the trainer's FastGenerator: `vlm-grpo-round3` samples on the host after the recorded forward and
# copies the base weights back before the scoring forward, not beside it (engine/token_loop.py, engine/lora_merge.py).
GENERATOR_VARIANTS = {"vlm-grpo-round3": {"sample_in_graph": False, "overlap_restore": False},
                      "vlm-grpo-whole": {"regional_compile": False}}  # fmt: skip


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-vl-3b", help="qwen2.5-vl-3b or qwen2.5-vl-7b (random weights); tiny: "
                   "CPU smoke test; tiny-deep: tiny widths at the 3B's depth (36 + 32 layers), a step's host time on CPU")  # fmt: skip
    p.add_argument("--image_size", type=int, default=448, help="side of the square synthetic images (or frames)")
    p.add_argument("--video_frames", type=int, default=0,
                   help="frames per clip: every prompt holds a clip instead of an image (0: images)")  # fmt: skip
    p.add_argument("--prompts", type=int, default=2, help="prompts per step")
    p.add_argument("--num_generations", type=int, default=8, help="completions per prompt")
    p.add_argument("--completion_length", type=int, default=256, help="forced new tokens per completion")
    p.add_argument("--steps", type=int, default=3, help="GRPO steps per run; the first is warm-up")
    p.add_argument("--warmup_steps", type=int, default=1,
                   help="first steps of each run left out of the medians (compilation; for about a minute after one "
                   "the host is slower, see docs/benchmarks.md)")  # fmt: skip
    p.add_argument("--steps_trl", type=int, default=None,
                   help="steps for the trl / trl-static runs (default: enough for 3 measured steps, or --steps if more; "
                   "TRL's own step varies up to 1.6x between steps)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=2,
                   help="alternating rounds of all trainers (2: every ratio from two invocations' worth of runs)")  # fmt: skip
    p.add_argument("--tools", type=int, default=0,
                   help="forced `crop` calls per rollout: multi-turn tool rollouts (forced_tools.py); 0: one turn")  # fmt: skip
    p.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA r=16 on all linear layers")
    p.add_argument("--no_gradient_checkpointing", action="store_true")
    p.add_argument("--load_in_4bit", action="store_true")
    p.add_argument("--load_in_8bit", action="store_true")
    p.add_argument("--memory_cap_gib", type=float, default=None,
                   help="cap every process at this much GPU memory (torch.cuda.set_per_process_memory_fraction), "
                   "e.g. 24 for a 24 GB card; a run that needs more fails with an out-of-memory error")  # fmt: skip
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--trainers", default=None, help=f"comma-separated subset of {','.join(TRAINERS + VLLM_TRAINERS)} "
                   f"(default: all; with --video_frames: {','.join(VIDEO_TRAINERS)})")  # fmt: skip
    p.add_argument("--profile_step", type=int, default=0,
                   help="run this step of each trainer under torch.profiler and the next under cProfile "
                   "(step_profile.py: host and device time per phase; needs --steps >= profile_step + 1)")  # fmt: skip
    p.add_argument("--memory_peak", type=int, default=0,
                   help="record every allocation over this step and report what holds the memory at its peak, by the "
                   "code that allocated it (memory_peak.py; CUDA only)")  # fmt: skip
    p.add_argument("--inductor", default="", help="Inductor settings for every run, e.g. 'triton.autotune_pointwise="
                   "False,dynamic_scale_rblock=False' (what they cost or save in compile and step time)")  # fmt: skip
    p.add_argument("--checkpoint_dir", default="/tmp/vlm-grpo-bench", help="where the random checkpoint is cached")
    p.add_argument("--out", default="benchmarks/results", help="output folder for results.json / results.md")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker_out", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------- worker process


def _trl_steps(args) -> int:
    """TRL's runs: `--steps_trl`, else at least 3 steps measured after the warm-up ones."""
    return args.steps_trl if args.steps_trl is not None else max(args.steps, args.warmup_steps + 3)


def _dataset(args):
    import numpy as np
    from datasets import Dataset
    from PIL import Image

    rng = np.random.default_rng(0)
    rows = []

    def noise() -> Image.Image:
        return Image.fromarray(rng.integers(0, 256, (args.image_size, args.image_size, 3), dtype=np.uint8))

    for _ in range(args.prompts * args.steps):
        if args.video_frames:
            rows.append({"prompt": [{"role": "user", "content": "Describe the clip in detail ."}],
                         "video": [noise() for _ in range(args.video_frames)]})  # fmt: skip
        else:
            rows.append({"prompt": [{"role": "user", "content": "Describe the image in detail ."}], "image": noise()})
    return Dataset.from_list(rows)


def _reward(prompts, completions, **kwargs):
    # Any reward that differs within a group gives non-zero advantages, so the loss and backward do real work.
    return [float(len(str(c)) % 7) for c in completions]


def run_worker(args) -> None:
    import torch
    from real_arch import build_checkpoint

    apply_inductor_settings(args.inductor)

    from vlm_grpo.compat import checkpointing_settings

    trainer_name = args.worker
    if args.model.startswith("tiny"):  # CPU runs: "tiny" a smoke test, "tiny-deep" the 3B's module tree (host time)
        torch.set_num_threads(1)
    checkpoint = build_checkpoint(args.model, os.path.join(args.checkpoint_dir, args.model))
    on_gpu = torch.cuda.is_available()
    if on_gpu and args.memory_cap_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap_gib * 2**30 / total), 0)
    quantized = {"load_in_4bit": args.load_in_4bit, "load_in_8bit": args.load_in_8bit}
    if trainer_name == "trl-bf16":
        quantized = {"load_in_4bit": False, "load_in_8bit": False}
    common = dict(
        output_dir=os.path.join("/tmp", f"bench-{trainer_name}"), per_device_train_batch_size=args.prompts * args.num_generations,
        num_generations=args.num_generations, max_completion_length=args.completion_length,
        generation_kwargs={"min_new_tokens": args.completion_length}, beta=args.beta,
        **checkpointing_settings(not args.no_gradient_checkpointing), bf16=on_gpu, use_cpu=not on_gpu, learning_rate=1e-6,
        max_steps=args.steps if trainer_name in VLM_VARIANTS else _trl_steps(args), logging_steps=1, report_to="none", save_strategy="no", seed=0, disable_tqdm=True,
    )  # fmt: skip
    dataset = _dataset(args)
    tool_kwargs: dict = {}
    if args.tools:  # every rollout calls crop N times (forced_tools.py), on every trainer alike
        from vlm_grpo.tools import image_tools

        common.update(forced_tools.tool_settings(args))
        tool_kwargs["environment_factory"] = image_tools("crop")
    if args.video_frames:  # every frame kept: the clip is the benchmark's input, not the sampler's choice
        common["video_num_frames"] = args.video_frames
    records: list = []
    from step_timing import compile_frames, compile_seconds, step_timer, timed

    timer = step_timer(records, args.profile_step, args.warmup_steps)
    load_start = time.perf_counter()
    if trainer_name in VLM_VARIANTS:
        from vlm_grpo import FastVisionModel, VLMGRPOConfig, VLMGRPOTrainer

        common.update(VLM_VARIANTS[trainer_name])

        model, processor = FastVisionModel.from_pretrained(checkpoint, **quantized, full_finetuning=args.full)
        if not args.full:
            model = FastVisionModel.get_peft_model(model, r=16, lora_alpha=16)
        trainer = timed(VLMGRPOTrainer)(model, [_reward], args=VLMGRPOConfig(**common), train_dataset=dataset,
                                         processing_class=processor, callbacks=[timer], **tool_kwargs)  # fmt: skip
        for name, value in GENERATOR_VARIANTS.get(trainer_name, {}).items():
            setattr(trainer.fast_generator, name, value)
    else:
        from peft import LoraConfig
        from transformers import AutoModelForImageTextToText, AutoProcessor, BitsAndBytesConfig
        from trl import GRPOConfig, GRPOTrainer
        from trl_gap import sampler_gap_trl

        kwargs = dict(dtype=torch.bfloat16, device_map={"": 0}) if on_gpu else {}
        if quantized["load_in_4bit"]:
            kwargs["quantization_config"] = BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=torch.bfloat16,
            )  # fmt: skip
        elif quantized["load_in_8bit"]:
            kwargs["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True)
        model = AutoModelForImageTextToText.from_pretrained(checkpoint, **kwargs)
        if on_gpu:
            processor = AutoProcessor.from_pretrained(checkpoint, padding_side="left")
        else:  # no torchvision on CPU machines: AutoProcessor cannot build Qwen's video processor
            from vlm_grpo.media.processor import load_processor

            processor = load_processor(checkpoint, "qwen2_5_vl")
        if trainer_name == "trl-static":
            common["cache_implementation"] = "static"
        base = sampler_gap_trl(GRPOTrainer)
        if trainer_name in VLLM_TRAINERS:  # TRL logs vLLM's gap itself; vLLM's name for the forced length
            common.update(VLLM_SETTINGS, generation_kwargs={"min_tokens": args.completion_length})
            if trainer_name == "trl-vllm-blocked":
                common["generation_kwargs"]["bad_words"] = ["<|image_pad|>", "<|video_pad|>"]
            base = GRPOTrainer
        if args.tools:  # the tool template a TRL user must paste for Qwen2.5-VL (its own renders no tools)
            forced_tools.tool_template(processor, model, tool_kwargs)
        peft_config = None if args.full else LoraConfig(r=16, lora_alpha=16, target_modules="all-linear")
        trainer = timed(base)(model, [_reward], args=GRPOConfig(**common), train_dataset=dataset,
                                      processing_class=processor, peft_config=peft_config, callbacks=[timer],
                                      **tool_kwargs)  # fmt: skip
    timer.trainer = trainer
    if args.tools:
        forced_tools.force_calls(trainer, args.image_size)
    if args.profile_step:
        from step_profile import profiling_callback
        from torch.profiler import record_function

        trainer.add_callback(profiling_callback(trainer_name, args.profile_step, args.out))
        backward = trainer.accelerator.backward

        def labelled_backward(*a, **k):
            with record_function("step.backward"):
                return backward(*a, **k)

        trainer.accelerator.backward = labelled_backward
    load_s = time.perf_counter() - load_start
    memory: dict = {}
    if args.memory_peak and on_gpu:
        from memory_peak import memory_peak_callback

        trainer.add_callback(memory_peak_callback(args.memory_peak, memory))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    import torch._dynamo.utils

    gaps = [
        (h["sampling/sampling_logp_difference/mean"], h["sampling/sampling_logp_difference/max"])
        for h in trainer.state.log_history
        if "sampling/sampling_logp_difference/mean" in h
    ]
    result = {"trainer": trainer_name, "load_s": load_s, "steps": records, "losses": losses, "mean_lengths": lengths,
              "sampler_gap": gaps,
              "params": sum(p.numel() for p in trainer.model.parameters()),
              "compiled_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"], "compile_s": compile_seconds(),
              "compile_frames": compile_frames(),  # which graph a first step's compile went to (issue #48)
              # Ahead-of-time functions loaded (from a cache or a compile process) and compiled in this process.
              # What did not go as planned and why (`AheadOfTime.events`).
              "ahead_of_time": {k: getattr(getattr(getattr(trainer, "compiled_layers", None), "ahead", None), k, None)
                                for k in ("loaded", "compiled", "events")},
              "fast_generation": dict(getattr(getattr(trainer, "fast_generator", None), "stats", {})),
              "quantized_generation": (trainer.fast_generator.describe_quantized()
                                       if hasattr(trainer, "fast_generator") else {}),
              # vlm-grpo: log-prob calls served by the shared-prefix path, and why any fell back to TRL's
              "shared_prefix_calls": getattr(trainer, "shared_prefix_calls", None),
              "shared_prefix_fallbacks": getattr(trainer, "shared_prefix_fallbacks", {}),
              "memory_peak": memory.get("result"),
              "tools": forced_tools.tool_stats(trainer.state.log_history) if args.tools else None}  # fmt: skip
    with open(args.worker_out, "w") as f:
        json.dump(result, f)


# ----------------------------------------------------------------------------------------------- orchestrator


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return
    apply_inductor_settings(args.inductor)  # a wrong key stops here, not in every worker
    import peft
    import torch
    import transformers
    import trl

    if not torch.cuda.is_available() and not args.model.startswith("tiny"):
        raise SystemExit("benchmarks/grpo_step.py needs a CUDA GPU (only --model tiny / tiny-deep run on CPU).")
    env = {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (CPU)", "torch": torch.__version__, "transformers": transformers.__version__,
           "trl": trl.__version__, "peft": peft.__version__}  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    trainers = [t for t in (args.trainers or ",".join(VIDEO_TRAINERS if args.video_frames else TRAINERS)).split(",") if t]  # fmt: skip
    if args.video_frames and (no_video := [t for t in trainers if t not in VLM_VARIANTS]):
        raise SystemExit(f"--video_frames: TRL has no video path, so {', '.join(no_video)} cannot run; compare "
                         f"{', '.join(VIDEO_TRAINERS)}.")  # fmt: skip
    runs, failures, forwarded = {t: [] for t in trainers}, {}, list(argv if argv is not None else sys.argv[1:])
    table = ""
    for round_index in range(args.rounds):
        order = trainers if round_index % 2 == 0 else trainers[::-1]  # alternate so drift hits all sides
        for name in order:
            out = os.path.join(args.out, f"worker-{name}-{round_index}.json")
            cmd = [sys.executable, os.path.abspath(__file__), *forwarded, "--worker", name, "--worker_out", out]
            start = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            with open(out[: -len(".json")] + ".log", "w") as f:  # its warnings (fallbacks say why there), kept
                f.write(proc.stdout + proc.stderr)
            print(
                f"[{name} round {round_index}] exit {proc.returncode} in {time.perf_counter() - start:.0f} s",
                flush=True,
            )
            if proc.returncode != 0:
                print(proc.stdout[-2000:], proc.stderr[-6000:], flush=True)
                failures[name] = failure_line(proc.stderr)
            else:
                with open(out) as f:
                    runs[name].append(json.load(f))
            table = _write_report(args, env, runs, failures)
    print(table, flush=True)


def _write_report(args, env: dict, runs: dict, failures: dict) -> str:
    """Write results.md / results.json from the runs so far and return the table. Called after every worker, so an invocation cut
    short (a machine's time limit) still leaves the table of the trainers that finished."""
    from memory_peak import markdown as memory_markdown
    from step_report import markdown, summary

    summaries = {}
    for name, name_runs in runs.items():
        if name_runs:  # each run's first steps are warm-up; the warm-up column shows the first run's first step
            warmup = args.warmup_steps if name in VLM_VARIANTS else 1  # TRL compiles nothing
            steps = name_runs[0]["steps"][:1] + [s for r in name_runs for s in r["steps"][warmup:]]
            summaries[name] = summary({"steps": steps, "compiled_graphs": name_runs[0].get("compiled_graphs", 0)}, args)
            summaries[name]["quantized_generation"] = name_runs[0].get("quantized_generation") or {}
            gaps = [g for r in name_runs for g in r.get("sampler_gap", [])]
            if gaps:  # |scored - sampled| log-prob per completion token: median of the steps' means, largest max
                summaries[name]["sampler_gap"] = {"mean": statistics.median(g[0] for g in gaps),
                                                  "max": max(g[1] for g in gaps)}  # fmt: skip
    table = markdown(summaries, args, env, VLM_VARIANTS)
    for name, why in failures.items():
        table += f"| {name} | failed: {why} |\n"
    gaps = {name: summary["sampler_gap"] for name, summary in summaries.items() if "sampler_gap" in summary}
    if gaps:
        table += "\n| trainer | sampler gap: mean abs log-prob | max |\n|---|---|---|\n"
        table += "".join(f"| {name} | {g['mean']:.2e} | {g['max']:.2e} |\n" for name, g in gaps.items())
    for name, run_summary in summaries.items():
        if q := run_summary["quantized_generation"]:
            table += (f"\n{name}: quantised layers generate in {q['mode']} mode ({q['layers']} layers, "
                      f"{q['copy_gib']:.1f} GiB of 16-bit copies)\n")  # fmt: skip
    table += forced_tools.markdown(runs, args) if args.tools else ""
    for name, name_runs in runs.items():
        if name_runs and name_runs[0].get("memory_peak"):
            table += memory_markdown(name, name_runs[0]["memory_peak"])
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"args": vars(args), "env": env, "summaries": summaries, "runs": runs, "failures": failures}, f,
                  indent=1)  # fmt: skip
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table)
    return table


if __name__ == "__main__":
    main()
