"""Resuming from a run's checkpoints: which `checkpoint-N` directories are complete, and loading the full weights
of one into the model being trained.

transformers writes a checkpoint file by file into `output_dir/checkpoint-N` (weights, optimizer, scheduler, RNG
state, then `trainer_state.json`), so a run killed during a save leaves a directory that looks like a checkpoint but
is not one; its `get_last_checkpoint` picks it all the same. `incomplete_reason` decides from the files themselves
(any transformers checkpoint, ours or not) and `newest_complete_checkpoint` skips what it names. The previous
checkpoint survives a kill during a save: transformers' `save_total_limit` rotation runs only after the new
checkpoint's `trainer_state.json` is written, and keeps the newest.

`load_full_weights` is the resume side of `save_pretrained`: transformers saves a VLM's weights under the Hub's
original names (Qwen2.5-VL's `model.layers.*` for the model's `model.language_model.layers.*`), but its Trainer
reloads them with `load_state_dict` on the saved names, so all but the LM head stay as they were, with only a warning
(transformers issue #43701).
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import zipfile
from typing import Any

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import (
    ADAPTER_SAFE_WEIGHTS_NAME,
    ADAPTER_WEIGHTS_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
)

__all__ = ["checkpoint_dirs", "incomplete_reason", "load_full_weights", "newest_complete_checkpoint"]

logger = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.json"
SCHEDULER = "scheduler.pt"
_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")  # transformers' own pattern (get_last_checkpoint)
_WEIGHT_FILES = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, ADAPTER_SAFE_WEIGHTS_NAME, WEIGHTS_NAME,
                 WEIGHTS_INDEX_NAME, ADAPTER_WEIGHTS_NAME)  # fmt: skip
# Sharded layouts keep weights and optimizer state in directories: FSDP's `pytorch_model_fsdp_0` and `optimizer_0`,
# DeepSpeed's `global_step<N>` (which also holds its scheduler).
_SHARDED_WEIGHTS = ("pytorch_model_fsdp", "global_step")


def checkpoint_dirs(output_dir: str | os.PathLike) -> list[str]:
    """The `checkpoint-N` directories of `output_dir` (complete or not), oldest step first; [] if it does not exist."""
    output_dir = os.fspath(output_dir)
    if not os.path.isdir(output_dir):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(output_dir) if (m := _CHECKPOINT.match(name))]
    return [
        os.path.join(output_dir, name) for _, name in sorted(found) if os.path.isdir(os.path.join(output_dir, name))
    ]


def incomplete_reason(checkpoint: str | os.PathLike) -> str | None:
    """Why `checkpoint` cannot be resumed from, in a few words (None: it is complete).

    Complete means: `trainer_state.json` parses and its `global_step` is the directory's N; the weights (full,
    sharded or adapter) and the optimizer and scheduler state are there (transformers would silently resume with a
    fresh optimizer without them); and no file was cut short: every `.safetensors` file is as long as its header
    says, every `torch.save` file (`.pt`, `.pth`, `.bin`) ends with its zip directory, every `.json` file parses and
    every shard an index names is there. Only headers, file ends and JSON files are read, so a large checkpoint is
    checked in moments.
    """
    checkpoint = os.fspath(checkpoint)
    if not os.path.isdir(checkpoint):
        return "not a directory"
    names = set(os.listdir(checkpoint))
    if TRAINER_STATE not in names:
        return f"no {TRAINER_STATE} (the save was interrupted)"
    for name in sorted(names):
        if problem := _damaged(os.path.join(checkpoint, name)):
            return f"{name} {problem}"
    with open(os.path.join(checkpoint, TRAINER_STATE)) as f:
        step = json.load(f).get("global_step")
    match = _CHECKPOINT.match(os.path.basename(os.path.normpath(checkpoint)))
    if match and step != int(match.group(1)):
        return f"{TRAINER_STATE} is for step {step}, not {match.group(1)}"
    sharded = [name for name in names if os.path.isdir(os.path.join(checkpoint, name))]
    if not names.intersection(_WEIGHT_FILES) and not any(d.startswith(_SHARDED_WEIGHTS) for d in sharded):
        return "no model weights"
    for index in names.intersection((SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_INDEX_NAME)):
        with open(os.path.join(checkpoint, index)) as f:
            missing = sorted(set(json.load(f).get("weight_map", {}).values()) - names)
        if missing:
            return f"{index} names missing shards ({', '.join(missing[:3])})"
    if not any("optimizer" in name or name.startswith("global_step") for name in names):
        return "no optimizer state (a --save_only_model checkpoint cannot be resumed)"
    if SCHEDULER not in names and not any(d.startswith("global_step") for d in sharded):
        return f"no {SCHEDULER}"
    return None


def _damaged(path: str) -> str | None:
    """What is wrong with one file of a checkpoint, judged by its format (None: nothing found)."""
    if not os.path.isfile(path):
        return None
    size = os.path.getsize(path)
    if path.endswith((".safetensors", ".pt", ".pth", ".bin", ".json")) and size == 0:
        return "is empty"
    try:
        if path.endswith(".safetensors"):
            with open(path, "rb") as f:
                (header_size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(header_size))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
            if size != 8 + header_size + end:
                return "is truncated"
        elif path.endswith((".pt", ".pth", ".bin")):
            if not zipfile.is_zipfile(path):  # torch.save's zip format ends with its directory: gone when cut short
                return "is truncated"
        elif path.endswith(".json"):
            with open(path) as f:
                json.load(f)
    except (ValueError, KeyError, TypeError, struct.error):
        return "is truncated or unreadable"
    return None


def newest_complete_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The complete checkpoint of `output_dir` with the highest step (None if there is none); each newer incomplete
    one skipped is logged with its reason."""
    for checkpoint in reversed(checkpoint_dirs(output_dir)):
        reason = incomplete_reason(checkpoint)
        if reason is None:
            return checkpoint
        logger.warning("Skipping %s, which is incomplete: %s.", checkpoint, reason)
    return None


