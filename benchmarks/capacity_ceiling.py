"""The most any capacity controller could gain on the Qwen3-8B shape, from measured costs.

    python benchmarks/capacity_ceiling.py --out benchmarks/results/capacity_ceiling.json

CPU only: it reads what H200 runs committed and models one pure-decode step of R requests
with a K=7 DSpark drafter (setup (b) of the capacity issue). For every physical depth d
and every admission count N it takes the expected tokens of the step, R plus the N best
prefix survivals of the batch (calibrated synthetic confidence around the sweep's
acceptance profile, :mod:`vllm_dspark.bench.synthetic`, so the expectation is exact),
over the step's time, and keeps the best. Every choice is optimistic:
- admission is an oracle on the step's own survivals (the lossless scheme must take its
  count from the previous proposal), best per batch;
- the target's forward at R + N tokens is linear between the forwards measured at R, 2R,
  4R and 8R tokens, where the real cost bulges above its chords (the finer SPS curve,
  ``sps_curve_qwen3_8b.json``: 13.27 ms at 384 tokens against 12.02 on its chord from
  256 to 512);
- a speculative step costs that forward, what its R + N tokens add over R tokens' to the
  logits and rejection sampling and to the drafter's context-K/V store (measured with the
  forwards, linear between the same token counts), the draft graph at depth d
  (``depth_time.json``), and what a step without speculation spends outside its forward;
  the controller's host work is left out.
The ratio is to a step without speculation measured in the same run as the forwards.
End to end (``end_to_end_ceiling``), a batch without speculation measured on the H200
(``NOSPEC_BATCH_SOURCE``: all requests at once, --output-len tokens each) keeps its time
outside decode steps, its length less (output_len - 1) steps without speculation, and
divides the rest by the decode ceiling.

That division leaves out the batch's tail. Without speculation every request of the
batch needs output_len - 1 decode steps; with it, each needs as many as its own
acceptance draws take, and the batch lasts until its slowest request is done, on a
shrinking batch. ``drain`` plays that out (``--drain-trials`` batches per depth) for
fixed depths k with vLLM's synthetic acceptance (each draft accepted with its
position's rate given the ones before), each step costing the median step measured at
that depth (``DRAIN_SOURCES``: whole decode steps of fixed-k DSpark, linear in the
requests between 1, 64 and 256). ``DRAIN_CHECK`` sets a measured end-to-end ratio beside
the model's, and ``cut_ms_for`` says how much shorter every speculative step would have
to be for the drained batch to reach a given ratio to no speculation.
``oracle_drain`` drains batches with the oracle instead: every step the best choice for
the requests still decoding, on costs interpolated between the requests measured
(``costs_by_requests``), each admitted draft accepted with its calibrated confidence.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from offline_sweep import DEFAULT_RATES, conditional_rates

from vllm_dspark.bench.synthetic import SyntheticConfidence
from vllm_dspark.capacity.allocation import UNCOMPUTED_SURVIVAL, prefix_survival, sps_rates

K = 7
RESULTS = Path(__file__).parent / "results"
# What each multiple of R tokens per request was measured with: (file, arm).
FORWARD_SOURCES = {
    1: ("step_breakdown_graphs1024_a37526b.json", "nospec"),
    2: ("step_breakdown_graphs1024_a37526b.json", "dspark-k1"),
    4: ("step_breakdown_graphs1024_a37526b.json", "dspark-k3"),
    8: ("step_breakdown_overhead_a37526b.json", "conf-k7"),
}
DEPTH_SOURCE = "depth_time.json"
# The batch without speculation whose time outside decode steps the end-to-end ceiling
# keeps: an H200 run with graphs to 1,024 tokens, as the step costs above (the capacity
# sweep's setup (b) has since run on an H100).
NOSPEC_BATCH_SOURCE = ("fixed_k3_fp8_graphs1024_757bc32.json", "qwen3-8b/rates")
# Whole decode steps of fixed-k DSpark (k drafts, K = k), one step-breakdown run with graphs
# to 1,024 tokens, by k (0: no speculation).
DRAIN_SOURCES = {
    0: ("step_breakdown_graphs1024_a37526b.json", "nospec"),
    1: ("step_breakdown_graphs1024_a37526b.json", "dspark-k1"),
    3: ("step_breakdown_graphs1024_a37526b.json", "dspark-k3"),
}
# End to end, measured: (file, no-speculation arm, arm, k), the same graphs and machine kind.
DRAIN_CHECK = ("fixed_k3_fp8_graphs1024_757bc32.json", "nospec", "dspark", 3)
DRAIN_CONCURRENCY = (1, 16, 64, 256)


@functools.cache
def _rows(path: Path) -> list[dict]:
    return json.loads(path.read_text())["rows"]


def _row(results: Path, name: str, arm: str, concurrency: int) -> dict:
    rows = _rows(results / name)
    found = [r for r in rows if r["arm"] == arm and r["concurrency"] == concurrency]
    if not found:
        measured = sorted({r["concurrency"] for r in rows if r["arm"] == arm})
        raise SystemExit(f"{name} has no {arm} row at {concurrency} requests; it has {measured}")
    return found[0]


def measured_costs(
    results: Path, concurrency: int, vocab_share: float = 1.0, backbone_scale: float = 1.0
) -> dict:
    """Forward ms at R * multiple tokens (with what verifying them adds over R tokens to
    the logits and rejection sampling and to the drafter's context-K/V store: any
    speculative step at that size pays it), the no-speculation step, and draft ms by depth.
    ``vocab_share`` < 1 (``dspark_draft_vocab``, a share of the vocabulary): each depth's
    time past the backbone, the per-position work that scores the vocabulary, shrinks to
    that share (the backbone taken as depth 1's time less one position's mean cost).
    ``backbone_scale`` < 1 (``dspark_fp8_draft_backbone``, an assumed speed-up): the
    backbone's time shrinks by it."""
    nospec = _row(results, *FORWARD_SOURCES[1], concurrency)
    forward = {}
    for multiple, (name, arm) in FORWARD_SOURCES.items():
        phases = _row(results, name, arm, concurrency)["phases_ms"]
        verification = phases["logits_rejection"] - nospec["phases_ms"]["logits_rejection"]
        context_kv = phases.get("draft_context_kv") or 0.0
        forward[concurrency * multiple] = phases["target_forward"] + verification + context_kv
    depths = _rows(results / DEPTH_SOURCE)
    draft = {r["depth"]: r["draft_ms"] for r in depths if r["concurrency"] == concurrency}
    backbone = draft[1] - (draft[K] - draft[1]) / (K - 1)
    draft = {
        d: backbone * backbone_scale + (ms - backbone) * vocab_share for d, ms in draft.items()
    }
    return {"forward_ms": forward, "nospec_step_ms": nospec["step_ms_median"], "draft_ms": draft}


