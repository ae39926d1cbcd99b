"""`grpo_step.py`'s timers: a GRPO trainer subclass timing generation and scoring, and a callback timing whole steps
(with CUDA syncs on the compute stream), each phase also a profiler range that `step_profile.py` reads."""

from __future__ import annotations

import os
import time


def sync_time() -> float:
    import torch

    # The compute stream's work, not the device's: vlm-grpo copies the base weights back from the host on a side
    # stream that overlaps the scoring forward (engine/lora_merge.py), so that copy counts where it makes the compute
    # stream wait (scoring), and in the step total. For TRL, which uses one stream, the two are the same.
    if torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()
    return time.perf_counter()


def take_peak() -> float:
    """GiB allocated at the peak since the last call (or the step's start), the peak counter then reset: one phase's
    peak, so that the step's peak is told by phase (generation, scoring, training)."""
    import torch

    if not torch.cuda.is_available():
        return 0.0
    peak = torch.cuda.max_memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()
    return peak


def timed(base):
    """Subclass of a GRPO trainer that times generation and scoring, and whole steps, with CUDA syncs."""

    from torch.profiler import record_function  # the phases `step_profile.py` reads (no cost unless profiling)

    class Timed(base):
        def _generate(self, prompts):
            start = sync_time()
            with record_function("step.generation"):
                out = super()._generate(prompts)
            self._bench_generation += sync_time() - start
            self._bench_peaks["generation"] = max(self._bench_peaks.get("generation", 0.0), take_peak())
            return out

        def _generate_and_score_completions(self, inputs):
            start = sync_time()
            before = self._bench_generation
            with record_function("step.rollout"):
                out = super()._generate_and_score_completions(inputs)
            self._bench_scoring += (sync_time() - start) - (self._bench_generation - before)
            self._bench_peaks["scoring"] = max(self._bench_peaks.get("scoring", 0.0), take_peak())
            return out

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            with record_function("step.logps"):
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)

        def _calculate_rewards(self, *args, **kwargs):
            with record_function("step.rewards"):
                return super()._calculate_rewards(*args, **kwargs)

        def compute_loss(self, *args, **kwargs):
            with record_function("step.loss"):
                return super().compute_loss(*args, **kwargs)

    return Timed


def _wait_for_background_compiles(trainer) -> float:
    """Seconds waited for the layers another process is compiling (`compile_layers_in_background`): the steps after
    the warm-up measure the compiled layers, not the layers as written while that process runs."""
    ahead = getattr(getattr(trainer, "compiled_layers", None), "ahead", None)
    if ahead is None or ahead.background is None or not ahead.background.pending():
        return 0.0
    start = time.perf_counter()
    ahead.background.wait()
    return time.perf_counter() - start


def step_timer(records: list, args_profile_step: int = 0, warmup_steps: int = 1):
    import torch
    from torch.profiler import record_function
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        trainer = None

        def on_step_begin(self, args, state, control, **kwargs):
            t = self.trainer
            # Before the first measured step (the trainer's own callback then loads what the wait saw finish).
            self.waited = _wait_for_background_compiles(t) if state.global_step == warmup_steps else 0.0
            t._bench_generation = t._bench_scoring = 0.0
            t._bench_peaks = {}
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            self.start = sync_time()

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.optimizer_range = record_function("step.optimizer")
            self.optimizer_range.__enter__()

        def on_optimizer_step(self, args, state, control, **kwargs):
            self.optimizer_range.__exit__(None, None, None)

        def on_step_end(self, args, state, control, **kwargs):
            total = sync_time() - self.start
            t = self.trainer
            records.append({
                "step": state.global_step, "total_s": total, "profiled": state.global_step == 1 if args_profile_step == 1 else 0 < args_profile_step <= state.global_step, "generation_s": t._bench_generation,
                "scoring_s": t._bench_scoring, "training_s": total - t._bench_generation - t._bench_scoring,
            })  # fmt: skip
            # The step's peak, and each phase's (a phase's peak counter is reset when it ends)
            phases = {**t._bench_peaks, "training": take_peak()}
            records[-1].update(peak_gib=max(phases.values()), peak_phases_gib=phases)
            if self.waited:
                records[-1]["background_compile_wait_s"] = self.waited

    return StepTimer()


def compile_seconds(least: float = 0.1) -> dict[str, float]:
    """Seconds this process spent in each part of torch.compile so far (Dynamo's `compile_times`: `_compile.
    compile_inner` is the whole, `bytecode_tracing` Dynamo's trace, `create_aot_dispatcher_function` AOTAutograd with
    Inductor inside it, `async_compile.wait` the Triton kernels' builds), the parts of `least` seconds or more; empty
    where torch does not say. Where a first step's compile goes (issue #48)."""
    try:
        from torch._dynamo.utils import compile_times

        names, values = compile_times(repr="csv", aggregate=True)
        return {
            name: round(float(value), 2) for name, value in zip(names, values, strict=True) if float(value) >= least
        }
    except Exception:  # noqa: BLE001 (a private API: a report without it, never a failed benchmark)
        return {}


def compile_frames(least: float = 0.5) -> list[dict]:
    """One entry per frame torch.compile compiled in this process that took `least` seconds or more (Dynamo's
    compilation metrics): the function (`file:line name`), its whole compile, Inductor's part and the code generation
    and Triton builds inside it, and the graph's size. `compile_seconds` says which stage a first step's compile spent
    its time in; this says which graph (the decode layer, the training layers forward or backward, the vision tower).
    Empty where torch does not say."""
    try:
        from torch._dynamo.utils import get_compilation_metrics

        frames = []
        for m in get_compilation_metrics():
            whole = getattr(m, "entire_frame_compile_time_s", None) or 0.0
            if whole < least:
                continue
            us = {"triton_s": "triton_compile_time_us", "pre_grad_s": "pre_grad_pass_time_us",
                  "post_grad_s": "post_grad_pass_time_us", "joint_graph_s": "joint_graph_pass_time_us"}  # fmt: skip
            frame = {
                "frame": f"{os.path.basename(m.co_filename or '?')}:{m.co_firstlineno} {m.co_name}",
                "compile_s": round(whole, 2),
                "backend_s": round(getattr(m, "backend_compile_time_s", None) or 0.0, 2),
                "inductor_s": round(getattr(m, "inductor_compile_time_s", None) or 0.0, 2),
                "code_gen_s": round(getattr(m, "code_gen_time_s", None) or 0.0, 2),
                **{k: round((getattr(m, v, None) or 0) / 1e6, 2) for k, v in us.items()},
                "graph_ops": getattr(m, "graph_op_count", None),
                "restarts": len(getattr(m, "restart_reasons", None) or ()),
                "backward": bool(getattr(m, "is_runtime", False)),  # AOTAutograd's lazy backward compile
            }
            frames.append(frame)
        return frames
    except Exception:  # noqa: BLE001 (a private API: a report without it, never a failed benchmark)
        return []
