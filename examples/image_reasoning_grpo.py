"""Teach a vision-language model an image-reasoning task with GRPO, written out with vlm-grpo's Python API.

    python examples/image_reasoning_grpo.py                 # tiny VLM built offline, CPU, ~2 minutes
    python examples/image_reasoning_grpo.py --max_steps 3   # smoke run (what CI runs)
    python examples/image_reasoning_grpo.py --model Qwen/Qwen2.5-VL-3B-Instruct --load_in_4bit --task count
    python examples/image_reasoning_grpo.py --model Qwen/Qwen2.5-VL-3B-Instruct --load_in_4bit \
        --dataset hiyouga/geometry3k --eval_split test     # a Hub id, or a JSONL / CSV / Parquet file

Task (data + rewards) -> load -> LoRA -> GRPO -> accuracy before/after -> merged 16-bit checkpoint. The `vlm-grpo`
command runs the same recipe in one line; this file is the code to copy and change.
"""

import argparse
import os

import torch
from transformers import PrinterCallback

from vlm_grpo import (
    FastVisionModel,
    VLMGRPOConfig,
    VLMGRPOTrainer,
    build_tiny_vlm,
    dataset_task,
    evaluate,
    synthetic_task,
)
from vlm_grpo.cli.demo import DEMO
from vlm_grpo.data import TASKS
from vlm_grpo.rewards import think_answer_format
from vlm_grpo.training.callbacks import LivePlotCallback

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--model", default=DEMO.model, help="Hub id or path; tiny:<family> builds one offline")
parser.add_argument("--load_in_4bit", action="store_true", help="4-bit base weights (CUDA + bitsandbytes)")
parser.add_argument("--task", default=DEMO.task, choices=TASKS, help="synthetic task (each brings its own reward)")
parser.add_argument("--dataset", default=None, help="your data instead: a Hub id or a JSONL / CSV / Parquet file")
parser.add_argument("--eval_split", default=None, help="the dataset's split for accuracy (else 10%% held out)")
parser.add_argument("--max_steps", type=int, default=None, help="training steps (default: the recipe's)")
parser.add_argument("--output_dir", default="runs/image-reasoning-example")
args = parser.parse_args()

# -- hyperparameters -------------------------------------------------------------------------------------------------
tiny = args.model.startswith("tiny:")
if tiny:
    # The embedded demo's recipe (vlm_grpo.cli.demo.DEMO, docs/demo.md) for a tiny random-init model: all weights train
    # (LoRA on random weights barely learns), lr 5e-4, 16 samples per prompt, one-word answers in 4 new tokens.
    use_lora, learning_rate, max_steps, num_generations, prompts_per_step, max_completion_length = (
        False, DEMO.learning_rate, DEMO.max_steps, DEMO.num_generations, DEMO.prompts_per_step,
        DEMO.max_completion_length)  # fmt: skip
    system_prompt = None  # a random model cannot learn a reasoning format in a few hundred steps
else:
    # A pretrained VLM: LoRA (r 16) on a frozen, possibly 4-bit base; a small lr, as RL fine-tunes are fragile; 8
    # samples per prompt is TRL's default group; room to think before answering.
    use_lora, learning_rate, max_steps, num_generations, prompts_per_step, max_completion_length = (
        True, 1e-5, 500, 8, 4, 512)  # fmt: skip
    system_prompt = ("First think about the question step by step inside <think></think>, then give only the final "
                     "answer inside <answer></answer>.")  # fmt: skip
max_steps = args.max_steps or max_steps
seed = DEMO.seed
on_gpu = torch.cuda.is_available()
if not on_gpu:
    torch.set_num_threads(1)  # tiny models on CPU: one thread is fastest