def best_step(survival: torch.Tensor, costs: dict) -> tuple[float, int, int]:
    """(expected tokens per ms, depth, admitted) of the best choice for one batch, as
    ``sps`` weighs it (:func:`~vllm_dspark.capacity.allocation.sps_rates`) on the measured
    costs. survival: [R, K] prefix survivals at full depth."""
    num_reqs = survival.shape[0]
    tokens_at = sorted(costs["forward_ms"])
    forward_at = [costs["forward_ms"][t] for t in tokens_at]
    outside = costs["nospec_step_ms"] - costs["forward_ms"][num_reqs]
    best = (num_reqs / costs["nospec_step_ms"], 0, 0)
    tokens = np.arange(num_reqs * (1 + K) + 1)
    steps_per_second = torch.from_numpy(1000.0 / np.interp(tokens, tokens_at, forward_at))
    for depth, draft_ms in sorted(costs["draft_ms"].items()):
        computed = survival.double().clone()
        computed[:, depth:] = UNCOMPUTED_SURVIVAL
        rate = sps_rates(computed, steps_per_second, (outside + draft_ms) / 1000.0) / 1000.0
        admitted = int(rate.argmax())
        if float(rate[admitted]) > best[0]:
            best = (float(rate[admitted]), depth, admitted)
    return best


