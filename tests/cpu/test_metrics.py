from dataclasses import replace

from vllm.v1.metrics.reader import Counter, Histogram, Vector

from vllm_dspark.metrics import (
    ITERATION_TOKENS,
    AdmissionCounts,
    SpecDecodeCounts,
    histogram_totals,
)


def snapshot(drafts, accepted, per_pos):
    labels = {"engine": "0"}
    return SpecDecodeCounts.from_metrics(
        [
            Counter("vllm:spec_decode_num_drafts", labels, drafts),
            Counter("vllm:spec_decode_num_draft_tokens", labels, 3 * drafts),
            Counter("vllm:spec_decode_num_accepted_tokens", labels, accepted),
            Vector("vllm:spec_decode_num_accepted_tokens_per_pos", labels, per_pos),
            Counter("vllm:num_requests_running", labels, 99),
        ]
    )


def test_difference_of_snapshots_gives_the_run():
    before = snapshot(10, 12, [8, 3, 1])
    after = snapshot(30, 42, [26, 12, 4])
    run = after - before
    assert (run.drafts, run.draft_tokens, run.accepted_tokens) == (20, 60, 30)
    assert run.accepted_per_position == [18, 9, 3]
    assert run.acceptance_length == 2.5
    assert run.per_position_acceptance == [0.9, 0.45, 0.15]


def test_runs_taken_in_turn_add_up_to_their_counts_with_the_later_gauges():
    first = snapshot(30, 42, [26, 12, 4]) - snapshot(10, 12, [8, 3, 1])
    second = snapshot(5, 4, [3, 1]) - SpecDecodeCounts()
    both = first + second
    assert (both.drafts, both.accepted_tokens, both.accepted_per_position) == (25, 34, [21, 10, 3])
    earlier = AdmissionCounts(proposed=70, admitted=40, steps=10, depth=7, compaction_ms=1.0)
    later = AdmissionCounts(proposed=7, admitted=3, steps=1, depth=5, compaction_ms=0.5)
    earlier.proposals_at_depth, later.proposals_at_depth = [0, 10], [1, 0]
    total = earlier + later
    assert (total.proposed, total.admitted, total.steps) == (77, 43, 11)
    assert (total.depth, total.compaction_ms) == (5, 0.5)  # gauges: the later run's
    assert total.proposals_at_depth == [1, 10]
    assert total - later == replace(earlier, depth=5, compaction_ms=0.5)


def test_histogram_totals_add_every_engines_observations():
    def iterations(engine, count):
        return Histogram(ITERATION_TOKENS, {"engine": engine}, count, 9.0 * count, {})

    other = Histogram("vllm:time_to_first_token_seconds", {"engine": "0"}, 50, 1.0, {})
    metrics = [iterations("0", 120), iterations("1", 7), other]
    assert histogram_totals(metrics, ITERATION_TOKENS) == (127, 9.0 * 127)
    assert histogram_totals(metrics, "vllm:time_to_first_token_seconds") == (50, 1.0)
    running = Counter("vllm:num_requests_running", {"engine": "0"}, 99)
    assert histogram_totals([running], ITERATION_TOKENS) == (0, 0)


def test_no_drafts_gives_nan():
    assert SpecDecodeCounts().acceptance_length != SpecDecodeCounts().acceptance_length


def test_admitted_per_request_counts_compacted_steps_only():
    from vllm_dspark.metrics import AdmissionCounts

    before = AdmissionCounts(proposed=70, admitted=30, num_drafts=7)
    after = AdmissionCounts(proposed=70 + 4 * 7, admitted=30 + 10, num_drafts=7, steps=2)
    assert (after - before).admitted_per_request == 10 / 4  # 4 request-steps, 10 drafts
    assert (after - before).steps == 2
    before.proposals_at_depth, after.proposals_at_depth = [3, 0, 5], [4, 2, 5]
    assert (after - before).proposals_at_depth == [1, 2, 0]
    assert AdmissionCounts(num_drafts=7).admitted_per_request == 7.0  # nothing compacted


def test_sps_reports_the_step_overhead_it_plans_with():
    import torch

    from vllm_dspark.capacity.step_overhead import StepOverhead
    from vllm_dspark.metrics import AdmissionCounts, _overhead

    overhead = StepOverhead(torch.device("cpu"), fixed_seconds=0.0025)
    overhead.per_request_seconds, overhead.per_draft_seconds = 2e-6, 1.5e-5
    overhead.skip_seconds, overhead.compaction_seconds = 1.25e-3, 6e-4
    overhead.plain_seconds, overhead.plain_per_request_seconds = 1.1e-3, 4e-6
    gauges = _overhead(overhead)
    assert gauges == {
        "step_overhead_ms": 2.5,
        "per_request_overhead_us": 2.0,
        "per_draft_overhead_us": 15.0,
        "skipped_proposal_ms": 1.25,
        "compaction_ms": 0.6,
        "plain_step_ms": 1.1,
        "plain_per_request_us": 4.0,
    }
    counts = AdmissionCounts(num_drafts=7, **gauges)
    difference = counts - AdmissionCounts(num_drafts=7)
    assert (difference.step_overhead_ms, difference.skipped_proposal_ms) == (2.5, 1.25)  # gauges
    assert (difference.plain_step_ms, difference.plain_per_request_us) == (1.1, 4.0)
    assert difference.compaction_ms == 0.6
    assert _overhead(None) == {}
