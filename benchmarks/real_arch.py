"""Real-architecture VLMs with random weights, for GPU benchmarks and tests without Hub access.

The configs are Qwen2.5-VL-3B/7B/32B-Instruct's and Qwen3.5-4B/9B's, written in code; the tokenizer is built locally
with the real vocabulary size and Qwen2.5's special-token ids, so prompts have the real shape (a 448x448 image is 256
image tokens for Qwen2.5-VL, 196 for Qwen3.5's 16-px patches) and generation costs what it costs with the real
checkpoint. Qwen3.5's text models are the published configs (hybrid: three gated delta-rule layers, then a gated
full-attention one, 32 layers); their vision towers are Qwen3-VL-4B's / 8B's (depth 24 / 27).
"""

from __future__ import annotations

import os

import torch

VISION = dict(
    depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14, spatial_merge_size=2,
    temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2,
    hidden_act="silu", in_channels=3,
)  # fmt: skip
TEXT = {
    "qwen2.5-vl-3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                          num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-vl-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                          num_key_value_heads=4, tie_word_embeddings=False),
    # Qwen2.5-VL-32B-Instruct's text model (its vision tower is the same as the smaller models'): 64 GB in bf16,
    # more than one 80 GB GPU holds with training beside it.
    "qwen2.5-vl-32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                           num_key_value_heads=8, tie_word_embeddings=False),
}  # fmt: skip
# Qwen3.5: the published text configs; the vision towers of Qwen3-VL's models of the same size.
QWEN3_5 = {
    "qwen3.5-4b": (
        dict(hidden_size=2560, intermediate_size=9216, tie_word_embeddings=True),
        dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16),
    ),
    "qwen3.5-9b": (
        dict(hidden_size=4096, intermediate_size=12288, tie_word_embeddings=False),
        dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16),
    ),
}
VOCAB_SIZE = 151936
# Qwen2.5's added tokens, at their real ids.
SPECIAL = {
    "<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|object_ref_start|>": 151646,
    "<|object_ref_end|>": 151647, "<|box_start|>": 151648, "<|box_end|>": 151649, "<|quad_start|>": 151650,
    "<|quad_end|>": 151651, "<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655, "<|video_pad|>": 151656,
}  # fmt: skip
WORDS = "What colour is the shape ? Describe image in detail . Answer with one word red green blue yellow".split()


def _qwen3_5_config(name: str):
    from transformers import Qwen3_5Config

    text, vision = QWEN3_5[name]
    text = dict(
        text, vocab_size=248320, num_hidden_layers=32, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 8,
        num_attention_heads=16, num_key_value_heads=4, head_dim=256, attn_output_gate=True, linear_conv_kernel_dim=4,
        linear_key_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32, linear_value_head_dim=128,
        max_position_embeddings=262144, rms_norm_eps=1e-6, hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        bos_token_id=None, eos_token_id=151645, pad_token_id=151643,
    )  # fmt: skip
    vision = dict(vision, patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                  out_hidden_size=text["hidden_size"], in_channels=3, hidden_act="gelu_pytorch_tanh")  # fmt: skip
    return Qwen3_5Config(
        text_config=text, vision_config=vision, image_token_id=151655, video_token_id=151656,
        vision_start_token_id=151652, vision_end_token_id=151653, tie_word_embeddings=text["tie_word_embeddings"],
    )  # fmt: skip


SHALLOW = "-shallow"


def _shallow(config):
    """`config` cut to one layer of each kind (decoder: Qwen3.5's linear and full attention; vision: one block, full
    attention): every class the training layers compile, at the real widths, for warming the compile caches of the
    full model (`benchmarks/precompile_probe.py`)."""
    text, vision = config.text_config, config.vision_config
    kinds = list(dict.fromkeys(getattr(text, "layer_types", None) or ["full_attention"]))
    text.num_hidden_layers, text.layer_types = len(kinds), kinds
    vision.depth = 1
    for key in ("fullatt_block_indexes", "deepstack_visual_indexes"):
        if getattr(vision, key, None):
            setattr(vision, key, [0])
    return config


