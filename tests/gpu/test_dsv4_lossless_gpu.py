"""On a GPU: a DeepSeek-V4 target (the tiny-dsv4 shape: five layers of every attention and
routing kind, 16 experts, dummy weights) with its own DSpark module keeps the greedy
outputs of no speculation, under stock DSpark (k=7, the plugin inert) and under every
capacity mode, sps, budget, threshold and acceptance, switched in one engine: verified
masked (``dspark_varlen_verify=false``), in an engine started as offline_sweep starts its
masked arms (the timed ``dsv4`` stage's); and verified compacted
(``dspark_varlen_verify=true``, on Hopper only: patches/dsv4_compact.py), decode steps and
steps with prompts alike, every compacted decode step replayed from a FULL graph (a
compact graph, or a one-token graph where it admits no draft: verify/compact_graphs.py)
and steps with prompts run PIECEWISE.

The engine is served as vLLM 0.26.0 serves DeepSeek-V4 (offline_sweep.DSV4_ENGINE: an FP8
KV cache in blocks of 256; no "model" in the speculative config). The dummy folder holds
no confidence head, so the capacity modes draw calibrated synthetic confidences to decide
what is verified, and verification accepts what the target chooses
(offline_sweep.accept_by_target): synthetic confidence alone would accept the drafter's
tokens by a draw, whatever the target says.

What equality is asserted: the model runs in its config's bfloat16 with block-scaled FP8
linears (not float32: its weights are FP8), and a speculative step runs the target over 8
rows a request where no speculation runs one, so its GEMMs and attention round
differently; a greedy choice between two logits closer than that noise may flip. So an
output that differs must first do so where no speculation's top-two logit gap is a near
tie, at or below the ``TIE_PERCENTILE`` percentile of all its gaps (the scale of dummy
logits is not known ahead, so the threshold is read from them; no speculation returns
raw logits, since float32 log-probabilities of a near-uniform distribution, near -8.3,
resolve no gap below 1e-6), and at most ``MAX_DIVERGING`` of the prompts may differ; a
misplaced, unverified or wrongly accepted row derails at a gap of any size.

Dummy weights could make that comparison empty (vLLM's dummy loader leaves the MXFP4
experts zero and draws every other weight from +-1e-3): the test first checks that no
speculation's outputs differ between prompts and use many tokens, with finite margins
that are not all ties, and that the capacity arms verified fewer drafts than they
proposed (masked or compact verification of part of the drafts ran; compacted steps with
prompts among them). Needs the MoE bundle's dsv4 set (tools/device/moe_bundle.sh)."""

import math
import os
import statistics
import tempfile
from pathlib import Path

import pytest
from gpu_results import greedy_comparison, write_result
from offline_sweep import DSV4_ENGINE, shared_engine_plan
from pair_probe import run_dummy
from shapes import write_deepseek_v4_shape

# vLLM's CUDA-graph mode for every engine of the lossless tests, when set (gpu_stage.sh
# dsv4-lossless MODE): FULL_DECODE_ONLY runs whatever is not a uniform decode eagerly.
# (gpu_stage.sh dsv4-lossless breakable sets VLLM_USE_BREAKABLE_CUDAGRAPH=1 instead.)
GRAPH_MODE = os.environ.get("DSV4_CUDAGRAPH_MODE")
GRAPHS = {"compilation_config": {"cudagraph_mode": GRAPH_MODE}} if GRAPH_MODE else {}
ENGINE = DSV4_ENGINE | GRAPHS
NUM_PROMPTS, MAX_TOKENS, MAX_NUM_SEQS = 16, 32, 8
TIE_PERCENTILE, MAX_DIVERGING = 10, 3
# No speculation's outputs must use at least this many distinct tokens.
MIN_DISTINCT_TOKENS = 16
SYNTHETIC_CONFIDENCE = [0.8, 0.78, 0.77, 0.77, 0.76, 0.75, 0.76]
# Each capacity mode verified masked (varlen_verify false), as switched in a running engine.
MASKED_SWITCH = [
    ["sps", {"capacity": "sps", "varlen_verify": False}],
    ["budget", {"capacity": "budget", "budget_frac": 0.5, "varlen_verify": False}],
    ["threshold", {"capacity": "threshold", "confidence_threshold": 0.5, "varlen_verify": False}],
    ["acceptance", {"capacity": "acceptance", "varlen_verify": False}],
]
# The same modes verified compacted, started in sps as compact arms start.
COMPACT_START = {"dspark_capacity": "sps", "dspark_varlen_verify": True}
COMPACT_SWITCH = [[name, options | {"varlen_verify": True}] for name, options in MASKED_SWITCH]
# Arms that admit fewer drafts than proposed whatever the load: half the drafts, and a
# prefix survival (a product of confidences around 0.77) that falls below 0.5.
CUTTING_ARMS = ("budget", "threshold")


