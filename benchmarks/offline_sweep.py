"""Offline throughput of several arms at several concurrencies.

    python benchmarks/offline_sweep.py --pair qwen3-8b --arms nospec,dspark,dspark-fp8 \
        --concurrency 1,16 --out benchmarks/results/fp8_e2e.json

Each arm runs in a fresh process (`LLM()`, greedy, EOS ignored). For each concurrency c
it submits c prompts of --prompt-len tokens at once, --output-len tokens each, after a
warm-up at that concurrency, --repeats times with fresh prompts (below --min-requests,
each repeat runs several such waves one after another), and reports the median output
tokens per second (each repeat's too) and the spec-decode counters of all repeats; rows
of ``sps`` arms add what the draft gate weighed (``gate``). ``--pair qwen3-8b`` uses
dummy weights with synthetic acceptance derived from ``--rates`` (per-position
unconditional acceptance): ``--acceptance rates`` is vLLM's own (one fixed rate per
position), ``--acceptance confidence`` draws per-draft confidences around the same
conditional rates and accepts each draft with its confidence
(``dspark_synthetic_confidence``: what capacity control needs; DFlash arms, which have
no confidence head, keep vLLM's rates). ``--pair embedded`` uses the trained pair with
real verification (DSpark arms only), on windows of its held-out text (``--prompts``).
``--pair dsv4-flash-reduced`` (or ``tiny-dsv4``) is a DeepSeek-V4 shape with dummy weights,
served as vLLM 0.26.0 serves DeepSeek-V4 (``DSV4_ENGINE``; docs/design/deepseek-v4.md): its
DSpark module is the target checkpoint's own (no "model" in the speculative config); its
capacity arms verify compacted (on SM90 only: elsewhere its attention backends refuse
compact verification, and the engine does not start) or masked (the ``-masked`` arms).
Each row says how the arm verifies (``verify``: :func:`verification`).
``--greedy-check``: after an arm's timed rows, the first wave of each concurrency once
more, untimed, its drafts accepted as the target's greedy choice (calibrated synthetic
confidence switched off around it, :func:`accept_by_target`); each row's
``greedy_identical`` then says whether its outputs were no speculation's (None: not
checked, vLLM's synthetic rates, which a running engine cannot switch off, or no
``nospec`` arm in the run), ``greedy_divergences`` [request, first differing position]
for the requests whose outputs were not.
``--shared-engine`` runs capacity arms that differ only in what a running engine can
switch (the method and drafter options such as FP8 layers agreeing) in one engine,
started with what they all need and switched between arms
(:mod:`vllm_dspark.bench.engine_control`); their rows name that engine. ``--mirror`` runs them
again in reverse order, each row numbered by its ``pass``; ``--interleave`` instead takes
their timed repeats in turn (repeat r of every arm before repeat r + 1 of any), each row
adding ``paired``, its median ratio to the engine's other arms over repeats of the same
index: what tells arms within 1-2% of each other apart. ``--lockstep`` starts every
arm's engine at once and keeps them alive, each with its share of the GPU and a fixed KV
cache, and takes their timed repeats in turn (repeat r of every arm, on the same prompts,
before repeat r + 1 of any), so that a drift of the machine meets every arm alike; each
row adds ``paired``, its median ratio to every other arm over repeats of the same index.
After its timed repeats each concurrency runs the first repeat's first wave once more,
untimed, and records it step by step (``timeline``: when every request had its first
token, when half had finished, the last token; :func:`step_timeline`; with speculation,
``decode_steps``: what capacity control decided in each decode step).
``--refill N`` measures steady load instead of one batch: each wave submits N x c
requests to engines that run at most c at once, so requests join as others finish and
most steps carry a prompt beside the decoding requests (what mixed steps compact;
the ``-unmixed`` arms turn that off), as in a server under load.
``--num-drafts`` sets K for every speculating arm (dummy shapes; default 7).
``--tensor-parallel-size`` runs every engine on that many GPUs; each speculating row
then says whether every rank's admissions were identical (``ranks_agree``: the ranks
must verify the same batches). Engines run in the order of their first arm in ``--arms``
(a shared engine where its first capacity arm stands). Rows are read as each engine
prints them and the JSON is rewritten after every row, so a run cut short (a failure, or
a device machine taken back mid-engine) keeps every row already measured; each row says
how long its engine took to start (``engine_start_s``) and its own measurement
(``wall_s``), to plan what fits a device session.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import functools
import itertools
import json
import operator
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import asdict
from pathlib import Path

from shapes import DSV4, SHAPES, shape_root, write_deepseek_v4_shape, write_shape

from vllm_dspark.bench import DUMMY_WEIGHTS_EXTENSION
from vllm_dspark.demo.report import first_difference

# The acceptance profile measured alongside the stock baseline in shared/device/README.md.
DEFAULT_RATES = "0.8,0.62,0.48,0.37,0.28,0.21,0.16"
# dspark_draft_vocab of the -vocab arms: the first 32,768 of Qwen3's 151,936 token ids, about
# a fifth, FR-Spec's size for Llama-3's 128k vocabulary. With dummy weights and synthetic
# acceptance these arms show the cost saved, not what a real drafter's acceptance loses.
DRAFT_VOCAB = 32768
DYNAMIC_SD_TABLE = json.loads(
    (Path(__file__).parent / "results" / "dynamic_sd_table.json").read_text()
)["num_speculative_tokens_per_batch_size"]

# sps whose closed draft gate schedules plain decode steps, drafting only the depth that
# pays under the load; the same for DFlash with the acceptance-length controller.
SPS_DEPTH_PLAIN = {
    "dspark_capacity": "sps",
    "dspark_varlen_verify": True,
    "dspark_dynamic_depth": True,
    "dspark_plain_steps": True,
}
DFLASH_DEPTH = {
    "method": "dflash",
    "dspark_capacity": "acceptance",
    "dspark_varlen_verify": True,
    "dspark_dynamic_depth": True,
}
DFLASH_DEPTH_PLAIN = DFLASH_DEPTH | {"dspark_plain_steps": True}
# Every drafting cut both drafters take: FP8 layers and LM head over part of the vocabulary.
LEAN_DRAFTING = {
    "dspark_fp8_draft_backbone": True,
    "dspark_fp8_draft_head": True,
    "dspark_draft_vocab": DRAFT_VOCAB,
}
# DSpark's lean drafting adds the Markov head in FP8 too (DFlash has none).
LEAN_DSPARK = LEAN_DRAFTING | {"dspark_fp8_markov_head": True}
# The engine arguments vLLM 0.26.0 serves a DeepSeek-V4 shape with
# (docs/design/deepseek-v4.md): an FP8 KV cache in blocks of 256 tokens.
DSV4_ENGINE = {"kv_cache_dtype": "fp8", "block_size": 256}

ARMS = {
    "nospec": None,
    "dspark": {},
    "dspark-fp8": {"dspark_fp8_draft_head": True},
    "dspark-fp8-markov": {"dspark_fp8_draft_head": True, "dspark_fp8_markov_head": True},
    # Drafting over part of the vocabulary (an engine of its own).
    "dspark-vocab": {"dspark_draft_vocab": DRAFT_VOCAB},
    # The drafter's own layers in FP8 (an engine of its own).
    "dspark-fp8-backbone": {"dspark_fp8_draft_backbone": True},
    "dspark-fp8-markov-vocab": {
        "dspark_fp8_draft_head": True,
        "dspark_fp8_markov_head": True,
        "dspark_draft_vocab": DRAFT_VOCAB,
    },
    # Every drafting cut at a fixed k (FP8 layers and heads over part of the vocabulary; an
    # engine of its own): the cheapest step a fixed depth drafts with.
    "dspark-lean": LEAN_DSPARK,
    # vLLM's Dynamic SD: k by batch size (inclusive ranges), the table tune_dynamic_sd.py
    # derived from measured fixed-k rows, each charged the K-draft proposal Dynamic SD runs.
    "dynamic-sd": {"num_speculative_tokens_per_batch_size": DYNAMIC_SD_TABLE},
    "budget": {
        "dspark_capacity": "budget",
        "dspark_budget_frac": 0.5,
        "dspark_varlen_verify": True,
    },
    "threshold": {
        "dspark_capacity": "threshold",
        "dspark_confidence_threshold": 0.5,
        "dspark_varlen_verify": True,
    },
    # dspark_sps_curve: --sps-curve, else auto (profiled at start-up).
    "sps": {"dspark_capacity": "sps", "dspark_varlen_verify": True},
    "sps-depth": {
        "dspark_capacity": "sps",
        "dspark_varlen_verify": True,
        "dspark_dynamic_depth": True,
    },
    # sps whose closed draft gate makes the scheduler schedule plain decode steps.
    "sps-plain": {
        "dspark_capacity": "sps",
        "dspark_varlen_verify": True,
        "dspark_plain_steps": True,
    },
    # sps-plain whose drafter runs only the depth that pays under the load.
    "sps-depth-plain": SPS_DEPTH_PLAIN,
    # ... drafting through the rowwise FP8 LM head (an engine of its own).
    "sps-depth-plain-fp8": SPS_DEPTH_PLAIN | {"dspark_fp8_draft_head": True},
    # ... drafting with the drafter's own layers in FP8 (an engine of its own).
    "sps-depth-plain-fp8-backbone": SPS_DEPTH_PLAIN | {"dspark_fp8_draft_backbone": True},
    # ... drafting as cheaply as the plugin can: FP8 layers and heads over part of the
    # vocabulary (an engine of its own).
    "sps-depth-plain-lean": SPS_DEPTH_PLAIN | LEAN_DSPARK,
    # ... whose steps with prompts verify all K drafts (dspark_mixed_steps=false; the
    # default before 8824b10's refill run): what mixed steps add under --refill (with
    # --shared-engine, switched in sps-depth-plain-lean's engine).
    "sps-depth-plain-lean-unmixed": SPS_DEPTH_PLAIN | LEAN_DSPARK | {"dspark_mixed_steps": False},
    # ... drafting over part of the vocabulary (an engine of its own).
    "sps-depth-plain-vocab": SPS_DEPTH_PLAIN | {"dspark_draft_vocab": DRAFT_VOCAB},
    # sps-plain whose gate weighs the request drafting worst: a batch submitted at once
    # lasts as long as its slowest request (benchmarks/batch_steps.py).
    "sps-batch": {
        "dspark_capacity": "sps",
        "dspark_varlen_verify": True,
        "dspark_plain_steps": True,
        "dspark_gate_objective": "batch",
    },
    "acceptance": {"dspark_capacity": "acceptance", "dspark_varlen_verify": True},
    # sps and acceptance verified masked (the target runs every draft; those not admitted
    # are not verified): where the target's attention backends refuse compact
    # verification, as DeepSeek-V4's do.
    "sps-masked": {"dspark_capacity": "sps", "dspark_varlen_verify": False},
    "acceptance-masked": {"dspark_capacity": "acceptance", "dspark_varlen_verify": False},
    "budget-masked": {
        "dspark_capacity": "budget",
        "dspark_budget_frac": 0.5,
        "dspark_varlen_verify": False,
    },
    "threshold-masked": {
        "dspark_capacity": "threshold",
        "dspark_confidence_threshold": 0.5,
        "dspark_varlen_verify": False,
    },
    # DFlash (no confidence head): fixed depth, and the acceptance-length controller.
    "dflash": {"method": "dflash"},
    # ... fixed depth, drafting as cheaply as the plugin can: what the cuts alone bring,
    # against which the controller's own share shows (an engine of its own).
    "dflash-lean": {"method": "dflash"} | LEAN_DRAFTING,
    "dflash-acceptance": {
        "method": "dflash",
        "dspark_capacity": "acceptance",
        "dspark_varlen_verify": True,
    },
    # ... whose draft gate schedules plain decode steps where drafting does not pay.
    "dflash-plain": {
        "method": "dflash",
        "dspark_capacity": "acceptance",
        "dspark_varlen_verify": True,
        "dspark_plain_steps": True,
    },
    # ... whose drafter samples only the positions the next step verifies.
    "dflash-depth": DFLASH_DEPTH,
    "dflash-depth-plain": DFLASH_DEPTH_PLAIN,
    "dflash-depth-plain-fp8-backbone": DFLASH_DEPTH_PLAIN | {"dspark_fp8_draft_backbone": True},
    "dflash-depth-plain-vocab": DFLASH_DEPTH_PLAIN | {"dspark_draft_vocab": DRAFT_VOCAB},
    # ... drafting as cheaply as the plugin can (DFlash has no Markov head).
    "dflash-depth-plain-lean": DFLASH_DEPTH_PLAIN | LEAN_DRAFTING,
    # ... without plain steps (with --shared-engine, one engine for both: same cuts).
    "dflash-depth-lean": DFLASH_DEPTH | LEAN_DRAFTING,
    "dflash-depth-lean-unmixed": DFLASH_DEPTH | LEAN_DRAFTING | {"dspark_mixed_steps": False},
    # dflash-lean's fixed depth switched to in the controller's engine (--shared-engine):
    # at 1 and 16 requests engines of their own differed by as much as the controller
    # could (47bc5ae, H200: a first token 16.9 against 19.7 ms on average at one request,
    # with equal steps); in one engine the arms differ in the controller alone.
    "dflash-fixed-lean": {"method": "dflash", "dspark_capacity": "off"} | LEAN_DRAFTING,
    # DSpark's fixed k=7 switched to in the sps arms' engine (--shared-engine): on the
    # host-bound embedded pair repeats of one arm spread 10-25% and engines of their own
    # more (bfbca4e, H200); in one engine the arms differ in the controller alone.
    "dspark-fixed": {"dspark_capacity": "off"},
}


# Capture sizes past vLLM's default 512 tokens (--graphs-to): a few, since each size is
# captured for the target and the drafter alike. 1,792: a DSpark drafter of K=7 queries 7
# tokens a request (anchor first), and vLLM rounds each size up to a multiple of that and
# drops what then exceeds the largest (2,048 -> 2,051): without it the largest draft graph
# held 220 requests, and every K=7 arm drafted eagerly at 256 requests (the embedded pair's
# step breakdown at bfbca4e: draft_cudagraph NONE), stock k=7 included.
LARGE_CAPTURE_SIZES = (640, 768, 1024, 1280, 1536, 1792, 2048)
# --lockstep: the share of the GPU all engines together take, each an equal part (each
# process also holds a CUDA context outside its share), which vLLM checks is free at
# start-up; each engine's KV cache is fixed (--lockstep-kv-cache-gib) instead, since its
# memory profiling would count the allocations of the engines starting beside it.
LOCKSTEP_MEMORY = 0.8


def capture_sizes(graphs_to: int) -> list[int]:
    """vLLM's default capture sizes up to 512 tokens, then LARGE_CAPTURE_SIZES up to
    ``graphs_to``."""
    default = [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]
    return [size for size in (*default, *LARGE_CAPTURE_SIZES) if size <= graphs_to]


def engine_kwargs(
    target: str,
    dummy: bool = True,
    graphs_to: int | None = None,
    tensor_parallel_size: int = 1,
    max_num_batched_tokens: int | None = None,
    max_num_seqs: int = 256,
    gpu_memory_utilization: float = 0.85,
    kv_cache_memory_bytes: int | None = None,
    cudagraph_mode: str | None = None,
) -> dict:
    """The engine arguments of every sweep arm (and of step_breakdown.py); ``graphs_to``:
    capture CUDA graphs up to that many tokens per step instead of vLLM's 512;
    ``cudagraph_mode``: vLLM's (default: its own, FULL_AND_PIECEWISE);
    ``max_num_batched_tokens``: vLLM's (default: its own, 16,384 offline on an H100/H200);
    ``max_num_seqs``: the requests the engine runs at once (``--refill``: the concurrency);
    ``gpu_memory_utilization``: its share of the GPU and ``kv_cache_memory_bytes``: a fixed
    KV cache (--lockstep: engines side by side)."""
    kwargs = dict(
        model=target,
        tensor_parallel_size=tensor_parallel_size,
        load_format="dummy" if dummy else "auto",
        worker_extension_cls=DUMMY_WEIGHTS_EXTENSION if dummy else "",
        skip_tokenizer_init=dummy,
        dtype="bfloat16",
        max_model_len=2048,
        max_num_seqs=max_num_seqs,
        gpu_memory_utilization=gpu_memory_utilization,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        seed=0,
        disable_log_stats=False,
        # Arms switched in one engine (--shared-engine) run the same prompts one after
        # another: with vLLM's prefix cache every arm after the first found them cached,
        # and at 256 requests its mean time to first token was 0.24-0.26 s against
        # 0.53-0.57 s for the first arm and the arms in engines of their own (5b1d70a).
        enable_prefix_caching=False,
    )
    compilation = {}
    if graphs_to:
        compilation["cudagraph_capture_sizes"] = capture_sizes(graphs_to)
    if cudagraph_mode:
        compilation["cudagraph_mode"] = cudagraph_mode
    if compilation:
        kwargs["compilation_config"] = compilation
    if max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = max_num_batched_tokens
    return kwargs


def seeded_params(max_tokens: int, count: int, offset: int) -> list:
    """Greedy sampling parameters for the ``count`` prompts of ``sweep_prompts(count,
    offset)``, each with a seed of its own that every arm gives the same prompt. Calibrated
    synthetic acceptance draws from the seed and the draft's position (common random
    numbers: :mod:`vllm_dspark.bench.synthetic`), so arms meet the same draws; greedy
    outputs do not read the seed."""
    from vllm import SamplingParams

    return [
        SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, seed=(offset << 20) + i
        )
        for i in range(count)
    ]


def sweep_prompts(
    count: int, offset: int, prompt_len: int, stream: list[int] | None = None
) -> list[dict]:
    """``count`` token-id prompts of ``prompt_len`` tokens, distinct per ``offset``: windows
    of ``stream`` (text the pair's drafter should know) 11 tokens apart, so that no two
    share a first 16-token cache block; without a stream, arithmetic id sequences (dummy
    weights predict nothing anyway)."""
    if stream is None:
        return [
            {"prompt_token_ids": [3 + (13 * i + j + offset) % 4000 for j in range(prompt_len)]}
            for i in range(count)
        ]
    starts = len(stream) - prompt_len
    return [
        {"prompt_token_ids": stream[start : start + prompt_len]}
        for start in (11 * (offset * 131 + i) % starts for i in range(count))
    ]


def heldout_stream() -> list[int]:
    """The embedded pair's held-out prompts end to end: in-distribution text whose
    confidences mean something (the arithmetic prompts are noise to a trained drafter)."""
    from vllm_dspark.demo import load_prompts

    return [token for prompt in load_prompts(num_prompts=None) for token in prompt]


def conditional_rates(unconditional: list[float]) -> list[float]:
    """P(draft k accepted | drafts before it were) from P(drafts 1..k accepted)."""
    return [u / (unconditional[k - 1] if k else 1.0) for k, u in enumerate(unconditional)]


def speculative_config(spec: dict) -> dict | None:
    """The arm's speculative config: its options on K drafts of its method's drafter, with
    synthetic acceptance on dummy weights (None: no speculation). A drafter of None (a
    DeepSeek-V4 shape) names no model: vLLM then takes the DSpark module from the target's
    checkpoint."""
    if spec["options"] is None:
        return None
    options = dict(spec["options"])
    method = options.pop("method", "dspark")
    draft = spec["draft"] if method == "dspark" else spec["dflash"]
    num_drafts = spec["num_drafts"]
    speculative = {"method": method, "num_speculative_tokens": num_drafts}
    if draft is not None:
        speculative["model"] = draft
    if spec["dummy"]:
        rates = [float(r) for r in spec["rates"].split(",")][:num_drafts]
        if spec["acceptance"] == "confidence" and method == "dspark":
            speculative["dspark_synthetic_confidence"] = conditional_rates(rates)
        else:
            speculative |= {
                "rejection_sample_method": "synthetic",
                "synthetic_acceptance_rates": rates,
            }
    return speculative | options


class Engine:
    """One arm's running engine (``LLM()``, greedy, EOS ignored) and what measuring it
    needs: its prompts and its counters."""

    def __init__(self, spec: dict):
        from vllm import LLM, SamplingParams

        self.spec = spec
        self.speculative = speculative_config(spec)
        if self.speculating:
            # admission_counts_per_rank() reads the speculators' counters in the workers.
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        started = time.monotonic()  # not perf_counter: the tests' fake clock times batches
        kwargs = engine_kwargs(
            spec["target"],
            spec["dummy"],
            spec.get("graphs_to"),
            spec.get("tensor_parallel_size", 1),
            spec.get("max_num_batched_tokens"),
            spec.get("max_num_seqs", 256),
            spec.get("gpu_memory_utilization", 0.85),
            spec.get("kv_cache_memory_bytes"),
            spec.get("cudagraph_mode"),
        )
        # What the pair needs beyond (DSV4_ENGINE for a DeepSeek-V4 shape).
        kwargs |= spec.get("engine") or {}
        self.llm = LLM(**kwargs, speculative_config=self.speculative)
        self.engine_start_s = round(time.monotonic() - started, 1)
        self.params = SamplingParams(
            temperature=0.0, max_tokens=spec["output_len"], ignore_eos=True
        )
        self.warm_params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        self.stream = heldout_stream() if spec["prompts"] == "heldout" else None
        self.llm.generate(self.prompts(8, 0), self.params, use_tqdm=False)
        # One unrecorded pass over every concurrency first, in every engine. In the dflash
        # run at 851bbd0 the arms measured first in an engine (stock DFlash, and the first
        # arm of the shared one) took 157-166 ms to a first token at 64 requests where the
        # later arms of the shared engine took 65-74 ms; and capacity control fits its
        # step costs while serving (step_overhead.py): that first arm, fitted at one
        # request only, verified 3.2 drafts per request at 256 where later arms verified
        # 2.0. (The prompts of the concurrency's own warm-up below, which no measured
        # prompt shares.)
        for concurrency in spec["concurrency"]:
            self.llm.generate(
                self.prompts(concurrency, 50_000 + concurrency), self.params, use_tqdm=False
            )

    @property
    def speculating(self) -> bool:
        return self.speculative is not None

    def prompts(self, count: int, offset: int) -> list[dict]:
        return sweep_prompts(count, offset, self.spec["prompt_len"], self.stream)

    def counters(self) -> tuple:
        """(spec-decode counts, engine steps, first tokens, their seconds, admission counts
        per rank) so far."""
        from vllm_dspark.metrics import (
            ITERATION_TOKENS,
            TIME_TO_FIRST_TOKEN,
            AdmissionCounts,
            SpecDecodeCounts,
            admission_counts_per_rank,
            histogram_totals,
        )

        metrics = self.llm.get_metrics()
        per_rank = admission_counts_per_rank(self.llm) if self.speculating else [AdmissionCounts()]
        steps, _ = histogram_totals(metrics, ITERATION_TOKENS)
        firsts, first_seconds = histogram_totals(metrics, TIME_TO_FIRST_TOKEN)
        return SpecDecodeCounts.from_metrics(metrics), steps, firsts, first_seconds, per_rank

    def per_wave(self, concurrency: int) -> tuple[int, int]:
        """(requests a wave submits, waves a repeat runs). --refill: a wave submits refill x
        concurrency requests to an engine that runs ``concurrency`` at once; waiting ones
        join as others finish. Below min_requests, a repeat is several such waves one after
        another: one 128-token request verifies too few drafts for its acceptance (and so
        its throughput) to be more than noise."""
        per_wave = concurrency * self.spec.get("refill", 1)
        return per_wave, -(-self.spec["min_requests"] // per_wave)

    def since(self, before: tuple) -> tuple:
        """What the counters (:meth:`counters`) counted since ``before``."""
        return combine_counted(operator.sub, self.counters(), before)

    def begin(self, concurrency: int) -> tuple:
        """Before a concurrency's repeats: a short warm-up at that batch size (a batch size
        not run before can compile kernels, Triton specialising on sizes, which the short
        runs at low concurrency would otherwise count); returns the counters then."""
        warm = self.prompts(concurrency, 50_000 + concurrency)
        self.llm.generate(warm, self.warm_params, use_tqdm=False)
        return self.counters()

    def timed_repeat(self, concurrency: int, repeat: int) -> float:
        """One timed repeat's output tokens per second, on fresh prompts."""
        per_wave, waves = self.per_wave(concurrency)
        tokens, seconds = 0, 0.0
        for wave in range(waves):
            # Offsets 7 apart: no prompt starts like an earlier one's (no cache).
            offset = concurrency + 7 * (repeat * waves + wave)
            batch = self.prompts(per_wave, offset)
            seeded = seeded_params(self.spec["output_len"], per_wave, offset)
            start = time.perf_counter()
            outputs = self.llm.generate(batch, seeded, use_tqdm=False)
            seconds += time.perf_counter() - start
            tokens += sum(len(out.outputs[0].token_ids) for out in outputs)
        return round(tokens / seconds, 1)

    def row(self, concurrency: int, tok_s: list[float], counted: tuple) -> dict:
        """A concurrency's row after its repeats (``tok_s``), with what the counters counted
        over them (:meth:`since`); then the first repeat's first wave once more, untimed
        and outside the counters, step by step: as the front end receives them and, with
        speculation, what capacity control decided in each decode step."""
        from vllm_dspark.bench.engine_control import trace_steps
        from vllm_dspark.metrics import gate_inputs

        counts, steps, firsts, first_seconds, per_rank = counted
        admitted = per_rank[0]
        per_wave, waves = self.per_wave(concurrency)
        if self.speculating:
            trace_steps(self.llm, True)
        with step_timeline(self.llm) as timeline:
            offset = concurrency  # repeat 0, wave 0
            self.llm.generate(
                self.prompts(per_wave, offset),
                seeded_params(self.spec["output_len"], per_wave, offset),
                use_tqdm=False,
            )
        decisions = trace_steps(self.llm, False) if self.speculating else None
        row = {
            "concurrency": concurrency,
            "tok_s": statistics.median(tok_s),
            "tok_s_repeats": tok_s,
            "acceptance_length": counts.acceptance_length if counts.drafts else None,
            # Prefill steps included: the tail of slow requests shows here, the prefill
            # phase in the time to first token.
            "engine_steps_per_batch": steps / (len(tok_s) * waves),
            "mean_ttft_s": first_seconds / max(firsts, 1),
            # Per request and step, compacted steps only (else all K).
            "admitted_per_req": admitted.admitted_per_request if self.speculating else None,
            "admission": asdict(admitted),
            "spec_decode": asdict(counts),
            "engine_start_s": self.engine_start_s,
            "timeline": timeline_summary(timeline, per_wave),
        }
        if self.spec.get("refill"):
            row["refill"] = self.spec["refill"]
        if decisions:
            row["timeline"]["decode_steps"] = decisions
        if self.speculating and len(per_rank) > 1:
            row["ranks_agree"] = all(counts == admitted for counts in per_rank)
        gate = gate_inputs(self.llm) if self.speculating else {}
        if gate:
            row["gate"] = gate
        return row

    def greedy_outputs(self, concurrency: int) -> list[list[int]] | None:
        """--greedy-check: the first repeat's first wave at ``concurrency`` once more,
        untimed, its drafts accepted as the target's greedy choice (calibrated synthetic
        confidence, which accepts a draft by a draw, switched off around it: capacity
        control still decides what is verified); each request's token ids. None under
        vLLM's synthetic rates, which a running engine cannot switch off."""
        speculative = self.speculative or {}
        if speculative.get("rejection_sample_method") == "synthetic":
            return None
        synthetic = "dspark_synthetic_confidence" in speculative
        per_wave, _ = self.per_wave(concurrency)
        offset = concurrency  # repeat 0, wave 0
        if synthetic:
            accept_by_target(self.llm, True)
        outputs = self.llm.generate(
            self.prompts(per_wave, offset),
            seeded_params(self.spec["output_len"], per_wave, offset),
            use_tqdm=False,
        )
        if synthetic:
            accept_by_target(self.llm, False)
        return [list(out.outputs[0].token_ids) for out in outputs]


