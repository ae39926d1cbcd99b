"""`benchmarks/grpo_step.py`: a failed worker's row names its error, not the warning torch prints as it exits."""

from __future__ import annotations

import os
import sys

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
