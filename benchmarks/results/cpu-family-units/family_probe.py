"""Every tiny family: the eager loss and gradients against compile_layers_unit 'modules' and 'layers'.

    python benchmarks/results/cpu-family-units/family_probe.py [family,...]   # from the repository root, CPU

Prints, per family and unit: the modules given a compiled forward, graphs, graph breaks, the loss's relative difference
and the worst gradient's (LoRA on both towers, gradient checkpointing; the helpers of tests/test_shared_prefix.py).
"""

from __future__ import annotations

import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "tests"))

import torch
from test_compiled_layers import _loss_and_grads
from test_shared_prefix import _batch, _trainer
from torch._dynamo.utils import counters

from vlm_grpo.engine.compiled_layers import CompiledLayers, unsupported_reason
from vlm_grpo.tiny import TINY_FAMILIES, build_tiny_vlm

ROOT = pathlib.Path(tempfile.mkdtemp())
_built: dict = {}


def tiny_dir(family: str, **kwargs) -> str:
    """tests/conftest.py's fixture: a tiny checkpoint per (family, kwargs), built once."""
    key = (family, tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in kwargs.items())))
    if key not in _built:
        out = ROOT / f"tiny-{family}-{len(_built)}"
        out.mkdir()
        _built[key] = build_tiny_vlm(family, out, **kwargs)
    return _built[key]


def probe(family: str) -> str:
    trainer = _trainer(tiny_dir, pathlib.Path(tempfile.mkdtemp()), family, lora="both", gc=True)
    inputs = _batch(trainer, family)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    eager_loss, eager = _loss_and_grads(trainer, inputs)
    out = [f"{family}: eager {eager_loss.item():.5f} unsupported={unsupported_reason(trainer.model)}"]
    for unit in ("modules", "layers"):
        torch._dynamo.reset()
        counters.clear()
        compiled = CompiledLayers()
        count = compiled.attach(trainer.model, unit=unit)
        loss, grads = _loss_and_grads(trainer, inputs)
        worst = max(((grads[k] - g).norm() / (g.norm() + 1e-30)).item() for k, g in eager.items())
        out.append(f"{unit}: n={count} graphs={counters['stats']['unique_graphs']} "
                   f"loss_rel={abs(loss - eager_loss).item() / (abs(eager_loss).item() + 1e-12):.2e} "
                   f"worst_grad_rel={worst:.2e} missing={len(set(eager) ^ set(grads))} "
                   f"breaks={sum(counters['graph_break'].values())}")  # fmt: skip
        compiled.detach()
    return " | ".join(out)


if __name__ == "__main__":
    for family in sys.argv[1].split(",") if len(sys.argv) > 1 else TINY_FAMILIES:
        start = time.time()
        print(probe(family), f"({time.time() - start:.0f}s)", flush=True)
