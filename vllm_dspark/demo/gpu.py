"""The demo on a CUDA GPU: the embedded pair served by vLLM in three arms, each in an engine
of its own, one after another: no speculation, DSpark with a fixed k (stock vLLM: no
``dspark_*`` option, so the plugin stays inert) and the recommended adaptive configuration
(:data:`ADAPTIVE_OPTIONS`). Each engine is warmed at every load, then timed over a few
repeats per load (the median counts); the same requests run in every arm, greedy, so their
outputs must equal no speculation's (in bfloat16 up to near ties: :func:`top_two_gaps`).
After its timed repeats the adaptive engine records the confidence head's calibration over
one untimed pass (a reader of every verified step would keep ``sps`` from resting while
timed). Reading the counters the plugin keeps calls into the workers
(``VLLM_ALLOW_INSECURE_SERIALIZATION``).
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from vllm_dspark.demo import EMBEDDED_PAIR, load_prompts
from vllm_dspark.demo.progress import stage

# The README's recommendation for DSpark with its confidence head ("Which to set"):
# drafts verified per request chosen for expected tokens per second, verified compacted.
ADAPTIVE_OPTIONS = {"dspark_capacity": "sps", "dspark_varlen_verify": True}
# At light load a wave is one request: a repeat runs waves until this many requests, so
# that it verifies enough drafts for its acceptance (and speed) to be more than one text's.
MIN_REQUESTS_PER_REPEAT = 8
# vLLM captures CUDA graphs up to 512 tokens a step by default.
DEFAULT_MAX_GRAPH_TOKENS = 512


@dataclass
class ArmSpec:
    key: str  # nospec, fixed, adaptive
    name: str
    options: dict | None  # speculative options beyond method, model and k; None: none


def demo_arms(k: int) -> list[ArmSpec]:
    return [
        ArmSpec("nospec", "no speculation", None),
        ArmSpec("fixed", f"fixed k={k}", {}),
        ArmSpec("adaptive", "adaptive (sps)", ADAPTIVE_OPTIONS),
    ]


@dataclass
class ArmRow:
    """One arm at one load (concurrent requests)."""

    arm: str  # ArmSpec.key
    name: str
    concurrency: int
    tok_s: float  # median of the repeats
    tok_s_repeats: list[float]
    acceptance_length: float | None = None  # tokens per verification step, bonus included
    per_position_acceptance: list[float] | None = None
    drafts_per_request: float | None = None  # drafts verified per request and step
    outputs: list[list[int]] = field(default_factory=list, repr=False)  # greedy, per request
    # No speculation: per request and output token, the log-probability gap between the
    # target's two best tokens (None where an untimed rerun did not reproduce the output).
    top_two_gaps: list[list[float] | None] | None = field(default=None, repr=False)


@dataclass
class ArmResult:
    spec: ArmSpec
    engine_start_s: float
    rows: list[ArmRow]
    calibration: dict | None = None  # the confidence head's, over the arm's whole run


def requests_for(concurrency: int, pool: list[list[int]]) -> list[list[list[int]]]:
    """A repeat's waves at ``concurrency``: waves of that many requests, submitted at once,
    until at least :data:`MIN_REQUESTS_PER_REPEAT`, the prompts taken from ``pool`` in turn."""
    waves = math.ceil(MIN_REQUESTS_PER_REPEAT / concurrency)
    return [
        [pool[(wave * concurrency + i) % len(pool)] for i in range(concurrency)]
        for wave in range(waves)
    ]


def engine_kwargs(
    pair_dir: Path, dtype: str, max_concurrency: int, speculative: dict | None
) -> dict:
    kwargs = dict(
        model=str(pair_dir / "target"),
        # The prompts are token ids and the outputs are compared as ids.
        skip_tokenizer_init=True,
        dtype=dtype,
        seed=0,
        max_model_len=2048,
        max_num_seqs=max_concurrency,
        # The pair is tiny: a tenth of the GPU holds far more KV cache than the demo needs.
        gpu_memory_utilization=0.1,
        disable_log_stats=False,  # the spec-decode counters
        # Every repeat runs the same prompts again: none may find them cached.
        enable_prefix_caching=False,
        speculative_config=speculative,
    )
    # Each speculating request verifies 1 + k tokens a step; past vLLM's default largest
    # graph, steps at the heavy load would run without one.
    step_tokens = max_concurrency * (1 + (speculative or {}).get("num_speculative_tokens", 0))
    if step_tokens > DEFAULT_MAX_GRAPH_TOKENS:
        kwargs["compilation_config"] = {"max_cudagraph_capture_size": step_tokens}
    return kwargs


def speculative_config(spec: ArmSpec, pair_dir: Path, k: int) -> dict | None:
    if spec.options is None:
        return None
    return {
        "method": "dspark",
        "model": str(pair_dir / "draft"),
        "num_speculative_tokens": k,
        **spec.options,
    }


class ArmEngine:
    """One arm's running engine and what measuring it reads."""

    def __init__(self, spec: ArmSpec, pair_dir: Path, k: int, dtype: str, max_concurrency: int):
        from vllm import LLM

        self.spec = spec
        speculative = speculative_config(spec, pair_dir, k)
        self.speculating = speculative is not None
        self.llm = LLM(**engine_kwargs(pair_dir, dtype, max_concurrency, speculative))

    def run(
        self, waves: list[list[list[int]]], max_tokens: int, logprobs: int | None = None
    ) -> tuple[float, list]:
        """(seconds, completions) of the waves, one after another."""
        from vllm import SamplingParams

        params = SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs
        )
        seconds, completions = 0.0, []
        for wave in waves:
            batch = [{"prompt_token_ids": ids} for ids in wave]
            start = time.perf_counter()
            done = self.llm.generate(batch, params, use_tqdm=False)
            seconds += time.perf_counter() - start
            completions += [out.outputs[0] for out in done]
        return seconds, completions

    def top_two_gaps(self, waves, max_tokens: int, outputs: list[list[int]]) -> list:
        """An untimed rerun of the waves with the target's two best tokens per position:
        per request the gap between their log-probabilities, None where the rerun's tokens
        are not ``outputs``' (so a gap always describes the compared context)."""
        _, completions = self.run(waves, max_tokens, logprobs=2)
        gaps = []
        for completion, output in zip(completions, outputs, strict=True):
            if list(completion.token_ids) != output:
                gaps.append(None)
                continue
            best = [sorted(p.values(), key=lambda lp: lp.rank)[:2] for p in completion.logprobs]
            gaps.append([first.logprob - second.logprob for first, second in best])
        return gaps

    def calibration(self, pool: list[list[int]], load: int, max_tokens: int) -> dict:
        """The confidence head's calibration (per position, prefix survival) over one
        untimed pass of the whole pool at ``load``, recorded during that pass only."""
        from vllm_dspark.bench.engine_control import switch_capacity
        from vllm_dspark.metrics import confidence_calibration

        options = {key.removeprefix("dspark_"): value for key, value in self.spec.options.items()}
        switch_capacity(self.llm, **options, confidence_metrics=True)
        self.run([pool[i : i + load] for i in range(0, len(pool), load)], max_tokens)
        return confidence_calibration(self.llm)["prefix"]

    def counters(self) -> tuple:
        from vllm_dspark.metrics import AdmissionCounts, SpecDecodeCounts, admission_counts

        spec = SpecDecodeCounts.from_metrics(self.llm.get_metrics())
        admitted = admission_counts(self.llm) if self.speculating else AdmissionCounts()
        return spec, admitted

    def close(self) -> None:
        # The engine runs in its own process; this one never touches CUDA (the next
        # engine's process could not start from it).
        del self.llm
        gc.collect()


