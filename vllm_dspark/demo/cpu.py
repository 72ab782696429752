"""The demo without a CUDA GPU: the embedded pair through the project's PyTorch reference of
a DSpark step, on the CPU (not vLLM, and not a speed measurement).

For each held-out prompt, greedy speculative decoding step by step: the drafter proposes K
tokens with its confidence head's per-position confidences
(:func:`~vllm_dspark.tiny_pair.reference.propose_draft_tokens`, the drafts vLLM's DSpark
speculator proposes), one target forward verifies them greedily (the leading drafts equal
to the target's own greedy choices are accepted, then the target's next token follows), and
the walk goes on from there. The report shows one step in full, acceptance, how well the
confidences predicted it, that the output equals the target's plain greedy decode, and what
each capacity mode would verify at a few loads, decided by the runtime's own policy
functions (:mod:`vllm_dspark.capacity.allocation`) on this run's confidences.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from vllm_dspark.demo import EMBEDDED_PAIR, load_prompts
from vllm_dspark.demo.progress import stage

# Capacity modes shown, with the settings the README's sweeps use for budget and threshold.
BUDGET_FRAC = 0.5
CONFIDENCE_THRESHOLD = 0.5
# Batches drawn per load to average what a mode admits (each decides from the one before).
ADMISSION_ROUNDS = 16
# Tokens per target forward at which this CPU's step time is measured for sps's curve.
CURVE_TOKENS = (1, 8, 32, 128, 512)


@dataclass
class VerifiedStep:
    """One speculative step: K drafts and their confidences, then greedy verification."""

    drafts: list[int]
    confidences: list[float]  # c_k, calibrated: P(draft k accepted | drafts before it were)
    survival: list[float]  # s_k = c_1 ... c_k: P(drafts 1..k all accepted)
    target: list[int]  # the target's greedy token after the anchor and after each draft
    accepted: int  # leading drafts equal to the target's own choices

    @property
    def committed(self) -> list[int]:
        """Tokens the step adds: the accepted drafts, then the target's next token."""
        return self.drafts[: self.accepted] + [self.target[self.accepted]]


@dataclass
class PromptWalk:
    prompt: list[int]
    output: list[int]
    steps: list[VerifiedStep] = field(default_factory=list)


def greedy_token(target, token_ids: list[int]) -> int:
    logits = target(torch.tensor([token_ids])).logits
    return int(logits[0, -1].argmax())


@torch.no_grad()
def speculative_greedy(
    target, drafter, temperatures, prompt: list[int], max_tokens: int, k: int
) -> PromptWalk:
    """Greedy decoding of ``max_tokens`` tokens with K = ``k`` drafts per step. As in vLLM,
    the prompt's forward gives the first token (no drafts yet); every later step drafts
    from the last token and verifies in one target forward."""
    from vllm_dspark.tiny_pair.reference import propose_draft_tokens

    walk = PromptWalk(prompt, [])
    tokens = prompt + [greedy_token(target, prompt)]
    while len(tokens) - len(prompt) < max_tokens:
        draft = propose_draft_tokens(target, drafter, tokens, temperatures)
        drafts = draft.tokens[:k]
        # Logits at the anchor and at each draft: the target's choice after each prefix.
        logits = target(torch.tensor([tokens + drafts])).logits[0, len(tokens) - 1 :]
        choices = logits.argmax(dim=-1).tolist()
        accepted = 0
        while accepted < k and drafts[accepted] == choices[accepted]:
            accepted += 1
        step = VerifiedStep(drafts, draft.confidences[:k], draft.survival[:k], choices, accepted)
        walk.steps.append(step)
        tokens += step.committed
    walk.output = tokens[len(prompt) : len(prompt) + max_tokens]
    return walk


