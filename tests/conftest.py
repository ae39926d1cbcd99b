"""Shared fixtures: tiny offline VLMs built once per test session."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest
import torch
from deprecation_guard import install as _install_deprecation_guard
from deprecation_guard import no_deprecated_calls_from_our_code  # noqa: F401 (an autouse fixture for every test)

# Two busy threads on a shared 2-core machine made steps 10-100x slower; tiny models need only one.
torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Compiled code the trainer keeps for later runs (`vlm_grpo.engine.compile_cache`) goes to a temporary folder, not the
# home directory of whoever runs the tests.
os.environ.setdefault("VLM_GRPO_CACHE", tempfile.mkdtemp(prefix="vlm-grpo-test-cache-"))
_install_deprecation_guard()


def _trl_trains_here() -> bool:
    import trl
    from packaging.version import Version

    return torch.cuda.is_available() or Version(trl.__version__) >= Version("1.16")


# TRL 1.15 (the version Unsloth pins) has no CPU path for GRPO's log-probs; tests that run training steps are
# skipped there, and the trainer's own check (test_trainer.py) says so clearly to users.
TRL_TRAINS_HERE = _trl_trains_here()


def pytest_configure(config):
    # Third-party, beside pyproject's list: numpy 2.4 deprecating torch's `Tensor.__array__` (no `copy` keyword),
    # reached by transformers' PaliGemma and GLM-4V processors calling `np.array` on the tensors they return.
    config.addinivalue_line("filterwarnings", "ignore:__array__ implementation doesn't accept a copy keyword")


def pytest_collection_modifyitems(config, items):
    # The long runs first (learning checks, then the other slow ones: multi-process launches, resumes): under `-n 2`
    # each core starts on one and the short tests fill in after, instead of one core running a 6-minute test alone at
    # the end; tiny Qwen3.5's learning runs lead (its byte-level tokenizer makes them the longest). Stable: the
    # collected order otherwise.
    items.sort(key=lambda item: ("slow" not in item.keywords, "learns" not in item.name, "qwen3_5" not in item.name))
    if TRL_TRAINS_HERE:
        return
    skip = pytest.mark.skip(reason="TRL < 1.16 cannot run GRPO steps on CPU (Triton-only log-prob kernel)")
    for item in items:
        if "trains" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """`tiny_dir(family, **kwargs)` -> path of a tiny checkpoint, built once per (family, kwargs)."""
    from vlm_grpo.tiny import build_tiny_vlm

    cache: dict = {}

    def build(family: str, **kwargs) -> str:
        key = (family, tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in kwargs.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"tiny-{family}")
            cache[key] = build_tiny_vlm(family, out, **kwargs)
        return cache[key]

    return build


# ----- helpers shared by test files (`from conftest import ...`) -----


def colour_rows(family: str) -> dict:
    """Chat rows of plain-colour images for the group tests, sized for `family` (Qwen3-VL's patches are 16 px, the
    others' 14): `text` (no image), `one` (a red image), `two` (red, then a wider blue one), `other` (`one`'s prompt,
    a green image)."""
    from PIL import Image

    side = 64 if family == "qwen3_vl" else 56
    red, green = Image.new("RGB", (side, side), (255, 0, 0)), Image.new("RGB", (side, side), (0, 255, 0))
    wide_blue = Image.new("RGB", (side * 3 // 2, side), (0, 0, 255))
    return {
        "text": {"prompt": user_turn("Say red."), "images": []},
        "one": {"prompt": user_turn(None, "What colour?"), "images": [red]},
        "two": {"prompt": user_turn(None, "and", None, "first?"), "images": [red, wide_blue]},
        "other": {"prompt": user_turn(None, "What colour?"), "images": [green]},
    }


def image_batch(processor, n: int = 2, size: int = 56, seed: int = 0):
    """Processor outputs for `n` chat prompts, each one random-pixel `size`x`size` image and a question."""
    from PIL import Image

    messages = [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]}]] * n
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    g = torch.Generator().manual_seed(seed)
    images = [[Image.fromarray((torch.rand(size, size, 3, generator=g) * 255).byte().numpy())] for _ in range(n)]
    return processor(text=text, images=images, return_tensors="pt", padding=True)


def lora_b_grads(model, inputs) -> dict:
    """Every LoRA B matrix's gradient (None where none arrived) after a GRPO-style backward on `inputs`: no labels,
    the loss built on the logits."""
    model.zero_grad(set_to_none=True)
    out = model(**{k: v for k, v in inputs.items() if k != "labels"})  # PaliGemma's processor returns some
    assert out.loss is None
    out.logits.float().logsumexp(-1).mean().backward()
    return {n: p.grad for n, p in model.named_parameters() if "lora_B" in n}


def lora_b_weights(model) -> dict:
    """A copy of every LoRA B matrix, to compare with after training (`changed_weights`)."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_B" in n}


def changed_weights(model, before: dict) -> set:
    """Names of the parameters in `before` whose values in `model` differ from it."""
    return {n for n, p in model.named_parameters() if n in before and not torch.equal(p, before[n])}


def user_turn(*parts: str | None) -> list[dict]:
    """A chat prompt of one user message: each part a text, or None for an image placeholder."""
    content = [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]
    return [{"role": "user", "content": content}]


def write_video(path, n: int = 10, fps: int = 8, size: tuple[int, int] = (32, 32)) -> str:
    """An mp4 (MPEG-4 part 2) of `n` frames at `fps`, frame i grey level 20 i; PyAV encodes it."""
    av = pytest.importorskip("av")
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for i in range(n):
            frame = av.VideoFrame.from_ndarray(np.full((size[1], size[0], 3), 20 * i, np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return str(path)


def trl_logps(trainer, model, *args, **kwargs):
    """TRL's own per-row `_get_per_token_logps_and_entropies` on `model`, scoring as the trainer does: the ids the
    sampler never picks out of the softmax (`vlm_grpo.blocked_tokens`)."""
    from trl import GRPOTrainer

    from vlm_grpo.blocked_tokens import scoring_as_sampled

    with scoring_as_sampled(trainer, model):
        return GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, *args, **kwargs)


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches and counters empty for the test, and left empty for the tests after it (the counters are
    global: other tests count their own graphs)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()


def guarded_model_dir(tiny_dir, tmp_path) -> str:
    """A tiny Qwen2.5-VL whose chat template refuses to render unless it is given `marker` (a chat template argument,
    as `{"enable_thinking": False}` is for Qwen3): it tells whether `chat_template_kwargs` reached the template."""
    import shutil

    from vlm_grpo.data import answer_words

    path = tmp_path / "guarded"
    shutil.copytree(tiny_dir("qwen2_5_vl", words=answer_words("color", 1)), path)
    template = path / "chat_template.jinja"
    guard = "{%- if marker is not defined %}{{ raise_exception('chat_template_kwargs did not reach it') }}{%- endif %}"
    template.write_text(guard + template.read_text())
    return str(path)