def ceiling(costs: dict, concurrency: int, batches: int, rates: list[float]) -> dict:
    """The best choice per batch over ``batches`` batches of synthetic survivals."""
    synthetic = SyntheticConfidence(conditional_rates(rates)[:K], torch.device("cpu"))
    nospec_rate = concurrency / costs["nospec_step_ms"]
    ratios, depths, admitted = [], [], []
    for batch in range(batches):
        seeds = torch.arange(concurrency, dtype=torch.int64) + batch * concurrency
        positions = 200 + torch.arange(1, K + 1).expand(concurrency, K)
        survival = prefix_survival(synthetic.draw(seeds, positions), torch.ones(K))
        rate, depth, count = best_step(survival, costs)
        ratios.append(rate / nospec_rate)
        depths.append(depth)
        admitted.append(count / concurrency)
    mean = sum(ratios) / batches
    return {
        "concurrency": concurrency,
        "ceiling_over_nospec": round(mean, 4),
        "max_over_batches": round(max(ratios), 4),
        "depth_chosen": sorted(set(depths)),
        "admitted_per_request_mean": round(sum(admitted) / batches, 3),
    }


def end_to_end_ceiling(
    decode_ceiling: float, nospec_tok_s: float, concurrency: int, output_len: int, step_ms: float
) -> float:
    """The batch's speed-up when only its decode steps speed up by ``decode_ceiling``."""
    batch_s = concurrency * output_len / nospec_tok_s
    decode_s = (output_len - 1) * step_ms / 1000.0
    return batch_s / (batch_s - decode_s + decode_s / decode_ceiling)


def drain_step_ms(results: Path, k: int) -> Callable[[int], float]:
    """A decode step's median ms at depth k for any number of requests (linear between
    the requests measured)."""
    name, arm = DRAIN_SOURCES[k]
    measured = sorted(
        (r["concurrency"], r["step_ms_median"]) for r in _rows(results / name) if r["arm"] == arm
    )
    requests, ms = zip(*measured, strict=True)
    return lambda num_reqs: float(np.interp(num_reqs, requests, ms))


def drain(
    step_ms: Callable[[int], float],
    rates: list[float],
    k: int,
    concurrency: int,
    output_len: int,
    trials: int,
    seed: int = 0,
) -> tuple[float, float]:
    """(mean decode steps, mean decode ms) until every request of a batch has its
    output_len - 1 tokens after the prefill's, at k drafts a step, each draft accepted
    with its conditional rate while the ones before it were."""
    rng = np.random.default_rng(seed)
    conditional = np.asarray(conditional_rates(rates)[:k])
    steps, ms = [], []
    for _ in range(trials):
        left = np.full(concurrency, output_len - 1)
        count, elapsed = 0, 0.0
        while (live := left > 0).any():
            draws = rng.random((int(live.sum()), k)) < conditional
            accepted = np.cumprod(draws, axis=1).sum(axis=1)
            left[live] -= 1 + accepted
            count += 1
            elapsed += step_ms(int(live.sum()))
        steps.append(count)
        ms.append(elapsed)
    return float(np.mean(steps)), float(np.mean(ms))


def nospec_batch(results: Path, concurrency: int, output_len: int) -> tuple[dict, float, float]:
    """``DRAIN_CHECK``'s tok/s by arm at ``concurrency``, and its batch without speculation
    as ms in all and ms of decode steps (at the breakdown's median step)."""
    check_name, nospec_arm, _, _ = DRAIN_CHECK
    tok_s = {
        r["arm"]: r["tok_s"] for r in _rows(results / check_name) if r["concurrency"] == concurrency
    }
    batch_ms = concurrency * output_len / tok_s[nospec_arm] * 1000.0
    decode_ms = (output_len - 1) * drain_step_ms(results, 0)(concurrency)
    return tok_s, batch_ms, decode_ms


