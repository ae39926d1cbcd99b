"""One record per vision-language model family: everything the package knows about each, in one place.

Families differ in ways several modules care about: the processor class (and whether it bundles a video processor
that needs torchvision), whether the processor resizes images by a pixel budget of its own, where the vision tower
and projector live (LoRA selection, 4-bit loading, the requires-grad hooks), how text positions are encoded (Qwen's
3-D rotary positions), what the text model's attention mask may look like, and the frame boxes are written in.
Each module used to keep its own table of these, and the copies drifted apart; now they all read :data:`FAMILIES`,
so supporting a family (or a new fact about one) is a change to one record here.

Records are keyed by ``config.model_type``. Every fact is checked against the real models, processors and
transformers' own mappings by ``tests/test_families.py``. Light to import (no torch or transformers at import
time), so the `vlm-grpo` command's help and the reward modules can read it.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

__all__ = [
    "FAMILIES",
    "Family",
    "core_model",
    "family_of",
    "find_family",
    "model_type_of",
    "model_types",
    "projector_names",
    "vision_tower_names",
]

Rope = Literal["mrope", "1d"]
VideoBudget = Literal["frame", "clip"]
BoxFrame = Literal["qwen2_vl", "qwen2_5_vl"]

# Processors without a video part that still need `vlm_grpo.media.standins` to build without torchvision.
_STANDIN_PROCESSORS = ("PaliGemmaProcessor", "PixtralProcessor")

# Attribute names other (unregistered) transformers VLMs keep their vision encoder under, so the hooks and 4-bit
# loading still find it in a VLM without a record here (e.g. LightOnOCR's `vision_encoder`).
OTHER_VISION_TOWER_NAMES = ("vision_encoder", "image_encoder")


@dataclass(frozen=True)
class Family:
    """What the package knows about one VLM family (one ``config.model_type``).

    Module names are attribute names (the last part of a name in ``model.named_modules()``), not full paths: the
    paths moved between transformers releases (``model.visual`` vs ``visual``), the attribute names did not.
    """

    model_type: str
    #: "mrope": 3-D rotary positions (temporal, height, width) from the model's ``get_rope_index`` (Qwen-VL);
    #: "1d": ordinary positions.
    rope: Rope
    #: The processor's class name in transformers.
    processor_class: str
    #: The ``transformers.models.<name>`` package that defines the family's image processors (Qwen2.5-VL and
    #: Qwen3-VL reuse Qwen2-VL's), and the name of the PIL one there, which works without torchvision; a ``vlm_grpo.``
    #: module path names our stand-in where transformers has no PIL variant.
    image_package: str
    pil_image_processor: str
    #: Whether the processor resizes every image by a pixel budget of its own, kept in
    #: ``image_processor.size["shortest_edge"]`` (min_pixels) / ``["longest_edge"]`` (max_pixels), as Qwen-VL's
    #: ``smart_resize`` does; otherwise it resizes to a fixed input size and a budget can only be applied before it.
    pixel_budget: bool
    #: The video processor class the processor bundles (None: images only). Its base class imports torchvision, so
    #: without it `vlm_grpo.media.video_processor` stands in (PIL and torch only).
    video_processor: str | None
    #: What the video processor's pixel budget (``video_processor.size``) bounds: each frame's area ("frame",
    #: Qwen2/2.5-VL) or frames x area of the whole clip ("clip", Qwen3-VL); None without video.
    video_budget: VideoBudget | None
    #: Attribute name of the vision encoder, and of the module that maps its features into the language model
    #: (inside the vision tower for Qwen-VL).
    vision_tower: str
    projector: str
    #: What the processor returns for images besides ``input_ids`` / ``attention_mask``.
    image_inputs: tuple[str, ...]
    #: The processor output that marks image tokens with 1 (text 0), or None when it returns none.
    token_type_key: str | None
    #: Config attributes holding the ids of the placeholder tokens that image (and video) features replace.
    image_token_attrs: tuple[str, ...]
    #: Whether the text model takes ``attention_mask`` as a ``{layer type: 4-D mask}`` dict (needed to give
    #: sliding-window layers their own mask); the others build their masks from one tensor.
    dict_mask: bool
    #: Whether image tokens attend to every token of their own image, not only to earlier ones (Gemma 3).
    bidirectional_image_attention: bool
    #: The frame the family writes boxes in (see `vlm_grpo.rewards.grounding`); None: no native frame.
    box_frame: BoxFrame | None
    #: Whether shared-prefix scoring (`vlm_grpo.engine.shared_prefix`) serves it: checked against the unpacked forward.
    shared_prefix: bool
    #: Whether `vlm_grpo.tiny.build_tiny_vlm` builds an offline tiny model of it (tests, the demo).
    tiny: bool
    #: Prefix-LM attention (PaliGemma): the whole prompt attends bidirectionally, the completion causally; the model
    #: tells them apart by ``token_type_ids`` (0 prompt, 1 completion), so a scored completion must be marked 1.
    prefix_lm: bool = False
    #: Processor outputs no forward takes, dropped where processor outputs enter (PaliGemma's all -100 ``labels``).
    forward_drops: tuple[str, ...] = ()
    #: The forward input holding each row's image count (LLaVA-OneVision's ``batch_num_images``: one image per row
    #: is tiled, several are not), computed for each forward from its rows' ``num_images``.
    images_per_row_input: str | None = None
    #: Whether the processor takes a batch of prompts that tokenize to different lengths without padding
    #: (PaliGemma's `labels` and Pixtral's tensors do not); if not, distinct prompts are processed one by one.
    batched_prompts: bool = True
    #: Without a pixel budget of ours: the most elongated image (long side : short side) the processor takes (GLM-4V's
    #: own `smart_resize` raises over 200:1), checked up front; None: any.
    max_aspect_ratio: float | None = None

    @property
    def needs_torchvision_standins(self) -> bool:
        """Whether its processor cannot be built as transformers ships it without torchvision: it bundles a video
        processor, or needs a stand-in (`vlm_grpo.media.standins`; PaliGemma's image token count, Pixtral's import)."""
        return self.video_processor is not None or self.processor_class in _STANDIN_PROCESSORS

    @property
    def supports_video(self) -> bool:
        """Whether the processor takes videos (it bundles a video processor)."""
        return self.video_processor is not None

    @property
    def trains_on_clips(self) -> bool:
        """Whether the trainer serves its clips: the video budget has a rule for it (Qwen-VL); a bundled video
        processor alone (`supports_video`) is not enough."""
        return self.video_budget is not None

    def image_token_ids(self, config: Any) -> set[int]:
        """Ids of the image (and video) placeholder tokens in `config` (the model's config)."""
        values = (getattr(config, name, None) for name in self.image_token_attrs)
        return {v for v in values if isinstance(v, int)}

    def pil_image_processor_class(self) -> type:
        """The family's PIL image processor class, imported from its module (the top-level transformers name is a
        torchvision-guarded placeholder in some releases)."""
        package = self.image_package
        # A package path of ours names a stand-in module (transformers ships the family's processor for torchvision only).
        module = importlib.import_module(
            package
            if package.startswith("vlm_grpo.")
            else f"transformers.models.{package}.image_processing_pil_{package}"
        )
        return getattr(module, self.pil_image_processor)


_QWEN2_VL = Family(
    model_type="qwen2_vl",
    rope="mrope",
    processor_class="Qwen2VLProcessor",
    image_package="qwen2_vl",
    pil_image_processor="Qwen2VLImageProcessorPil",
    pixel_budget=True,
    video_processor="Qwen2VLVideoProcessor",
    video_budget="frame",
    vision_tower="visual",
    projector="merger",
    image_inputs=("pixel_values", "image_grid_thw"),
    token_type_key="mm_token_type_ids",
    image_token_attrs=("image_token_id", "video_token_id"),
    dict_mask=True,
    bidirectional_image_attention=False,
    box_frame="qwen2_vl",  # a 0-1000 grid over the image
    shared_prefix=True,
    tiny=True,
)
# Qwen2.5-VL writes boxes in pixels of the image its processor resized.
_QWEN2_5_VL = dataclasses.replace(
    _QWEN2_VL, model_type="qwen2_5_vl", processor_class="Qwen2_5_VLProcessor", box_frame="qwen2_5_vl"
)
# Qwen3-VL: Qwen2-VL's 0-1000 box grid again; its text model builds its mask from one tensor (it has no sliding-window
# layers to give another).
_QWEN3_VL = dataclasses.replace(
    _QWEN2_VL, model_type="qwen3_vl", processor_class="Qwen3VLProcessor", video_processor="Qwen3VLVideoProcessor",
    video_budget="clip", dict_mask=False,
)  # fmt: skip
# The mixture-of-experts text model (Qwen3-VL-30B-A3B) under the same vision side.
_QWEN3_VL_MOE = dataclasses.replace(_QWEN3_VL, model_type="qwen3_vl_moe")
# Qwen3.5: Qwen3-VL's processor, positions and video, over a hybrid text model whose linear-attention layers (gated
# delta rule: a convolution and a recurrent state) cannot be packed behind a shared prompt with a 4-D mask; shared-prefix
# scoring continues each group's prompt cache instead (`vlm_grpo.engine.prefix_cache`). The MoE variant routes experts.
_QWEN3_5 = dataclasses.replace(_QWEN3_VL, model_type="qwen3_5")
_QWEN3_5_MOE = dataclasses.replace(_QWEN3_VL, model_type="qwen3_5_moe")

_GEMMA3 = Family(
    model_type="gemma3",
    rope="1d",
    processor_class="Gemma3Processor",
    image_package="gemma3",
    pil_image_processor="Gemma3ImageProcessorPil",
    pixel_budget=False,  # every image becomes one fixed square
    video_processor=None,
    video_budget=None,
    vision_tower="vision_tower",
    projector="multi_modal_projector",
    image_inputs=("pixel_values",),
    token_type_key="token_type_ids",
    image_token_attrs=("image_token_index",),
    dict_mask=True,
    bidirectional_image_attention=True,
    box_frame=None,
    shared_prefix=True,
    tiny=True,
)

# Idefics3, which SmolVLM (v1) checkpoints are: a Llama text model.
_IDEFICS3 = Family(
    model_type="idefics3",
    rope="1d",
    processor_class="Idefics3Processor",
    image_package="idefics3",
    pil_image_processor="Idefics3ImageProcessorPil",
    pixel_budget=False,  # the longest edge is resized to size["longest_edge"], then cut into tiles
    video_processor=None,
    video_budget=None,
    vision_tower="vision_model",
    projector="connector",
    image_inputs=("pixel_values", "pixel_attention_mask"),
    token_type_key=None,
    image_token_attrs=("image_token_id",),
    dict_mask=False,
    bidirectional_image_attention=False,
    box_frame=None,
    shared_prefix=True,
    tiny=True,
)

# SmolVLM (SmolVLM2 checkpoints): Idefics3's architecture and processor under its own model type, with a video part.
_SMOLVLM = dataclasses.replace(
    _IDEFICS3, model_type="smolvlm", processor_class="SmolVLMProcessor", image_package="smolvlm",
    pil_image_processor="SmolVLMImageProcessorPil", video_processor="SmolVLMVideoProcessor",
)  # fmt: skip

# LLaVA-OneVision: SigLIP + Qwen2; one image per row is tiled (any resolution: a base view and tiles, 5-D
# pixel_values [images, views, C, H, W]), several are not, which the model learns from `batch_num_images`.
_LLAVA_ONEVISION = Family(
    model_type="llava_onevision",
    rope="1d",
    processor_class="LlavaOnevisionProcessor",
    image_package="llava_onevision",
    pil_image_processor="LlavaOnevisionImageProcessorPil",
    pixel_budget=False,  # resized to the best of its grid pinpoints, then cut into tiles
    video_processor="LlavaOnevisionVideoProcessor",
    video_budget=None,  # clips are served for Qwen-VL only (the video budget's rules are theirs)
    vision_tower="vision_tower",
    projector="multi_modal_projector",
    image_inputs=("pixel_values", "image_sizes", "batch_num_images"),
    token_type_key=None,
    image_token_attrs=("image_token_id", "video_token_id"),
    dict_mask=True,
    bidirectional_image_attention=False,
    box_frame=None,
    shared_prefix=True,
    tiny=True,
    images_per_row_input="batch_num_images",
)
# InternVL 3 / 3.5 (transformers-native checkpoints): InternViT + Qwen2; images cut into tiles ([tiles, C, H, W]).
_INTERNVL = dataclasses.replace(
    _LLAVA_ONEVISION, model_type="internvl", processor_class="InternVLProcessor", image_package="got_ocr2",
    pil_image_processor="GotOcr2ImageProcessorPil", video_processor="InternVLVideoProcessor",
    image_inputs=("pixel_values",), image_token_attrs=("image_token_id",), images_per_row_input=None,
)  # fmt: skip
# Mistral 3 (Mistral Small 3.1 / 3.2): Pixtral vision (each image at its own aspect ratio, `image_sizes`) + Mistral.
_MISTRAL3 = dataclasses.replace(
    _INTERNVL, model_type="mistral3", processor_class="PixtralProcessor", image_package="pixtral",
    pil_image_processor="PixtralImageProcessorPil", video_processor=None, image_inputs=("pixel_values", "image_sizes"),
    dict_mask=False, batched_prompts=False,
)  # fmt: skip
# PaliGemma (2): SigLIP + Gemma (2), prefix-LM attention over the whole prompt (its token_type_ids mark prompt 0 and
# completion 1, not images); no chat template on the Hub.
_PALIGEMMA = dataclasses.replace(
    _MISTRAL3, model_type="paligemma", processor_class="PaliGemmaProcessor", image_package="siglip",
    pil_image_processor="SiglipImageProcessorPil", image_inputs=("pixel_values",),
    bidirectional_image_attention=True, prefix_lm=True, forward_drops=("labels",),
)  # fmt: skip
# GLM-4.1V and GLM-4.5V / 4.6V (`glm46v`, the same parts): Qwen2-VL-like vision and 3-D rotary positions. Their
# `smart_resize` budgets frames x area, unlike Qwen's, so the package's pixel budget does not serve them (images are
# fitted before the processor, as for fixed-size processors), nor do clips.
_GLM4V = dataclasses.replace(
    _QWEN2_VL, model_type="glm4v", processor_class="Glm4vProcessor", image_package="glm4v",
    pil_image_processor="Glm4vImageProcessorPil", pixel_budget=False, video_processor="Glm4vVideoProcessor",
    video_budget=None, dict_mask=False, box_frame=None, max_aspect_ratio=200.0,
)  # fmt: skip
_GLM46V = dataclasses.replace(
    _GLM4V, model_type="glm46v", processor_class="Glm46VProcessor", image_package="glm46v",
    pil_image_processor="Glm46VImageProcessorPil", video_processor="Glm46VVideoProcessor",
)  # fmt: skip

# LFM2-VL: LFM2's hybrid text model (short convolutions beside attention: continued from a prompt cache, not packed)
# and a SigLIP2 NaFlex tower fed patch rows with a mask. transformers' image processor needs torchvision; ours is its
# one-tile PIL variant.
_LFM2_VL = Family(
    model_type="lfm2_vl",
    rope="1d",
    processor_class="Lfm2VlProcessor",
    image_package="vlm_grpo.media.lfm2_image_processor",
    pil_image_processor="Lfm2VlImageProcessorPil",
    pixel_budget=False,  # a token budget of its own (min / max image tokens), not an area in size[...]
    video_processor=None,
    video_budget=None,
    vision_tower="vision_tower",
    projector="multi_modal_projector",
    image_inputs=("pixel_values", "pixel_attention_mask", "spatial_shapes"),
    token_type_key=None,
    image_token_attrs=("image_token_id",),
    dict_mask=False,
    bidirectional_image_attention=False,
    box_frame=None,
    shared_prefix=True,
    tiny=True,
)

#: Every known family by ``config.model_type``, in a stable order (the tiny families' order is the tests').
FAMILIES: MappingProxyType[str, Family] = MappingProxyType(
    {
        f.model_type: f
        for f in (
            _QWEN2_VL,
            _QWEN2_5_VL,
            _QWEN3_VL,
            _QWEN3_VL_MOE,
            _QWEN3_5,
            _QWEN3_5_MOE,
            _GEMMA3,
            _IDEFICS3,
            _LLAVA_ONEVISION,
            _PALIGEMMA,
            _GLM4V,
            _GLM46V,
            _INTERNVL,
            _SMOLVLM,
            _MISTRAL3,
            _LFM2_VL,
        )
    }
)


def core_model(model: Any) -> Any:
    """The transformers model under a PEFT wrapper (``PeftModel.get_base_model()``), else `model` itself."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def model_type_of(model_or_config_or_model_type: Any) -> str:
    """``config.model_type`` of a model (PEFT-wrapped or not), of a config, or a model type given as a string."""
    obj = model_or_config_or_model_type
    if isinstance(obj, str):
        return obj
    config = getattr(core_model(obj), "config", None)
    model_type = getattr(config if config is not None else obj, "model_type", None)
    if not isinstance(model_type, str):
        raise TypeError(f"Expected a model, a config or a model type string, got {type(obj).__name__}.")
    return model_type


def find_family(model_or_config_or_model_type: Any) -> Family | None:
    """The family record of a model, config or model type; None for one the package has no record of (for callers
    that work with any VLM and use the record only where there is one)."""
    return FAMILIES.get(model_type_of(model_or_config_or_model_type))


def family_of(model_or_config_or_model_type: Any) -> Family:
    """The family record of a model, config or model type; ValueError naming the known families otherwise."""
    model_type = model_type_of(model_or_config_or_model_type)
    family = FAMILIES.get(model_type)
    if family is None:
        raise ValueError(
            f"Unknown model family {model_type!r} (config.model_type); known families: {', '.join(FAMILIES)}."
        )
    return family


def model_types(where: Callable[[Family], bool] | None = None) -> tuple[str, ...]:
    """Model types of the families for which `where` holds (all when None), in registry order.

    >>> model_types(lambda f: f.rope == "mrope")
    ('qwen2_vl', 'qwen2_5_vl', 'qwen3_vl', 'qwen3_vl_moe')
    """
    return tuple(t for t, f in FAMILIES.items() if where is None or where(f))


def _unique(names: Any) -> tuple[str, ...]:
    return tuple(dict.fromkeys(names))


def vision_tower_names() -> tuple[str, ...]:
    """Attribute names a vision encoder may have: the registered families', then other VLMs' (for unregistered
    ones)."""
    return _unique([*(f.vision_tower for f in FAMILIES.values()), *OTHER_VISION_TOWER_NAMES])


def projector_names() -> tuple[str, ...]:
    """Attribute names of the registered families' projectors (vision features into the language model)."""
    return _unique(f.projector for f in FAMILIES.values())
