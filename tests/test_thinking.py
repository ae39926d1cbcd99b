"""`data.thinking`: a chat template that opens `<think>` in the prompt reaches the rewards, so a completion cut off
while reasoning has no answer and a well-formed one has its think block whole."""

import pytest
import torch
from datasets import Dataset
from PIL import Image
from trl.chat_template_utils import qwen3_5_think_chat_template

from vlm_grpo.data import answer_words
from vlm_grpo.data.thinking import THINKING_COLUMN, mark_thinking, prompts_open_thinking
from vlm_grpo.models.loader import FastVisionModel
from vlm_grpo.training.evaluation import evaluate
from vlm_grpo.training.trainer import VLMGRPOConfig, VLMGRPOTrainer

COLORS = answer_words("color", 1)
# The user's own text names the tag unclosed: only the template's generation prompt decides.
QUESTION = "Reason inside <think> tags. What colour is the shape?"


def _thinking_model(tiny_dir):
    """Tiny Qwen3-VL with Qwen's think tokens, under Qwen3.5's thinking template (it ends the prompt with `<think>`)."""
    path = tiny_dir("qwen3_vl", tools=True, words=COLORS)
    model, processor = FastVisionModel.from_pretrained(path, full_finetuning=True)
    processor.chat_template = processor.tokenizer.chat_template = qwen3_5_think_chat_template
    return model, processor


def _ids(processor, **template_kwargs):
    conversation = [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}]
    text = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False, **template_kwargs)
    return processor.tokenizer(text)["input_ids"]


def test_prompt_ids_tell_whether_the_template_opened_the_thinking(tiny_dir):
    _, processor = _thinking_model(tiny_dir)
    opened, closed = _ids(processor), _ids(processor, enable_thinking=False)  # `<think>\n\n</think>\n\n`: closed
    _, plain = FastVisionModel.from_pretrained(tiny_dir("qwen3_vl", tools=True, words=COLORS))
    assert prompts_open_thinking(processor, [opened, closed, _ids(plain), opened]) == [True, False, False, True]
    # Left-padded rows of one tensor, as `model.generate` takes them.
    pad = processor.tokenizer.pad_token_id
    padded = torch.tensor([closed, [pad] * (len(closed) - len(opened)) + opened])
    assert prompts_open_thinking(processor, padded) == [False, True]


def test_mark_thinking_copies_each_row_and_refuses_misaligned_flags():
    rows = [{"answer": "red"}, {"answer": "blue"}]
    assert mark_thinking(rows, [True, False]) == [{"answer": "red", THINKING_COLUMN: True},
                                                  {"answer": "blue", THINKING_COLUMN: False}]  # fmt: skip
    assert rows == [{"answer": "red"}, {"answer": "blue"}]  # the trainer's own rows unchanged
    with pytest.raises(RuntimeError, match="must align"):
        mark_thinking(rows, [True])


def _rows():
    return [{"prompt": QUESTION, "image": Image.new("RGB", (64, 64), c), "answer": a}
            for c, a in (((255, 0, 0), "red"), ((0, 0, 255), "blue"))]  # fmt: skip


@pytest.mark.trains
def test_trainer_and_evaluate_tell_every_reward_the_prompt_opened_the_thinking(tiny_dir, tmp_path):
    model, processor = _thinking_model(tiny_dir)
    seen: list[list[bool]] = []

    def spy(prompts, completions, **columns):
        seen.append(columns[THINKING_COLUMN])
        return [0.0] * len(completions)

    config = VLMGRPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=2, max_completion_length=4,
        max_steps=1, report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
    )  # fmt: skip
    trainer = VLMGRPOTrainer(model, spy, args=config, train_dataset=Dataset.from_list(_rows()),
                             processing_class=processor)  # fmt: skip
    trainer.train()
    assert seen and all(flags == [True] * 4 for flags in seen)

    seen.clear()
    evaluate(model, processor, Dataset.from_list(_rows()), spy, max_new_tokens=2)
    assert seen == [[True, True]]
    seen.clear()
    evaluate(model, processor, Dataset.from_list(_rows()), spy, max_new_tokens=2,
             chat_template_kwargs={"enable_thinking": False})  # fmt: skip
    assert seen == [[False, False]]