def drained_batch(results: Path, rates: list[float], output_len: int, trials: int) -> list[dict]:
    """Per concurrency: each fixed depth's drained batch against no speculation, end to end
    (the measured batch's time outside decode steps kept), beside the measured ratio."""
    _, nospec_arm, check_arm, check_k = DRAIN_CHECK
    speculative = {k: drain_step_ms(results, k) for k in sorted(DRAIN_SOURCES) if k}
    rows = []
    for concurrency in DRAIN_CONCURRENCY:
        tok_s, batch_ms, decode_ms = nospec_batch(results, concurrency, output_len)
        outside_ms = batch_ms - decode_ms
        row = {"concurrency": concurrency, "outside_decode_ms": round(outside_ms, 1)}
        for k, step_ms in speculative.items():
            steps, ms = drain(step_ms, rates, k, concurrency, output_len, trials)
            expected = 1.0 + sum(rates[:k])  # tokens a step gains: the unconditional rates
            no_tail_ms = (output_len - 1) / expected * step_ms(concurrency)
            entry = {
                "steps": round(steps, 1),
                "steps_without_tail": round((output_len - 1) / expected, 1),
                "end_to_end_over_nospec": round(batch_ms / (outside_ms + ms), 4),
                "without_tail": round(batch_ms / (outside_ms + no_tail_ms), 4),
                "cut_ms_for": {
                    str(goal): round(max(0.0, (outside_ms + ms - batch_ms / goal) / steps), 2)
                    for goal in (1.0, 1.1)
                },
            }
            if k == check_k:
                entry["measured"] = round(tok_s[check_arm] / tok_s[nospec_arm], 4)
            row[f"k{k}"] = entry
        rows.append(row)
    return rows


def costs_by_requests(
    results: Path, vocab_share: float = 1.0, backbone_scale: float = 1.0
) -> Callable[[int], dict]:
    """:func:`measured_costs` for any number of requests R, linear in R between the
    requests measured: the target's forward at each multiple of R tokens (a forward's
    cost depends on its requests as well as its tokens: 512 tokens took 11.7 ms for 64
    requests and 15.3 ms for 256), the step without speculation and the draft per depth."""
    measured = {c: measured_costs(results, c, vocab_share, backbone_scale) for c in (1, 64, 256)}
    requests = sorted(measured)
    multiples = sorted(FORWARD_SOURCES)

    @functools.cache  # a draining batch asks for each request count over and over
    def at(num_reqs: int) -> dict:
        def between(values: list[float]) -> float:
            return float(np.interp(num_reqs, requests, values))

        forward = [between([measured[c]["forward_ms"][c * m] for c in requests]) for m in multiples]
        grid = np.arange(num_reqs, num_reqs * (1 + K) + 1)
        by_tokens = np.interp(grid, [num_reqs * m for m in multiples], forward)
        return {
            "forward_ms": dict(zip(grid.tolist(), by_tokens.tolist(), strict=True)),
            "nospec_step_ms": between([measured[c]["nospec_step_ms"] for c in requests]),
            "draft_ms": {
                d: between([measured[c]["draft_ms"][d] for c in requests]) for d in range(1, K + 1)
            },
        }

    return at


