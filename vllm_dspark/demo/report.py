"""The GPU demo's report, JSON record and plot, built from measured arm rows (pure functions:
no engine, no GPU)."""

from __future__ import annotations

import datetime
import math
import os
import textwrap
from dataclasses import asdict, dataclass, field


@dataclass
class RunSettings:
    command: str
    prompts: int
    max_tokens: int
    k: int
    dtype: str
    concurrency: list[int]
    repeats: int
    adaptive_options: dict
    device: str
    vllm_version: str
    date: str = field(
        default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"
        )
    )
    # A copy of the tree without .git (the GPU machine): the caller names the commit.
    commit: str = field(default_factory=lambda: os.environ.get("DSPARK_COMMIT", "unknown"))


# Where an arm's greedy output first differs from no speculation's, a gap this small
# between no speculation's two best tokens (log-probabilities) is a near tie that bf16
# cannot resolve: a logit rounds to 2**-8 of itself (0.04 at a logit of 10), and every
# layer of a verification batch of another shape rounds differently before it.
NEAR_TIE_LOGPROB = 0.1


def first_difference(a: list[int], b: list[int]) -> int:
    """Where two token sequences first differ (the shorter's length if one continues the
    other)."""
    pairs = enumerate(zip(a, b, strict=False))
    return next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))


def divergence_gaps(outputs: list, reference: list, gaps: list | None) -> list[float | None]:
    """Per request whose output differs from ``reference``: no speculation's gap between
    its two best tokens at the first token that differs (None: not measured)."""
    found = []
    for index, (output, expected) in enumerate(zip(outputs, reference, strict=True)):
        if output == expected:
            continue
        first = first_difference(output, expected)
        # One output continuing the other has no differing token: not measured.
        differs = first < min(len(output), len(expected))
        known = gaps is not None and gaps[index] is not None and differs
        found.append(gaps[index][first] if known else None)
    return found


def _ratio(value: float, reference: float | None) -> float | None:
    return value / reference if reference else None


def compare_rows(rows: list) -> list[dict]:
    """Each arm row (:class:`~vllm_dspark.demo.gpu.ArmRow`) as a dict, with its speed over
    no speculation and over fixed k at the same load, and whether its greedy outputs are
    no speculation's, request by request (``identical_requests`` of ``requests``), and
    where not, whether each first differs at a near tie (``divergence_gaps``)."""
    by_load: dict[tuple[str, int], object] = {(row.arm, row.concurrency): row for row in rows}
    compared = []
    # Grouped by load, the arms in their order within it.
    for row in sorted(rows, key=lambda row: row.concurrency):
        nospec = by_load.get(("nospec", row.concurrency))
        fixed = by_load.get(("fixed", row.concurrency))
        identical, gaps, near_ties = None, None, None
        if nospec is not None and row.arm != "nospec":
            identical = sum(a == b for a, b in zip(row.outputs, nospec.outputs, strict=True))
            gaps = divergence_gaps(row.outputs, nospec.outputs, nospec.top_two_gaps)
            near_ties = all(gap is not None and gap <= NEAR_TIE_LOGPROB for gap in gaps)
        compared.append(
            {
                "name": row.name,
                "arm": row.arm,
                "concurrency": row.concurrency,
                "tok_s": row.tok_s,
                "tok_s_repeats": row.tok_s_repeats,
                "vs_nospec": _ratio(row.tok_s, nospec and nospec.tok_s),
                "vs_fixed": _ratio(row.tok_s, fixed and fixed.tok_s),
                "greedy_identical": None if identical is None else identical == len(row.outputs),
                "identical_requests": identical,
                "requests": len(row.outputs),
                "divergence_gaps": gaps,
                "differs_only_at_near_ties": near_ties,
                "acceptance_length": row.acceptance_length,
                "drafts_per_request": row.drafts_per_request,
                "per_position_acceptance": row.per_position_acceptance,
            }
        )
    return compared


def _number(value, digits: int = 2, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}{suffix}"


def _identity(row: dict) -> str:
    if row["identical_requests"] is None:
        return "(reference)"
    verdict = "yes" if row["greedy_identical"] else "NO"
    if not row["greedy_identical"] and row["differs_only_at_near_ties"]:
        verdict = "near ties"
    return f"{row['identical_requests']}/{row['requests']} {verdict}"


