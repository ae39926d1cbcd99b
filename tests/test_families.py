"""The family records (`vlm_grpo.families`) against the real models, processors and transformers' own tables, and the
package's tables derived from them.

Every family is checked on a real model: the tiny ones `build_tiny_vlm` writes, and Qwen3-VL-MoE (no tiny builder)
built by transformers from the tiny Qwen3-VL's config with a mixture-of-experts text model, under the same processor.
"""

import dataclasses
import inspect
import json

import pytest
import torch
import transformers
from conftest import image_batch
from transformers import AutoConfig, AutoModelForImageTextToText, Qwen3VLMoeConfig
from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES
from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES
from transformers.models.auto.video_processing_auto import VIDEO_PROCESSOR_MAPPING_NAMES

from vlm_grpo import tiny
from vlm_grpo.cli import command as cli
from vlm_grpo.compat import cache_kwarg
from vlm_grpo.families import (
    FAMILIES,
    core_model,
    family_of,
    find_family,
    model_type_of,
    model_types,
    projector_names,
    vision_tower_names,
)
from vlm_grpo.media.pixel_budget import resizes_by_pixel_budget
from vlm_grpo.media.processing import check_video_support
from vlm_grpo.media.processor import QWEN_PROCESSORS, build_qwen_processor, load_processor
from vlm_grpo.media.standins import has_torchvision
from vlm_grpo.models import hooks, lora_selection
from vlm_grpo.models import loader as model_module
from vlm_grpo.models.hooks import find_vision_tower
from vlm_grpo.models.loader import FastVisionModel
from vlm_grpo.rewards.grounding import FRAMES, coordinate_frame_for

ALL = list(FAMILIES)
# Image tokens of one 56x56 image where the tiny model has other than 4: LLaVA-OneVision's base view, tile and newlines.
IMAGE_TOKENS = {"llava_onevision": 10}
# Processors that resize by a pixel budget of their own that `vlm_grpo.media.pixel_budget` does not serve: GLM's
# `smart_resize` budgets frames x area (another signature than Qwen's); images are fitted before them instead.
BUDGET_NOT_SERVED = {"glm4v", "glm46v"}
# Sliding-window text models that build every layer's mask from one 4-D mask (PaliGemma 2): shared-prefix scoring
# serves them while the rows fit the window, and refuses longer ones (tests/test_shared_prefix.py).
ONE_MASK_WINDOW = {"paligemma"}


