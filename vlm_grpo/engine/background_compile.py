"""A layer's (or its attention's or MLP's) ahead-of-time compile run in another process while it trains as written,
so a fresh machine's first step does not wait for it.

Why: on a fresh H200 the 7B's first step took 35.2 s, 19.4 s of it training, most of that compiling the decoder
layer's training forward and backward (`benchmarks/results/h200-cold-start-7b-aot/`; issue #48 asks <= 30 s). The
layer's own forward gives the eager results without that wait, and the compile needs only the layer and one call's
inputs, which another process can have.

How: at a signature's first training call (`engine.aot_layers`), the layer or part (weights, LoRA, training settings; not the
training forward this package gave it) and the call's inputs (detached, `requires_grad` kept) are written
to a file, and `python -m vlm_grpo.engine.aot_worker FILE` compiles the same function with the same dynamic
marks, grad and autocast state and Dynamo / Inductor / functorch settings, and saves it where `AheadOfTime` looks for
it. Until then the layer runs its own forward. At the next step's start (`AheadOfTime.adopt`: between steps, so a
checkpoint's recomputation always runs the code its forward ran) the trainer loads what finished.

Never a silent wrong result: the process computes the signature's key (`aot_layers.signature_key`: class, code,
structure, the globals its modules hold, attention registry, the call's signature) on what it loaded and refuses to
compile when it differs from the trainer's (a patch the trainer's process made at run time that a new process does not
have); a failure, a refusal or a layer that cannot be written (e.g. a class made at run time) is said once and the
layer compiles in the training process, as without this.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["WORKER", "BackgroundCompiles", "aliases", "apply_state"]

logger = logging.getLogger(__name__)

_CONFIGS = ("torch._dynamo.config", "torch._inductor.config", "torch._functorch.config")
_DEVICE_TYPES = ("cpu", "cuda")
# Global state Dynamo's guards check besides grad mode, autocast, dtype and determinism (its `GLOBAL_STATE` guard).
_REDUCTIONS = ("allow_tf32", "allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction")
WORKER = "vlm_grpo.engine.aot_worker"  # the module a compile process runs (`python -m`)


def aliases(value: Any) -> Any:
    """`value` with each tensor (in tuples and lists too) replaced by a detached alias (the same storage, its
    `requires_grad` kept). What a compile's example inputs are (`aot_layers.compile_entry`), and what is written for a
    compile process. Not views: a function compiled on a view guards its base, which a call on a tensor that is no view
    (an MLP's input, fresh from its norm) does not have."""
    if isinstance(value, torch.Tensor):
        alias = value.detach()
        return alias.requires_grad_() if value.requires_grad else alias
    if isinstance(value, (tuple, list)):
        return type(value)(aliases(v) for v in value)
    return value


class _ClassForward:
    """What a written layer has for this package's training forward (which holds compiled functions that cannot be
    written): the same instance attribute (Dynamo guards a module's attribute names), the class's forward when
    called."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return type(self.module).forward(self.module, *args, **kwargs)


@contextlib.contextmanager
def _writable(module: torch.nn.Module) -> Iterator[None]:
    """Inside the block each instance `forward` of `module` and its submodules is a `_ClassForward`."""
    saved = [(m, vars(m)["forward"]) for m in module.modules() if "forward" in vars(m)]
    try:
        for m, _ in saved:
            m.forward = _ClassForward(m)
        yield
    finally:
        for m, forward in saved:
            m.forward = forward


def _state() -> dict[str, Any]:
    """What a compile reads besides the layer and its inputs: the global state a compiled function's guards check
    (Dynamo's `GLOBAL_STATE`: autocast, determinism, threads, reduced-precision reductions, default dtype) and the
    compilers' settings (those torch calls portable)."""
    configs = {}
    for name in _CONFIGS:
        with contextlib.suppress(Exception):  # an older torch without portable settings: the new process's defaults
            configs[name] = sys.modules[name].save_config_portable() if name in sys.modules else None
    return {
        "autocast": [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _DEVICE_TYPES],
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "threads": torch.get_num_threads(),
        "reductions": {name: getattr(torch.backends.cuda.matmul, name) for name in _REDUCTIONS},
        "default_dtype": torch.get_default_dtype(),
        "matmul_precision": torch.get_float32_matmul_precision(),
        "configs": configs,
    }


def apply_state(state: dict[str, Any]) -> None:
    """In a compile process: the trainer's process's state and settings (`_state`)."""
    import importlib

    for device_type, enabled, dtype in state["autocast"]:
        torch.set_autocast_enabled(device_type, enabled)
        torch.set_autocast_dtype(device_type, dtype)
    torch.use_deterministic_algorithms(state["deterministic"])
    torch.set_num_threads(state["threads"])
    for name, value in state["reductions"].items():
        setattr(torch.backends.cuda.matmul, name, value)
    torch.set_default_dtype(state["default_dtype"])
    torch.set_float32_matmul_precision(state["matmul_precision"])
    for name, config in state["configs"].items():
        if config is not None:
            importlib.import_module(name).load_config(config)


_PROCESS_BYTES = 2**30  # a CUDA context, the compiler's workspace and benchmarks: about 0.5-1 GiB


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)


def _short_of_gpu_memory(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> str | None:
    """Why another process would take GPU memory the training process may need (a copy of the layer and the inputs,
    and its own CUDA context, against what is free), or None."""
    tensors = [*module.parameters(), *module.buffers(), *_tensors(args), *_tensors(list(kwargs.values()))]
    devices = {t.device for t in tensors if t.device.type == "cuda"}
    for device in devices:
        needed = _PROCESS_BYTES + sum(t.numel() * t.element_size() for t in tensors if t.device == device)
        free = torch.cuda.mem_get_info(device)[0]
        if needed > free / 4:
            return (f"another process would take {needed / 2**30:.1f} GiB of the {free / 2**30:.1f} GiB free on "
                    f"{device}")  # fmt: skip
    return None


class BackgroundCompiles:
    """The compile processes started by one `AheadOfTime`, by signature key."""

    def __init__(self) -> None:
        self._running: dict[str, tuple[subprocess.Popen, str, str]] = {}  # key -> (process, job file, log file)

    def start(self, key: str, path: str, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any],
              dynamic: bool | None, mark: Callable[[tuple, dict], None]) -> str | None:  # fmt: skip
        """Start compiling `module`'s training forward for this call into `path`; None when started, else why not."""
        short = _short_of_gpu_memory(module, args, kwargs)
        if short is not None:
            return short
        job = {"key": key, "path": path, "dynamic": dynamic, "mark": mark, "state": _state(),
               "args": aliases(args), "kwargs": {k: aliases(v) for k, v in kwargs.items()}}  # fmt: skip
        handle, job_file = tempfile.mkstemp(prefix="vlm-grpo-layer-", suffix=".job")
        os.close(handle)
        try:
            with _writable(module):
                torch.save({**job, "module": module}, job_file)
        except Exception as error:  # noqa: BLE001 (a class made at run time, an unpicklable setting)
            os.remove(job_file)
            return f"the layer could not be written for another process ({type(error).__name__}: {error})"
        os.makedirs(os.path.dirname(path), exist_ok=True)
        log_file = f"{path}.log"
        # The new process imports what this one does, from where this one does.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        with open(log_file, "w") as log:
            process = subprocess.Popen([sys.executable, "-m", WORKER, job_file], stdout=log,
                                       stderr=subprocess.STDOUT, env=env, cwd=os.getcwd())  # fmt: skip
        self._running[key] = (process, job_file, log_file)
        return None

    def pending(self) -> set[str]:
        """The keys whose process has not finished."""
        return {key for key, (process, _, _) in self._running.items() if process.poll() is None}

    def finished(self) -> list[tuple[str, str | None]]:
        """`(key, None)` for each process that saved its function since the last call, `(key, why not)` for each that
        failed."""
        done = []
        for key, (process, job_file, log_file) in list(self._running.items()):
            if process.poll() is None:
                continue
            del self._running[key]
            with contextlib.suppress(OSError):
                os.remove(job_file)
            if process.returncode == 0:
                with contextlib.suppress(OSError):
                    os.remove(log_file)  # kept only to say why a process failed
                done.append((key, None))
                continue
            try:
                with open(log_file) as f:
                    last = [line.strip() for line in f if line.strip()][-1:]
            except OSError:
                last = []
            done.append((key, f"exit status {process.returncode}: {last[0][:300] if last else 'no output'}"))
        return done

    def wait(self, timeout: float | None = None) -> None:
        """Wait for every running process (tests; a trainer never waits)."""
        for process, _, _ in self._running.values():
            process.wait(timeout)
