"""Where TRL mishandles a family, our overrides fix it; each test shows TRL's own behaviour next to ours.

- PaliGemma: TRL extends `token_type_ids` with zeros over the completion, which puts it into PaliGemma's bidirectional
  prefix (an earlier token's log-prob sees later tokens); ours scores it causally on every path.
- LLaVA-OneVision: TRL's scoring raises TypeError on `batch_num_images`, and without it a row with two images is
  tiled as if each were its only one; ours gives each forward its rows' counts.
- PaliGemma and Mistral 3 (Pixtral): TRL's `_tokenize_prompts` crashes on prompts of different lengths; ours processes
  them one by one, as a batched call would (Pixtral's images padded alike), PaliGemma's `labels` dropped.
- PaliGemma 2 (Gemma 2 text, no sdpa in transformers 5.2x): TRL's reference reload for a full fine-tune raised.
"""

import contextlib

import pytest
import torch
from conftest import trl_logps
from datasets import Dataset
from PIL import Image
from trl import GRPOTrainer

from vlm_grpo.blocked_tokens import scoring_as_sampled
from vlm_grpo.models.loader import FastVisionModel
from vlm_grpo.training.trainer import VLMGRPOConfig, VLMGRPOTrainer

RED, BLUE = Image.new("RGB", (56, 56), (255, 0, 0)), Image.new("RGB", (84, 56), (0, 0, 255))
TALL = Image.new("RGB", (28, 112), (0, 255, 0))  # fed to the tiny Pixtral as 16 x 32 (its 16 px merged patches)


def _zero_reward(prompts, completions, **kwargs):
    return [0.0] * len(completions)


def _user(images, text):
    return [
        {"role": "user", "content": [*({"type": "image", "image": i} for i in images), {"type": "text", "text": text}]}
    ]


def _make_trainer(tiny_dir, tmp_path, family, full=False, **config):
    model, processor = FastVisionModel.from_pretrained(tiny_dir(family), full_finetuning=full)
    if not full:
        model = FastVisionModel.get_peft_model(model, r=4, init_lora_weights=False)
    args = VLMGRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2, max_completion_length=4,
        report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True, **config,
    )  # fmt: skip
    dataset = Dataset.from_list([{"prompt": "What colour ?", "images": [RED]}] * 2)
    return VLMGRPOTrainer(model, [_zero_reward], args=args, train_dataset=dataset, processing_class=processor)


@pytest.fixture(scope="module")
def trainers(tiny_dir, tmp_path_factory):
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = _make_trainer(tiny_dir, tmp_path_factory.mktemp(family), family)
        return cache[family]

    return get


def _batch(trainer, prompts, images, completions):
    """TRL's scoring inputs: its padded processor call's outputs, the completion appended, `token_type_ids` extended
    with zeros as TRL extends them."""
    processor = trainer.processing_class
    texts = processor.apply_chat_template(prompts, add_generation_prompt=True, tokenize=False)
    fields = dict(processor(text=texts, images=images, padding=True, return_tensors="pt"))
    completion = torch.tensor(completions)
    input_ids = torch.cat([fields.pop("input_ids"), completion], 1)
    attention_mask = torch.cat([fields.pop("attention_mask"), torch.ones_like(completion)], 1)
    if "token_type_ids" in fields:
        fields["token_type_ids"] = torch.cat([fields["token_type_ids"], torch.zeros_like(completion)], 1)
    fields["num_images"] = [len(row) for row in images]
    return input_ids, attention_mask, completion.size(1), fields


def _ours(trainer, model, batch, shared, **kwargs):
    trainer.args.shared_prefix = shared
    input_ids, attention_mask, keep, fields = batch
    with torch.no_grad():
        return VLMGRPOTrainer._get_per_token_logps_and_entropies(
            trainer, model, input_ids, attention_mask, keep, **fields, **kwargs
        )[0]


@pytest.mark.trains
def test_paligemma_completions_are_scored_causally_on_every_path(trainers):
    trainer = trainers("paligemma")
    # Two rows alike but for their last completion token: the earlier tokens' log-probs must not see it.
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour ?"}]}]
    words = trainer.processing_class.tokenizer.convert_tokens_to_ids(["shape", "image", "one", "word"])
    batch = _batch(trainer, [prompt, prompt], [[RED], [RED]], [words[:3], words[:2] + words[3:]])
    assert "labels" in batch[3]  # the processor's, as TRL passes them on to its reference and old log-probs
    for reference in (False, True):  # the policy, and the KL reference (TRL's: the adapter disabled)
        with trainer.model.disable_adapter() if reference else contextlib.nullcontext():
            for shared in (False, True):
                calls = trainer.shared_prefix_calls
                logps = _ours(trainer, trainer.model, batch, shared)
                assert trainer.shared_prefix_calls == calls + shared
                assert torch.allclose(logps[0, :2], logps[1, :2], atol=1e-6)
                assert (logps[0, 2] - logps[1, 2]).abs() > 1e-3
    # TRL's own: the completion joins the bidirectional prompt, so the earlier tokens see the later one.
    input_ids, attention_mask, keep, fields = batch
    fields = {k: v for k, v in fields.items() if k != "labels"}
    with torch.no_grad():
        trl = trl_logps(trainer, trainer.model, input_ids, attention_mask, keep, **fields)[0]
    assert (trl[0, :2] - trl[1, :2]).abs().max() > 1e-3