def combine_counted(op, first: tuple, second: tuple) -> tuple:
    """Two tuples of :meth:`Engine.counters` combined field by field (the last, per rank):
    ``operator.sub`` for what a run counted, ``operator.add`` for two runs' counts
    together (an arm's interleaved repeats)."""
    per_rank = [op(a, b) for a, b in zip(first[4], second[4], strict=True)]
    return (*(op(a, b) for a, b in zip(first[:4], second[:4], strict=True)), per_rank)


def _worker_accept_by_target(worker, target: bool) -> bool:
    """Runs in the worker: verification accepts drafts as vLLM's rejection sampler does
    (``target``: greedy, the target's argmax) or, again, by the speculator's calibrated
    synthetic confidences (:mod:`vllm_dspark.bench.synthetic_acceptance`). False where the
    speculator draws none (nothing to switch)."""
    from vllm_dspark.bench import synthetic_acceptance
    from vllm_dspark.patches.wrapping import original

    speculator = worker.model_runner.speculator
    if getattr(speculator, "synthetic", None) is None:
        return False
    sampler = sys.modules[synthetic_acceptance.SAMPLER_MODULE]
    if target:
        sampler.rejection_sample = original(sampler, "rejection_sample")
    else:
        synthetic_acceptance.apply(speculator)
    return True


