"""The embedded demo's settings, written once: what `vlm-grpo` with no arguments trains, and how.

The `vlm-grpo` command takes its defaults from `DEMO`, `examples/image_reasoning_grpo.py` and the notebook read
their tiny-model hyperparameters from it, and `examples/recipes/cpu_smoke.yaml` (a file users read, so it spells the
values out) is checked against it by `tests/test_demo.py`. Change a value here and all of them follow, or the test
says which file to update.

The values were chosen from runs on 7 seeds and 5 families (docs/demo.md).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["DEMO", "DemoSettings"]


@dataclass(frozen=True)
class DemoSettings:
    """The demo's task and its GRPO hyperparameters; field names are the `vlm-grpo` flags they set."""

    # -- what it learns: a tiny random-init model, one large shape in one of four colours (chance 0.25) --------------
    model: str = "tiny:qwen2_5_vl"  # built offline in code by vlm_grpo.tiny: a real architecture at a tiny size
    task: str = "color"
    difficulty: int = 1
    train_size: int = 2048  # synthetic training prompts (rows are reused per epoch)
    test_size: int = 128  # held-out prompts, for the accuracy before and after
    image_size: int = 56

    # -- how: full fine-tuning, since LoRA on random weights barely learns (embeddings and head stay frozen) -----------
    learning_rate: float = 5e-4  # >= 3e-3 collapses to one answer
    lr_scheduler_type: str = "constant"  # a short RL run: no schedule to tune
    warmup_steps: int = 0
    max_steps: int = 400
    per_device_train_batch_size: int = 64  # 4 prompts x 16 generations per step
    # 16 samples per prompt: with 8, some seeds stalled at 0.3-0.7 accuracy because too many groups had identical
    # rewards (no signal); 16 learned to >= 0.8 on every seed tried.
    num_generations: int = 16
    max_completion_length: int = 4  # the answer is one word; a short budget keeps rollouts cheap
    temperature: float = 1.0  # the model's own distribution: diverse groups give a learning signal
    beta: float = 0.04  # KL to the starting model
    seed: int = 0

    # -- what the command writes and shows --------------------------------------------------------------------------
    output_dir: str = "runs/image-reasoning"
    logging_steps: int = 10
    save_strategy: str = "no"  # the final model is saved once, at the end
    report_to: str = "none"
    disable_tqdm: bool = False  # one progress bar, the reward in its postfix

    @property
    def prompts_per_step(self) -> int:
        """Prompts per optimiser step: the batch holds `num_generations` completions of each."""
        return self.per_device_train_batch_size // self.num_generations

    def training_args(self) -> dict[str, Any]:
        """The settings that are `VLMGRPOConfig` fields (everything after the task), as keyword arguments."""
        task_fields = {"model", "task", "difficulty", "train_size", "test_size", "image_size"}
        return {k: v for k, v in asdict(self).items() if k not in task_fields}


DEMO = DemoSettings()