@pytest.fixture(scope="module")
def dsv4_folder() -> str:
    return write_deepseek_v4_shape("tiny-dsv4", Path(tempfile.mkdtemp()))


@pytest.fixture(autouse=True)
def model_routing(monkeypatch):
    """The model's own routers: the experts are zero, so no routing changes an output, but
    vLLM's simulated routing draws at random."""
    monkeypatch.delenv("VLLM_MOE_ROUTING_SIMULATION_STRATEGY", raising=False)


def prompts() -> list[list[int]]:
    """Prompts of 9 to 35 tokens, below the noise token (4095) of the shape's vocabulary."""
    return [
        [3 + (37 * i + 11 * j) % 4000 for j in range(9 + (7 * i) % 27)] for i in range(NUM_PROMPTS)
    ]


def run(folder: str, options: dict | None, engine: dict = ENGINE, **probe) -> dict:
    return run_dummy(
        folder,
        None,
        options,
        dtype="bfloat16",
        engine=engine,
        max_num_seqs=MAX_NUM_SEQS,
        prompts=prompts(),
        max_tokens=MAX_TOKENS,
        **probe,
    )


def output_spread(nospec: dict) -> dict:
    """What shows that no speculation's outputs can tell a wrong token from a right one:
    their distinct tokens and outputs, and their top-two logit gaps (``tie_gap``: the gap
    a divergence may start at)."""
    outputs = nospec["token_ids"]
    gaps = [gap for margins in nospec["margins"] for gap in margins]
    finite = all(map(math.isfinite, gaps))
    return {
        "distinct_tokens": len({token for ids in outputs for token in ids}),
        "distinct_outputs": len({tuple(ids) for ids in outputs}),
        "finite_gaps": finite,
        "median_gap": statistics.median(gaps) if finite else None,
        "tie_gap": statistics.quantiles(gaps, n=100)[TIE_PERCENTILE - 1] if finite else None,
    }


@pytest.fixture(scope="module")
def nospec(dsv4_folder) -> dict:
    """No speculation's outputs and their spread, once they are shown to tell a wrong
    token from a right one."""
    raw_logits = ENGINE | {"logprobs_mode": "raw_logits"}  # margins: logit gaps
    out = run(dsv4_folder, None, engine=raw_logits, margins=True)
    return {"out": out, "spread": output_spread(out)}


def check_nospec(nospec: dict) -> None:
    assert all(len(ids) == MAX_TOKENS for ids in nospec["out"]["token_ids"])
    # Outputs that could not tell a wrong token from a right one prove nothing: stop here.
    found = nospec["spread"]
    assert found["finite_gaps"] and found["median_gap"] > 0, found
    assert found["distinct_tokens"] >= MIN_DISTINCT_TOKENS, found
    assert found["distinct_outputs"] >= NUM_PROMPTS // 2, found


def capacity_arms(folder: str, start: dict, switch: list, nospec: dict) -> dict:
    capacity = run(
        folder,
        start | {"dspark_synthetic_confidence": SYNTHETIC_CONFIDENCE},
        switch=switch,
        accept_by_target=True,
    )
    assert capacity["accepted_by_target"]
    return {arm: greedy_comparison(out, nospec["out"]) for arm, out in capacity["arms"].items()}


def check_lossless(results: dict, nospec: dict) -> None:
    tie_gap = nospec["spread"]["tie_gap"]
    for arm, result in results.items():
        assert result["spec_decode"]["drafts"] > 0, arm
        divergences = result["first_divergences"]
        assert len(divergences) <= MAX_DIVERGING, (arm, divergences)
        assert all(d["gap"] <= tie_gap for d in divergences.values()), (arm, tie_gap, divergences)
    for arm in CUTTING_ARMS:
        admission = results[arm]["admission"]
        assert 0 < admission["admitted"] < admission["proposed"], (arm, admission)


def result_writer(name: str, command: str, arms: str, nospec: dict):
    """A function writing ``name`` (under DSPARK_RESULTS_DIR) with the setup, no
    speculation's spread and the results it is given."""
    record = {
        "setup": {
            "target": "tiny-dsv4 DeepSeek-V4 (5 layers, hidden 1024, 16 experts), dummy "
            "weights, its DSpark module (3 layers) from the same checkpoint",
            "engine": ENGINE | {"dtype": "bfloat16 (FP8 linears)"},
            "arms": arms,
            "sampling": "greedy",
        },
        "nospec": nospec["spread"],
    }

    def save(results: dict) -> None:
        write_result(name, command, record | {"result": results})

    return save