@torch.no_grad()
def plain_greedy(target, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The target's own greedy decode (transformers' generate, KV cache), no drafts."""
    from vllm_dspark.tiny_pair.target import generate_continuations

    sequences = generate_continuations(target, torch.tensor(prompts), max_tokens, greedy=True)
    return sequences[:, len(prompts[0]) :].tolist()


def acceptance_summary(steps: list[VerifiedStep], k: int) -> dict:
    """Mean acceptance length (tokens per target forward, the target's own token included)
    and the share of steps whose draft k was accepted (vLLM's per-position counters)."""
    accepted = np.array([step.accepted for step in steps])
    return {
        "steps": len(steps),
        "acceptance_length": float(1 + accepted.mean()),
        "per_position_acceptance": [float((accepted > j).mean()) for j in range(k)],
    }


def calibration_summary(steps: list[VerifiedStep], k: int) -> dict:
    """Per position: the mean predicted survival s_k against the observed share of steps
    whose drafts 1..k were all accepted, and the survival's AUROC and ECE, measured by the
    runtime's own statistics (what ``dspark_confidence_metrics`` reports from an engine)."""
    from vllm_dspark.capacity.calibration_stats import CalibrationStats

    stats = CalibrationStats(k, torch.device("cpu"))
    accepted = torch.tensor([step.accepted for step in steps])
    survival = torch.tensor([step.survival for step in steps], dtype=torch.float32)
    stats.observe(survival, torch.full_like(accepted, k), accepted)  # every step verifies K
    prefix = stats.summary()["prefix"]

    def known(values: list[float]) -> list[float | None]:
        return [None if math.isnan(value) else value for value in values]

    return {
        "predicted_survival": prefix.mean_predicted,
        "observed_survival": prefix.mean_observed,
        "auroc": known(prefix.auroc),
        "ece": known(prefix.ece),
    }


@torch.no_grad()
def measured_sps_curve(target, token_counts=CURVE_TOKENS) -> list[list[float]]:
    """[tokens, steps/s] of one target forward over that many tokens on this CPU (the best
    of two): the curve ``sps`` weighs, here for this machine (no KV cache, so no context)."""
    curve = []
    for count in token_counts:
        ids = torch.arange(count)[None] % target.config.vocab_size
        best = float("inf")
        for _ in range(2):
            start = time.perf_counter()
            target(ids)
            best = min(best, time.perf_counter() - start)
        curve.append([count, 1.0 / best])
    return curve


def admitted_drafts(
    mode: str, previous: torch.Tensor, current: torch.Tensor, sps_table: torch.Tensor
) -> torch.Tensor:
    """Drafts each request of ``current`` [R, K] (prefix survivals) verifies under
    ``mode``. As in the runtime, threshold and sps take their budget from the previous
    proposal (``previous``, here of the same size), and every mode admits the budget's
    highest-survival slots of the current one."""
    from vllm_dspark.capacity.allocation import (
        admission_budget,
        budget_capacity,
        sps_best_count,
        threshold_count,
    )

    num_reqs, num_drafts = current.shape
    if mode == "off":
        return torch.full((num_reqs,), num_drafts)
    if mode == "budget":
        budget = admission_budget(num_reqs, num_drafts, BUDGET_FRAC)
    elif mode == "threshold":
        budget = threshold_count(previous, CONFIDENCE_THRESHOLD)
    else:
        budget = sps_best_count(previous, sps_table)
    return budget_capacity(current, budget)


CAPACITY_MODES = {
    "off": "off (fixed K)",
    "budget": f"budget {BUDGET_FRAC}",
    "threshold": f"threshold {CONFIDENCE_THRESHOLD}",
    "sps": "sps (this CPU's curve)",
}


def capacity_admissions(
    steps: list[VerifiedStep], loads: list[int], curve: list[list[float]], seed: int = 0
) -> dict[str, dict[int, dict]]:
    """{mode: {load R: drafts verified per request, tokens a request gains per step}} over
    batches of R of this run's proposals drawn at random; a request gains 1 + the accepted
    drafts among those it verified (greedy: its accepted prefix, cut at the admission)."""
    from vllm_dspark.capacity.allocation import sps_table_from_curve

    survival = torch.tensor([step.survival for step in steps], dtype=torch.float32)
    accepted = torch.tensor([step.accepted for step in steps])
    generator = torch.Generator().manual_seed(seed)
    result: dict[str, dict[int, dict]] = {mode: {} for mode in CAPACITY_MODES}
    for load in loads:
        table = sps_table_from_curve(curve, load * (1 + survival.shape[1]))
        draws = torch.randint(len(steps), (ADMISSION_ROUNDS + 1, load), generator=generator)
        for mode in CAPACITY_MODES:
            admitted, gained = [], []
            for previous, current in zip(draws[:-1], draws[1:], strict=True):
                counts = admitted_drafts(mode, survival[previous], survival[current], table)
                admitted.append(counts.float().mean())
                gained.append((1 + torch.minimum(counts, accepted[current])).float().mean())
            result[mode][load] = {
                "drafts_per_request": float(torch.stack(admitted).mean()),
                "tokens_per_step": float(torch.stack(gained).mean()),
            }
    return result


@contextmanager
def one_thread() -> Iterator[None]:
    """The pair's matrices are tiny: one thread runs them about as fast as several, and
    does not collapse on a busy machine, where threads waiting on each other spin."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def token_text(tokenizer, token: int, width: int = 9) -> str:
    """A token as a short, visible string (newlines escaped; its id without a tokenizer)."""
    if tokenizer is None:
        return str(token)
    text = repr(tokenizer.decode([token]))[1:-1]
    return text if len(text) <= width else text[: width - 1] + "…"


def load_tokenizer(pair_dir: Path):
    """The target's tokenizer (the report shows tokens as text)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(pair_dir / "target" / "tokenizer.json"))


def _row(label: str, cells, width: int = 10, label_width: int = 14) -> str:
    return f"  {label:<{label_width}}" + "".join(f"{cell:>{width}}" for cell in cells)


def _floats(values, digits: int = 2) -> list[str]:
    return ["-" if value is None else f"{value:.{digits}f}" for value in values]


def example_step(walks: list[PromptWalk], k: int) -> tuple[int, int, VerifiedStep, list[int]]:
    """(prompt, step, the step, its context): the first step that accepted some drafts and
    rejected one, which shows both (else the first step)."""
    found = [
        (p, s)
        for p, walk in enumerate(walks)
        for s, step in enumerate(walk.steps)
        if 0 < step.accepted < k
    ]
    prompt, index = found[0] if found else (0, 0)
    walk = walks[prompt]
    context = walk.prompt + [walk.output[0]]
    for step in walk.steps[:index]:
        context += step.committed
    return prompt, index, walk.steps[index], context


def format_step(step: VerifiedStep, context: list[int], tokenizer) -> list[str]:
    k = len(step.drafts)
    marks = ["yes" if j < step.accepted else ("no" if j == step.accepted else "") for j in range(k)]
    tail = "".join(token_text(tokenizer, t, 40) for t in context[-6:])
    return [
        f"  context ends '{tail}'",
        _row("position", range(1, k + 1)),
        _row("draft", [token_text(tokenizer, t) for t in step.drafts]),
        _row("confidence", _floats(step.confidences)),
        _row("survival", _floats(step.survival)),
        _row("target's pick", [token_text(tokenizer, t) for t in step.target[:k]]),
        _row("accepted", marks),
        f"  -> {step.accepted} of {k} drafts accepted, then the target's own next token: "
        f"{step.accepted + 1} token(s) from one target forward",
    ]


def format_cpu_report(result: dict, tokenizer=None) -> list[str]:
    """The report's lines from :func:`cpu_demo_result`'s record."""
    k, loads = result["k"], result["loads"]
    acceptance, calibration = result["acceptance"], result["calibration"]
    lossless = result["lossless"]
    lines = [
        "=== CPU reference (PyTorch), not vLLM ===",
        f"The embedded pair (5.6M-parameter target, DSpark drafter with a confidence head), "
        f"{result['prompts']} held-out prompts x {result['max_tokens']} tokens, greedy, "
        f"K={k} drafts per step, float32 on the CPU; throughput is compared on a GPU only.",
        "",
        f"One DSpark step (prompt {result['example'][0]}, step {result['example'][1] + 1}):",
        *format_step(*result["example"][2:], tokenizer),
        "",
        "Acceptance:",
        f"  {acceptance['steps']} speculative steps; mean acceptance length "
        f"{acceptance['acceptance_length']:.2f} tokens per target forward "
        f"(1.00 without speculation)",
        _row("position", range(1, k + 1), 7),
        _row("accepted", _floats(acceptance["per_position_acceptance"]), 7),
        "",
        "Confidence calibration (prefix survival s_k = P(drafts 1..k all accepted)):",
        _row("position", range(1, k + 1), 7),
        _row("predicted", _floats(calibration["predicted_survival"]), 7),
        _row("observed", _floats(calibration["observed_survival"]), 7),
        _row("AUROC", _floats(calibration["auroc"]), 7),
        _row("ECE", _floats(calibration["ece"], 3), 7),
        "",
        "Lossless:",
        f"  speculative greedy output == the target's plain greedy decode on "
        f"{lossless['identical']}/{lossless['prompts']} prompts "
        f"({'identical' if lossless['identical'] == lossless['prompts'] else 'NOT identical'})",
        "",
        "Capacity modes: drafts verified per request (tokens per request per step), decided by "
        "vllm_dspark.capacity.allocation on this run's confidences, at R requests per step:",
        _row("mode", [f"R={load}" for load in loads], 14, 24),
    ]
    for mode, label in CAPACITY_MODES.items():
        cells = [
            f"{cell['drafts_per_request']:.1f} ({cell['tokens_per_step']:.2f})"
            for cell in (result["capacity"][mode][load] for load in loads)
        ]
        lines.append(_row(label, cells, 14, 24))
    lines += [
        "  sps weighs expected tokens per second on a curve of step time against tokens per",
        "  step: this CPU's target forward grows with every token, so it verifies fewer drafts",
        "  as the load rises; a GPU's step stays flat until compute-bound, and sps keeps more.",
        "",
        "Next:",
        "  vllm-dspark doctor   # what this machine has, and whether it can run DSpark",
        "  vllm-dspark demo     # on a CUDA GPU: the pair served by vLLM with no speculation,",
        "                       # fixed k=7 and adaptive (sps), tok/s at 1 and 64 requests",
    ]
    return lines


def cpu_demo_result(
    pair_dir: Path, num_prompts: int, max_tokens: int, k: int, loads: list[int], out=print
) -> dict:
    """Runs the reference walk and returns the report's record (JSON-ready except the
    example step, kept as a :class:`VerifiedStep`)."""
    from tqdm import tqdm

    from vllm_dspark.tiny_pair.reference import load_reference_pair

    with one_thread():
        with stage(1, 4, "loading the embedded pair (PyTorch, CPU)", out=out):
            target, drafter, temperatures = load_reference_pair(pair_dir)
            prompts = load_prompts(pair_dir, num_prompts)
        with stage(2, 4, f"speculative greedy decoding of {len(prompts)} prompts", out=out):
            walks = [
                speculative_greedy(target, drafter, temperatures, prompt, max_tokens, k)
                for prompt in tqdm(prompts, desc="prompts", leave=False)
            ]
        with stage(3, 4, "the target's plain greedy decode (no drafts)", out=out):
            plain = plain_greedy(target, prompts, max_tokens)
        with stage(4, 4, "timing this CPU's target forward for sps's curve", out=out):
            curve = measured_sps_curve(target)
    steps = [step for walk in walks for step in walk.steps]
    example = example_step(walks, k)
    return {
        "record": "vllm-dspark demo, CPU reference (PyTorch), not vLLM",
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "k": k,
        "loads": loads,
        "example": example,
        "acceptance": acceptance_summary(steps, k),
        "calibration": calibration_summary(steps, k),
        "lossless": {
            "prompts": len(prompts),
            "identical": sum(w.output == p for w, p in zip(walks, plain, strict=True)),
        },
        "sps_curve_cpu": curve,
        "capacity": capacity_admissions(steps, loads, curve),
    }


def plot_calibration(calibration: dict, path: str) -> None:
    """Predicted against observed prefix survival per draft position (a PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    positions = np.arange(1, len(calibration["predicted_survival"]) + 1)
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar(positions - 0.2, calibration["predicted_survival"], 0.4, label="predicted")
    ax.bar(positions + 0.2, calibration["observed_survival"], 0.4, label="observed")
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(drafts 1..k accepted)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax.set_title("Embedded pair, CPU reference (PyTorch): confidence head", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_cpu_demo(
    num_prompts: int,
    max_tokens: int,
    k: int,
    loads: list[int],
    json_out: str | None = None,
    plot: str | None = None,
    pair_dir: Path = EMBEDDED_PAIR,
    out=print,
) -> int:
    import json

    start = time.monotonic()
    result = cpu_demo_result(pair_dir, num_prompts, max_tokens, k, loads, out)
    out("")
    for line in format_cpu_report(result, load_tokenizer(pair_dir)):
        out(line)
    result["wall_s"] = round(time.monotonic() - start, 1)
    if plot:
        plot_calibration(result["calibration"], plot)
        out(f"plot: {plot}")
    if json_out:
        record = {key: value for key, value in result.items() if key != "example"}
        Path(json_out).write_text(json.dumps(record, indent=2))
    return 0