def accept_by_target(llm, target: bool) -> None:
    """Every rank's verification accepts drafts as the target chooses (``target``) or by
    the calibrated synthetic confidences (:func:`_worker_accept_by_target`); refuses an
    engine that draws none."""
    if not all(llm.collective_rpc(_worker_accept_by_target, args=(target,))):
        raise RuntimeError("accept_by_target: the engine draws no synthetic confidences")


def run_arm_here(spec: dict) -> None:
    """In the arm's own process: one engine, every concurrency, one JSON line each."""
    from vllm_dspark.bench.engine_control import switch_capacity

    engine = Engine(spec)
    if spec.get("interleave") and spec.get("switch"):
        run_interleaved(engine, spec)
        return
    # One arm, or (--shared-engine) several capacity arms switched in this engine; with
    # --mirror each twice, its rows numbered by pass.
    switch = spec.get("switch") or [[None, None]]
    mirrored = len({name for name, _ in switch}) < len(switch)
    passes: collections.Counter = collections.Counter()
    printed = 0  # rows so far: a GREEDY line names its row by this count
    for name, updates in switch:
        passes[name] += 1
        if updates is not None:
            switch_capacity(engine.llm, **updates)
            engine.llm.generate(engine.prompts(8, 1), engine.params, use_tqdm=False)
        first_row = printed
        for concurrency in spec["concurrency"]:
            measuring = time.monotonic()
            before = engine.begin(concurrency)
            tok_s = [engine.timed_repeat(concurrency, r) for r in range(spec["repeats"])]
            row = engine.row(concurrency, tok_s, engine.since(before))
            row["wall_s"] = round(time.monotonic() - measuring, 1)
            if mirrored:
                row["pass"] = passes[name]
            print("ROW " + json.dumps(row | ({"arm": name} if name else {})), flush=True)
            printed += 1
        if spec.get("greedy_check"):
            # After the arm's every row: a controller that learns from acceptance would
            # carry the check's into the next concurrency's measurement.
            for index, concurrency in enumerate(spec["concurrency"], first_row):
                token_ids = engine.greedy_outputs(concurrency)
                if token_ids is not None:
                    check = {"row": index, "token_ids": token_ids}
                    print("GREEDY " + json.dumps(check), flush=True)


