"""What of the processor's outputs reaches a model's forward, decided in one place from the family records.

Some processors return outputs the training forward must not get, or must get in another form:

- PaliGemma's processor always returns `labels` (all -100 without a suffix). Nothing takes them: the generation prefill
  would compute a loss against them, TRL's scoring would pass them on. They are dropped wherever processor outputs
  enter (`drop_outputs`: the prompts' tokenisation and the scoring inputs).
- LLaVA-OneVision's `batch_num_images` (each row's image count: a row's only image is tiled, several are not) belongs
  to the rows of one forward. The processor counts only rows with images; `prompt_fields` makes it one count per row
  (0 for a row without: the model reads the same), so the rows of a batch can be cut and joined. TRL's scoring takes
  no such input (it raises TypeError on it) and cuts a batch into chunks, so the scoring path drops it and gives each
  forward its own rows' counts (`images_per_row_input`).
- PaliGemma attends bidirectionally over the prompt and causally over the completion, told apart by `token_type_ids`
  (0 prompt, 1 completion). TRL extends the prompt's with zeros over the completion, which puts the completion in the
  bidirectional block: an earlier token's log-prob would see later ones. `completion_token_types` marks them 1, as
  generation does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["completion_token_types", "drop_outputs", "images_per_row_input", "prompt_fields", "scoring_inputs"]


def drop_outputs(fields: dict[str, Any], family: Any) -> dict[str, Any]:
    """`fields` without the processor outputs no forward of `family`'s models takes (`Family.forward_drops`)."""
    drops = getattr(family, "forward_drops", ())
    return {k: v for k, v in fields.items() if k not in drops} if drops else fields


def prompt_fields(fields: dict[str, Any], family: Any, images: Sequence[Any] | None) -> dict[str, Any]:
    """The processor's outputs for prompts (`images`: each row's images, None for none) as the rest of the package
    takes them: no output no forward takes, and the per-forward image counts one per row."""
    fields = drop_outputs(fields, family)
    name = getattr(family, "images_per_row_input", None)
    if name is not None and name in fields:
        counts = [len(row or []) for row in images] if images is not None else []
        fields = {**fields, name: torch.tensor(counts, dtype=torch.long)}
    return fields


def completion_token_types(token_type_ids: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
    """A prefix-LM's `token_type_ids` with the last `logits_to_keep` columns (the completion) marked 1 (causal)."""
    types = token_type_ids.clone()
    types[:, types.size(1) - logits_to_keep :] = 1
    return types


def scoring_inputs(family: Any, model_inputs: dict[str, Any], logits_to_keep: int) -> dict[str, Any]:
    """TRL's scoring inputs (`_get_per_token_logps_and_entropies`'s keywords) as `family`'s forward must get them:
    dropped outputs out, the per-forward image counts out (`images_per_row_input` adds them per forward), a prefix-LM's
    completion marked causal."""
    if family is None:
        return model_inputs
    inputs = drop_outputs(model_inputs, family)
    if family.images_per_row_input is not None:
        inputs = {k: v for k, v in inputs.items() if k != family.images_per_row_input}
    if family.prefix_lm and inputs.get("token_type_ids") is not None:
        inputs = {**inputs, "token_type_ids": completion_token_types(inputs["token_type_ids"], logits_to_keep)}
    return inputs


def images_per_row_input(family: Any, num_images: Sequence[int] | None, device: Any = None) -> dict[str, Any]:
    """The forward input holding each of its rows' image counts (`{"batch_num_images": tensor}` for LLaVA-OneVision),
    for the rows `num_images` counts; empty for other families and forwards without images."""
    name = getattr(family, "images_per_row_input", None)
    if name is None or num_images is None or not sum(int(n) for n in num_images):
        return {}
    return {name: torch.tensor([int(n) for n in num_images], device=device)}