def drafts_per_request(spec_counts, admission) -> float | None:
    """Drafts a request verified per step: the plugin's count where it compacted steps
    (capacity control), else vLLM's draft tokens per drafting request (all k)."""
    if admission.steps:
        return admission.admitted_per_request
    if spec_counts.drafts:
        return spec_counts.draft_tokens / spec_counts.drafts
    return None


def measure_arm(
    engine: ArmEngine,
    pool: list[list[int]],
    concurrency: list[int],
    max_tokens: int,
    repeats: int,
) -> list[ArmRow]:
    """Warm the engine at every load first (kernels specialise on batch sizes, and the
    adaptive arm fits its step costs while serving), then time each load's repeats."""
    from tqdm import tqdm

    for load in concurrency:
        engine.run(requests_for(load, pool), max_tokens)
    rows = []
    for load in concurrency:
        waves = requests_for(load, pool)
        before_spec, before_admitted = engine.counters()
        tok_s, outputs = [], []
        for _ in tqdm(range(repeats), desc=f"      {load} concurrent", leave=False):
            seconds, completions = engine.run(waves, max_tokens)
            outputs = [list(completion.token_ids) for completion in completions]
            tok_s.append(sum(map(len, outputs)) / seconds)
        after_spec, after_admitted = engine.counters()
        spec = after_spec - before_spec
        row = ArmRow(
            engine.spec.key,
            engine.spec.name,
            load,
            statistics.median(tok_s),
            tok_s,
            outputs=outputs,
        )
        if not engine.speculating:
            row.top_two_gaps = engine.top_two_gaps(waves, max_tokens, outputs)
        else:
            row.acceptance_length = spec.acceptance_length
            row.per_position_acceptance = spec.per_position_acceptance
            row.drafts_per_request = drafts_per_request(spec, after_admitted - before_admitted)
        rows.append(row)
    return rows


