"""Stand-ins for the torchvision-only pieces some processors reach for even when they only see images.

Without torchvision (every CPU-only pip install of torch, for one) these processors cannot be built as transformers
ships them, although each has a PIL image processor that does the work:

- Pixtral's processor (Mistral 3) imports `get_resize_output_image_size` from the torchvision image processor's
  module at import time. `pixtral_processor_class` registers a stand-in for that module holding the PIL module's
  function of the same name (the two are the same code), then imports the real class. Anything else asked of the
  stand-in is missing, with a message naming torchvision.
- SmolVLM's processor refuses to build without `num2words`, which it needs only to write a video's frame count in
  words; `smolvlm_without_num2words` lets an image-only processor build, and a video prompt would still fail loudly.
- A processor whose video processor was dropped (`vlm_grpo.media.processor.build_image_only_processor`) keeps the
  checkpoint's video settings in `VideoSettings`, so it saves them back unchanged and plain transformers (with
  torchvision) loads what we save. (SmolVLM's `apply_chat_template` reads `num_frames` / `fps` off its video processor
  even for images; the image-only SmolVLM processor takes `ProcessorMixin`'s, which does not.)

With torchvision installed none of this is used: `vlm_grpo.media.processor.load_processor` takes transformers' path.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from typing import Any

__all__ = ["VideoSettings", "has_torchvision", "pixtral_processor_class", "smolvlm_without_num2words"]

_PIXTRAL_TORCHVISION_MODULE = "transformers.models.pixtral.image_processing_pixtral"


class VideoSettings:
    """A dropped video processor's settings, readable as attributes, written back by `to_dict` when the processor is
    saved."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self._settings = dict(settings)

    def __getattr__(self, name: str) -> Any:
        settings = self.__dict__.get("_settings", {})
        if name in settings:
            return settings[name]
        raise AttributeError(name)

    def to_dict(self) -> dict[str, Any]:
        """The settings, as saved in `processor_config.json`'s "video_processor"."""
        return dict(self._settings)


def has_torchvision() -> bool:
    """Whether torchvision imports here."""
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001  (a broken torchvision, e.g. an ABI mismatch, is as good as none)
        return False
    return True


def _torchvision_module_standin() -> types.ModuleType:
    from transformers.models.pixtral import image_processing_pil_pixtral as pil

    module = types.ModuleType(_PIXTRAL_TORCHVISION_MODULE)
    module.__doc__ = "vlm_grpo's stand-in (no torchvision here): only the PIL module's resize helper."
    module.get_resize_output_image_size = pil.get_resize_output_image_size

    def __getattr__(name: str) -> Any:  # `from ... import name` turns this into an ImportError naming the module
        raise AttributeError(
            f"{_PIXTRAL_TORCHVISION_MODULE}.{name} needs torchvision, which is not installed; vlm_grpo registered a "
            "stand-in for this module to build PixtralProcessor with its PIL image processor."
        )

    module.__getattr__ = __getattr__
    return module


def pixtral_processor_class() -> type:
    """transformers' `PixtralProcessor` class, importable without torchvision (see the module docstring)."""
    if not has_torchvision() and _PIXTRAL_TORCHVISION_MODULE not in sys.modules:
        sys.modules[_PIXTRAL_TORCHVISION_MODULE] = _torchvision_module_standin()
    from transformers.models.pixtral.processing_pixtral import PixtralProcessor

    return PixtralProcessor


def _num2words_missing(*args: Any, **kwargs: Any) -> str:
    raise ImportError("SmolVLM writes a video's frame count with `num2words`: `pip install num2words`.")


@contextlib.contextmanager
def smolvlm_without_num2words() -> Iterator[None]:
    """While it is open, SmolVLM's processor builds without `num2words` (only its video prompts use it); restored
    after, so transformers' own check stands for every other construction."""
    from transformers.models.smolvlm import processing_smolvlm

    if processing_smolvlm.num2words is not None:
        yield
        return
    processing_smolvlm.num2words = _num2words_missing
    try:
        yield
    finally:
        processing_smolvlm.num2words = None