def run_interleaved(engine: Engine, spec: dict) -> None:
    """--interleave: a shared engine's arms measured in turn. At each concurrency, repeat r
    of every arm (switched to in order on even repeats, in reverse on odd ones) before
    repeat r + 1 of any, on the same prompts, so that a drift over the engine's life meets
    every arm alike; each row adds ``paired``, its median ratio to every other arm of the
    engine over repeats of the same index. Rows come by concurrency, then arm."""
    from vllm_dspark.bench.engine_control import switch_capacity

    switch, current = spec["switch"], None
    names = [name for name, _ in switch]

    def switch_to(name: str, updates: dict) -> None:
        nonlocal current
        if name != current:
            switch_capacity(engine.llm, **updates)
            engine.llm.generate(engine.prompts(8, 1), engine.params, use_tqdm=False)
            current = name

    for concurrency in spec["concurrency"]:
        engine.begin(concurrency)
        tok_s: dict[str, list[float]] = {name: [] for name in names}
        counted: dict[str, tuple] = {}
        seconds = dict.fromkeys(names, 0.0)  # each arm's share of the measurement (wall_s)
        for repeat in range(spec["repeats"]):
            for name, updates in switch if repeat % 2 == 0 else switch[::-1]:
                measuring = time.monotonic()
                switch_to(name, updates)
                before = engine.counters()
                tok_s[name].append(engine.timed_repeat(concurrency, repeat))
                since = engine.since(before)
                if name in counted:
                    since = combine_counted(operator.add, counted[name], since)
                counted[name] = since
                seconds[name] += time.monotonic() - measuring
        for name, updates in switch:
            measuring = time.monotonic()
            switch_to(name, updates)
            row = engine.row(concurrency, tok_s[name], counted[name])
            row["paired"] = {
                other: round(paired_ratio(tok_s[name], tok_s[other]), 4)
                for other in names
                if other != name
            }
            row["wall_s"] = round(seconds[name] + time.monotonic() - measuring, 1)
            print("ROW " + json.dumps(row | {"arm": name}), flush=True)
    if spec.get("greedy_check"):
        for position, (name, updates) in enumerate(switch):
            switch_to(name, updates)
            for index, concurrency in enumerate(spec["concurrency"]):
                token_ids = engine.greedy_outputs(concurrency)
                if token_ids is not None:
                    row = index * len(names) + position
                    print("GREEDY " + json.dumps({"row": row, "token_ids": token_ids}), flush=True)


