"""Compiled code kept across processes and machines, so a run's first step does not compile again.

Why: the first step of a run on a fresh machine compiled for 75-93 s on an H100 (3B / 7B: the training layers,
`vlm_grpo.engine.compiled_layers`, and the decode step), twice TRL's whole first step; with torch's on-disk caches
warm it took 21.6 s. Those caches live in the machine's temporary directory, so every new node, container or resumed
job pays the compilation again. torch's portable caches ("mega-cache": `torch.compiler.save_cache_artifacts` /
`load_cache_artifacts`) carry inductor's compiled graphs, AOTAutograd's and the autotuning results in one blob that
another process, on another machine, loads before it compiles: its compilations become cache hits.

Where: `<dir>/<key>.bin`, `<dir>` being `VLMGRPOConfig.compile_cache_dir` (default `$VLM_GRPO_CACHE/compile`, else
`~/.cache/vlm_grpo/compile`; "none" turns this off), and beside every checkpoint (`checkpoint-N/compile_cache/`), so a
job resumed on a new node finds it with the weights. The key hashes torch's, triton's, transformers' and this
package's versions, the device (GPU name and compute capability, or cpu), the model's architecture (its config
without names and paths) and dtype: artefacts never cross a change in any of them (torch checks its own versions too).

When: loaded when training starts, before anything compiles (from the checkpoint resumed from, then the cache
directory); saved by the main process of each machine after a step in which something compiled (the first, and any
later one whose new shapes compiled again), and at each checkpoint. A file that cannot be read or loaded is logged
and ignored: compiling again is the fallback, never a failed run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from typing import Any

import torch
from transformers import TrainerCallback

__all__ = ["CHECKPOINT_FOLDER", "CompileCache", "artifact_key", "compiled_count", "default_cache_dir"]

logger = logging.getLogger(__name__)

CHECKPOINT_FOLDER = "compile_cache"  # inside checkpoint-N/
# The trainer's settings that change what compiles (their artefacts differ; a run of one would overwrite another's).
COMPILE_SETTINGS = (
    "compile_layers",
    "compile_layers_unit",
    "compile_layers_dynamic",
    "compile_linear_attention",
    "compile_layers_ahead_of_time",
)
OFF = "none"
# Config entries that name the model rather than shape its code.
_NAMES = {"_name_or_path", "transformers_version", "_commit_hash"}


def default_cache_dir() -> str:
    """`$VLM_GRPO_CACHE/compile`, else `$XDG_CACHE_HOME/vlm_grpo/compile`, else `~/.cache/vlm_grpo/compile`."""
    root = os.environ.get("VLM_GRPO_CACHE")
    if root is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "vlm_grpo")
    return os.path.join(root, "compile")


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {"torch": torch.__version__}
    for name in ("triton", "transformers", "vlm-grpo", "peft"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = ""
    return out


def _device(model: torch.nn.Module) -> str:
    device = next(model.parameters()).device
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} sm{major}{minor}"
    return device.type


def artifact_key(model: torch.nn.Module, settings: dict[str, Any] | None = None) -> str:
    """A short hash of what compiled code depends on: versions, device, the model's config and dtype, and the
    trainer's compile `settings` (`COMPILE_SETTINGS`: runs that compile differently keep a file each).

    Two processes training the same architecture on the same kind of GPU with the same software get the same key;
    any difference gives another file, never artefacts compiled for something else."""
    config = getattr(model, "config", None)
    described = config.to_dict() if config is not None else {"class": type(model).__name__}
    described = {k: v for k, v in described.items() if k not in _NAMES}
    peft = getattr(model, "peft_config", None) or {}
    payload = {
        "versions": _versions(),
        "device": _device(model),
        "dtype": str(next(model.parameters()).dtype),
        "config": described,
        "adapters": {name: sorted(map(str, getattr(c, "target_modules", None) or [])) for name, c in peft.items()},
    }
    if settings:
        payload["settings"] = settings
    blob = json.dumps(payload, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:20]


def compiled_count() -> int:
    """Graphs compiled or fetched from a cache so far in this process (grows when a step compiled something)."""
    if "torch._dynamo" not in sys.modules:  # nothing compiled: not worth importing Dynamo to count it
        return 0
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return sum(inductor.get(k, 0) for k in ("fxgraph_cache_miss", "fxgraph_cache_hit", "fxgraph_cache_bypass"))


def _write(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)  # a reader never sees half a file


class CompileCache(TrainerCallback):
    """Loads a run's compiled code before training (`load`) and saves it after steps that compiled and at
    checkpoints (a transformers callback). `directory` None: off."""

    def __init__(self, directory: str | None, key: str) -> None:
        self.directory, self.key = directory, key
        self._saved_count = 0
        self._artifacts: bytes | None = None

    @classmethod
    def for_trainer(cls, model: torch.nn.Module, config: Any) -> CompileCache:
        """The cache the trainer's config asks for: `compile_cache_dir` None is the default directory, "none" off;
        keyed by the model and the config's `COMPILE_SETTINGS`."""
        setting = getattr(config, "compile_cache_dir", None)
        directory = None if setting == OFF else os.path.expanduser(setting or default_cache_dir())
        settings = {name: getattr(config, name) for name in COMPILE_SETTINGS if hasattr(config, name)}
        return cls(directory, artifact_key(model, settings))

    def _file(self, folder: str) -> str:
        return os.path.join(folder, f"{self.key}.bin")

    def layers_folder(self) -> str | None:
        """Where the layers' ahead-of-time compiled forwards of this key live (`engine.aot_layers`); None: off."""
        return None if self.directory is None else os.path.join(self.directory, f"{self.key}-layers")

    def load(self, checkpoint: str | None = None) -> str | None:
        """Load the artefacts saved by an earlier run with this key, from `checkpoint`'s folder, else the cache
        directory; returns the file loaded, or None (none there, or off)."""
        if self.directory is None:
            return None
        self._saved_count = compiled_count()
        candidates = [self._file(os.path.join(checkpoint, CHECKPOINT_FOLDER))] if checkpoint else []
        candidates.append(self._file(self.directory))
        for path in candidates:
            if not os.path.isfile(path):
                continue
            try:
                with open(path, "rb") as f:
                    info = torch.compiler.load_cache_artifacts(f.read())
            except Exception as error:  # noqa: BLE001 (a stale or torn file: compiling again is the fallback)
                logger.warning("Compiled code in %s could not be loaded (%s: %s); compiling again.", path,
                               type(error).__name__, error)  # fmt: skip
                continue
            if info is None:  # torch logs why (a torn or foreign file) and loads nothing
                logger.warning("Compiled code in %s could not be loaded; compiling again.", path)
                continue
            graphs = sum(len(v) for v in info.artifacts.values())
            logger.info("Reusing %d compiled artefacts from %s: the first step compiles from cache.", graphs, path)
            return path
        return None

    def save(self, checkpoint: str | None = None) -> str | None:
        """Write this process's artefacts to the cache directory (or into `checkpoint`'s folder); the path, or None
        when nothing was compiled."""
        if self.directory is None:
            return None
        if checkpoint is None or self._artifacts is None:
            result = torch.compiler.save_cache_artifacts()
            if result is None:
                return None
            self._artifacts = result[0]
        path = self._file(os.path.join(checkpoint, CHECKPOINT_FOLDER) if checkpoint else self.directory)
        try:
            _write(path, self._artifacts)
        except OSError as error:  # a read-only home or a full disk costs the next run a compilation, not this run
            logger.warning("Could not save compiled code to %s (%s); the next run compiles again.", path, error)
            return None
        return path

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        count = compiled_count()
        if count > self._saved_count and state.is_local_process_zero:
            self._saved_count = count
            self._artifacts = None  # new graphs: serialise again
            self.save()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_local_process_zero and self.directory is not None:
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            if os.path.isdir(folder):
                self.save(checkpoint=folder)
