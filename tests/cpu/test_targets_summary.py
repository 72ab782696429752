"""tools/targets_summary.py: the capacity and the depth / DFlash / online-STS targets from
the GPU records."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "tools"))

from targets_summary import embedded_pair, summarize  # noqa: E402

RECORD = {"commit": "abc", "date": "d", "device": "H200"}


def write(directory: Path, name: str, body: dict) -> None:
    (directory / name).write_text(json.dumps(RECORD | body))


def sweep_rows(setup: str, tok_s: dict) -> list[dict]:
    return [
        {"setup": setup, "arm": arm, "concurrency": c, "tok_s": value}
        for (arm, c), value in tok_s.items()
    ]


def test_every_target_is_checked_from_its_record(tmp_path):
    depth = [
        {"concurrency": c, "depth": d, "draft_ms": ms}
        for c, d, ms in [(256, 2, 3.5), (256, 7, 6.5), (64, 2, 1.1), (64, 7, 1.9)]
    ]
    write(tmp_path, "depth_time.json", {"rows": depth})
    setup = "qwen3-8b/confidence"
    current = {("sps", 64): 100.0, ("sps-depth", 64): 110.0, ("nospec", 64): 50.0}
    current |= {("sps", 256): 200.0, ("sps-depth", 256): 190.0, ("threshold", 256): 150.0}
    current |= {("sps-plain", 256): 180.0, ("sps-depth-plain", 256): 198.0}
    # The other setup's run, listed first (as in the file), must not count.
    rows = sweep_rows("embedded", {("nospec", 64): 999.0, ("nospec", 256): 999.0})
    rows += sweep_rows(setup, current)
    runs = [{"commit": "old", "setup": "embedded"}, {"commit": "new", "setup": setup}]
    write(tmp_path, "capacity_sweep.json", {"runs": runs, "rows": rows})
    dflash = {(arm, c): 100.0 for arm in ("dflash", "nospec") for c in (1, 16, 64, 256)}
    dflash |= {("dflash-acceptance", c): 101.0 for c in (1, 16, 64, 256)}
    dflash |= {("dflash-plain", c): 99.0 for c in (1, 16, 64, 256)}
    dflash_rows = sweep_rows(setup, dflash)
    for row in dflash_rows:
        if row["concurrency"] == 256 and row["arm"] in ("nospec", "dflash-acceptance"):
            row["tok_s_repeats"] = [row["tok_s"] - 1, row["tok_s"], row["tok_s"] + 5]
    write(tmp_path, "dflash_acceptance.json", {"rows": dflash_rows})
    evaluation = {"steps_before": 1800, "ece": [0.02, 0.031], "max_ece": 0.031}
    write(
        tmp_path,
        "online_sts.json",
        {"evaluation": evaluation, "greedy_identical": True, "greedy_identical_prompts": 200},
    )
    entries, missing = summarize(tmp_path, "depth-sts")
    assert missing == []
    depth_entry, gain, dflash_entry, sts = entries
    assert depth_entry["passes"] and abs(depth_entry["measured"]["ratio"] - 3.5 / 6.5) < 1e-9
    assert gain["passes"] is None  # a measurement, not a threshold
    assert gain["measured"]["64"]["gain"] == 1.1
    assert gain["evidence"]["commit"] == "new"  # setup (b)'s run, not the file's or (a)'s
    # At 256 the best depth arm is sps-depth-plain, short of sps; against its own options
    # without depth (sps-plain) it gains 10%.
    at_256 = gain["measured"]["256"]
    assert (at_256["best_depth_arm"], at_256["best_other_arm"]) == ("sps-depth-plain", "sps")
    assert at_256["gain"] == pytest.approx(0.99)
    assert at_256["over_same_arm_without_depth"] == pytest.approx(
        {"sps-depth": 0.95, "sps-depth-plain": 1.1}
    )
    # The plain-steps arm misses (0.99x); the other passes, so the target does.
    assert dflash_entry["passes"]
    assert dflash_entry["measured"]["dflash-acceptance"]["over_nospec_256"] == 1.01
    assert dflash_entry["measured"]["dflash-plain"]["over_fixed"]["1"] == 0.99
    assert dflash_entry["measured"]["dflash-acceptance"]["repeats_256"] == {
        "dflash-acceptance": [100.0, 101.0, 106.0],
        "nospec": [99.0, 100.0, 105.0],
    }
    assert "repeats_256" not in dflash_entry["measured"]["dflash-plain"]  # none recorded
    assert not sts["passes"]  # position 2's ECE is 0.031
    # The arm that meets the DFlash target skipped its prefill: no verdict.
    for row in dflash_rows:
        row["mean_ttft_s"] = 0.2 if row["arm"] == "dflash-acceptance" else 0.5
    write(tmp_path, "dflash_acceptance.json", {"rows": dflash_rows})
    dflash_entry = summarize(tmp_path, "depth-sts")[0][2]
    assert dflash_entry["passes"] is None
    assert dflash_entry["prefill_cached_arms"] == ["dflash-acceptance"]
    assert sts["evidence"] == {"file": "benchmarks/results/online_sts.json"} | RECORD


def test_a_lean_controller_arm_is_held_to_the_fixed_arm_that_drafts_alike():
    from targets_summary import dflash, fixed_counterpart

    assert fixed_counterpart("dflash-depth-plain") == "dflash"
    assert fixed_counterpart("dflash-depth-plain-lean") == "dflash-lean"
    # The lean controller beats stock fixed depth and no speculation, but not fixed depth
    # with the same drafting cuts at one request; fixed lean is no controller arm.
    tok_s = {(arm, c): 100.0 for arm in ("dflash", "nospec") for c in (1, 16, 64, 256)}
    tok_s |= {("dflash-lean", c): 103.0 for c in (1, 16, 64, 256)}
    tok_s |= {("dflash-depth-plain-lean", c): 104.0 for c in (16, 64, 256)}
    tok_s[("dflash-depth-plain-lean", 1)] = 102.0
    entry = dflash({"rows": sweep_rows("qwen3-8b/rates", tok_s)})
    assert set(entry["measured"]) == {"dflash-depth-plain-lean"}
    measured = entry["measured"]["dflash-depth-plain-lean"]
    assert measured["fixed_arm"] == "dflash-lean"
    assert measured["over_fixed"]["1"] == pytest.approx(102 / 103)
    assert entry["passes"] is False
    tok_s[("dflash-depth-plain-lean", 1)] = 103.0
    assert dflash({"rows": sweep_rows("qwen3-8b/rates", tok_s)})["passes"] is True
    # A run at 256 requests alone cannot show it matches fixed depth at every load.
    at_256 = {key: value for key, value in tok_s.items() if key[1] == 256}
    assert dflash({"rows": sweep_rows("qwen3-8b/rates", at_256)})["passes"] is False


def test_a_follow_up_run_of_more_repeats_pools_into_the_verdict():
    from targets_summary import dflash

    tok_s = {(arm, c): 100.0 for arm in ("dflash-lean", "nospec") for c in (1, 16, 64, 256)}
    tok_s |= {("dflash-depth-lean", c): 104.0 for c in (1, 16, 64, 256)}
    rows = sweep_rows("qwen3-8b/rates", tok_s)
    for row in rows:
        row["tok_s_repeats"] = [row["tok_s"]] * 3
    behind = [98.0, 99.0, 100.0]  # the controller's repeats at 16, fixed depth's 100 each
    for row in rows:
        if row["arm"] == "dflash-depth-lean" and row["concurrency"] == 16:
            row |= {"tok_s": 99.0, "tok_s_repeats": behind}
    record = RECORD | {"rows": rows}
    assert dflash(record)["passes"] is False
    more = [
        {"arm": "dflash-depth-lean", "concurrency": 16, "tok_s_repeats": [101.0] * 5},
        {"arm": "dflash-lean", "concurrency": 16, "tok_s_repeats": [100.0] * 5},
    ]
    entry = dflash(record | {"more_repeats": RECORD | {"rows": more}})
    measured = entry["measured"]["dflash-depth-lean"]
    assert measured["over_fixed"]["16"] == pytest.approx(1.01)  # median of 8 repeats
    assert measured["over_fixed_first_run"]["16"] == pytest.approx(0.99)
    assert entry["pooled_repeats"] == [["dflash-lean", 16], ["dflash-depth-lean", 16]]
    assert entry["passes"] is True
    # Another commit's (or device's) repeats do not pool.
    with pytest.raises(ValueError, match="commit and device"):
        dflash(record | {"more_repeats": RECORD | {"commit": "def", "rows": more}})


def test_a_missing_record_leaves_its_target_unmeasured(tmp_path):
    for issue, targets in [
        ("capacity", 4),
        ("depth-sts", 4),
        ("step-cost", 4),
        ("moe", 4),
        ("dsv4-compact", 3),
        ("serving", 5),
    ]:
        entries, missing = summarize(tmp_path, issue)
        assert len(missing) == len(entries) == targets
        assert all(entry["passes"] is None and entry["measured"] is None for entry in entries)


def shape_rows(shape: str, tok_s: dict, **fields) -> list[dict]:
    return [
        {"shape": shape, "arm": arm, "concurrency": c, "tok_s": value} | fields
        for (arm, c), value in tok_s.items()
    ]


def test_moe_targets_hold_sps_to_the_best_speculation_free_arm_everywhere(tmp_path):
    tok_s = {("nospec", c): 100.0 * c for c in (1, 16, 64, 256)}
    tok_s |= {("dspark", c): 200.0 * c for c in (1, 16, 64)} | {("dspark", 256): 150.0 * 256}
    tok_s |= {("sps", c): 201.0 * c for c in (1, 16, 256)} | {("sps", 64): 199.0 * 64}
    rows = shape_rows("qwen3-30b-a3b", tok_s) + shape_rows("tiny-moe", {("sps", 1): 1.0})
    write(tmp_path, "moe_qwen3.json", {"rows": rows})
    (against_best, under_load, masked, table), missing = summarize(tmp_path, "moe")
    assert missing == ["deepseek_v4.json", "deepseek_v4.json"]
    assert against_best["passes"] is False  # 64 requests: 0.995x stock k=7
    assert against_best["measured"]["64"] == {"best_other_arm": "dspark", "ratio": 199 / 200}
    assert against_best["measured"]["256"]["ratio"] == pytest.approx(201 / 150)
    assert under_load["passes"] is True and under_load["measured"]["ratio"] == 2.01
    # sps's repeats interleaved with its engine's own k=7: that pairing decides against
    # both k=7 arms (no speculation still by its median).
    fixed = shape_rows("qwen3-30b-a3b", {("dspark-fixed", 64): 201.0 * 64})
    for paired, verdict in ((1.004, True), (0.998, False)):
        sps = shape_rows(
            "qwen3-30b-a3b", {("sps", 64): 199.0 * 64}, paired={"dspark-fixed": paired}
        )
        write(tmp_path, "moe_qwen3.json", {"rows": rows + fixed + sps})
        (against_best, *_), _ = summarize(tmp_path, "moe")
        assert against_best["passes"] is verdict
        assert against_best["measured"]["64"]["ratio"] == paired
        assert against_best["measured"]["64"]["best_other_arm"] == "dspark-fixed"
        assert against_best["measured"]["64"]["median_ratio"] == 199 / 201
    # A concurrency not run leaves the verdict open, not met.
    del tok_s[("sps", 64)]
    write(tmp_path, "moe_qwen3.json", {"rows": shape_rows("qwen3-30b-a3b", tok_s)})
    assert summarize(tmp_path, "moe")[0][0]["passes"] is None


def dsv4_rows(tok_s: dict, greedy: dict) -> list[dict]:
    verify = {"nospec": "none", "dspark": "none", "sps": "compact"}
    rows = shape_rows("dsv4-flash-reduced", tok_s)
    for row in rows:
        row["verify"] = verify.get(row["arm"], "masked")
        row["greedy_identical"] = greedy.get(row["arm"])
    return rows


def test_dsv4_targets_compare_compact_sps_with_no_speculation_masked_sps_and_fixed_depth(
    tmp_path,
):
    tok_s = {("nospec", 1): 100.0, ("dspark", 1): 250.0, ("sps-masked", 1): 240.0}
    tok_s |= {("sps", 1): 245.0, ("nospec", 256): 1000.0, ("dspark", 256): 900.0}
    tok_s |= {("sps-masked", 256): 1100.0, ("sps", 256): 1200.0}
    tok_s |= {(arm, 16): 1.0 for arm in ("budget-masked", "threshold-masked", "acceptance-masked")}
    greedy = {arm: True for arm, _ in tok_s} | {"nospec": None, "dspark": None}
    write(tmp_path, "deepseek_v4.json", {"rows": dsv4_rows(tok_s, greedy)})
    results = {"sps": {"greedy_token_ids_identical": True}}
    results["sps"]["admission"] = {"steps": 12, "mixed_steps": 2, "graph_steps": 10}
    write(tmp_path, "dsv4_compact_lossless_gpu.json", {"result": results})
    (lossless, under_load, at_one), _ = summarize(tmp_path, "dsv4-compact")
    assert lossless["passes"] is True
    assert under_load["passes"] is False  # 1.20x no speculation, but 1.09x masked sps
    assert under_load["measured"]["sps-masked"]["ratio"] == pytest.approx(1200 / 1100)
    assert under_load["measured"]["nospec"]["ratio"] == pytest.approx(1.2)
    # The same medians, but masked and compact sps interleaved: their pairing decides.
    rows = dsv4_rows(tok_s, greedy)
    for row in rows:
        if (row["arm"], row["concurrency"]) == ("sps", 256):
            row["paired"] = {"sps-masked": 1.12}
    write(tmp_path, "deepseek_v4.json", {"rows": rows})
    (_, paired, _), _ = summarize(tmp_path, "dsv4-compact")
    assert paired["passes"] is True
    masked = paired["measured"]["sps-masked"]
    assert masked["ratio"] == 1.12 and masked["median_ratio"] == pytest.approx(1200 / 1100)
    write(tmp_path, "deepseek_v4.json", {"rows": dsv4_rows(tok_s, greedy)})
    assert at_one["passes"] is True and at_one["measured"]["ratio"] == 245 / 250
    (_, _, masked, table), _ = summarize(tmp_path, "moe")
    assert masked["passes"] is True  # sps, budget, threshold and acceptance, all identical
    assert table["passes"] is False  # 16 and 64 requests not run
    # One masked mode that diverged, or one compacted decode step off the graphs, fails.
    greedy["threshold-masked"] = False
    write(tmp_path, "deepseek_v4.json", {"rows": dsv4_rows(tok_s, greedy)})
    assert summarize(tmp_path, "moe")[0][2]["passes"] is False
    results["sps"]["admission"]["graph_steps"] = 9
    write(tmp_path, "dsv4_compact_lossless_gpu.json", {"result": results})
    assert summarize(tmp_path, "dsv4-compact")[0][0]["passes"] is False


def test_capacity_targets_are_checked_from_the_sweep_and_the_newest_breakdown(tmp_path):
    concurrencies = (1, 16, 64, 256)
    setup_b = {("nospec", c): 100.0 for c in concurrencies}
    setup_b |= {("dspark", c): 200.0 for c in concurrencies}
    setup_b |= {("sps", 1): 193.0, ("sps", 16): 210.0, ("sps", 64): 205.0, ("sps", 256): 112.0}
    # Another sps configuration: 0.98x fixed k=7 at one request and at 256, below sps at 16
    # (another configuration of the same mode is no rival).
    setup_b |= {("sps-plain", 1): 196.0, ("sps-plain", 16): 200.0}
    setup_b |= {("sps-plain", 64): 200.0, ("sps-plain", 256): 196.0}
    setup_a = {("nospec", c): 100.0 for c in concurrencies}
    setup_a |= {("dspark", c): 90.0 + c for c in concurrencies}
    setup_a |= {("sps", c): 99.0 for c in concurrencies}  # below no speculation everywhere
    setup_a |= {("sps-plain", c): 101.0 + c for c in concurrencies}  # above both everywhere
    rows = sweep_rows("embedded", setup_a) + sweep_rows("qwen3-8b/confidence", setup_b)
    runs = [
        {"commit": "a", "setup": "embedded"},
        {"commit": "b", "setup": "qwen3-8b/confidence"},
    ]
    write(tmp_path, "capacity_sweep.json", {"runs": runs, "rows": rows})
    for date, all_k7 in (("2026-12-01", 14.0), ("2026-12-04", 10.2)):
        steps = [("conf-k7", 64, 10.0), ("all-k7", 64, all_k7), ("all-k7", 1, 99.0)]
        body = {
            "date": date,
            "rows": [{"arm": arm, "concurrency": c, "step_ms_median": ms} for arm, c, ms in steps],
        }
        write(tmp_path, f"step_breakdown_overhead_{date}.json", body)
    entries, missing = summarize(tmp_path, "capacity")
    assert missing == []
    under_load, against_best, embedded, overhead = entries
    assert under_load["passes"] and under_load["measured"]["sps"]["ratio"] == 1.12
    assert under_load["measured"]["sps-plain"]["ratio"] == 1.96
    assert under_load["evidence"]["commit"] == "b"
    # sps is 0.965x fixed k=7 at one request: missed by sps whatever the other concurrencies
    # do; met by sps-plain everywhere (0.98x at one request and at 256).
    assert against_best["passes"]
    assert against_best["measured"]["sps"]["1"] == {"best_other_arm": "dspark", "ratio": 0.965}
    assert against_best["measured"]["sps"]["256"]["best_other_arm"] == "dspark"
    assert against_best["measured"]["sps-plain"]["16"] == {"best_other_arm": "dspark", "ratio": 1.0}
    # sps-plain meets both everywhere, sps neither: the target passes on sps-plain.
    assert embedded["passes"] and embedded["evidence"]["commit"] == "a"
    assert set(embedded["measured"]) == {"sps", "sps-plain"}
    assert embedded["measured"]["sps"]["1"]["over_nospec"] == 0.99
    assert embedded["measured"]["sps-plain"]["256"]["over_fixed"] == 357.0 / 346.0
    # The newest breakdown counts (1.02x), not the older (1.4x).
    assert overhead["passes"] and overhead["measured"]["ratio"] == pytest.approx(1.02)
    assert overhead["evidence"]["file"].endswith("overhead_2026-12-04.json")
    assert under_load["prefill_cached_arms"] == []  # no time to a first token recorded
    # An arm whose first tokens came in under 0.7x no speculation's time skipped its
    # prefill (prompts an earlier arm of its engine left cached): no verdict rests on it.
    for row in rows:
        row["mean_ttft_s"] = 0.2 if row["arm"] == "sps" else 0.5
    write(tmp_path, "capacity_sweep.json", {"runs": runs, "rows": rows})
    under_load, against_best, embedded, _ = summarize(tmp_path, "capacity")[0]
    assert under_load["passes"]  # sps-plain paid its prefill and meets it
    assert against_best["passes"]  # the same
    assert under_load["prefill_cached_arms"] == ["sps"]
    assert embedded["passes"]  # sps-plain, which paid its prefill, still meets it
    for row in rows:
        row["mean_ttft_s"] = 0.2 if row["arm"] == "sps-plain" else 0.5
    write(tmp_path, "capacity_sweep.json", {"runs": runs, "rows": rows})
    _, against_best, embedded, _ = summarize(tmp_path, "capacity")[0]
    # Only the cached arm meets it: unknown (sps, which paid its prefill, misses).
    assert embedded["passes"] is None and embedded["prefill_cached_arms"] == ["sps-plain"]
    assert against_best["passes"] is None  # a pass the skipped prefill may have made


@pytest.mark.parametrize(
    ("alone_equals_batched", "speculative_equals_alone", "passes"),
    [(False, True, True), (True, False, False), (False, False, False), (None, None, False)],
)
def test_a_greedy_divergence_passes_only_when_stock_batching_explains_it(
    tmp_path, alone_equals_batched, speculative_equals_alone, passes
):
    divergence = {"prompt": 54, "position": 2, "top_two_gap": 9e-5}
    if alone_equals_batched is not None:  # an older record, which did not serve it alone
        divergence["reference_alone_equals_batched"] = alone_equals_batched
        divergence["speculative_equals_reference_alone"] = speculative_equals_alone
    evaluation = {"steps_before": 2036, "last_refit_step": 1792, "ece": [0.02], "max_ece": 0.02}
    body = {"evaluation": evaluation, "greedy_identical": False, "greedy_identical_prompts": 199}
    write(tmp_path, "online_sts.json", body | {"divergences": [divergence]})
    sts = summarize(tmp_path, "depth-sts")[0][3]
    assert sts["passes"] is passes
    assert sts["measured"]["divergences_not_from_batching"] == (0 if passes else 1)
    # Refits past 2,000 steps miss the target whatever the outputs.
    late = evaluation | {"last_refit_step": 2048}
    write(tmp_path, "online_sts.json", body | {"evaluation": late, "greedy_identical": True})
    assert summarize(tmp_path, "depth-sts")[0][3]["passes"] is False


def test_every_sps_configuration_of_the_sweep_counts_for_the_sps_mode():
    """An sps arm the sweep adds (the FP8-head one, started apart) is a configuration of
    the mode, not a rival it must reach 0.97x of."""
    from offline_sweep import ARMS
    from targets_summary import CAPACITY_ARMS, SPS_MODE_ARMS

    sps = {arm for arm, options in ARMS.items() if (options or {}).get("dspark_capacity") == "sps"}
    assert "sps-depth-plain-fp8" in sps and set(SPS_MODE_ARMS) == sps
    assert {"budget", "threshold", "budget-masked", "threshold-masked"} | sps == set(CAPACITY_ARMS)


def test_step_cost_targets_take_the_best_cut_and_the_newest_k3_run(tmp_path):
    breakdown = [
        {"arm": arm, "concurrency": 256, "step_ms_median": ms, "phases_sum_over_step": ratio}
        for arm, ms, ratio in [("nospec", 10.0, 0.97), ("dspark-k1", 13.9, 1.06)]
    ]
    write(tmp_path, "step_breakdown_graphs1024_x.json", {"rows": breakdown})
    write(tmp_path, "step_breakdown.json", {"rows": breakdown})
    old = {("nospec", 256): 100.0, ("dspark", 256): 120.0, ("nospec", 1): 10.0, ("dspark", 1): 20.0}
    write(tmp_path, "fixed_k3_old.json", {"date": "1", "rows": sweep_rows("s", old)})
    new = {("nospec", 256): 100.0, ("dspark", 256): 98.0, ("dspark-vocab", 256): 101.0}
    new |= {("dspark", 1): 20.0, ("dspark-vocab", 1): 19.9}
    write(tmp_path, "fixed_k3_new.json", {"date": "2", "rows": sweep_rows("s", new)})
    # A later run at 256 requests alone: the one-request target reads the run before it.
    at_256 = {("nospec", 256): 100.0, ("dspark", 256): 99.0, ("dspark-lean", 256): 100.8}
    write(tmp_path, "fixed_k3_256.json", {"date": "3", "rows": sweep_rows("s", at_256)})
    entries, missing = summarize(tmp_path, "step-cost")
    assert missing == []
    k1, k3, one_request, phases = entries
    assert k1["passes"] and abs(k1["measured"]["ratio"] - 1.39) < 1e-9
    # The newest record counts, and its best arm: the cut, not stock.
    assert k3["passes"] and k3["evidence"]["file"].endswith("fixed_k3_256.json")
    assert k3["measured"] == pytest.approx({"dspark": 0.99, "dspark-lean": 1.008})
    assert one_request["evidence"]["file"].endswith("fixed_k3_new.json")
    assert one_request["passes"] is False
    assert one_request["measured"] == {"dspark-vocab": pytest.approx(0.995)}
    assert phases["passes"] is False and phases["measured"]["dspark-k1@256"] == 1.06


def test_the_fixed_arm_switched_to_in_the_controllers_engine_is_its_rival():
    """Where the run switched to fixed depth in the controller's own engine, the verdict
    holds the controller to that arm; the fixed arm of an engine of its own is reported."""
    from targets_summary import dflash, fixed_counterpart

    engines = {"dflash-depth-lean": "e1", "dflash-fixed-lean": "e1"}
    assert fixed_counterpart("dflash-depth-lean", engines) == "dflash-fixed-lean"
    assert fixed_counterpart("dflash-depth-lean") == "dflash-lean"  # no engine known
    other = {"dflash-depth-lean": "e1", "dflash-fixed-lean": "e2"}
    assert fixed_counterpart("dflash-depth-lean", other) == "dflash-lean"
    concurrencies = (1, 16, 64, 256)
    tok_s = {("nospec", c): 100.0 for c in concurrencies}
    tok_s |= {("dflash-lean", c): 103.0 for c in concurrencies}
    tok_s |= {("dflash-fixed-lean", c): 101.0 for c in concurrencies}
    tok_s |= {("dflash-depth-lean", c): 102.0 for c in concurrencies}
    rows = sweep_rows("qwen3-8b/rates", tok_s)
    for row in rows:
        if row["arm"] in engines:
            row["engine"] = "dflash-depth-lean+dflash-fixed-lean"
    entry = dflash({"rows": rows})
    measured = entry["measured"]["dflash-depth-lean"]
    assert measured["fixed_arm"] == "dflash-fixed-lean"
    assert measured["over_fixed"]["1"] == pytest.approx(102 / 101)
    assert measured["over_fixed_own_engine"]["1"] == pytest.approx(102 / 103)
    assert entry["passes"] is True
    # Engines of their own: the separate fixed arm decides, and it is faster.
    for row in rows:
        row.pop("engine", None)
    entry = dflash({"rows": rows})
    assert entry["measured"]["dflash-depth-lean"]["fixed_arm"] == "dflash-lean"
    assert entry["passes"] is False


def test_setup_a_counts_the_plugins_fixed_k7_and_an_arm_run_twice_at_its_mean(tmp_path):
    concurrencies = (1, 16, 64, 256)
    setup_a = {("dspark", c): 100.0 for c in concurrencies}
    setup_a |= {("sps-plain", c): 110.0 for c in concurrencies}
    rows = sweep_rows("embedded", setup_a)
    # No speculation run first and again last: 105, then 125 at 64 requests, 95 at one.
    rows += sweep_rows("embedded", {("nospec", c): 105.0 for c in concurrencies})
    rows += sweep_rows("embedded", {("nospec", c): 125.0 if c == 64 else 95.0 for c in (1, 64)})
    setup_b = {(arm, c): 100.0 for arm in ("nospec", "sps") for c in concurrencies}
    rows += sweep_rows("qwen3-8b/confidence", setup_b)
    runs = [{"commit": "a", "setup": "embedded"}, {"commit": "b", "setup": "qwen3-8b/confidence"}]

    def embedded_target():
        write(tmp_path, "capacity_sweep.json", {"runs": runs, "rows": rows})
        return summarize(tmp_path, "capacity")[0][2]

    embedded = embedded_target()
    # sps-plain beats stock k=7 everywhere, but not no speculation's mean at 64 (115).
    assert embedded["passes"] is False
    assert embedded["measured"]["sps-plain"]["64"]["over_nospec"] == 110.0 / 115.0
    assert embedded["measured"]["sps-plain"]["1"]["over_nospec"] == 110.0 / 100.0
    rows[:] = [row for row in rows if row["tok_s"] != 125.0]
    assert embedded_target()["passes"]
    # The plugin's fixed k=7 in the capacity engine is a fixed-k arm too.
    rows += sweep_rows("embedded", {("dspark-fixed", 1): 120.0})
    embedded = embedded_target()
    assert embedded["passes"] is False
    assert embedded["measured"]["sps-plain"]["1"]["over_fixed"] == 110.0 / 120.0
    assert embedded["measured"]["sps-plain"]["16"]["over_fixed"] == 1.1  # stock k=7 there


def test_setup_a_reports_the_noise_floor_of_an_arm_run_in_two_engines():
    """--lockstep with stock k=7 named twice: both engines count at their mean, and the
    second's paired ratio to the first is the noise floor."""
    rows = sweep_rows("embedded", {("nospec", 1): 50.0, ("dspark", 1): 100.0, ("sps", 1): 104.0})
    rows += [
        {"setup": "embedded", "arm": "dspark", "copy": 2, "concurrency": 1, "tok_s": 96.0}
        | {"paired": {"dspark": 0.97, "nospec": 1.9, "sps": 0.93}}
    ]
    embedded = embedded_pair({"runs": [{"setup": "embedded"}], "rows": rows})
    assert embedded["noise_floor"] == {"1": 0.97}
    assert embedded["measured"]["sps"]["1"]["over_fixed"] == 104.0 / 98.0
    assert embedded["passes"]


