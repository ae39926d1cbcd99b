"""Image-reasoning GRPO fine-tune: the same recipe as the `vlm-grpo` command.

    python examples/image_reasoning_grpo.py                      # tiny offline model, CPU, a few minutes
    python examples/image_reasoning_grpo.py --model Qwen/Qwen2.5-VL-3B-Instruct --use_peft --load_in_4bit \
        --task count --max_completion_length 256 --per_device_train_batch_size 16 --learning_rate 1e-5

Every flag of `vlm_grpo.cli.ScriptArguments` and `VLMGRPOConfig` works, and `--config recipe.yaml` loads them.
"""

from vlm_grpo.cli import main

if __name__ == "__main__":
    main()