def config(name: str):
    """The transformers config of a named real architecture (`<name>-shallow`: one layer of each kind, `_shallow`)."""
    from transformers import Qwen2_5_VLConfig

    if name.endswith(SHALLOW):
        return _shallow(config(name[: -len(SHALLOW)]))
    if name in QWEN3_5:
        return _qwen3_5_config(name)
    if name not in TEXT:
        raise ValueError(f"Unknown architecture {name!r}; choose one of {', '.join([*TEXT, *QWEN3_5])}.")
    text = dict(
        TEXT[name], vocab_size=VOCAB_SIZE, max_position_embeddings=128000, rms_norm_eps=1e-6, hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
        bos_token_id=151643, eos_token_id=151645, pad_token_id=151643, use_sliding_window=False,
    )  # fmt: skip
    vision = dict(VISION, out_hidden_size=text["hidden_size"])
    return Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=151655, video_token_id=151656,
        vision_start_token_id=151652, vision_end_token_id=151653, tie_word_embeddings=text["tie_word_embeddings"],
    )  # fmt: skip


def tokenizer():
    """Word-level tokenizer with Qwen2.5's vocabulary size and special-token ids (ids 0..151642 are filler words)."""
    from vlm_grpo.tiny import build_word_level_tokenizer

    vocab = {w: i for i, w in enumerate(WORDS)}
    vocab.update({f"w{i}": i for i in range(len(WORDS), min(SPECIAL.values()))})
    # The special tokens are not in `vocab`: they take the next ids, 151643 on, in SPECIAL's order.
    tok = build_word_level_tokenizer(
        vocab, SPECIAL, f"w{len(WORDS)}", pad_token="<|endoftext|>", eos_token="<|im_end|>"
    )
    assert all(tok.convert_tokens_to_ids(t) == i for t, i in SPECIAL.items()), "special-token ids drifted"
    return tok


def processor(name: str = "qwen2.5-vl-3b"):
    """The architecture's processor: the real image processor settings (Qwen3.5: 16-px patches), the local tokenizer,
    Qwen's chat template."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from vlm_grpo.media.processor import build_qwen_processor
    from vlm_grpo.tiny.qwen import _QWEN_TEMPLATE

    name = name.removesuffix(SHALLOW)
    patch = 16 if name in QWEN3_5 else 14
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=patch, merge_size=2, temporal_patch_size=2,
        size={"shortest_edge": 4 * patch * patch, "longest_edge": 4 * patch * patch * 1280},
        image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711],
    )  # fmt: skip
    family = "qwen3_5" if name in QWEN3_5 else "qwen2_5_vl"
    return build_qwen_processor(family, image_processor, tokenizer(), _QWEN_TEMPLATE)


def build_checkpoint(name: str, out_dir: str, seed: int = 0) -> str:
    """Write a random-weight checkpoint of `name` (bf16) with its processor; reuse it if already there."""
    from transformers import AutoModelForImageTextToText, GenerationConfig

    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    if name.startswith("tiny"):
        return _tiny(out_dir, name.removeprefix("tiny").removeprefix("-"), seed=seed)
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config(name), dtype=torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=[151645, 151643], pad_token_id=151643, do_sample=True)
    tmp = out_dir + ".tmp"
    model.save_pretrained(tmp)
    processor(name).save_pretrained(tmp)
    os.replace(tmp, out_dir)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out_dir


def _tiny(out_dir: str, kind: str, seed: int) -> str:
    """The tiny Qwen2.5-VL (`vlm_grpo.tiny`); `kind` "deep": at the 3B's depth (36 decoder layers, 32 vision blocks)
    with its tiny widths, so a CPU step walks as many modules and calls as many layers as the 3B's, for little
    compute; "shallow": one layer of each kind (`_shallow`)."""
    import shutil

    from transformers import AutoConfig, AutoModelForImageTextToText

    from vlm_grpo.tiny import build_tiny_vlm

    base = build_tiny_vlm("qwen2_5_vl", out_dir if not kind else out_dir + "-base", seed=seed)
    if not kind:
        return base
    config = AutoConfig.from_pretrained(base)
    if kind == "shallow":
        _shallow(config)
    elif kind == "deep":
        config.text_config.num_hidden_layers = TEXT["qwen2.5-vl-3b"]["num_hidden_layers"]
        config.text_config.layer_types = ["full_attention"] * config.text_config.num_hidden_layers
        config.vision_config.depth = VISION["depth"]
        config.vision_config.fullatt_block_indexes = VISION["fullatt_block_indexes"]
    else:
        raise ValueError(f"Unknown tiny model tiny-{kind}: tiny, tiny-deep or tiny-shallow.")
    torch.manual_seed(seed)
    tmp = out_dir + ".tmp"
    AutoModelForImageTextToText.from_config(config).save_pretrained(tmp)
    for name in set(os.listdir(base)) - {"config.json", "model.safetensors"}:  # tokenizer, processor, template, ...
        shutil.copy(os.path.join(base, name), tmp)
    os.replace(tmp, out_dir)
    return out_dir