def served_rows(run: str, points: dict) -> list[dict]:
    """Rows of the qwen3-8b setup: {(arm, rate): (p50, p90, tok/s)}."""
    return [
        {
            "setup": "qwen3-8b",
            "arm": arm,
            "request_rate": rate,
            "tpot_p50_ms": p50,
            "tpot_p90_ms": p90,
            "output_tok_s": tok_s,
            "run": run,
        }
        for (arm, rate), (p50, p90, tok_s) in points.items()
    ]


def test_served_targets_compare_arms_of_another_part_through_k7(tmp_path):
    # Part 1: sps beside no speculation and k7. Part 2, on a machine 10% slower: k3 beside
    # them again, so its figures carry over through k7's ratio between the parts.
    first = {("nospec", 1.0): (7.0, 7.2, 240.0), ("k7", 1.0): (3.0, 3.3, 560.0)}
    first |= {("nospec", "inf"): (24.0, 28.0, 10000.0), ("k7", "inf"): (30.0, 35.0, 8000.0)}
    sps = {("sps", 1.0): (3.05, 3.5, 550.0), ("sps", "inf"): (20.0, 23.0, 10600.0)}
    second = {("nospec", 1.0): (7.7, 7.92, 218.0), ("k7", 1.0): (3.3, 3.63, 509.0)}
    second |= {("k3", 1.0): (3.0, 3.3, 560.0), ("nospec", "inf"): (26.4, 30.8, 9000.0)}
    second |= {("k7", "inf"): (33.0, 38.5, 7200.0), ("k3", "inf"): (22.0, 26.0, 9900.0)}

    def check(sps_points: dict) -> tuple[dict, dict]:
        rows = served_rows("2026-12-08", first | sps_points) + served_rows("2026-12-09", second)
        write(tmp_path, "serving.json", {"rows": rows})
        tpot, saturation, embedded_tpot, _, _ = summarize(tmp_path, "serving")[0]
        assert embedded_tpot["passes"] is None  # no embedded rows
        return tpot, saturation

    tpot, saturation = check(sps)
    at_one = tpot["measured"]["1.0"]
    assert at_one["tpot_p50_ms"]["best_arm"] == "k3"
    assert at_one["tpot_p50_ms"]["best"]["bridge"] == "k7"
    assert at_one["tpot_p50_ms"]["best"]["value"] == pytest.approx(3.0 * 3.0 / 3.3)
    assert at_one["tpot_p50_ms"]["ratio"] == pytest.approx(3.05 / (3.0 * 3.0 / 3.3))
    assert tpot["passes"] is False and tpot["run"] == "2026-12-08"
    assert saturation["measured"]["best_fixed_arm"] == "k3"
    assert saturation["measured"]["best_fixed"]["value"] == pytest.approx(9900 * 8000 / 7200)
    assert saturation["measured"]["over_nospec"] == pytest.approx(1.06)
    assert saturation["passes"] is False  # 0.96x the bridged k3
    # An sps that is the best arm at every rate and 1.05x k3 at saturation meets both.
    best = {("sps", 1.0): (2.7, 3.0, 600.0), ("sps", "inf"): (19.0, 22.0, 11600.0)}
    tpot, saturation = check(best)
    assert tpot["passes"] is True and saturation["passes"] is True


