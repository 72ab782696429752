from dataclasses import replace

import pytest
import torch

from vllm_dspark import doctor
from vllm_dspark.cli import main
from vllm_dspark.config import OPTION_NAMES
from vllm_dspark.doctor import Machine, run_doctor

TORCH_ARCHS = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
H100 = Machine("0.26.0", "NVIDIA H100 80GB HBM3", (9, 0), TORCH_ARCHS, True, 3)
A100 = Machine("0.26.0", "NVIDIA A100-SXM4-80GB", (8, 0), TORCH_ARCHS, True, 2)
NO_GPU = Machine("0.26.0")


def report_of(machine: Machine) -> tuple[bool, str]:
    lines: list[str] = []
    can_run = run_doctor(out=lines.append, machine=machine)
    return can_run, "\n".join(lines)


def test_doctor_reports_versions_options_and_verdict(monkeypatch):
    monkeypatch.delenv("VLLM_DSPARK_CAPACITY", raising=False)
    lines: list[str] = []
    can_run = run_doctor(out=lines.append)
    report = "\n".join(lines)
    assert "vLLM    0.26.0" in report
    for name in OPTION_NAMES:
        assert f"dspark_{name} / VLLM_DSPARK_{name.upper()}" in report
    if not torch.cuda.is_available():
        assert not can_run
    assert ("cannot run DSpark" in report) == (not can_run)


def test_doctor_flags_a_bad_environment(monkeypatch):
    monkeypatch.setenv("VLLM_DSPARK_CAPACITY", "fast")
    lines: list[str] = []
    assert not run_doctor(out=lines.append)
    assert any("[NO ] VLLM_DSPARK_* environment" in line and "'fast'" in line for line in lines)


def test_capable_gpu_can_run(monkeypatch):
    monkeypatch.delenv("VLLM_DSPARK_CAPACITY", raising=False)
    can_run, report = report_of(H100)
    assert can_run, report
    assert "[ok ] CUDA GPU: NVIDIA H100 80GB HBM3, compute capability 9.0" in report
    assert "[ok ] FP8 (e4m3)" in report and "[ok ] draft attention: FlashAttention 3" in report
    assert "This machine can run DSpark." in report


def test_fp8_is_optional(monkeypatch):
    """An A100 runs DSpark; only the FP8 options are ruled out."""
    monkeypatch.delenv("VLLM_DSPARK_CAPACITY", raising=False)
    can_run, report = report_of(A100)
    assert can_run, report
    assert "[ - ] FP8 (e4m3): needs compute capability 8.9" in report


@pytest.mark.parametrize(
    "machine, failed",
    [
        (NO_GPU, "CUDA GPU"),
        (replace(H100, vllm_version="0.25.1"), "vLLM version"),
        (replace(H100, vllm_version="not installed", has_triton=False), "vLLM version"),
        (
            Machine("0.26.0", "Tesla V100-SXM2-32GB", (7, 0), TORCH_ARCHS, True),
            "compute capability",
        ),
        (replace(H100, has_triton=False), "Triton driver"),
    ],
)
def test_machines_that_cannot_run_say_why(machine, failed, monkeypatch):
    monkeypatch.delenv("VLLM_DSPARK_CAPACITY", raising=False)
    can_run, report = report_of(machine)
    assert not can_run
    assert f"[NO ] {failed}" in report
    assert f"This machine cannot run DSpark ({failed}" in report


@pytest.mark.parametrize("machine, code", [(NO_GPU, 1), (H100, 0)])
def test_cli_doctor_exit_status_follows_the_verdict(machine, code, monkeypatch, capsys):
    monkeypatch.delenv("VLLM_DSPARK_CAPACITY", raising=False)
    monkeypatch.setattr(doctor, "inspect_machine", lambda: machine)
    assert main(["doctor"]) == code
    out = capsys.readouterr().out
    assert "Options" in out and "Checks" in out  # the full report, whatever the verdict


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_cli_doctor_fails_on_this_gpu_less_machine(capsys):
    assert main(["doctor"]) == 1
    assert "cannot run DSpark (CUDA GPU)" in capsys.readouterr().out