def format_gpu_report(settings: RunSettings, rows: list[dict], results: list, wall_s: float):
    """The report's lines: one row per arm and load, then the confidence head's calibration
    and how to read it all."""
    k = settings.k
    header = (
        f"  {'load':>4}  {'arm':<16}{'tok/s':>9}{'vs none':>9}{f'vs k={k}':>9}"
        f"{'accept len':>12}{'drafts/req':>12}  outputs = no spec"
    )
    lines = [
        f"=== vllm-dspark demo: the embedded pair in vLLM {settings.vllm_version} "
        f"on {settings.device} ===",
        f"{settings.prompts} held-out prompts, {settings.max_tokens} output tokens per request, "
        f"greedy, {settings.dtype}; tok/s: median of {settings.repeats} timed repeats; load: "
        "requests submitted at once",
        header,
    ]
    for before, row in zip([None, *rows], rows, strict=False):
        if before is not None and row["concurrency"] != before["concurrency"]:
            lines.append("")  # a blank line between loads
        lines.append(
            f"  {row['concurrency']:>4}  {row['name']:<16}{row['tok_s']:>9,.0f}"
            f"{_number(row['vs_nospec'], suffix='x'):>9}{_number(row['vs_fixed'], suffix='x'):>9}"
            f"{_number(row['acceptance_length']):>12}{_number(row['drafts_per_request'], 1):>12}"
            f"  {_identity(row)}"
        )
    for result in results:
        if result.calibration:
            lines += ["", *format_calibration(result.spec.name, result.calibration)]
    starts = " / ".join(f"{result.engine_start_s:.0f}" for result in results)
    notes = [
        "accept len: tokens each verification step commits (accepted drafts + the target's "
        "own token); drafts/req: drafts verified per request and step (fixed k verifies all "
        "k).",
        f"adaptive: {_options(settings.adaptive_options)} (README, 'Which to set'): it "
        "verifies the drafts whose predicted survival pays for their verification on this "
        "GPU's step times, measured at start-up and while serving.",
        "This pair is tiny (a 5.6M-parameter target) and its steps are host-bound: the ratios "
        "show the plugin's own work per step, not what a large model gains. Repeats of one "
        "arm spread by several percent.",
    ]
    if settings.dtype == "float32":
        notes.append(
            "float32: greedy speculative decoding must reproduce no speculation's outputs "
            "token for token."
        )
    else:
        notes.append(
            f"{settings.dtype}: verification batches of other shapes round differently, so a "
            "request may differ where the target's two best tokens nearly tie; 'near ties': "
            f"each differing request first differs where no speculation's two best tokens "
            f"were at most {NEAR_TIE_LOGPROB} apart in log-probability"
            f"{_widest_gap(rows)}. --dtype float32 compares exactly."
        )
    lines += [
        "",
        f"Engines started in {starts} s; the whole demo took {wall_s / 60:.1f} min.",
        "How to read it:",
    ]
    for note in notes:
        lines += textwrap.wrap(note, 92, initial_indent="- ", subsequent_indent="  ")
    return lines


def _widest_gap(rows: list[dict]) -> str:
    gaps = [gap for row in rows for gap in row["divergence_gaps"] or [] if gap is not None]
    return f" (widest here: {max(gaps):.3f})" if gaps else ""


def _options(options: dict) -> str:
    return ", ".join(f"{key}={str(value).lower()}" for key, value in options.items())


def format_calibration(name: str, calibration: dict) -> list[str]:
    """Predicted against observed prefix survival per draft position, AUROC and ECE."""
    positions = range(1, len(calibration["mean_predicted"]) + 1)

    def row(label: str, values, digits: int = 2) -> str:
        return f"  {label:<12}" + "".join(f"{_number(v, digits):>7}" for v in values)

    return [
        f"Confidence head, {name} arm (an untimed pass of every prompt): survival of drafts "
        "1..k per position",
        row("position", positions, 0),
        row("predicted", calibration["mean_predicted"]),
        row("observed", calibration["mean_observed"]),
        row("AUROC", calibration["auroc"]),
        row("ECE", calibration["ece"], 3),
    ]


def _finite(value):
    """JSON has no NaN: unmeasured numbers become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value


def demo_record(settings: RunSettings, rows: list[dict], results: list, wall_s: float) -> dict:
    """The JSON record: provenance, settings, the whole run's wall time, each arm's engine
    start, one entry per arm and load, and the confidence head's calibration."""
    from vllm_dspark import __version__

    calibration = {r.spec.key: r.calibration for r in results if r.calibration}
    return _finite(
        {
            "record": "vllm-dspark demo: the embedded pair, no speculation / fixed k / adaptive",
            "command": settings.command,
            "date": settings.date,
            "commit": settings.commit,
            "device": settings.device,
            "vllm_version": settings.vllm_version,
            "vllm_dspark_version": __version__,
            "settings": {
                key: value
                for key, value in asdict(settings).items()
                if key not in ("command", "date", "commit", "device", "vllm_version")
            },
            "wall_s": round(wall_s, 1),
            "engine_start_s": {r.spec.key: r.engine_start_s for r in results},
            "arms": rows,
            "confidence_calibration": calibration,
        }
    )


def plot_throughput(rows: list[dict], path: str, settings: RunSettings) -> None:
    """Tokens per second by arm, one panel per load (their scales differ): the median of the
    repeats, a line from the slowest to the fastest repeat, and the ratio to no
    speculation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = sorted({row["concurrency"] for row in rows})
    names = list(dict.fromkeys(row["name"] for row in rows))
    colours = ["#9a9a9a", "#3b75af", "#e07b39", "#5a9e4b"]
    fig, axes = plt.subplots(1, len(loads), figsize=(3.4 * len(loads), 3.4), squeeze=False)
    for ax, load in zip(axes[0], loads, strict=True):
        at_load = {row["name"]: row for row in rows if row["concurrency"] == load}
        values = [at_load[name]["tok_s"] if name in at_load else 0 for name in names]
        repeats = [at_load[name]["tok_s_repeats"] if name in at_load else [0] for name in names]
        spread = [
            [value - min(times) for value, times in zip(values, repeats, strict=True)],
            [max(times) - value for value, times in zip(values, repeats, strict=True)],
        ]
        bars = ax.bar(range(len(names)), values, color=colours[: len(names)])
        ax.errorbar(range(len(names)), values, yerr=spread, fmt="none", ecolor="black", lw=1)
        for index, (bar, name) in enumerate(zip(bars, names, strict=True)):
            ratio = at_load.get(name, {}).get("vs_nospec")
            if ratio:
                top = bar.get_height() + spread[1][index]
                ax.annotate(
                    f"{ratio:.2f}x",
                    (bar.get_x() + bar.get_width() / 2, top),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                )
        ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
        ax.set_title(f"{load} concurrent request{'s' if load > 1 else ''}", fontsize=9)
        ax.set_ylabel("output tokens / s")
        ax.margins(y=0.15)
    fig.suptitle(
        f"Embedded pair, vLLM {settings.vllm_version}, {settings.device}, {settings.dtype}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