def oracle_drain(
    costs_at: Callable[[int], dict],
    rates: list[float],
    concurrency: int,
    output_len: int,
    trials: int,
) -> tuple[float, float]:
    """(mean decode steps, mean decode ms) of a batch whose every step takes
    :func:`best_step`'s choice for the requests still decoding, on the current step's own
    survivals (an oracle: lossless ``sps`` takes its count from the step before), each
    admitted draft accepted with its calibrated synthetic confidence while the ones
    before it were; until every request has its output_len - 1 tokens after the
    prefill's."""
    synthetic = SyntheticConfidence(conditional_rates(rates)[:K], torch.device("cpu"))
    rng = np.random.default_rng(0)
    steps, ms = [], []
    for trial in range(trials):
        seeds = torch.arange(concurrency, dtype=torch.int64) + trial * concurrency
        left = np.full(concurrency, output_len - 1)
        count, elapsed = 0, 0.0
        while (live := left > 0).any():
            rows = np.flatnonzero(live)
            done = torch.from_numpy(output_len - 1 - left[rows])
            positions = done[:, None] + torch.arange(1, K + 1)
            confidence = torch.sigmoid(synthetic.draw(seeds[rows], positions).double())
            survival = torch.cumprod(confidence, dim=1)
            costs = costs_at(len(rows))
            _, depth, admitted = best_step(survival, costs)
            verified = np.zeros(len(rows), dtype=int)
            if admitted:
                computed = survival.clone()
                computed[:, depth:] = UNCOMPUTED_SURVIVAL
                top = computed.flatten().argsort(descending=True)[:admitted]
                verified = np.bincount((top // K).numpy(), minlength=len(rows))
            draws = rng.random((len(rows), K)) < confidence.numpy()
            leading = np.cumprod(draws, axis=1).sum(axis=1)
            left[rows] -= 1 + np.minimum(leading, verified)
            count += 1
            if admitted:
                tokens = len(rows) + admitted
                outside = costs["nospec_step_ms"] - costs["forward_ms"][len(rows)]
                elapsed += costs["forward_ms"][tokens] + outside + costs["draft_ms"][depth]
            else:
                elapsed += costs["nospec_step_ms"]
        steps.append(count)
        ms.append(elapsed)
    return float(np.mean(steps)), float(np.mean(ms))


def oracle_drained_batch(
    results: Path,
    rates: list[float],
    output_len: int,
    trials: int,
    concurrencies: list[int],
    vocab_share: float = 1.0,
    backbone_scale: float = 1.0,
) -> list[dict]:
    """Per concurrency: :func:`oracle_drain`'s batch against no speculation end to end,
    the measured batch's time outside decode steps kept (as :func:`drained_batch`)."""
    costs_at = costs_by_requests(results, vocab_share, backbone_scale)
    rows = []
    for concurrency in concurrencies:
        _, batch_ms, decode_ms = nospec_batch(results, concurrency, output_len)
        steps, ms = oracle_drain(costs_at, rates, concurrency, output_len, trials)
        rows.append(
            {
                "concurrency": concurrency,
                "steps": round(steps, 1),
                "decode_over_nospec": round(decode_ms / ms, 4),
                "end_to_end_over_nospec": round(batch_ms / (batch_ms - decode_ms + ms), 4),
            }
        )
    return rows


def nospec_batch_tok_s(results: Path, concurrency: int) -> float:
    name, setup = NOSPEC_BATCH_SOURCE
    rows = _rows(results / name)
    return next(
        r["tok_s"]
        for r in rows
        if r["setup"] == setup and r["arm"] == "nospec" and r["concurrency"] == concurrency
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,64,256", help="of 1, 64, 256 (measured)")
    parser.add_argument("--batches", type=int, default=64)
    parser.add_argument("--rates", default=DEFAULT_RATES)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--drain-trials", type=int, default=64)
    parser.add_argument(
        "--vocab-share", type=float, default=1.0, help="drafting over this share of the vocabulary"
    )
    parser.add_argument(
        "--backbone-scale",
        type=float,
        default=1.0,
        help="the draft backbone's time as this share of the measured (an FP8 drafter)",
    )
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    rows = []
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        costs = measured_costs(args.results, concurrency, args.vocab_share, args.backbone_scale)
        row = ceiling(costs, concurrency, args.batches, rates)
        nospec_tok_s = nospec_batch_tok_s(args.results, concurrency)
        row["end_to_end_ceiling_over_nospec"] = round(
            end_to_end_ceiling(
                row["ceiling_over_nospec"],
                nospec_tok_s,
                concurrency,
                args.output_len,
                costs["nospec_step_ms"],
            ),
            4,
        )
        rows.append(row | {"inputs": costs | {"nospec_batch_tok_s": nospec_tok_s}})
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    record = {
        "command": "capacity_ceiling.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "results"),
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": "CPU (a model over H200 measurements)",
        "sources": sorted(
            {name for name, _ in FORWARD_SOURCES.values()} | {DEPTH_SOURCE, NOSPEC_BATCH_SOURCE[0]}
        ),
        "rows": rows,
        "drained_batch": {
            "sources": sorted({name for name, _ in DRAIN_SOURCES.values()} | {DRAIN_CHECK[0]}),
            "rows": drained_batch(args.results, rates, args.output_len, args.drain_trials),
        },
        # The best choice every step, on the step's own survivals, as the batch drains.
        "oracle_drained_batch": oracle_drained_batch(
            args.results,
            rates,
            args.output_len,
            args.drain_trials,
            [int(c) for c in args.concurrency.split(",")],
            args.vocab_share,
            args.backbone_scale,
        ),
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    for row in rows:
        print({k: v for k, v in row.items() if k != "inputs"})
    for row in record["drained_batch"]["rows"] + record["oracle_drained_batch"]:
        print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