def test_a_served_record_of_one_run_without_run_names_compares_its_arms_directly(tmp_path):
    """A record written before rows named their run holds one run."""
    points = {("nospec", "inf"): (24.0, 28.0, 10000.0), ("k7", "inf"): (30.0, 35.0, 8000.0)}
    points |= {("sps", "inf"): (20.0, 23.0, 10600.0)}
    rows = [{k: v for k, v in row.items() if k != "run"} for row in served_rows("", points)]
    write(tmp_path, "serving.json", {"rows": rows})
    tpot, saturation = summarize(tmp_path, "serving")[0][:2]
    assert tpot["passes"] is True and tpot["measured"]["inf"]["tpot_p50_ms"]["best_arm"] == "sps"
    assert saturation["measured"]["over_fixed"] == pytest.approx(10600 / 8000)
    assert saturation["passes"] is True


def test_a_served_rate_without_sps_leaves_the_tpot_verdict_open(tmp_path):
    """sps cut before its saturation point: the light-load rate it met decides nothing."""
    points = {("nospec", 4.0): (7.3, 7.5, 968.0), ("k7", 4.0): (2.30, 2.51, 1000.0)}
    points |= {("nospec", "inf"): (28.0, 32.0, 7240.0), ("k7", "inf"): (25.3, 29.5, 8756.0)}
    points |= {("sps", 4.0): (2.31, 2.52, 1000.0)}
    write(tmp_path, "serving.json", {"rows": served_rows("2026-12-07", points)})
    tpot, saturation = summarize(tmp_path, "serving")[0][:2]
    assert tpot["measured"]["4.0"]["tpot_p50_ms"]["ratio"] == pytest.approx(2.31 / 2.30)
    assert tpot["measured"]["inf"] is None
    assert tpot["passes"] is None and saturation["passes"] is None
    # Slower than k7 at 4 req/s by more than 3%: missed, whatever saturation shows.
    points[("sps", 4.0)] = (2.40, 2.52, 990.0)
    write(tmp_path, "serving.json", {"rows": served_rows("2026-12-07", points)})
    assert summarize(tmp_path, "serving")[0][0]["passes"] is False


