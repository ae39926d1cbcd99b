"""`benchmarks/grpo_step.py`: a failed worker's row names its error, not the warning torch prints as it exits."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from step_report import failure_line

# The tail of the 7B TRL + vLLM worker that crashed on a sampled image pad (H100, 2026-11-27).
CRASH = """[rank0]:     raise error_type(message_evaluated)
[rank0]: ValueError: Image features and image tokens do not match, tokens: 4097, features: 4096
[rank0]:[W1127 18:01:02.1 ProcessGroupNCCL.cpp:1575] Warning: WARNING: destroy_process_group() was not called before program exit, which can leak resources.
"""


def test_the_error_line_is_named_not_the_exit_warning():
    assert failure_line(CRASH) == (
        "[rank0]: ValueError: Image features and image tokens do not match, tokens: 4097, features: 4096"
    )
    assert failure_line("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB") == "out of memory"
    assert failure_line("only a line\n") == "only a line"
    assert failure_line("") == "no output"


def test_tiny_deep_has_the_3b_depth_at_tiny_widths(tmp_path):
    # `--model tiny-deep`: a CPU step walks the 3B's module tree (host time) without the 3B's compute.
    from real_arch import TEXT, VISION, build_checkpoint
    from transformers import AutoConfig

    path = build_checkpoint("tiny-deep", str(tmp_path / "tiny-deep"))
    config = AutoConfig.from_pretrained(path)
    assert config.text_config.num_hidden_layers == TEXT["qwen2.5-vl-3b"]["num_hidden_layers"] == 36
    assert config.vision_config.depth == VISION["depth"] and config.text_config.hidden_size < 256
    files = set(os.listdir(path))
    assert {"tokenizer.json", "processor_config.json", "chat_template.jinja", "model.safetensors"} <= files
    assert build_checkpoint("tiny-deep", path) == path  # reused, not rebuilt


def test_the_report_lists_every_step_and_the_later_peaks_by_phase():
    # A median of three steps hides one slow step; the first step's peak (the merge's backup) hides the later ones.
    from types import SimpleNamespace

    from step_report import markdown, summary

    def step(total, gen_peak):
        phases = {"generation": gen_peak, "scoring": 10.0, "training": 14.0}
        return {"total_s": total, "generation_s": 1.0, "scoring_s": 0.3, "training_s": 0.7,
                "peak_gib": max(phases.values()), "peak_phases_gib": phases}  # fmt: skip

    args = SimpleNamespace(prompts=2, num_generations=8, completion_length=256, video_frames=0, image_size=448,
                           model="m", full=False, no_gradient_checkpointing=False, load_in_4bit=False,
                           load_in_8bit=False, beta=0.04, memory_cap_gib=0, warmup_steps=1, steps=4, steps_trl=3,
                           profile_step=0)  # fmt: skip
    s = summary({"steps": [step(30.0, 17.2), step(2.4, 9.0), step(3.1, 9.5), step(2.5, 9.2)]}, args)
    assert s["total_s"] == 2.5 and s["step_times_s"] == [30.0, 2.4, 3.1, 2.5]
    assert s["peak_gib"] == 17.2 and s["later_peak_gib"] == 14.0
    assert s["later_phases_gib"] == {"generation": 9.5, "scoring": 10.0, "training": 14.0}
    table = markdown({"vlm-grpo": s}, args, {"gpu": "x", "torch": "", "transformers": "", "trl": "", "peft": ""}, {})
    assert "| vlm-grpo | 30.00 2.40 3.10 2.50 |" in table and "| vlm-grpo | 9.5 | 10.0 | 14.0 |" in table
    profiled = [step(30.0, 17.2), step(2.4, 9.0), {**step(9.0, 9.0), "profiled": True}]
    assert "| vlm-grpo | 30.00 2.40 9.00* |" in markdown({"vlm-grpo": summary({"steps": profiled}, args)}, args,
                                                        {"gpu": "x", "torch": "", "transformers": "", "trl": "",
                                                         "peft": ""}, {})  # fmt: skip


def test_inductor_settings_reach_torchs_config():
    # `--inductor`: what a setting costs or saves in compile and step time, measured on the GPU (docs/benchmarks.md).
    from inductor_settings import apply_inductor_settings
    from torch._inductor import config

    before = (config.triton.autotune_pointwise, config.dynamic_scale_rblock, config.max_autotune_gemm_backends)
    try:
        got = apply_inductor_settings("triton.autotune_pointwise=False, dynamic_scale_rblock=False")
        assert got == {"triton.autotune_pointwise": False, "dynamic_scale_rblock": False}
        assert config.triton.autotune_pointwise is False and config.dynamic_scale_rblock is False
        assert apply_inductor_settings("") == {}
        assert apply_inductor_settings("max_autotune_gemm_backends=ATEN") == {"max_autotune_gemm_backends": "ATEN"}
        for wrong in ("triton.autotune_pointwise", "no_such_setting=1", "nope.autotune=1"):
            with pytest.raises(SystemExit, match="is not key=value with a key of torch._inductor.config"):
                apply_inductor_settings(wrong)
    finally:
        config.triton.autotune_pointwise, config.dynamic_scale_rblock, config.max_autotune_gemm_backends = before
