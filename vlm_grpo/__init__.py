"""vlm-grpo: GRPO for vision-language models on TRL + transformers + peft.

Heavy imports (torch, transformers, trl) happen on first use of a name, so `import vlm_grpo` is cheap and
never imports optional integrations (unsloth_zoo, vllm, bitsandbytes).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from typing import Any

from . import third_party_logs

third_party_logs.install()  # before anything imports PEFT, which imports bitsandbytes

__version__ = "0.1.0"

_EXPORTS = {
    "FastBaseVisionModel": "vlm_grpo.models.loader",
    "FastVisionModel": "vlm_grpo.models.loader",
    "VLMGRPOConfig": "vlm_grpo.training.config",
    "VLMGRPOTrainer": "vlm_grpo.training.trainer",
    "build_tiny_vlm": "vlm_grpo.tiny",
    "dataset_task": "vlm_grpo.cli.task",
    "synthetic_task": "vlm_grpo.cli.task",
    "evaluate": "vlm_grpo.training.evaluation",
    "requires_grad_post_hook": "vlm_grpo.models.hooks",
    "requires_grad_pre_hook": "vlm_grpo.models.hooks",
    "enable_requires_grad_hooks": "vlm_grpo.models.hooks",
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


# Modules that moved into packages (design pass 4): their old paths still import, as the modules they moved to, with a
# DeprecationWarning naming the new path, for one release.
_MOVED = {
    "vlm_grpo.adapters": "vlm_grpo.models.adapters",
    "vlm_grpo.callbacks": "vlm_grpo.training.callbacks",
    "vlm_grpo.checkpoint_writes": "vlm_grpo.training.checkpoint_writes",
    "vlm_grpo.checkpoints": "vlm_grpo.training.checkpoints",
    "vlm_grpo.cli_args": "vlm_grpo.cli.args",
    "vlm_grpo.cli_checks": "vlm_grpo.cli.checks",
    "vlm_grpo.cli_defaults": "vlm_grpo.cli.defaults",
    "vlm_grpo.cli_finish": "vlm_grpo.cli.finish",
    "vlm_grpo.cli_stop": "vlm_grpo.cli.stop",
    "vlm_grpo.config": "vlm_grpo.training.config",
    "vlm_grpo.demo": "vlm_grpo.cli.demo",
    "vlm_grpo.display": "vlm_grpo.training.display",
    "vlm_grpo.dynamic_sampling": "vlm_grpo.training.dynamic_sampling",
    "vlm_grpo.engine.sharded": "vlm_grpo.models.sharded",
    "vlm_grpo.evaluation": "vlm_grpo.training.evaluation",
    "vlm_grpo.export": "vlm_grpo.models.export",
    "vlm_grpo.generation_route": "vlm_grpo.training.generation_route",
    "vlm_grpo.hooks": "vlm_grpo.models.hooks",
    "vlm_grpo.lora_selection": "vlm_grpo.models.lora_selection",
    "vlm_grpo.model": "vlm_grpo.models.loader",
    "vlm_grpo.model_card": "vlm_grpo.models.model_card",
    "vlm_grpo.modes": "vlm_grpo.models.modes",
    "vlm_grpo.nonfinite": "vlm_grpo.training.nonfinite",
    "vlm_grpo.preemption": "vlm_grpo.training.preemption",
    "vlm_grpo.prompts": "vlm_grpo.data.prompts",
    "vlm_grpo.reward_checks": "vlm_grpo.rewards.checks",
    "vlm_grpo.reward_watch": "vlm_grpo.cli.reward_watch",
    "vlm_grpo.rollout_batch": "vlm_grpo.training.rollout_batch",
    "vlm_grpo.rows": "vlm_grpo.data.rows",
    "vlm_grpo.sampler_logprobs": "vlm_grpo.training.sampler_logprobs",
    "vlm_grpo.scoring_route": "vlm_grpo.training.scoring_route",
    "vlm_grpo.task": "vlm_grpo.cli.task",
    "vlm_grpo.trainer": "vlm_grpo.training.trainer",
    "vlm_grpo.trainer_inputs": "vlm_grpo.training.inputs",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module path of `_MOVED` and gives the module it moved to, saying where it went."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        return importlib.util.spec_from_loader(fullname, self) if fullname in _MOVED else None

    def create_module(self, spec: Any) -> Any:
        new = _MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}: import it from there ({spec.name} goes in the next release).",
                      DeprecationWarning, stacklevel=2)  # fmt: skip
        return importlib.import_module(new)

    def exec_module(self, module: Any) -> None:
        """Nothing to run: the module it moved to is imported already."""


sys.meta_path.insert(0, _MovedModules())  # before any other finder: an old path never loads a stale file