def _qwen3_vl_moe(tiny_dir):
    """A tiny Qwen3-VL-MoE: the tiny Qwen3-VL's config with a 2-expert text model, and the checkpoint's processor."""
    path = tiny_dir("qwen3_vl")
    config = AutoConfig.from_pretrained(path).to_dict()
    drop = ("model_type", "architectures", "dtype", "transformers_version")
    text, vision = (
        {k: v for k, v in config[part].items() if k not in drop} for part in ("text_config", "vision_config")
    )
    text.update(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32, decoder_sparse_step=1)
    ids = {k: config[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
    torch.manual_seed(0)
    moe = Qwen3VLMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    model = AutoModelForImageTextToText.from_config(moe, dtype=torch.float32).eval()
    return model, load_processor(path, "qwen3_vl_moe")


def _real(tiny_dir, model_type):
    """A real (model, processor) of the family, freshly loaded."""
    if model_type == "qwen3_vl_moe":
        return _qwen3_vl_moe(tiny_dir)
    assert FAMILIES[model_type].tiny, f"{model_type} has neither a tiny builder nor a model built here"
    return FastVisionModel.from_pretrained(tiny_dir(model_type))


def _named(model, attribute):
    """The first module of `model` whose name ends in `attribute` (None without one)."""
    return next((m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] == attribute), None)


def test_registry_covers_the_families_the_package_handles():
    assert set(FAMILIES) == {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "gemma3",
                             "idefics3", "llava_onevision", "paligemma", "glm4v", "glm46v", "internvl", "smolvlm",
                             "mistral3", "lfm2_vl"}  # fmt: skip
    for model_type, family in FAMILIES.items():
        assert family.model_type == model_type
        assert family.box_frame is None or family.box_frame in FRAMES
        assert family.rope in ("mrope", "1d")
    with pytest.raises(dataclasses.FrozenInstanceError):
        FAMILIES["gemma3"].rope = "mrope"


@pytest.mark.parametrize("model_type", ALL)
def test_processor_classes_match_transformers_own_tables(model_type):
    family = FAMILIES[model_type]
    assert PROCESSOR_MAPPING_NAMES[model_type] == family.processor_class
    pil = family.pil_image_processor_class()
    assert pil.__name__ == family.pil_image_processor
    if model_type in IMAGE_PROCESSOR_MAPPING_NAMES:  # Qwen3-VL-MoE has no entry: its checkpoints name Qwen2-VL's
        names = IMAGE_PROCESSOR_MAPPING_NAMES[model_type]
        names = names.values() if isinstance(names, dict) else names
        # Our stand-in (transformers ships no PIL variant) saves under the class name transformers maps.
        own = pil().to_dict()["image_processor_type"] if family.image_package.startswith("vlm_grpo.") else None
        assert family.pil_image_processor in names or own in names
    # The pixel budget lives in size["shortest_edge"] / ["longest_edge"] exactly where the family says it does.
    size = {k for k, v in dict(pil().size).items() if v is not None}  # a dict or a SizeDict, by release
    assert ({"shortest_edge", "longest_edge"} <= size) == (family.pixel_budget or model_type in BUDGET_NOT_SERVED)
    assert resizes_by_pixel_budget(pil()) == family.pixel_budget
    # A processor takes videos when its constructor takes a video processor.
    parameters = inspect.signature(getattr(transformers, family.processor_class).__init__).parameters
    assert ("video_processor" in parameters) == family.supports_video == (model_type in VIDEO_PROCESSOR_MAPPING_NAMES)
    if family.supports_video:
        assert hasattr(transformers, family.video_processor)


@pytest.mark.parametrize("model_type", ALL)
def test_record_matches_the_real_model_and_processor(tiny_dir, model_type):
    family = FAMILIES[model_type]
    model, processor = _real(tiny_dir, model_type)
    assert model.config.model_type == model_type and family_of(model) is family
    assert type(processor).__name__ == family.processor_class
    assert resizes_by_pixel_budget(processor) == family.pixel_budget

    inputs = image_batch(processor, n=1)
    assert set(inputs) == {"input_ids", "attention_mask", *family.image_inputs, *family.forward_drops} | (
        {family.token_type_key} if family.token_type_key else set()
    ) | ({"token_type_ids"} if family.prefix_lm else set())
    # The config's placeholder ids are where the image features go: 4 per image in these models, and exactly the
    # tokens the processor's token types mark as image.
    is_image = torch.isin(inputs["input_ids"], torch.tensor(sorted(family.image_token_ids(model.config))))
    assert is_image.sum() == IMAGE_TOKENS.get(model_type, 4)
    if family.token_type_key:
        assert torch.equal(inputs[family.token_type_key] == 1, is_image)

    # The vision tower receives the pixels; the projector outputs image features of the language model's width.
    tower, projector = _named(model, family.vision_tower), _named(model, family.projector)
    assert tower is not None and projector is not None
    assert find_vision_tower(model) is tower
    seen = {}

    def first_tensor(values):
        return next(v for v in values if isinstance(v, torch.Tensor) and v.is_floating_point())

    def tower_input(module, args, kwargs):
        seen.setdefault("tower", first_tensor([*args, *kwargs.values()]))

    def projector_output(module, args, output):
        seen.setdefault("projector", output if isinstance(output, torch.Tensor) else first_tensor(output))

    tower.register_forward_pre_hook(tower_input, with_kwargs=True)
    projector.register_forward_hook(projector_output)
    with torch.no_grad():
        model(**inputs)
    assert seen["tower"].numel() == inputs["pixel_values"].numel()
    assert seen["projector"].shape[-1] == model.config.get_text_config().hidden_size

    # Qwen-VL's 3-D rotary positions come from the model's get_rope_index.
    assert callable(getattr(model.model, "get_rope_index", None)) == (family.rope == "mrope")


@pytest.mark.parametrize("model_type", ALL)
def test_dict_mask_is_taken_exactly_where_the_record_says(tiny_dir, model_type):
    """A {layer type: causal 4-D mask} dict gives the plain forward's logits where the text model takes one."""
    model, processor = _real(tiny_dir, model_type)
    ids = processor.tokenizer(["what shape is the image"], add_special_tokens=False, return_tensors="pt")["input_ids"]
    length = ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()[None, None]
    masks = {"full_attention": causal, "sliding_attention": causal}
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        try:
            from_dict = model(input_ids=ids, attention_mask=masks, position_ids=torch.arange(length)[None]).logits
        except (AttributeError, TypeError, KeyError):  # a tensor's `.ndim` / `.shape` read, or a layer type missing
            from_dict = None
    takes_dict = from_dict is not None and torch.allclose(from_dict, plain, atol=1e-5)
    assert takes_dict == FAMILIES[model_type].dict_mask


@pytest.mark.parametrize("model_type", ALL)
def test_image_tokens_see_later_tokens_of_their_image_exactly_where_the_record_says(tiny_dir, model_type):
    model, processor = _real(tiny_dir, model_type)
    model.set_attn_implementation("eager")  # the attention probabilities are returned by eager attention only
    inputs = image_batch(processor, n=1)
    with torch.no_grad():
        attentions = model(**inputs, output_attentions=True).attentions
    family = FAMILIES[model_type]
    image = torch.isin(inputs["input_ids"][0], torch.tensor(sorted(family.image_token_ids(model.config))))
    first, last = image.nonzero().flatten()[[0, -1]].tolist()
    sees_later = [bool(a[0, :, first, last].max() > 0) for a in attentions]
    assert sees_later == [family.bidirectional_image_attention] * len(attentions)


def test_lookups_take_a_model_type_config_model_or_peft_model_and_name_the_known_families(tiny_dir):
    model, _ = FastVisionModel.from_pretrained(tiny_dir("idefics3"))
    family = FAMILIES["idefics3"]
    assert family_of("idefics3") is family_of(model.config) is family_of(model) is find_family(model) is family
    peft_model = FastVisionModel.get_peft_model(model, r=4)
    assert core_model(peft_model) is model and core_model(model) is model
    assert family_of(peft_model) is family and model_type_of(peft_model) == "idefics3"
    assert cache_kwarg(peft_model) == cache_kwarg(model)  # compat unwraps PEFT through core_model

    with pytest.raises(ValueError, match="Unknown model family 'llava_next'") as error:
        family_of("llava_next")
    assert all(t in str(error.value) for t in FAMILIES)
    assert find_family("llava_next") is None
    with pytest.raises(TypeError, match="model type"):
        model_type_of(3)


def test_tables_derived_from_the_registry_agree_with_it():
    # Each family's vision tower and projector, with other VLMs' names after the registered ones.
    towers = [f.vision_tower for f in FAMILIES.values()]
    assert hooks.VISION_TOWER_NAMES == vision_tower_names()
    assert set(towers) <= set(hooks.VISION_TOWER_NAMES[: len(set(towers))])
    assert {"vision_encoder", "image_encoder"} <= set(hooks.VISION_TOWER_NAMES)  # unregistered VLMs still found
    assert set(projector_names()) == {f.projector for f in FAMILIES.values()}
    assert set(model_module._KEEP_16BIT) == set(hooks.VISION_TOWER_NAMES) | set(projector_names())
    assert set(projector_names()) <= set(lora_selection._PROJECTOR_TAGS)
    assert set(towers) <= set(lora_selection._VISION_TAGS)

    for model_type, family in FAMILIES.items():
        if family.box_frame is None:
            with pytest.raises(ValueError, match="coordinate_frame"):
                coordinate_frame_for(model_type)
        else:
            assert coordinate_frame_for(model_type) == family.box_frame
    with pytest.raises(ValueError, match="coordinate_frame"):
        coordinate_frame_for("llava_next")

    assert QWEN_PROCESSORS == {t: f.processor_class for t, f in FAMILIES.items() if f.pixel_budget and f.supports_video}
    assert tiny.TINY_FAMILIES == model_types(lambda f: f.tiny) == tuple(tiny.build._BUILDERS)
    help_text = next(f.metadata["help"] for f in dataclasses.fields(cli.ScriptArguments) if f.name == "model")
    assert f"(families: {', '.join(tiny.TINY_FAMILIES)})" in help_text
    assert model_types(lambda f: f.rope == "mrope") == (
        "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "glm4v", "glm46v"
    )  # fmt: skip


def test_qwen3_vl_moe_is_known_everywhere_through_its_record(tiny_dir, tmp_path):
    """The one-record family: nothing but its record names it, yet every table and loader knows it."""
    assert QWEN_PROCESSORS["qwen3_vl_moe"] == "Qwen3VLProcessor"
    assert coordinate_frame_for("qwen3_vl_moe") == "qwen2_vl"
    source = tiny_dir("qwen3_vl")
    processor = load_processor(source, "qwen3_vl_moe")
    assert resizes_by_pixel_budget(processor)
    rebuilt = build_qwen_processor("qwen3_vl_moe", processor.image_processor, processor.tokenizer)
    rebuilt.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "processor_config.json").read_text())
    assert saved["processor_class"] == "Qwen3VLProcessor"
    assert saved["video_processor"]["video_processor_type"] == FAMILIES["qwen3_vl_moe"].video_processor