def run_lockstep_here(spec: dict) -> None:
    """In the arm's own process, beside the other arms' (--lockstep): the engine starts,
    says READY, then measures what the sweep's driver asks on stdin, one JSON command a
    line: {"do": "begin" | "time" | "row", "concurrency": c, "repeat": r}, answering each
    on a line of its own (OK, TIMED tok/s, ROW {...}). EOF ends it."""
    engine = Engine(spec)
    print("READY", flush=True)
    measured: dict[int, tuple[tuple, list[float]]] = {}
    for line in sys.stdin:
        command = json.loads(line)
        concurrency = command["concurrency"]
        if command["do"] == "begin":
            measured[concurrency] = (engine.begin(concurrency), [])
            print("OK", flush=True)
        elif command["do"] == "time":
            tok_s = engine.timed_repeat(concurrency, command["repeat"])
            measured[concurrency][1].append(tok_s)
            print(f"TIMED {tok_s}", flush=True)
        else:
            before, tok_s = measured.pop(concurrency)
            row = engine.row(concurrency, tok_s, engine.since(before))
            print("ROW " + json.dumps(row), flush=True)


@contextmanager
def step_timeline(llm) -> Iterator[list[list[float]]]:
    """Every engine step of the ``generate`` calls inside, as the front end receives its
    outputs: [ms since entry, requests given tokens, tokens, first tokens, requests
    finished]. Wraps the engine's output processor on this instance only, for the block."""
    processor = llm.llm_engine.output_processor
    process, seen, steps = processor.process_outputs, set(), []
    start = time.perf_counter()

    def record(outputs, *args, **kwargs):
        if outputs:  # not a message that carries only statistics
            firsts = {out.request_id for out in outputs if out.new_token_ids} - seen
            seen.update(firsts)
            steps.append(
                [
                    round((time.perf_counter() - start) * 1e3, 2),
                    len(outputs),
                    sum(len(out.new_token_ids) for out in outputs),
                    len(firsts),
                    sum(out.finished for out in outputs),
                ]
            )
        return process(outputs, *args, **kwargs)

    processor.process_outputs = record
    try:
        yield steps
    finally:
        del processor.process_outputs  # the class's method again


def timeline_summary(steps: list[list[float]], requests: int) -> dict:
    """Where one batch's time went (:func:`step_timeline`): until every request had its
    first token (the prefill phase), until half of them had finished, and to the last
    token; the median time of a step after that (the host's pace: at 78ed08b one arm's
    traced steps took 2.82 ms in one pass and 4.13 in the next); the steps themselves too.
    A batch lasts as long as its slowest request: the time past half finished is the tail
    that speculation's uneven progress adds."""
    firsts = finished = 0
    first_tokens_ms = half_finished_ms = None
    decoding = []  # when each step after every first token ended
    for ms, _, _, new_firsts, new_finished in steps:
        firsts, finished = firsts + new_firsts, finished + new_finished
        if first_tokens_ms is None and firsts >= requests:
            first_tokens_ms = ms
        if first_tokens_ms is not None:
            decoding.append(ms)
        if half_finished_ms is None and 2 * finished >= requests:
            half_finished_ms = ms
    intervals = [later - earlier for earlier, later in itertools.pairwise(decoding)]
    return {
        "engine_steps": len(steps),
        "first_tokens_ms": first_tokens_ms,
        "half_finished_ms": half_finished_ms,
        "last_token_ms": steps[-1][0] if steps else None,
        "decode_step_ms": round(statistics.median(intervals), 3) if intervals else None,
        "steps": steps,
    }