def test_a_rate_the_newest_run_left_out_is_judged_in_the_run_that_served_sps_there(tmp_path):
    """Run 1 served 4 req/s and saturation; run 2 served 16 req/s and saturation only. The
    4 req/s comparison stays run 1's, where every arm was served at it."""
    first = {("nospec", 4.0): (7.3, 7.5, 968.0), ("k7", 4.0): (2.30, 2.51, 1000.0)}
    first |= {("sps", 4.0): (2.31, 2.52, 1000.0), ("k7", "inf"): (25.3, 29.5, 8756.0)}
    second = {("k7", 16.0): (2.94, 3.45, 4012.0), ("sps", 16.0): (2.89, 3.40, 4013.0)}
    second |= {("k7", "inf"): (25.6, 30.0, 8734.0), ("sps", "inf"): (22.8, 26.1, 9978.0)}
    rows = served_rows("2026-12-07T19", first) + served_rows("2026-12-07T22", second)
    write(tmp_path, "serving.json", {"rows": rows})
    tpot = summarize(tmp_path, "serving")[0][0]
    at_four = tpot["measured"]["4.0"]["tpot_p90_ms"]
    assert at_four["best"]["run"] == "2026-12-07T19" and at_four["ratio"] == pytest.approx(
        2.52 / 2.51
    )
    assert tpot["measured"]["16.0"]["tpot_p50_ms"]["best_arm"] == "sps"
    assert tpot["passes"] is True