def load_full_weights(model: Any, checkpoint: str | os.PathLike) -> bool:
    """Load the full weights `save_pretrained` wrote to `checkpoint` into `model`, each saved name mapped back to the
    model's own; False (nothing loaded) where the saved names are the model's, for the caller's plain load.

    The names are mapped by inverting the save itself: transformers' `revert_weight_conversion` renames the model's
    own state dict as `save_pretrained` does, and each renamed tensor is the model's tensor under its saved name.
    Raises `ValueError` if a saved weight has no place in the model or a weight of the model is not in the
    checkpoint (tied weights excepted), instead of training on from partly loaded weights.
    """
    from safetensors.torch import load_file
    from transformers.core_model_loading import revert_weight_conversion

    checkpoint = os.fspath(checkpoint)
    files = _safetensors_files(checkpoint)
    if not files or not hasattr(model, "config"):
        return False
    own = model.state_dict()
    by_tensor = {id(tensor): name for name, tensor in own.items()}
    saved_to_own = {saved: by_tensor.get(id(t)) for saved, t in revert_weight_conversion(model, dict(own)).items()}
    if all(saved == name for saved, name in saved_to_own.items()):
        return False
    converted = sorted(saved for saved, name in saved_to_own.items() if name is None)
    if converted:  # merged or split on save (fused MoE experts): not a renaming this can invert
        raise ValueError(
            f"Cannot resume the full weights of {type(model).__name__} from {checkpoint}: transformers saves "
            f"{len(converted)} of them converted, not only renamed ({', '.join(converted[:3])}), and loading them as "
            "saved would leave those weights untrained."
        )
    loaded: set[str] = set()
    for file in files:
        state = load_file(os.path.join(checkpoint, file))
        unknown = sorted(name for name in state if name not in saved_to_own)
        if unknown:
            raise ValueError(
                f"{checkpoint}: {len(unknown)} saved weight(s) have no place in the model ({', '.join(unknown[:3])}); "
                "was it saved from another model?"
            )
        renamed = {saved_to_own[name]: tensor for name, tensor in state.items()}
        model.load_state_dict(renamed, strict=False)
        loaded.update(renamed)
    # A tied weight (the LM head sharing the embedding) is saved once and loads through its twin.
    storage = {own[name].data_ptr() for name in loaded}
    missing = sorted(name for name in own if name not in loaded and own[name].data_ptr() not in storage)
    if missing:
        raise ValueError(
            f"{checkpoint}: {len(missing)} weight(s) of the model are not in it ({', '.join(missing[:3])})."
        )
    return True


def _safetensors_files(checkpoint: str) -> list[str]:
    """The full-model safetensors files of a checkpoint (the shards its index names, or the one file)."""
    index = os.path.join(checkpoint, SAFE_WEIGHTS_INDEX_NAME)
    if os.path.isfile(index):
        with open(index) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    return [SAFE_WEIGHTS_NAME] if os.path.isfile(os.path.join(checkpoint, SAFE_WEIGHTS_NAME)) else []
