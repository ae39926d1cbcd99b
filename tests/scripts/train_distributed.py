"""A few GRPO steps under `accelerate launch`; each rank writes its losses and a weight checksum to OUT_DIR."""

import json
import math
import os
import sys

import torch

torch.set_num_threads(1)

from vlm_grpo.data import answer_words, make_visual_reasoning_dataset
from vlm_grpo.model import FastVisionModel
from vlm_grpo.rewards import make_choice_reward
from vlm_grpo.tiny import build_tiny_vlm
from vlm_grpo.trainer import VLMGRPOConfig, VLMGRPOTrainer


def main(out_dir: str, family: str = "qwen2_5_vl", steps: int = 3) -> None:
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    words = answer_words("color", 1)
    # Every rank builds the same seeded model in its own directory: no file races, identical weights.
    path = build_tiny_vlm(family, os.path.join(out_dir, f"model-rank{rank}"), seed=0, words=words)
    model, processor = FastVisionModel.from_pretrained(path, full_finetuning=True)
    config = VLMGRPOConfig(
        output_dir=os.path.join(out_dir, "run"), per_device_train_batch_size=8, num_generations=8,
        max_completion_length=4, learning_rate=5e-4, max_steps=steps, logging_steps=1, report_to="none",
        save_strategy="no", disable_tqdm=True, seed=0, use_cpu=not torch.cuda.is_available(),
    )  # fmt: skip
    trainer = VLMGRPOTrainer(
        model, [make_choice_reward(words)], args=config, train_dataset=make_visual_reasoning_dataset("color", 64),
        processing_class=processor,
    )  # fmt: skip
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    weights = trainer.accelerator.unwrap_model(trainer.model).state_dict()
    checksum = float(sum(v.double().sum() for v in weights.values() if v.is_floating_point()))
    record = {
        "rank": rank, "world_size": trainer.accelerator.num_processes, "steps": trainer.state.global_step,
        "losses": losses, "finite": all(math.isfinite(x) for x in losses), "checksum": checksum,
        "fast_generation": trainer.fast_generator.stats,
    }  # fmt: skip
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], *(sys.argv[2:3]), *(int(a) for a in sys.argv[3:4]))