# Engines stock DSpark must run in. On an H100 (6e7cb70) the eager one ran and vLLM's
# default graphs (FULL and PIECEWISE, 1,024 or 8,192 tokens) faulted in the first PIECEWISE
# replay: "piecewise" waits for each of its segments, to name the one that faults;
# "piecewise-no-draft-graphs" captures no draft graphs (captured after the target's, in
# the same pool); "piecewise-breakable-env" turns vLLM's breakable graphs on before its
# model modules are imported (built on CPU, the model config imports them before vLLM
# turns them on, so attention may stay inside the captured graphs); FULL decode graphs
# alone leave every step that is not a uniform decode eager.
STOCK_ENGINES = {
    "eager": ({"enforce_eager": True}, {}),
    "piecewise": ({}, {"sync_segments": True}),
    "piecewise-no-draft-graphs": ({}, {"sync_segments": True, "eager_draft": True}),
    "piecewise-breakable-env": ({}, {"sync_segments": True, "breakable_env": True}),
    "full-decode-only": ({"compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}}, {}),
}


@pytest.mark.gpu
@pytest.mark.parametrize("variant", STOCK_ENGINES)
def test_dsv4_stock_dspark_starts_and_generates(dsv4_folder, variant):
    """Stock DSpark (k=7, the plugin inert) on the tiny-dsv4 shape starts and returns every
    token: what the lossless tests stand on. The dsv4-probe stage runs it alone with
    synchronous kernel launches, so that a fault names its kernel."""
    engine, probe = STOCK_ENGINES[variant]
    out = run(dsv4_folder, {}, engine=DSV4_ENGINE | engine, **probe)
    print(variant, "breakable graph segments replayed:", out.get("breakable_segments"))
    assert [len(ids) for ids in out["token_ids"]] == [MAX_TOKENS] * NUM_PROMPTS


@pytest.mark.gpu
def test_dsv4_plugin_dspark_starts_and_generates(dsv4_folder):
    """With a capacity mode the plugin's speculator decorates DeepSeek-V4's attention
    again before graph capture (patches/dsv4_breakable_attention.py): sps verified masked
    starts with vLLM's default graphs, its engine core forked as LLM() forks it, and
    returns every token."""
    options = {
        "dspark_capacity": "sps",
        "dspark_varlen_verify": False,
        "dspark_synthetic_confidence": SYNTHETIC_CONFIDENCE,
    }
    out = run(dsv4_folder, options, engine=DSV4_ENGINE)
    assert [len(ids) for ids in out["token_ids"]] == [MAX_TOKENS] * NUM_PROMPTS


@pytest.mark.gpu
def test_dsv4_greedy_lossless_stock_and_masked_capacity_modes(dsv4_folder, nospec):
    save = result_writer(
        "dsv4_lossless_gpu.json",
        "DSPARK_RESULTS_DIR=$OUT pytest tests/gpu/test_dsv4_lossless_gpu.py",
        "stock DSpark k=7; "
        + ", ".join(name for name, _ in MASKED_SWITCH)
        + " verified masked, switched in one engine, synthetic confidence, drafts "
        "accepted as the target chooses",
        nospec,
    )
    save({})
    check_nospec(nospec)
    results = {"dspark": greedy_comparison(run(dsv4_folder, {}), nospec["out"])}
    start, _ = shared_engine_plan(["sps-masked", "acceptance-masked"], None)
    results |= capacity_arms(dsv4_folder, start, MASKED_SWITCH, nospec)
    save(results)

    assert set(results) == {"dspark", *(name for name, _ in MASKED_SWITCH)}
    check_lossless(results, nospec)


@pytest.mark.gpu
def test_dsv4_greedy_lossless_compact_capacity_modes(dsv4_folder, nospec):
    """Issue #59: the capacity modes verified compacted. Every compacted decode step (one
    without prompts) replayed a FULL graph, counted per arm; some steps carried prompts
    (those run PIECEWISE)."""
    save = result_writer(
        "dsv4_compact_lossless_gpu.json",
        "DSPARK_RESULTS_DIR=$OUT pytest tests/gpu/test_dsv4_lossless_gpu.py -k compact",
        ", ".join(name for name, _ in COMPACT_SWITCH)
        + " verified compacted, switched in one engine, synthetic confidence, drafts "
        "accepted as the target chooses; compacted decode steps from FULL graphs "
        "(admission: graph_steps = steps - mixed_steps; proposals_skipped: proposals the "
        "draft gate skipped, whose steps admit no draft and take one-token graphs)",
        nospec,
    )
    save({})
    check_nospec(nospec)
    results = capacity_arms(dsv4_folder, COMPACT_START, COMPACT_SWITCH, nospec)
    save(results)

    assert set(results) == {name for name, _ in COMPACT_SWITCH}
    check_lossless(results, nospec)
    admissions = {arm: result["admission"] for arm, result in results.items()}
    for arm, admission in admissions.items():
        decode_only = admission["steps"] - admission["mixed_steps"]
        assert admission["graph_steps"] == decode_only, (arm, admission)
        # Arms that admit fewer drafts than proposed compact decode steps whatever the load.
        assert decode_only > 0 or arm not in CUTTING_ARMS, (arm, admission)
    assert sum(admission["mixed_steps"] for admission in admissions.values()) > 0, admissions
