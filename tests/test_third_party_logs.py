"""Third-party log lines that report no problem are dropped; the same lines reporting a real one are kept."""

import logging
import os
import subprocess
import sys

import pytest

import vlm_grpo  # noqa: F401 (installs the filters)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _logged(caplog, cause: Exception) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="bitsandbytes.backends.cpu.ops"):
        logging.getLogger("bitsandbytes.backends.cpu.ops").warning(
            "Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you already `pip "
            "install kernels` and the kernels >= 0.11.1", cause,
        )  # fmt: skip
    return [r.getMessage() for r in caplog.records]


def test_the_optional_kernels_package_missing_is_not_reported_but_other_causes_are(caplog):
    assert _logged(caplog, ModuleNotFoundError("No module named 'kernels'", name="kernels")) == []
    kept = _logged(caplog, ModuleNotFoundError("No module named 'torch_extra'", name="torch_extra"))
    assert len(kept) == 1 and "torch_extra" in kept[0]
    assert len(_logged(caplog, RuntimeError("Hub unreachable"))) == 1


def test_the_optional_kernel_not_fetched_is_not_reported_but_a_failing_one_is(caplog):
    # transformers 5.25 installs `kernels`: bitsandbytes then fails to fetch its kernel, offline or with no Hub.
    repo = "'kernels-community/quantization-bitsandbytes'"
    offline = ValueError(f"Version 1 of {repo} is not available in the local cache and Hugging Face Hub is in offline")
    unreachable = ValueError(f"Kernel repository {repo} could not verify publisher trust status. Set trust_remote_code")
    assert _logged(caplog, offline) == [] and _logged(caplog, unreachable) == []
    assert len(_logged(caplog, ValueError(f"Kernel repository {repo} is not from a trusted publisher."))) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kernels._internals.hf_hub"):
        for repo_id in (repo, "'kernels-community/flash-attn3'"):
            logging.getLogger("kernels._internals.hf_hub").warning(
                f"Skipping publisher trust check for {repo_id} because Hugging Face Hub is in offline mode."
            )
    assert [r.getMessage() for r in caplog.records] == [
        "Skipping publisher trust check for 'kernels-community/flash-attn3' because Hugging Face Hub is in offline mode."
    ]  # a kernel the user asked for keeps its line


@pytest.mark.parametrize("offline", [True, False])
def test_importing_the_trainer_prints_nothing(offline):
    # PEFT imports bitsandbytes when it is installed (the dev extras install it): its import warning is the case.
    env = {**os.environ, "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1" if offline else "0"}
    if not offline:  # online, the Hub unreachable: a port nothing listens on refuses at once
        env["HF_ENDPOINT"] = "http://127.0.0.1:9"
    proc = subprocess.run([sys.executable, "-c", "import vlm_grpo.training.trainer"], check=False, capture_output=True,
                          text=True, timeout=300, env=env)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == "", proc.stderr


def test_gpu_kernel_advice_is_dropped_without_a_gpu_and_kept_with_one(caplog, monkeypatch):
    import torch

    message = "`chunk_gated_delta_rule` is falling back to its reference PyTorch implementation because x"
    logger = logging.getLogger("transformers.integrations.hub_kernels")
    for gpu, expected in ((False, 0), (True, 1)):  # this machine's answer replaced by each of the two
        monkeypatch.setattr(torch.cuda, "is_available", lambda gpu=gpu: gpu)
        caplog.clear()
        # transformers' root logger does not propagate once transformers configured it: caplog listens on the logger.
        logger.addHandler(caplog.handler)
        propagate, logger.propagate = logger.propagate, False  # one record each, whatever the order tests ran in
        try:
            with caplog.at_level(logging.WARNING, logger="transformers.integrations.hub_kernels"):
                logger.warning(message)
                logger.warning("another transformers kernel warning")
        finally:
            logger.removeHandler(caplog.handler)
            logger.propagate = propagate
        assert [r.getMessage() for r in caplog.records].count(message) == expected
        assert "another transformers kernel warning" in caplog.text


def test_torchao_extension_failures_are_dropped_without_cuda_and_its_enum_notice_always(caplog, monkeypatch):
    import torch

    failure = "Failed to load /venv/torchao/_C_mxfp8.so: Could not load this library: /venv/torchao/_C_mxfp8.so"
    notice = "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile as an opaque"
    for cuda, expected in ((None, []), ("12.8", [failure])):  # a CPU build of torch, then a CUDA one
        monkeypatch.setattr(torch.version, "cuda", cuda)
        caplog.clear()
        loggers = [logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")]
        propagate = [logger.propagate for logger in loggers]
        for logger in loggers:  # torch's loggers do not propagate: caplog listens on each, once
            logger.addHandler(caplog.handler)
            logger.propagate = False
        try:
            loggers[0].warning(failure)
            loggers[1].warning(notice)
            loggers[1].warning("another pytree warning")
        finally:
            for logger, was in zip(loggers, propagate, strict=True):
                logger.removeHandler(caplog.handler)
                logger.propagate = was
        assert [r.getMessage() for r in caplog.records] == [*expected, "another pytree warning"]
