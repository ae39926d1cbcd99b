"""vlm-grpo: GRPO for vision-language models on TRL + transformers + peft.

Heavy imports (torch, transformers, trl) happen on first use of a name, so `import vlm_grpo` is cheap and
never imports optional integrations (unsloth_zoo, vllm, bitsandbytes).
"""

from __future__ import annotations

import importlib
from typing import Any

from . import third_party_logs

third_party_logs.install()  # before anything imports PEFT, which imports bitsandbytes

__version__ = "0.1.0"

_EXPORTS = {
    "FastBaseVisionModel": "vlm_grpo.model",
    "FastVisionModel": "vlm_grpo.model",
    "VLMGRPOConfig": "vlm_grpo.config",
    "VLMGRPOTrainer": "vlm_grpo.trainer",
    "build_tiny_vlm": "vlm_grpo.tiny",
    "evaluate": "vlm_grpo.evaluation",
    "requires_grad_post_hook": "vlm_grpo.hooks",
    "requires_grad_pre_hook": "vlm_grpo.hooks",
    "enable_requires_grad_hooks": "vlm_grpo.hooks",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'vlm_grpo' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