# -- the task: rows with `prompt` (chat messages), `image` and `answer`, and the rewards that score them -----------
# synthetic_task draws rows with vlm_grpo.data.make_visual_reasoning_dataset (train and test images disjoint by
# construction) and brings the task's own reward, its accuracy: 1.0 when the completion names exactly one of the
# task's answers, the right one (a box: its IoU). dataset_task reads yours with vlm_grpo.data.load.load_grpo_dataset
# and scores it with answer_accuracy: the answer tag's content (numbers, LaTeX and words compared sensibly).
if args.dataset is None:
    task = synthetic_task(args.task, seed=seed, system_prompt=system_prompt)
else:
    task = dataset_task(args.dataset, eval_split=args.eval_split, seed=seed, system_prompt=system_prompt)
if system_prompt:  # the format reward is worth half, so a well-formatted wrong answer never outscores a right one
    task = task.with_reward(think_answer_format, weight=0.5)

# -- model -----------------------------------------------------------------------------------------------------------
model_path = args.model
if tiny:  # a real architecture at a tiny size, built offline; its vocabulary includes the task's answer words
    model_path = build_tiny_vlm(args.model.removeprefix("tiny:"), os.path.join(args.output_dir, "tiny-base"),
                                seed=seed, words=task.answer_words)  # fmt: skip
model, processor = FastVisionModel.from_pretrained(
    model_path, load_in_4bit=args.load_in_4bit, full_finetuning=not use_lora
)
if use_lora:  # adapters on the vision tower and the language model, attention and MLP
    model = FastVisionModel.get_peft_model(model, r=16, lora_alpha=16, finetune_vision_layers=True,
                                           finetune_language_layers=True, random_state=seed)  # fmt: skip

# -- accuracy before training (greedy decoding) ----------------------------------------------------------------------
before = evaluate(model, processor, task.test, task.eval_funcs, max_new_tokens=max_completion_length)  # accuracy first
print(f"held-out accuracy before training: {before['accuracy']:.3f}  ({len(task.test)} prompts)", flush=True)

# -- GRPO ------------------------------------------------------------------------------------------------------------
config = VLMGRPOConfig(
    output_dir=args.output_dir,
    learning_rate=learning_rate,
    lr_scheduler_type=DEMO.lr_scheduler_type,  # constant: short RL runs have no schedule worth tuning
    max_steps=max_steps,
    per_device_train_batch_size=prompts_per_step * num_generations,  # completions per step
    num_generations=num_generations,  # samples per prompt: GRPO's group, rewards are compared within it
    max_completion_length=max_completion_length,
    temperature=DEMO.temperature,  # 1.0, the model's own distribution: diverse groups give a learning signal
    beta=DEMO.beta,  # KL to the starting model keeps it from drifting into reward hacking
    reward_weights=task.reward_weights,
    logging_steps=max(1, min(10, max_steps // 10)),
    disable_tqdm=True,  # LivePlotCallback shows progress: a line per logging step (a live plot in Jupyter)
    save_strategy="no",
    report_to="none",  # "wandb" / "tensorboard" to watch there (log_completions=True adds completion tables)
    use_cpu=not on_gpu,
    dataloader_pin_memory=on_gpu,
    seed=seed,
)
trainer = VLMGRPOTrainer(model=model, reward_funcs=task.reward_funcs, args=config, train_dataset=task.train,
                         processing_class=processor, callbacks=[LivePlotCallback(title=f"GRPO: {args.model}")])  # fmt: skip
trainer.remove_callback(PrinterCallback)  # it would print every logged dict as well
trainer.train()

# -- accuracy after, and a standalone checkpoint ---------------------------------------------------------------------
after = evaluate(trainer.model, processor, task.test, task.eval_funcs, max_new_tokens=max_completion_length)
print(f"held-out accuracy after training:  {after['accuracy']:.3f}", flush=True)
merged = FastVisionModel.save_pretrained_merged(trainer.model, processor, os.path.join(args.output_dir, "merged"))
print(f"wrote {merged}: a standalone 16-bit checkpoint (LoRA merged in), for FastVisionModel or transformers")