def test_the_engine_serves_the_families_the_registry_says(tiny_dir):
    from vlm_grpo.engine.prefix_cache import RECURRENT_LAYER_TYPES
    from vlm_grpo.engine.prefix_cache import serves as prefix_cache_serves
    from vlm_grpo.engine.shared_prefix import SUPPORTED_MODEL_TYPES

    assert SUPPORTED_MODEL_TYPES == model_types(lambda f: f.shared_prefix)
    for model_type in ALL:
        model, _ = _real(tiny_dir, model_type)
        # A text model with sliding-window layers needs their own mask, so its family must take a mask dict; one with
        # recurrent layers is continued from its prompt's cache instead of packed (`engine.prefix_cache`).
        layer_types = set(getattr(model.config.get_text_config(), "layer_types", None) or ["full_attention"])
        recurrent = bool(layer_types & RECURRENT_LAYER_TYPES)
        one_window = model_type in ONE_MASK_WINDOW
        assert layer_types == {"full_attention"} or FAMILIES[model_type].dict_mask or recurrent or one_window
        assert prefix_cache_serves(model) == recurrent


STANDIN_FAMILIES = [
    t for t, f in FAMILIES.items() if f.tiny and f.needs_torchvision_standins and f.video_budget is None
]


@pytest.mark.skipif(has_torchvision(), reason="with torchvision, transformers builds these processors itself")
@pytest.mark.parametrize("model_type", STANDIN_FAMILIES)
def test_processor_built_without_torchvision_saves_as_the_real_one(tiny_dir, tmp_path, model_type):
    """Built around the PIL image processor (its video part left out, a stand-in where needed), the processor saves
    the real class names and its own settings, the checkpoint's video settings kept, and loads back the same."""
    family = FAMILIES[model_type]
    processor = load_processor(tiny_dir(model_type), model_type)
    assert type(processor).__name__ == family.processor_class
    assert type(processor.image_processor).__name__ == family.pil_image_processor
    processor.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "processor_config.json").read_text())
    assert saved["processor_class"] == family.processor_class
    if family.video_processor is not None:  # plain transformers (with torchvision) builds the video processor from it
        assert saved["video_processor"]["video_processor_type"] == family.video_processor
        with pytest.raises(ValueError, match="take no video"):  # its settings only: no clips through it
            check_video_support(processor)
    again = load_processor(str(tmp_path), model_type)
    first, second = image_batch(processor, n=2), image_batch(again, n=2)
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