def shared_engine_plan(
    arms: list[str], sps_curve: str | None, deepseek_v4: bool = False
) -> tuple[dict, list]:
    """Start-up options that prepare every capacity arm of one engine (compaction, depth
    graphs, the SPS profile, their common :func:`startup_options`) and, per arm, the
    options switched to (``dspark_`` prefix dropped). Masked arms without compact ones
    start masked (a target whose attention refuses compact verification would refuse the
    engine). An engine with compact arms captures depth graphs (any depth arm can then be
    switched to); a masked one, or a DeepSeek-V4 one (``deepseek_v4``: its DSpark module
    runs as its GPU tests run it, without them), only where one of its arms drafts by
    depth."""
    verifies = {verification(ARMS[arm]) for arm in arms}
    masked_only = "masked" in verifies and "compact" not in verifies
    start = {"dspark_capacity": "sps", "dspark_varlen_verify": not masked_only}
    by_depth = any(ARMS[arm].get("dspark_dynamic_depth") for arm in arms)
    if by_depth or not (masked_only or deepseek_v4):
        start["dspark_dynamic_depth"] = True
    if ARMS[arms[0]].get("method") == "dflash":
        start["dspark_capacity"] = "acceptance"
    start |= startup_options(arms[0])
    if any(ARMS[arm].get("dspark_plain_steps") for arm in arms):
        start["dspark_plain_steps"] = True  # its one-token decode graphs are captured at start
    if sps_curve:
        start["dspark_sps_curve"] = sps_curve
    switch = []
    for arm in arms:
        # Options an arm leaves out go back to their defaults (dynamic_depth off): naming
        # dynamic_depth for the acceptance arm would be refused, as that mode never reads it.
        fixed = startup_options(arm)
        updates = {
            key.removeprefix("dspark_"): value
            for key, value in ARMS[arm].items()
            if key not in fixed
        }
        if arm.startswith("sps") and sps_curve:
            updates["sps_curve"] = sps_curve
        switch.append([arm, updates])
    return start, switch


def verification(options: dict | None) -> str:
    """How an arm with these options verifies its drafts (a row's ``verify``): "compact"
    (a capacity mode with dspark_varlen_verify: only the admitted drafts run), "masked" (a
    capacity mode without: the target runs every draft, those not admitted are not
    verified), "none" (no capacity control: no speculation, or every draft verified as
    stock vLLM verifies them)."""
    if not options or options.get("dspark_capacity", "off") == "off":
        return "none"
    return "compact" if options.get("dspark_varlen_verify") else "masked"


def startup_options(arm: str) -> dict:
    """The options of ``arm`` that a running engine cannot switch: the method and what is
    built at start-up (an FP8 head, a draft vocabulary, FP8 drafter layers)."""
    from vllm_dspark.bench.engine_control import SWITCHABLE

    options = ARMS[arm] or {}
    return {
        key: value
        for key, value in options.items()
        if key.removeprefix("dspark_") not in SWITCHABLE
    }


def engine_runs(
    arms: list[str], shared_engine: bool, sps_curve: str | None, deepseek_v4: bool = False
) -> list[list]:
    """[label, start-up options, switches or None], one per engine, in the order of each
    engine's first arm. With ``shared_engine``, capacity arms with the same
    :func:`startup_options` share one engine (two or more of them; one alone runs as
    itself; ``deepseek_v4``: :func:`shared_engine_plan`'s)."""
    groups: dict[str, list[str]] = {}
    for arm in arms:
        if shared_engine and "dspark_capacity" in (ARMS[arm] or {}):
            groups.setdefault(json.dumps(startup_options(arm), sort_keys=True), []).append(arm)
    runs = []
    for arm in arms:
        group = next((g for g in groups.values() if arm in g), [arm])
        if len(group) == 1:
            runs.append([arm, ARMS[arm], None])
        elif arm == group[0]:
            runs.append(["+".join(group), *shared_engine_plan(group, sps_curve, deepseek_v4)])
    return runs


def check_deepseek_v4_arms(parser: argparse.ArgumentParser, arms: list[str]) -> None:
    """A DeepSeek-V4 shape drafts with its DSpark module only: no DFlash arm."""
    refused = [arm for arm in arms if (ARMS[arm] or {}).get("method") == "dflash"]
    if refused:
        parser.error(
            f"DeepSeek-V4 shapes draft with their DSpark module only; not {', '.join(refused)}"
        )


