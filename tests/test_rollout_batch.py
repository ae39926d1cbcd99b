"""`vlm_grpo.training.rollout_batch`: TRL's scored rollout batches cut to some rows and joined.

The check is the model: every row of a joined batch must score (TRL's own per-row log-probs) as it did in its own
batch, on every tiny family (each lays its vision tensors out its own way) and with parts of different widths.
"""

from __future__ import annotations

import pytest
import torch
from conftest import colour_rows, user_turn
from datasets import Dataset
from trl import GRPOTrainer

from vlm_grpo.data import answer_words
from vlm_grpo.families import family_of
from vlm_grpo.media.batch_layout import LayoutUnknown
from vlm_grpo.models.loader import FastVisionModel
from vlm_grpo.tiny import TINY_FAMILIES
from vlm_grpo.training.rollout_batch import concat_rollouts, loss_token_count, select_rollouts
from vlm_grpo.training.trainer import VLMGRPOConfig, VLMGRPOTrainer

COLORS = answer_words("color", 1)
MULTIMODAL = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "token_type_ids",
              "mm_token_type_ids", "image_sizes", "spatial_shapes", "num_tiles")  # fmt: skip


def _varied_reward(prompts, completions, **kwargs):
    return [float(i % 3) for i in range(len(completions))]


def _rows(family):
    rows = colour_rows(family)
    text, one, other = rows["text"], rows["one"], rows["other"]
    if family_of(family).prefix_lm:  # PaliGemma's processor takes no prompt without an image
        text = dict(other, prompt=user_turn(None, "Say red."))
    two = dict(rows["two"], prompt=user_turn(None, "and", None, "which colour comes first?"))
    # Two batches: text and one-image rows with short prompts; two-image rows with a longer prompt.
    return [text, text, one, one], [two, two, other, other]


def _trainer(tiny_dir, tmp_path, family):
    model, processor = FastVisionModel.from_pretrained(tiny_dir(family, words=COLORS), full_finetuning=True)
    args = VLMGRPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=2, max_completion_length=6,
        report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
    )  # fmt: skip
    dataset = Dataset.from_list(_rows(family)[0])
    return VLMGRPOTrainer(model, [_varied_reward], args=args, train_dataset=dataset, processing_class=processor)


def _cut_completions(batch: dict, width: int) -> dict:
    """The batch with its completions cut to `width` tokens (still a valid batch: completions are right-padded)."""
    prompt_width = batch["prompt_ids"].shape[1]
    out = dict(batch)
    for key in (
        "completion_ids",
        "completion_mask",
        "old_per_token_logps",
        "ref_per_token_logps",
        "sampling_per_token_logps",
    ):
        if key in out:
            out[key] = out[key][:, :width]
    for key in ("token_type_ids", "mm_token_type_ids"):
        if key in out:
            out[key] = out[key][:, : prompt_width + width]
    return out


def _logps(trainer, batch):
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    # TRL's own per-row method; where it scores a family wrong (PaliGemma's prefix, LLaVA-OneVision's image counts),
    # the trainer's per-row path, which is that method with the fixes (tests/test_scoring_fixes.py).
    family = family_of(trainer.model)
    method = GRPOTrainer._get_per_token_logps_and_entropies
    if family.prefix_lm or family.images_per_row_input:
        method = VLMGRPOTrainer._get_per_token_logps_and_entropies
        trainer.args.shared_prefix = False
    with torch.no_grad():
        logps, _, _ = method(
            trainer, trainer.model, input_ids, attention_mask, batch["completion_ids"].size(1),
            **{k: batch[k] for k in MULTIMODAL if k in batch},
        )  # fmt: skip
    return logps


