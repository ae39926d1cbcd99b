"""Loading a VLM's processor, including on machines without torchvision.

The Qwen2/2.5/3-VL processors bundle a *video* processor whose base class imports torchvision, so
`AutoProcessor.from_pretrained` fails where torchvision is missing (every CPU-only pip install of
torch, for one). Image-only training never touches the video processor, so we build the same
processor class without it: the tokenizer, the PIL image processor and the chat template are the
checkpoint's own.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

from .families import FAMILIES, find_family

__all__ = ["QWEN_PROCESSORS", "build_qwen_processor", "load_processor"]

# model_type -> processor class name in transformers, for the Qwen-VL processors (pixel budget, video part), read from
# the family records (`vlm_grpo.families`).
QWEN_PROCESSORS = {t: f.processor_class for t, f in FAMILIES.items() if f.pixel_budget and f.supports_video}


@functools.cache
def _image_only_class(class_name: str, video_class_name: str) -> type:
    """A subclass of a Qwen processor whose only sub-processors are the image processor and tokenizer.

    `ProcessorMixin` derives a processor's parts from its `__init__` signature, so dropping
    `video_processor` from the signature is what makes the video part optional.
    """
    import transformers

    base = getattr(transformers, class_name)

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        base.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)
        self.video_processor = None

    def save_pretrained(self, save_directory, *args, **kwargs):
        out = base.save_pretrained(self, save_directory, *args, **kwargs)
        _add_video_processor_config(save_directory, self.image_processor, video_class_name)
        return out

    # Saved as the real class name so plain transformers (with torchvision) loads the checkpoint as usual.
    return type(
        class_name, (base,), {"__init__": __init__, "save_pretrained": save_pretrained, "__module__": base.__module__}
    )


_VIDEO_KEYS = (
    "size",
    "patch_size",
    "temporal_patch_size",
    "merge_size",
    "image_mean",
    "image_std",
    "do_resize",
    "do_rescale",
    "rescale_factor",
    "do_normalize",
    "do_convert_rgb",
    "resample",
)


def _add_video_processor_config(save_directory: str | os.PathLike, image_processor: Any, video_class_name: str) -> None:
    """Write the video processor settings (the image processor's) next to a saved image-only processor.

    With torchvision installed, `AutoProcessor` builds the full Qwen processor and needs them; the Hub's
    checkpoints ship them, and ours must too so plain transformers loads what we save.
    """
    path = os.path.join(os.fspath(save_directory), "processor_config.json")
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    if "video_processor" in config:
        return
    image = config.get("image_processor") or image_processor.to_dict()
    video = {k: image[k] for k in _VIDEO_KEYS if k in image}
    video["video_processor_type"] = video_class_name
    config["video_processor"] = video
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    os.replace(tmp, path)


def build_qwen_processor(
    model_type: str, image_processor: Any, tokenizer: Any, chat_template: str | None = None
) -> Any:
    """Build a Qwen-VL processor from an image processor and a tokenizer, without a video processor."""
    if model_type not in QWEN_PROCESSORS:
        raise ValueError(f"{model_type!r} is not a Qwen-VL model type ({', '.join(QWEN_PROCESSORS)}).")
    family = FAMILIES[model_type]
    cls = _image_only_class(family.processor_class, family.video_processor)
    return cls(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template)


def _has_torchvision() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001  (a broken torchvision, e.g. an ABI mismatch, is as good as none)
        return False
    return True


def _load_qwen_image_only(path: str, model_type: str, **kwargs: Any):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    image_processor = FAMILIES[model_type].pil_image_processor_class().from_pretrained(path, **kwargs)
    chat_template = _chat_template(path, tokenizer, **kwargs)
    return build_qwen_processor(model_type, image_processor, tokenizer, chat_template)


def _chat_template(path: str, tokenizer: Any, **kwargs: Any) -> str | None:
    """The checkpoint's chat template: its own file (local folder or Hub), else the tokenizer's."""
    from transformers.utils import cached_file

    for name in ("chat_template.jinja", "chat_template.json"):
        try:
            file = cached_file(path, name, _raise_exceptions_for_missing_entries=False, **kwargs)
        except OSError:
            file = None
        if file:
            with open(file, encoding="utf-8") as f:
                return f.read() if name.endswith(".jinja") else json.load(f)["chat_template"]
    return getattr(tokenizer, "chat_template", None)


def _processor_config(path: str, **kwargs: Any) -> dict:
    from transformers.utils import cached_file

    file = (
        os.path.join(path, "processor_config.json")
        if os.path.isdir(path)
        else cached_file(path, "processor_config.json", _raise_exceptions_for_missing_entries=False, **kwargs)
    )
    if not file or not os.path.exists(file):
        raise OSError(f"{path!r} has no processor_config.json to rebuild its processor from.")
    with open(file, encoding="utf-8") as f:
        return json.load(f)


def _load_with_pil_image_processor(path: str, model_type: str, **kwargs: Any):
    """The checkpoint's processor class, with the PIL variant of its image processor (no torchvision needed)."""
    import importlib

    import transformers
    from transformers import AutoTokenizer

    config = _processor_config(path, **kwargs)
    image_type = (config.get("image_processor") or {}).get("image_processor_type", "")
    pil_name = image_type.removesuffix("Fast").removesuffix("Pil") + "Pil"
    # The family's image-processor package where it has a record (Qwen2.5/3-VL use Qwen2-VL's), else its own.
    family = find_family(model_type)
    package = family.image_package if family is not None else model_type
    try:  # from its module: the top-level name is a torchvision-guarded placeholder in some releases
        module = importlib.import_module(f"transformers.models.{package}.image_processing_pil_{package}")
        pil_class = getattr(module, pil_name, None)
    except ImportError:
        pil_class = None
    processor_class = getattr(transformers, config.get("processor_class", ""), None)
    if pil_class is None or processor_class is None:
        raise ImportError(
            f"{path!r} needs torchvision for its image processor ({image_type or 'unknown'}) and has no PIL variant; "
            "install torchvision matching your torch."
        )
    image_processor = pil_class.from_pretrained(path, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    extra = {k: v for k, v in config.items() if k not in ("image_processor", "video_processor", "processor_class")}
    chat_template = _chat_template(path, tokenizer, **kwargs)
    return processor_class(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template, **extra)


def load_processor(path: str, model_type: str, *, padding_side: str = "left", **kwargs: Any) -> Any:
    """Load the processor of a VLM checkpoint, padded on the left for generation.

    Qwen-VL checkpoints load without torchvision (image-only processor, see the module docstring);
    everything else goes through `AutoProcessor`.
    """
    from transformers import AutoProcessor

    if model_type in QWEN_PROCESSORS and not _has_torchvision():
        processor = _load_qwen_image_only(path, model_type, **kwargs)
    else:
        try:
            processor = AutoProcessor.from_pretrained(path, **kwargs)
        except OSError as error:
            # A checkpoint saved without video-processor settings (older exports): image-only still works.
            if model_type not in QWEN_PROCESSORS or "video processor" not in str(error):
                raise
            processor = _load_qwen_image_only(path, model_type, **kwargs)
        except (ImportError, ValueError) as error:
            # Some transformers releases (5.17) resolve AutoImageProcessor to the torchvision class even though
            # the family ships a PIL one; build the processor around the PIL class ourselves.
            if "torchvision" not in str(error).lower():
                raise
            processor = _load_with_pil_image_processor(path, model_type, **kwargs)
    tokenizer = getattr(processor, "tokenizer", processor)
    tokenizer.padding_side = padding_side
    if tokenizer.pad_token is None:  # generation with batches needs a pad token; eos is the usual stand-in
        tokenizer.pad_token = tokenizer.eos_token
    return processor
