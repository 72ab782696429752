import torch

from vllm_dspark.cli import main
from vllm_dspark.config import OPTION_NAMES
from vllm_dspark.doctor import run_doctor


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


def test_cli_doctor_exits_zero(capsys):
    assert main(["doctor"]) == 0
    assert "Options" in capsys.readouterr().out
