"""Loading a VLM's processor, including on machines without torchvision.

The Qwen2/2.5/3-VL processors bundle a *video* processor whose base class imports torchvision, so
`AutoProcessor.from_pretrained` fails where torchvision is missing (every CPU-only pip install of
torch, for one). There we build the same processor class with the PIL image processor and
`vlm_grpo.media.video_processor.QwenVideoProcessorPil` in place of the torchvision video processor: the
tokenizer, the chat template and every setting are the checkpoint's own.

Other families' processors that bundle a video processor (LLaVA-OneVision, GLM-4.1V / 4.6V, InternVL, SmolVLM) are built
image-only (`build_image_only_processor`), the checkpoint's video settings kept and saved back; PaliGemma's and
Pixtral's (Mistral 3) need a stand-in each (`vlm_grpo.media.standins`). Saved processors carry the real class names,
so plain transformers with torchvision loads them as it loads the Hub's.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
from typing import Any

from ..families import FAMILIES, find_family

__all__ = [
    "QWEN_PROCESSORS",
    "build_image_only_processor",
    "build_paligemma_processor",
    "build_qwen_processor",
    "load_processor",
    "pixtral_processor_class",
]

# model_type -> processor class name in transformers, for the Qwen-VL processors (pixel budget, video part), read from
# the family records (`vlm_grpo.families`).
QWEN_PROCESSORS = {t: f.processor_class for t, f in FAMILIES.items() if f.pixel_budget and f.supports_video}


@functools.cache
def _image_only_class(class_name: str, video_class_name: str) -> type:
    """A subclass of a processor bundling a video processor, whose video processor is not one of its saved parts.

    `ProcessorMixin` derives a processor's parts (checked for their class, saved, loaded) from its `__init__`
    signature, so dropping `video_processor` from the signature lets it hold a stand-in (Qwen's PIL video processor,
    or another family's `standins.VideoSettings`), which transformers' checks would refuse (passing
    `video_processor=None` to the real class fails too), and save that one's settings itself.
    """
    import transformers
    from transformers import ProcessorMixin

    from .standins import VideoSettings, smolvlm_without_num2words

    base = getattr(transformers, class_name)
    smolvlm = class_name == "SmolVLMProcessor"
    building = smolvlm_without_num2words if smolvlm else contextlib.nullcontext

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        video_processor = kwargs.pop("video_processor", None)  # a keyword, not a parameter: see the docstring
        with building():
            base.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)
        # Settings only (another family's dropped video processor) are kept to be saved; there is no video processor.
        settings = isinstance(video_processor, VideoSettings)
        self._video_settings = video_processor if settings else None
        self.video_processor = None if settings else video_processor

    # The processor saves the settings its `__init__` signature names (`num_image_tokens`, `image_seq_length`, ...):
    # the real signature, without the video processor.
    signature = inspect.signature(base.__init__)
    __init__.__signature__ = signature.replace(
        parameters=[p for name, p in signature.parameters.items() if name != "video_processor"]
    )

    def save_pretrained(self, save_directory, *args, **kwargs):
        out = base.save_pretrained(self, save_directory, *args, **kwargs)
        video = self._video_settings or self.video_processor
        _add_video_processor_config(save_directory, self.image_processor, video_class_name, video)
        return out

    methods = {"__init__": __init__, "save_pretrained": save_pretrained, "__module__": base.__module__}
    if smolvlm:  # its own adds only video settings (frame counts, a video template), read off its video processor
        methods["apply_chat_template"] = ProcessorMixin.apply_chat_template
    # Saved as the real class name so plain transformers (with torchvision) loads the checkpoint as usual.
    return type(class_name, (base,), methods)


def _add_video_processor_config(
    save_directory: str | os.PathLike, image_processor: Any, video_class_name: str, video_processor: Any = None
) -> None:
    """Write the video processor settings (the PIL stand-in's, else the image processor's) next to a saved processor.

    With torchvision installed, `AutoProcessor` builds the full Qwen processor and needs them; the Hub's
    checkpoints ship them, and ours must too so plain transformers loads what we save.
    """
    from .video_processor import VIDEO_KEYS

    path = os.path.join(os.fspath(save_directory), "processor_config.json")
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    if "video_processor" in config:
        return
    if video_processor is not None:
        video = video_processor.to_dict()
    else:
        image = config.get("image_processor") or image_processor.to_dict()
        video = {k: image[k] for k in VIDEO_KEYS if k in image}
        video["video_processor_type"] = video_class_name
    config["video_processor"] = video
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    os.replace(tmp, path)


def build_qwen_processor(
    model_type: str,
    image_processor: Any,
    tokenizer: Any,
    chat_template: str | None = None,
    video_processor: Any = None,
) -> Any:
    """Build a Qwen-VL processor from an image processor, a tokenizer and a PIL video processor
    (`vlm_grpo.media.video_processor.QwenVideoProcessorPil`; None: built from the image processor's settings)."""
    from .video_processor import VIDEO_KEYS, QwenVideoProcessorPil

    if model_type not in QWEN_PROCESSORS:
        raise ValueError(f"{model_type!r} is not a Qwen-VL model type ({', '.join(QWEN_PROCESSORS)}).")
    family = FAMILIES[model_type]
    if video_processor is None:
        settings = {k: getattr(image_processor, k, None) for k in VIDEO_KEYS if k != "size"}
        video_processor = QwenVideoProcessorPil(family.video_processor, **settings)  # the family's own video budget
    cls = _image_only_class(family.processor_class, family.video_processor)
    return cls(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template,
        video_processor=video_processor,
    )  # fmt: skip


def build_image_only_processor(
    model_type: str,
    image_processor: Any,
    tokenizer: Any,
    chat_template: str | None = None,
    video_settings: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Any:
    """Build the processor of a family that bundles a (torchvision) video processor without it: the family's processor
    class with `image_processor` (its PIL one) and `tokenizer`, holding the checkpoint's video settings
    (`video_settings`; None: the family's video processor class with the image processor's normalisation) to save them
    back. `kwargs` are the processor's own settings (`num_image_tokens`, `image_seq_length`, ...). Takes no clips."""
    from .standins import VideoSettings

    family = FAMILIES[model_type]
    if family.video_processor is None:
        raise ValueError(f"{model_type!r} has no video processor to leave out; build {family.processor_class} itself.")
    if video_settings is None:
        video_settings = {"video_processor_type": family.video_processor}
        for key in ("image_mean", "image_std", "do_normalize", "do_rescale", "rescale_factor"):
            if getattr(image_processor, key, None) is not None:
                video_settings[key] = getattr(image_processor, key)
    cls = _image_only_class(family.processor_class, family.video_processor)
    return cls(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template,
               video_processor=VideoSettings(video_settings), **kwargs)  # fmt: skip


def build_paligemma_processor(
    image_processor: Any, tokenizer: Any, image_seq_length: int, chat_template: str | None = None
) -> Any:
    """PaliGemma's processor around a SigLIP image processor (the PIL one without torchvision): the processor reads the
    image token count from the image processor's `image_seq_length`, which only PaliGemma's Hub configs carry."""
    from transformers import PaliGemmaProcessor

    image_processor.image_seq_length = int(image_seq_length)
    return PaliGemmaProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template)


def pixtral_processor_class() -> type:
    """transformers' `PixtralProcessor` (Mistral 3), importable without torchvision (`vlm_grpo.media.standins`)."""
    from .standins import pixtral_processor_class as load

    return load()


def _load_without_torchvision(path: str, model_type: str, **kwargs: Any) -> Any:
    """A recorded family's processor from a checkpoint, built around its PIL image processor (no torchvision): the
    checkpoint's tokenizer, chat template and processor settings, and its video settings kept to be saved back."""
    from transformers import AutoTokenizer

    family = FAMILIES[model_type]
    if family.pixel_budget and family.supports_video:
        return _load_qwen_image_only(path, model_type, **kwargs)
    config = _processor_config(path, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    image_config = config.get("image_processor") or {}
    image_processor = family.pil_image_processor_class().from_pretrained(path, **kwargs)
    chat_template = _chat_template(path, tokenizer, **kwargs)
    extra = {k: v for k, v in config.items() if k not in ("image_processor", "video_processor", "processor_class")}
    if family.video_processor is not None:
        video_settings = _video_processor_config(path, **kwargs)
        return build_image_only_processor(model_type, image_processor, tokenizer, chat_template, video_settings,
                                          **extra)  # fmt: skip
    if family.processor_class == "PaliGemmaProcessor":
        seq_length = image_config.get("image_seq_length", getattr(image_processor, "image_seq_length", None))
        if seq_length is None:
            raise ValueError(f"{path!r}: PaliGemma's image processor config has no image_seq_length.")
        return build_paligemma_processor(image_processor, tokenizer, seq_length, chat_template)
    if family.processor_class == "PixtralProcessor":
        return pixtral_processor_class()(image_processor=image_processor, tokenizer=tokenizer,
                                         chat_template=chat_template, **extra)  # fmt: skip
    import transformers

    return getattr(transformers, family.processor_class)(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template, **extra
    )


def _has_torchvision() -> bool:
    from .standins import has_torchvision

    return has_torchvision()


def _load_qwen_image_only(path: str, model_type: str, **kwargs: Any):
    from transformers import AutoTokenizer

    from .video_processor import QwenVideoProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    image_processor = FAMILIES[model_type].pil_image_processor_class().from_pretrained(path, **kwargs)
    chat_template = _chat_template(path, tokenizer, **kwargs)
    video_config = _video_processor_config(path, **kwargs)
    video_processor = (
        QwenVideoProcessorPil.from_dict(video_config, FAMILIES[model_type].video_processor) if video_config else None
    )
    return build_qwen_processor(model_type, image_processor, tokenizer, chat_template, video_processor)


def _video_processor_config(path: str, **kwargs: Any) -> dict | None:
    """The checkpoint's video processor settings: `processor_config.json`'s "video_processor", else
    `video_preprocessor_config.json`; None when it has neither."""
    try:
        config = _processor_config(path, **kwargs).get("video_processor")
    except OSError:
        config = None
    if config:
        return config
    from transformers.utils import cached_file

    try:
        file = cached_file(path, "video_preprocessor_config.json", _raise_exceptions_for_missing_entries=False,
                           **kwargs)  # fmt: skip
    except OSError:
        return None
    if not file:
        return None
    with open(file, encoding="utf-8") as f:
        return json.load(f)


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
        if family is not None and family.pil_image_processor == pil_name:
            pil_class = family.pil_image_processor_class()  # our stand-in where transformers has none
        else:
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

    family = find_family(model_type)
    if family is not None and not _has_torchvision() and family.needs_torchvision_standins:
        processor = _load_without_torchvision(path, model_type, **kwargs)
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
            if family is not None:
                processor = _load_without_torchvision(path, model_type, **kwargs)
            else:
                processor = _load_with_pil_image_processor(path, model_type, **kwargs)
    tokenizer = getattr(processor, "tokenizer", processor)
    tokenizer.padding_side = padding_side
    if tokenizer.pad_token is None:  # generation with batches needs a pad token; eos is the usual stand-in
        tokenizer.pad_token = tokenizer.eos_token
    return processor
