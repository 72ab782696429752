"""On a GPU: the capacity-control kernels compute what their PyTorch definitions say (the
CPU suite checks the same under Triton's interpreter): the compaction of a verification
batch, each proposal's statistics, each verified step's counts and each draft position's
confidence logit; and proposals' survivals reach the host intact through pinned memory
without a sync."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu"))
from test_compaction_kernel import NUM_REQS, check_kernel_against_layout  # noqa: E402
from test_confidence_kernel import CASES as CONFIDENCE_CASES  # noqa: E402
from test_confidence_kernel import check_kernel_against_head  # noqa: E402
from test_physical_depth import check_snapshots  # noqa: E402
from test_proposal_kernel import CASES, check_kernel_against_definitions  # noqa: E402
from test_verification_kernel import CASES as VERIFIED_STEPS  # noqa: E402
from test_verification_kernel import check_kernel_against_definition  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("num_reqs", NUM_REQS)
def test_compaction_kernel_matches_the_pytorch_layout(num_reqs):
    check_kernel_against_layout(num_reqs, torch.device("cuda"))


@pytest.mark.parametrize("case", CASES)
def test_proposal_kernel_matches_the_definitions(case):
    check_kernel_against_definitions(case, torch.device("cuda"))


@pytest.mark.parametrize("case", VERIFIED_STEPS)
def test_verification_kernel_matches_the_definition(case):
    check_kernel_against_definition(case, torch.device("cuda"))


def test_survival_snapshots_reach_the_host_as_taken():
    check_snapshots(torch.device("cuda"))


@pytest.mark.parametrize("case", CONFIDENCE_CASES)
def test_confidence_kernel_matches_the_head(case):
    check_kernel_against_head(case, torch.device("cuda"))


def test_step_periods_are_read_off_the_stream_without_waiting():
    """The step-overhead fit's periods: the time the stream ran between two marks (here a
    sleep of some 25 ms, timed apart by a pair of events around it), read once the later
    mark is done, never by waiting for it."""
    from vllm_dspark.capacity.step_overhead import DevicePeriods

    torch.cuda._sleep(1000)  # the sleep kernel loaded before anything is timed
    torch.cuda.synchronize()
    periods = DevicePeriods()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    assert periods.mark(None) == []  # a start only
    start.record()
    torch.cuda._sleep(50_000_000)
    end.record()
    assert periods.mark("sleep") == []  # still sleeping: nothing waited for
    torch.cuda.synchronize()
    (seconds, payload), *_ = periods.mark("next")
    assert payload == "sleep" and seconds > 5e-3
    assert seconds == pytest.approx(start.elapsed_time(end) / 1e3, rel=0.02)
