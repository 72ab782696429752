"""The load-aware physical depth controller (host-side decisions)."""

from vllm_dspark.capacity.physical_depth import PROBE_AFTER, WINDOW_STEPS, PhysicalDepth

K = 7


def window(depth: PhysicalDepth, max_admitted: int, num_reqs: int = 64) -> int:
    return [depth.observe(num_reqs, max_admitted) for _ in range(WINDOW_STEPS)][-1]


def test_depth_follows_the_largest_recent_admission_and_probes_when_saturated():
    depth = PhysicalDepth(K)
    assert depth.depth == K
    assert [depth.observe(64, 2) for _ in range(WINDOW_STEPS - 1)] == [K] * (WINDOW_STEPS - 1)
    assert depth.observe(64, 2) == 2  # the window's largest admission
    assert depth.changes == 1
    # Admissions at the cap: d may be the limit; after PROBE_AFTER windows, one deeper.
    for _ in range(PROBE_AFTER - 1):
        assert window(depth, 2) == 2
    assert window(depth, 2) == 3
    # The larger of the last two windows: one quiet window does not drop d at once.
    assert window(depth, 1) == 2  # max(1, 2 from the window before)
    assert window(depth, 1) == 1
    assert window(depth, 0) == 1  # never below one
    assert depth.changes == 4


def test_a_cost_reading_replaces_the_largest_admission():
    """sps: the depth that pays best decides, although some request admits all K; no
    reading (None) falls back to the largest admission."""
    depth = PhysicalDepth(K)
    readings = []

    def paying() -> int:
        readings.append(depth.depth)
        return 4

    assert [depth.observe(64, K, paying) for _ in range(WINDOW_STEPS)][-1] == 4
    assert readings == [K]  # read once, at the window's end
    # 4 is the limit it was allowed: after PROBE_AFTER such windows, one deeper.
    for _ in range(PROBE_AFTER - 1):
        assert [depth.observe(64, K, paying) for _ in range(WINDOW_STEPS)][-1] == 4
    assert [depth.observe(64, K, paying) for _ in range(WINDOW_STEPS)][-1] == 5
    # At 5, 4 pays best: back to 4 (the larger of the last two readings, both 4).
    assert [depth.observe(64, K, paying) for _ in range(WINDOW_STEPS)][-1] == 4
    assert [depth.observe(64, 2, lambda: None) for _ in range(WINDOW_STEPS)][-1] == 4
    assert [depth.observe(64, 2, lambda: None) for _ in range(WINDOW_STEPS)][-1] == 2


def check_snapshots(device) -> None:
    """Each snapshot comes back two proposals later, as it was when taken: the proposal's
    tensor, overwritten right after (as the next step's drafts overwrite a graph's
    buffers), does not change it."""
    import torch

    from vllm_dspark.capacity.stale_record import StaleSnapshots

    snapshots = StaleSnapshots(8, K, device)
    buffer = torch.zeros(8, K, device=device)
    taken = []

    def propose(rows: int | None):
        if rows is None:
            return snapshots.exchange(None)
        buffer[:rows] = torch.rand(rows, K, device=device)
        taken.append(buffer[:rows].cpu().clone())
        earlier = snapshots.exchange(buffer[:rows])
        buffer.fill_(-5.0)
        return earlier

    assert propose(3) is None and propose(5) is None
    torch.testing.assert_close(propose(None), taken[0])  # the third takes none
    torch.testing.assert_close(propose(2), taken[1])
    assert propose(None) is None  # the third's: none
    torch.testing.assert_close(propose(None), taken[2])


def test_snapshots_are_read_two_proposals_later():
    import torch

    check_snapshots(torch.device("cpu"))


def test_a_sharply_shrinking_batch_restores_full_depth():
    depth = PhysicalDepth(K)
    window(depth, 3, num_reqs=200)
    assert depth.depth == 3
    assert depth.observe(120, 3) == 3  # shrank, but not under half
    assert depth.observe(90, 3) == K  # under half of 200: load is leaving
    assert window(depth, 3, num_reqs=90) == 3  # decided afresh from what is admitted


def test_ranks_fed_alike_decide_alike():
    ranks = [PhysicalDepth(K), PhysicalDepth(K)]
    feed = [(64 - step % 40, (step * 7) % 6) for step in range(200)]
    paths = [[rank.observe(r, m) for r, m in feed] for rank in ranks]
    assert paths[0] == paths[1]
    assert len(set(paths[0])) > 1


def test_depth_ratios_are_per_concurrency_against_full_depth():
    from draft_depth_time import depth_ratios  # benchmarks/ is on the path (vllm_cpu.py)

    rows = [
        {"concurrency": 256, "depth": 7, "draft_ms": 4.0},
        {"concurrency": 256, "depth": 2, "draft_ms": 1.6},
        {"concurrency": 1, "depth": 7, "draft_ms": 1.0},
        {"concurrency": 1, "depth": 2, "draft_ms": 0.9},
        {"concurrency": 64, "depth": 2, "draft_ms": None},  # no graph
    ]
    assert depth_ratios(rows) == {"256/7": 1.0, "256/2": 0.4, "1/7": 1.0, "1/2": 0.9}
