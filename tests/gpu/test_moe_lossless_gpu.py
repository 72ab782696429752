"""On a GPU: a Qwen3 MoE target (the tiny-moe shape: 8 experts, 2 active, vLLM's fused MoE
path) with its dense DSpark drafter keeps greedy outputs identical to no speculation, at a
fixed K=7 and with every capacity mode under compact verification (sps, budget, threshold
and acceptance, switched in one engine: three engines in all).

Dummy weights in float32, as test_dflash_mixed_gpu.py: drafts are almost never accepted,
so the test checks that the MoE target's verification of K positions a request (its
routing and expert alignment over a batch of draft rows, compacted or not) changes no
output. The capacity arms' synthetic confidences steer what is admitted only: their
verification accepts what the target chooses (``accept_by_target``; synthetic acceptance
would accept the drafter's tokens). Needs the MoE bundle's _moe_C
(tools/device/moe_bundle.sh). An output that differs must do so first where no
speculation's top-two logprob gap is below ``FLOAT32_TIE_GAP``, and few may (dummy logits
lie close)."""

import tempfile
from pathlib import Path

import pytest
from gpu_results import greedy_comparison, write_result
from pair_probe import run_dummy
from shapes import write_shape

NUM_PROMPTS, MAX_TOKENS, MAX_NUM_SEQS = 32, 32, 8
FLOAT32_TIE_GAP, MAX_DIVERGING = 1e-4, 3
SYNTHETIC_CONFIDENCE = [0.8, 0.78, 0.77, 0.77, 0.76, 0.75, 0.76]
CURVE = [[1, 1000.0], [64, 900.0], [512, 400.0]]
# The capacity engine starts in sps with compact verification; each mode is switched to.
CAPACITY_START = {
    "dspark_capacity": "sps",
    "dspark_varlen_verify": True,
    "dspark_sps_curve": CURVE,
    "dspark_synthetic_confidence": SYNTHETIC_CONFIDENCE,
}
CAPACITY_SWITCH = [
    ["sps", {"capacity": "sps", "varlen_verify": True, "sps_curve": CURVE}],
    ["budget", {"capacity": "budget", "budget_frac": 0.5, "varlen_verify": True}],
    ["threshold", {"capacity": "threshold", "confidence_threshold": 0.5, "varlen_verify": True}],
    ["acceptance", {"capacity": "acceptance", "varlen_verify": True}],
]
# Arms that admit fewer drafts than proposed whatever the load: half the drafts, and a
# prefix survival (a product of confidences around 0.77) that falls below 0.5.
CUTTING_ARMS = ("budget", "threshold")


@pytest.fixture(scope="module")
def moe_dirs() -> dict[str, str]:
    return write_shape("tiny-moe", Path(tempfile.mkdtemp()), draft_layers=1)


def prompts() -> list[list[int]]:
    return [
        [3 + (29 * i + 5 * j) % 4000 for j in range(9 + (11 * i) % 27)] for i in range(NUM_PROMPTS)
    ]


def run(dirs: dict, options: dict | None, **probe) -> dict:
    return run_dummy(
        dirs["target"],
        dirs["draft"],
        options,
        max_num_seqs=MAX_NUM_SEQS,
        prompts=prompts(),
        max_tokens=MAX_TOKENS,
        **probe,
    )


@pytest.mark.gpu
def test_moe_target_greedy_lossless_with_every_capacity_mode(moe_dirs):
    nospec = run(moe_dirs, None, margins=True)
    assert all(len(ids) == MAX_TOKENS for ids in nospec["token_ids"])
    results = {"dspark": greedy_comparison(run(moe_dirs, {}), nospec)}
    # Synthetic confidences steer what is admitted; verification accepts what the target
    # chooses (synthetic acceptance would accept the drafter's tokens).
    capacity = run(moe_dirs, CAPACITY_START, switch=CAPACITY_SWITCH, accept_by_target=True)
    assert capacity["accepted_by_target"]
    results |= {arm: greedy_comparison(out, nospec) for arm, out in capacity["arms"].items()}
    write_result(
        "moe_lossless_gpu.json",
        "DSPARK_RESULTS_DIR=$OUT pytest tests/gpu/test_moe_lossless_gpu.py",
        {
            "setup": {
                "target": "tiny-moe Qwen3 MoE (4 layers, hidden 256, 8 experts, 2 active), "
                "dummy weights",
                "draft": "DSpark, 1 dense layer, K=7; capacity modes with compact "
                "verification, switched in one engine, synthetic confidence, drafts accepted "
                "as the target chooses",
                "sampling": "greedy, float32",
            },
            "result": results,
        },
    )
    assert set(results) == {"dspark", *(name for name, _ in CAPACITY_SWITCH)}
    for arm in CUTTING_ARMS:  # compacted steps were verified
        admission = results[arm]["admission"]
        assert 0 < admission["admitted"] < admission["proposed"], (arm, admission)
    for arm, result in results.items():
        assert result["spec_decode"]["drafts"] > 0, arm
        divergences = result["first_divergences"]
        assert len(divergences) <= MAX_DIVERGING, (arm, divergences)
        assert all(d["gap"] < FLOAT32_TIE_GAP for d in divergences.values()), (arm, divergences)
