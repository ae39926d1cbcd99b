"""The KL reference of a LoRA run: the policy with its adapters switched off by their own flags, not PEFT's walk.

TRL scores a fresh adapter's reference log-probs inside PEFT's `disable_adapter()`, which builds PEFT's model status
(every layer, every parameter), walks every module to switch each adapter off and again to switch it on, and on the
way sets `requires_grad` on every adapter (unfreezing any the user froze): 0.1-0.2 s a step for a 3B VLM with LoRA
on its 414 linear layers, while the GPU waits. `AdaptersOff` is what the trainer gives TRL as its `ref_model`
instead: TRL then passes it to `_get_per_token_logps_and_entropies`, which runs the policy inside `switched_off()`,
where each LoRA layer's own `_disable_adapters` flag (what PEFT's forward reads) is set and put back, and nothing
else changes. The same flags, so the same reference log-probs (tested against PEFT's context).

Only plain LoRA layers are switched this way (`layers_to_switch` says why not otherwise: other tuners, PEFT's
`modules_to_save` / trainable-token wrappers, a LoRA bias, a "ref" adapter, which TRL activates rather than
disables, Unsloth's patched layers); those runs keep TRL's path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from ..integrations.unsloth import uses_unsloth

__all__ = ["AdaptersOff", "is_fresh_lora", "layers_to_switch"]


def layers_to_switch(model: nn.Module) -> list[nn.Module] | None:
    """The LoRA layers whose flags give `model`'s reference, or None when PEFT's `disable_adapter` must (see above)."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    if not isinstance(model, PeftModel) or "ref" in model.peft_config or uses_unsloth(model):
        return None
    if any(getattr(config, "bias", "none") != "none" for config in model.peft_config.values()):
        return None
    layers = []
    for module in model.modules():
        if isinstance(module, AuxiliaryTrainingWrapper) or (
            isinstance(module, BaseTunerLayer) and not isinstance(module, LoraLayer)
        ):
            return None
        if isinstance(module, LoraLayer):
            layers.append(module)
    return layers or None


class AdaptersOff:
    """The policy (`policy()`, read at each use: the trainer's model may be re-wrapped) with `layers`' adapters off."""

    def __init__(self, policy: Callable[[], nn.Module], layers: list[nn.Module]) -> None:
        self.policy = policy
        self.layers = layers

    @contextlib.contextmanager
    def switched_off(self) -> Iterator[nn.Module]:
        """The policy with every listed layer's adapters off for the block, each flag put back as found after."""
        found = [layer._disable_adapters for layer in self.layers]
        try:
            for layer in self.layers:
                layer._disable_adapters = True
            yield self.policy()
        finally:
            for layer, flag in zip(self.layers, found):
                layer._disable_adapters = flag

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.switched_off() as model:
            return model(*args, **kwargs)


def is_fresh_lora(model: Any) -> bool:
    """True for a PEFT LoRA model whose only adapter has all-zero B matrices (so it changes nothing yet).

    TRL keeps a frozen copy of a passed-in adapter ("ref") as the KL reference, because the adapter might be
    pretrained; a fresh one is the identity, so the base model with its adapters off is the same reference without
    the copy's memory and compute (`AdaptersOff`).
    """
    peft_config = getattr(model, "peft_config", None)
    if not isinstance(peft_config, dict) or list(peft_config) != ["default"]:
        return False
    b_weights = [p for n, p in model.named_parameters() if ".lora_B." in n or ".lora_embedding_B." in n]
    return bool(b_weights) and all(not p.detach().any() for p in b_weights)