def check_num_drafts(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--num-drafts other than 7 needs a dummy shape (a drafter written for that block), a
    rate per draft, and no arm whose options assume K = 7."""
    if args.num_drafts == 7:
        return
    if args.pair == "embedded":
        parser.error("--num-drafts: the embedded pair's drafter has a block of 7")
    num_rates = len(args.rates.split(","))
    if not 1 <= args.num_drafts <= num_rates:
        parser.error(
            f"--num-drafts {args.num_drafts}: --rates has a rate for drafts 1 to {num_rates}"
        )
    if "dynamic-sd" in args.arms.split(","):
        parser.error("--num-drafts: the dynamic-sd arm's table is for K = 7")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="embedded", choices=["embedded", *SHAPES, *DSV4])
    parser.add_argument("--arms", default="nospec,dspark")
    parser.add_argument("--concurrency", default="1,16,64,256")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rates", default=DEFAULT_RATES)
    parser.add_argument(
        "--num-drafts",
        type=int,
        default=7,
        help="K of every speculating arm (dummy shapes only: their drafts are written with "
        "a block of K; the embedded pair's is 7)",
    )
    parser.add_argument("--acceptance", choices=["rates", "confidence"], default="rates")
    parser.add_argument("--sps-curve", help="curve JSON for the sps arm (default: auto)")
    parser.add_argument(
        "--shared-engine",
        action="store_true",
        help="run the DSpark capacity arms in one engine, switching options between them",
    )
    parser.add_argument(
        "--graphs-to", type=int, help="capture CUDA graphs up to this many tokens (every arm)"
    )
    parser.add_argument(
        "--cudagraph-mode",
        help="vLLM's CUDA-graph mode for every arm, e.g. FULL_DECODE_ONLY (DeepSeek-V4's "
        "PIECEWISE graphs fault under DSpark on vLLM 0.26.0: docs/design/deepseek-v4.md)",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs per concurrency (the median counts)"
    )
    parser.add_argument(
        "--min-requests",
        type=int,
        default=16,
        help="requests per repeat at least: below it, waves of --concurrency one after another",
    )
    parser.add_argument(
        "--prompts",
        choices=["heldout", "arithmetic"],
        help="heldout: windows of the embedded pair's held-out text (default with --pair "
        "embedded); arithmetic: id sequences (default with dummy weights)",
    )
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help="vLLM's max_num_batched_tokens for every arm (default: vLLM's). Speculation "
        "holds (K - 1) x max_num_seqs of it for drafting slots, so a speculating arm "
        "schedules that much less per step (14,848 of 16,384 at K=7, 256 sequences), and "
        "256 prompts of 128 tokens take it one more prefill step (20,480 did not save it "
        "on the H200, 47bc5ae: the first step takes the few prompts already arrived)",
    )
    parser.add_argument(
        "--refill",
        type=int,
        help="steady load instead of one batch: each wave submits REFILL x concurrency "
        "requests to engines that run at most the concurrency at once (max_num_seqs), so "
        "waiting requests join as others finish and most steps carry a prompt beside the "
        "decoding requests, as in a server under load (one concurrency)",
    )
    parser.add_argument(
        "--bracket",
        action="store_true",
        help="run the first engine again after the others: its two runs' rows (bracket "
        "first / last) show how far the machine drifted between engines",
    )
    parser.add_argument(
        "--mirror",
        action="store_true",
        help="a shared engine runs its arms again in reverse order (A B C C B A): each arm's "
        "two passes (pass 1 / 2) average out a drift over the engine's life (at 9da6cdd, "
        "one request, the embedded pair's arms ran faster the later they came)",
    )
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="a shared engine takes its arms' timed repeats in turn: at each concurrency, "
        "repeat r of every arm before repeat r + 1 of any, on the same prompts; rows add "
        "their paired ratios to the engine's other arms (a drift over the engine's life, "
        "or a 1%% difference, then shows in the pairs, not between whole arms)",
    )
    parser.add_argument(
        "--lockstep",
        action="store_true",
        help="every arm's engine started and alive at once (each with its share of the GPU "
        "and a fixed KV cache), their "
        "timed repeats taken in turn: repeat r of every arm before repeat r + 1 of any, "
        "on the same prompts, so that the machine's drift meets every arm alike; an arm "
        "named twice runs in two engines (the noise floor)",
    )
    parser.add_argument(
        "--lockstep-kv-cache-gib",
        type=float,
        default=2.0,
        help="--lockstep: each engine's KV cache, fixed, since the engines start at once "
        "(the embedded pair keeps 4 KiB a token: 2 GiB hold 512k)",
    )
    parser.add_argument(
        "--greedy-check",
        action="store_true",
        help="after each arm's rows, the first wave of every concurrency once more, "
        "untimed, drafts accepted as the target's greedy choice: rows then say whether "
        "their outputs were no speculation's (greedy_identical; needs the nospec arm)",
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--arm-spec", help=argparse.SUPPRESS)  # the per-arm subprocess
    args = parser.parse_args()
    if args.arm_spec:
        spec = json.loads(args.arm_spec)
        (run_lockstep_here if spec.get("lockstep") else run_arm_here)(spec)
        return 0
    if args.lockstep and (args.shared_engine or args.mirror or args.bracket or args.greedy_check):
        parser.error(
            "--lockstep: every arm has an engine of its own, all measured in turn "
            "(no --shared-engine, --mirror, --bracket or --greedy-check)"
        )

    if args.interleave and (not args.shared_engine or args.mirror):
        parser.error("--interleave: the arms of a shared engine (--shared-engine, no --mirror)")
    check_num_drafts(parser, args)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    if args.refill and len(concurrencies) != 1:
        parser.error("--refill: one concurrency (it is the engines' max_num_seqs)")
    arms = args.arms.split(",")
    if args.pair in DSV4:
        check_deepseek_v4_arms(parser, arms)
    if args.pair == "embedded":
        from vllm_dspark.demo import EMBEDDED_PAIR

        paths = {name: str(EMBEDDED_PAIR / name) for name in ("target", "draft")}
        paths["dflash"] = None  # the embedded pair has no DFlash drafter
    elif args.pair in DSV4:
        # One folder: the target, whose checkpoint holds its DSpark module (no DFlash).
        target = write_deepseek_v4_shape(args.pair, shape_root("offline"))
        paths = {"target": target, "draft": None, "dflash": None}
    else:
        folder = shape_root("offline") / f"{args.pair}-k{args.num_drafts}"
        paths = write_shape(args.pair, folder, block=args.num_drafts)
    curve = str(Path(args.sps_curve).resolve()) if args.sps_curve else None
    runs = engine_runs(arms, args.shared_engine, curve, deepseek_v4=args.pair in DSV4)
    if args.mirror:
        runs = [[label, start, switch and switch + switch[::-1]] for label, start, switch in runs]
    if args.bracket:
        runs.append(list(runs[0]))
    setup = args.pair if args.pair == "embedded" else f"{args.pair}/{args.acceptance}"
    # Asked once, before any engine: not from the middle of the first engine's rows, which
    # this process now records as they come.
    device_name()
    rows, failed, engines = [], {}, []
    checks: dict[int, list[list[int]]] = {}  # --greedy-check's outputs by row
    copies: collections.Counter = collections.Counter()
    for position, (label, options, switch) in enumerate(runs):
        bracket = {}
        if args.bracket and position in (0, len(runs) - 1):
            bracket = {"bracket": "first" if position == 0 else "last"}
        if label.startswith("sps") and curve and switch is None:
            options = options | {"dspark_sps_curve": curve}
        spec = {
            **paths,
            "dummy": args.pair != "embedded",
            "acceptance": args.acceptance,
            "options": options,
            "switch": switch,
            "rates": args.rates,
            "num_drafts": args.num_drafts,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "concurrency": concurrencies,
            "graphs_to": args.graphs_to,
            "cudagraph_mode": args.cudagraph_mode,
            "repeats": args.repeats,
            "min_requests": args.min_requests,
            "prompts": args.prompts or ("heldout" if args.pair == "embedded" else "arithmetic"),
            "tensor_parallel_size": args.tensor_parallel_size,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "engine": DSV4_ENGINE if args.pair in DSV4 else {},
            "greedy_check": args.greedy_check,
            "interleave": args.interleave,
        }
        if args.refill:
            spec |= {"refill": args.refill, "max_num_seqs": concurrencies[0]}
        context = {"setup": setup, "shape": args.pair, "arm": label}
        context |= {**({"engine": label} if switch else {}), **bracket}
        if args.lockstep:
            # An arm named twice runs twice, side by side: how far two engines of one arm
            # differ is the noise floor of the others' differences.
            copies[label] += 1
            if copies[label] > 1:
                context["copy"] = copies[label]
            spec["gpu_memory_utilization"] = round(LOCKSTEP_MEMORY / len(runs), 3)
            spec["kv_cache_memory_bytes"] = int(args.lockstep_kv_cache_gib * (1 << 30))
            engines.append((context, spec))
            continue
        keep = functools.partial(keep_row, rows, failed, args.out, context)
        check = functools.partial(keep_greedy_check, rows, checks, failed, args.out, len(rows))
        returncode, errors = run_engine(spec, args.out, keep, check)
        if returncode != 0:
            # The other arms still run: one arm failing to start must not cost the rest.
            print(errors, file=sys.stderr)
            failed[label] = failure_line(errors, returncode)
            write_record(args.out, rows, failed)
    if engines:
        run_lockstep(engines, concurrencies, args.repeats, args.out, rows, failed)
    return 1 if failed else 0


def keep_row(rows: list[dict], failed: dict, out: Path, context: dict, row: dict) -> None:
    """Add an engine's row (its own arm name, in a shared engine, over the label's), with
    how its arm verifies and (until --greedy-check's outputs come) no greedy verdict, and
    rewrite the record."""
    rows.append(context | row)
    rows[-1] |= {"verify": verification(ARMS[rows[-1]["arm"]]), "greedy_identical": None}
    print(json.dumps(rows[-1]), flush=True)
    write_record(out, rows, failed)


def keep_greedy_check(
    rows: list[dict],
    checks: dict,
    failed: dict,
    out: Path,
    first_row: int,
    check: dict,
) -> None:
    """An engine's --greedy-check outputs for its row ``check["row"]`` (counted from the
    engine's first, ``first_row`` of the sweep): every checked row compared again
    (:func:`compare_greedy`), the record rewritten."""
    index = first_row + check["row"]
    checks[index] = check["token_ids"]
    compare_greedy(rows, checks)
    row = rows[index]
    if row["greedy_identical"] is not None:
        identical, requests = row["greedy_identical_requests"], len(checks[index])
        print(f"greedy: {row['arm']} at {row['concurrency']}: {identical} of {requests} identical")
    write_record(out, rows, failed)


def compare_greedy(rows: list[dict], checks: dict[int, list[list[int]]]) -> None:
    """Each checked row's outputs against those of the first checked ``nospec`` row of its
    concurrency (the same prompts): ``greedy_identical``, the requests whose outputs were
    identical, and [request, first differing position] of the others."""
    reference = {}
    for index in sorted(checks):
        if rows[index]["arm"] == "nospec":
            reference.setdefault(rows[index]["concurrency"], checks[index])
    for index, outputs in checks.items():
        theirs = reference.get(rows[index]["concurrency"])
        if theirs is None:
            continue
        differing = [
            [request, first_difference(mine, their)]
            for request, (mine, their) in enumerate(zip(outputs, theirs, strict=True))
            if mine != their
        ]
        rows[index] |= {
            "greedy_identical": not differing,
            "greedy_identical_requests": len(outputs) - len(differing),
            "greedy_divergences": differing,
        }


# The engine's log lines (vLLM logs to stdout) passed on to the sweep's own output: the
# plugin's, and vLLM's start-up phases and their times, which say where a first engine's
# minutes went (gpu_stage.sh's quiet() keeps the same lines).
START_UP_LINES = re.compile(
    r"vllm-dspark:|\btook\b|\btakes\b|finished in|compiled \d+ units|Warming up|bytecode transform"
)


def run_engine(spec: dict, out: Path, keep, check=None) -> tuple[int, str]:
    """One engine in a process of its own; each row goes to ``keep`` as soon as the engine
    prints it, each --greedy-check result to ``check``, each :data:`START_UP_LINES` line to
    this process's output. Returns the exit code and :func:`failure_excerpt` of the
    engine's stderr."""
    # stderr to a file: vLLM logs more than a pipe holds while stdout is being read.
    with tempfile.TemporaryFile(mode="w+") as errors:
        with subprocess.Popen(
            arm_command(spec, out), stdout=subprocess.PIPE, stderr=errors, text=True
        ) as engine:
            for line in engine.stdout:
                if line.startswith("ROW "):
                    keep(json.loads(line[4:]))
                elif line.startswith("GREEDY ") and check is not None:
                    check(json.loads(line[7:]))
                elif START_UP_LINES.search(line):
                    print(line, end="", flush=True)
        errors.seek(0)
        return engine.returncode, failure_excerpt(errors.read())


def arm_command(spec: dict, out: Path) -> list[str]:
    """This script, run as one arm's engine process (run_arm_here or run_lockstep_here)."""
    return [sys.executable, __file__, "--out", str(out), "--arm-spec", json.dumps(spec)]


class LockstepEngine:
    """The driver's end of a run_lockstep_here process."""

    def __init__(self, context: dict, spec: dict, out: Path, errors, caches: Path):
        self.context, self.errors = context, errors
        self.label = context["arm"] + (f"#{context['copy']}" if "copy" in context else "")
        # Compile caches of its own: engines compiling at once could read an entry that
        # another is still writing.
        env = os.environ | {
            "VLLM_CACHE_ROOT": str(caches / "vllm"),
            "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
        }
        self.process = subprocess.Popen(
            arm_command(spec | {"lockstep": True}, out),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            env=env,
        )

    def reply(self, expected: str) -> str | None:
        """The rest of the engine's next line that starts with ``expected`` (vLLM logs to
        stdout too); None if the engine exited first."""
        for line in self.process.stdout:
            if line.startswith(expected):
                return line[len(expected) :].strip()
        return None

    def ask(self, expected: str, **command) -> str | None:
        try:
            self.process.stdin.write(json.dumps(command) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            return None
        return self.reply(expected)

    def failure(self) -> str:
        """The error line of an engine that exited (after printing its excerpt)."""
        self.process.stdin.close()
        returncode = self.process.wait()
        self.errors.seek(0)
        excerpt = failure_excerpt(self.errors.read())
        print(excerpt, file=sys.stderr)
        return failure_line(excerpt, returncode)


def run_lockstep(
    engines: list[tuple[dict, dict]],
    concurrencies: list[int],
    repeats: int,
    out: Path,
    rows: list[dict],
    failed: dict[str, str],
) -> None:
    """--lockstep: each (context, spec) in a process of its own, all started at once
    (each with a fixed KV cache, see LOCKSTEP_MEMORY) and kept alive; then, per
    concurrency, every engine's repeat r before any engine's repeat r + 1 (in order on
    even repeats, in reverse on odd ones). Each row adds ``paired``: against every other
    engine, the median ratio of their repeats of the same index (the same prompts, run
    back to back)."""
    start = time.monotonic()
    with ExitStack() as stack:
        caches = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        running = []
        for index, (context, spec) in enumerate(engines):
            errors = stack.enter_context(tempfile.TemporaryFile(mode="w+"))
            engine = LockstepEngine(context, spec, out, errors, caches / str(index))
            stack.enter_context(engine.process)
            running.append(engine)

        def ready(engine: LockstepEngine) -> bool:
            if engine.reply("READY") is None:
                return False
            # the device log's only sign of progress until the first rows
            print(f"lockstep: {engine.label} ready at {time.monotonic() - start:.0f} s", flush=True)
            return True

        # Every engine's log read at once: one whose stdout pipe filled would stall its start.
        with ThreadPoolExecutor(len(running)) as pool:
            started = list(pool.map(ready, running))
        for engine, ok in zip(list(running), started, strict=True):
            if not ok:
                lost(engine, running, rows, failed, out)

        def ask_all(order: list[LockstepEngine], expected: str, **command) -> dict[str, str]:
            replies = {}
            for engine in order:
                reply = engine.ask(expected, **command)
                if reply is None:
                    lost(engine, running, rows, failed, out)
                else:
                    replies[engine.label] = reply
            return replies

        for concurrency in concurrencies:
            print(f"lockstep: {concurrency} at {time.monotonic() - start:.0f} s", flush=True)
            ask_all(list(running), "OK", do="begin", concurrency=concurrency)
            for repeat in range(repeats):
                order = running if repeat % 2 == 0 else running[::-1]
                ask_all(list(order), "TIMED ", do="time", concurrency=concurrency, repeat=repeat)
            replies = ask_all(list(running), "ROW ", do="row", concurrency=concurrency)
            measured = {label: json.loads(row) for label, row in replies.items()}
            labels = [engine.label for engine in running]  # those still running: each replied
            for engine in running:
                row = measured[engine.label]
                row["paired"] = {
                    other: round(paired_ratio(row["tok_s_repeats"], theirs["tok_s_repeats"]), 4)
                    for other, theirs in measured.items()
                    if other != engine.label
                }
                keep_row(rows, failed, out, engine.context | {"lockstep": labels}, row)
        # Every engine told to end at once: each Popen's exit closes its stdin and waits,
        # one engine's shutdown after another's.
        for engine in running:
            engine.process.stdin.close()


def lost(engine: LockstepEngine, running: list, rows: list, failed: dict, out: Path) -> None:
    """An engine that exited: out of the rotation, its error on the record."""
    running.remove(engine)
    failed[engine.label] = engine.failure()
    write_record(out, rows, failed)


def paired_ratio(mine: list[float], theirs: list[float]) -> float:
    """The median of the ratios of repeats of the same index."""
    return statistics.median(a / b for a, b in zip(mine, theirs, strict=True))


def failure_line(excerpt: str, returncode: int) -> str:
    """The error a failed engine's :func:`failure_excerpt` names: its engine core's last
    one where the core logged one (the front end's only says the core failed)."""
    lines = excerpt.splitlines()
    core = [line for line in lines if line.startswith("(EngineCore")]
    return next(
        (line for line in reversed(core or lines) if "Error" in line), f"exit code {returncode}"
    )


def failure_excerpt(stderr: str, tail: int = 3000, most: int = 80) -> str:
    """What to print of a failed engine's stderr: the last traceback its engine-core process
    logged (the root cause, which the front end's own traceback pushes out of a short tail;
    twice a failed start showed only "Engine core initialization failed", 2b4a3dc and
    ea69b9f), at most ``most`` lines, then the last ``tail`` characters."""
    core = [line for line in stderr.splitlines() if line.startswith("(EngineCore")]
    starts = [i for i, line in enumerate(core) if "Traceback (most recent call last)" in line]
    root = core[starts[-1] : starts[-1] + most] if starts else []
    return "\n".join([*root, "..."] if root else []) + stderr[-tail:]


@functools.cache
def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def write_record(path: Path, rows: list[dict], failed: dict[str, str]) -> None:
    """The record so far; ``failed``: the arms whose engine failed, each with the last error
    line it printed."""
    record = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "commit": os.environ.get("DSPARK_COMMIT", "unknown"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(),
        "rows": rows,
        **({"failed_arms": failed} if failed else {}),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    # Whole or not at all: the device queue may pack the file while a row is being added.
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(record, indent=2))
    partial.replace(path)


if __name__ == "__main__":
    sys.exit(main())