class _WithImageCounts(torch.nn.Module):
    """The model called with LLaVA-OneVision's `batch_num_images` for the one row TRL's method scores."""

    def __init__(self, model, count):
        super().__init__()
        self.model, self.count = model, count

    def forward(self, **kwargs):
        return self.model(**kwargs, batch_num_images=torch.tensor([self.count]))


@pytest.mark.trains
def test_llava_onevision_forwards_get_their_rows_image_counts(trainers):
    trainer = trainers("llava_onevision")
    one = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour ?"}]}]
    two = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "which ?"}]}]
    batch = _batch(trainer, [one, two, two], [[RED], [RED, BLUE], [RED, BLUE]], [[20, 21, 22]] * 3)
    input_ids, attention_mask, keep, fields = batch
    assert fields["batch_num_images"].tolist() == [1, 2, 2]
    # Each row alone, given its own count: the model's own reading of the batch.
    images = [slice(0, 1), slice(1, 3), slice(3, 5)]
    expected = []
    with torch.no_grad():
        for row, (count, span) in enumerate(zip([1, 2, 2], images)):
            row_fields = {"pixel_values": fields["pixel_values"][span], "image_sizes": fields["image_sizes"][span]}
            with scoring_as_sampled(trainer, trainer.model):
                logps = GRPOTrainer._get_per_token_logps_and_entropies(
                    trainer, _WithImageCounts(trainer.model, count), input_ids[row : row + 1],
                    attention_mask[row : row + 1], keep, num_images=[count], **row_fields,
                )[0]  # fmt: skip
            expected.append(logps)
    expected = torch.cat(expected)
    for shared, batch_size in ((False, None), (False, 1), (False, 2), (True, None), (True, 1)):
        got = _ours(trainer, trainer.model, batch, shared, batch_size=batch_size)
        assert (got - expected).abs().max() < 1e-4, (shared, batch_size)
    # TRL's own: TypeError on the processor's `batch_num_images` (its old-policy and reference paths pass it) ...
    with pytest.raises(TypeError, match="batch_num_images"), torch.no_grad():
        trl_logps(trainer, trainer.model, input_ids, attention_mask, keep, **fields)
    # ... and its loss path, without it, tiles each of a row's two images as if it were alone: features mismatch.
    fields = {k: v for k, v in fields.items() if k != "batch_num_images"}
    with pytest.raises(ValueError, match="Image features and image tokens do not match"), torch.no_grad():
        trl_logps(trainer, trainer.model, input_ids, attention_mask, keep, **fields)


@pytest.mark.trains
@pytest.mark.parametrize("family", ["paligemma", "mistral3"])
def test_prompts_of_different_lengths_tokenize_one_by_one(trainers, family):
    trainer = trainers(family)
    short, long = _user([RED], "What colour ?"), _user([TALL], "which shape is in the image ? answer with one word")
    try:  # TRL's own fails on Pixtral's unpadded tensors (and on PaliGemma's labels array before transformers 5.25)
        theirs = [list(map(int, row)) for row in GRPOTrainer._tokenize_prompts(trainer, [short, long])[0]]
    except ValueError:
        theirs = None
    assert theirs is None or family == "paligemma"
    prompt_ids, images, fields = trainer._tokenize_prompts([short, long, short, long])
    alone = [list(map(int, GRPOTrainer._tokenize_prompts(trainer, [prompt])[0][0])) for prompt in (short, long)]
    assert prompt_ids == alone * 2 and len(prompt_ids[0]) != len(prompt_ids[1])
    assert theirs is None or theirs == alone
    assert [len(row) for row in images] == [1, 1, 1, 1] and "labels" not in fields
    # The vision tensors as one padded call gives them (TRL's scoring inputs): Pixtral pads the shorter image.
    processor = trainer.processing_class
    texts = processor.apply_chat_template([short, long, short, long], add_generation_prompt=True, tokenize=False)
    padded = processor(text=texts, images=[[RED], [TALL], [RED], [TALL]], padding=True, return_tensors="pt")
    assert torch.equal(torch.as_tensor(fields["pixel_values"]), padded["pixel_values"])
    if family == "mistral3":
        assert torch.equal(torch.as_tensor(fields["image_sizes"]), padded["image_sizes"])
        assert fields["image_sizes"][0].tolist() != fields["image_sizes"][1].tolist()


@pytest.mark.trains
def test_paligemma2_full_fine_tune_gets_its_reference_model(tiny_dir, tmp_path):
    trainer = _make_trainer(tiny_dir, tmp_path, "paligemma", full=True, beta=0.04)
    # transformers chose sdpa for the vision tower and eager for Gemma 2, and TRL reloads the reference with the
    # top-level choice, which Gemma 2 refused (ValueError); the model loads eager throughout instead.
    assert trainer.model.config._attn_implementation == "eager" and trainer.ref_model is not None
    assert trainer.ref_model.config.get_text_config()._attn_implementation == "eager"