@pytest.mark.trains
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_joined_rows_score_as_in_their_own_batches(tiny_dir, tmp_path, family):
    trainer = _trainer(tiny_dir, tmp_path, family)
    torch.manual_seed(0)
    first, second = (trainer._generate_and_score_completions(rows) for rows in _rows(family))
    second = _cut_completions(second, 3)
    picks = [(first, 3), (first, 0), (first, 2), (second, 1), (second, 2)]
    joined = concat_rollouts(
        [select_rollouts(first, [3, 0, 2]), select_rollouts(second, [1, 2])], trainer._tokenizer.pad_token_id
    )
    assert set(joined) == set(first) - {"num_items_in_batch"}
    assert joined["prompt_ids"].shape[1] == max(first["prompt_ids"].shape[1], second["prompt_ids"].shape[1])
    assert joined["completion_ids"].shape[1] == first["completion_ids"].shape[1] > 3
    text_images = int(family_of(family).prefix_lm)  # PaliGemma's "text" rows hold an image
    assert joined["num_images"] == [first["num_images"][3], text_images, 1, 2, 1]
    assert torch.equal(joined["advantages"], torch.stack([batch["advantages"][row] for batch, row in picks]))
    assert loss_token_count(joined) == sum(int(batch["completion_mask"][row].sum()) for batch, row in picks)

    own = {id(first): _logps(trainer, first), id(second): _logps(trainer, second)}
    together = _logps(trainer, joined)
    for k, (batch, row) in enumerate(picks):
        mask = batch["completion_mask"][row].bool()
        width = mask.shape[0]
        assert mask.any()
        assert (together[k, :width][mask] - own[id(batch)][row][mask]).abs().max() < 1e-4, (family, k)
        assert not joined["completion_mask"][k, width:].any()  # padding added to the shorter part is masked
        if "ref_per_token_logps" in batch:
            assert torch.equal(joined["ref_per_token_logps"][k, :width], batch["ref_per_token_logps"][row])


def _batch(prompt_width: int, completion_width: int, rows: int = 2) -> dict:
    ids = torch.arange(rows * (prompt_width + completion_width)).view(rows, -1) + 10
    return {
        "prompt_ids": ids[:, :prompt_width],
        "prompt_mask": torch.ones(rows, prompt_width, dtype=torch.long),
        "completion_ids": ids[:, prompt_width:],
        "completion_mask": torch.ones(rows, completion_width, dtype=torch.long),
        "advantages": torch.arange(rows, dtype=torch.float),
        "importance_sampling_ratio": torch.full((rows, 1), 0.5),  # sequence level: one value per row
        "mm_token_type_ids": torch.cat([torch.full((rows, prompt_width), 7), torch.zeros(rows, completion_width)], 1),
        "num_items_in_batch": torch.tensor(rows * completion_width),
    }


def test_parts_are_padded_on_the_side_their_tokens_are():
    short, long = _batch(2, 3), _batch(4, 1)
    joined = concat_rollouts([select_rollouts(short, [1]), select_rollouts(long, [0, 1])], pad_token_id=0)
    assert "num_items_in_batch" not in joined  # a count over every process: the caller recomputes it
    assert joined["prompt_ids"][0].tolist() == [0, 0, *short["prompt_ids"][1].tolist()]  # left
    assert joined["prompt_mask"][0].tolist() == [0, 0, 1, 1]
    assert joined["completion_ids"][1].tolist() == [*long["completion_ids"][0].tolist(), 0, 0]  # right
    assert joined["completion_mask"][1].tolist() == [1, 0, 0]
    # Over prompt + completion: each side padded like its tokens, so the prompt's marks stay on the prompt.
    assert joined["mm_token_type_ids"][0].tolist() == [0, 0, 7, 7, 0, 0, 0]
    assert joined["mm_token_type_ids"][1].tolist() == [7, 7, 7, 7, 0, 0, 0]
    assert joined["importance_sampling_ratio"].shape == (3, 1)
    assert joined["advantages"].tolist() == [1.0, 0.0, 1.0]
    assert loss_token_count(joined) == 3 + 1 + 1


def test_what_cannot_be_split_or_joined_is_refused():
    batch = _batch(2, 3) | {"spatial_shapes": torch.ones(5, 2)}  # 5 entries for 2 rows: per image, layout unknown
    with pytest.raises(LayoutUnknown, match="spatial_shapes"):
        select_rollouts(batch, [0])
    with pytest.raises(LayoutUnknown, match="different keys"):
        concat_rollouts([_batch(2, 3), _batch(2, 3) | {"tool_mask": torch.ones(2, 3)}], pad_token_id=0)