def run_arms(
    pair_dir: Path,
    num_prompts: int,
    max_tokens: int,
    k: int,
    dtype: str,
    concurrency: list[int],
    repeats: int,
    out=print,
) -> list[ArmResult]:
    # The metrics above call into the engine's workers; set before any engine starts.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    pool = load_prompts(pair_dir, num_prompts)
    arms = demo_arms(k)
    results = []
    for index, spec in enumerate(arms, 1):
        first = "first start compiles, ~1-2 min" if index == 1 else "~1 min"
        with stage(index, len(arms), f"starting engine: {spec.name} ({first})", 15, out):
            started = time.monotonic()
            engine = ArmEngine(spec, pair_dir, k, dtype, max(concurrency))
            start_s = time.monotonic() - started
        loads = " and ".join(map(str, concurrency))
        out(f"      measuring at {loads} concurrent requests, {repeats} repeats each")
        rows = measure_arm(engine, pool, concurrency, max_tokens, repeats)
        calibration = None
        if spec.key == "adaptive":
            out("      confidence head's calibration: one untimed pass of every prompt")
            calibration = engine.calibration(pool, max(concurrency), max_tokens)
        results.append(ArmResult(spec, round(start_s, 1), rows, calibration))
        engine.close()
    return results


def device_description() -> dict:
    from importlib.metadata import version

    from vllm.platforms import current_platform

    return {"device": current_platform.get_device_name(0), "vllm_version": version("vllm")}


def run_gpu_demo(
    num_prompts: int,
    max_tokens: int,
    k: int,
    dtype: str,
    concurrency: list[int],
    repeats: int,
    plot: str | None = None,
    json_out: str | None = None,
    command: str = "vllm-dspark demo",
    pair_dir: Path = EMBEDDED_PAIR,
    out=print,
) -> int:
    from vllm_dspark.demo.report import (
        RunSettings,
        compare_rows,
        demo_record,
        format_gpu_report,
        plot_throughput,
    )

    start = time.monotonic()
    results = run_arms(pair_dir, num_prompts, max_tokens, k, dtype, concurrency, repeats, out)
    settings = RunSettings(
        command=command,
        prompts=num_prompts,
        max_tokens=max_tokens,
        k=k,
        dtype=dtype,
        concurrency=concurrency,
        repeats=repeats,
        adaptive_options=ADAPTIVE_OPTIONS,
        **device_description(),
    )
    rows = compare_rows([row for result in results for row in result.rows])
    wall_s = time.monotonic() - start
    out("")
    for line in format_gpu_report(settings, rows, results, wall_s):
        out(line)
    if plot:
        plot_throughput(rows, plot, settings)
        out(f"plot: {plot}")
    if json_out:
        import json

        Path(json_out).write_text(
            json.dumps(demo_record(settings, rows, results, wall_s), indent=2)
        )
        out(f"record: {json_out}")
    return 0
