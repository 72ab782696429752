"""A minute's check that a long GPU queue is worth starting: one bf16 engine of the
embedded pair with every capacity option (FULL compact graphs under FlashAttention 3, the
SPS curve profiled at start-up, dynamic depth, online STS) starts, verifies compacted steps
inside its graphs and finishes every prompt. ``tools/device/gpu_stage.sh smoke`` runs it
first; the queue stops when it fails (an H200 session once spent its device time on stages
whose engines all failed to start on one compile error)."""

import pytest
from gpu_options import EVERY_CAPACITY_OPTION
from pair_probe import run_pair

from vllm_dspark.demo import EMBEDDED_PAIR, load_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (EMBEDDED_PAIR / "draft").is_dir(), reason="embedded pair not built"),
]
NUM_PROMPTS, MAX_TOKENS = 32, 64
# More requests than vLLM's largest decode graph holds (512 tokens: 64 requests of 1 + 7),
# so that the start-up SPS profile also times decode steps without a graph.
MAX_NUM_SEQS, NUM_DRAFTS = 96, 7
# Arms of the one engine (started with every option): sps exercises the proposal kernel
# and the draft gate; budget surely compacts (sps may admit every draft, or none).
ARMS = {
    "sps": {"capacity": "sps", "varlen_verify": True, "dynamic_depth": True},
    "budget": {"capacity": "budget", "budget_frac": 0.5, "varlen_verify": True},
}


def test_every_capacity_option_runs_compacted_steps_in_full_graphs():
    prompts = [prompt[:64] for prompt in load_prompts(num_prompts=NUM_PROMPTS)]
    result = run_pair(
        EVERY_CAPACITY_OPTION,
        dtype="bfloat16",
        prompts=prompts,
        max_tokens=MAX_TOKENS,
        max_num_seqs=MAX_NUM_SEQS,
        switch=[[name, updates] for name, updates in ARMS.items()],
        timeout=400,
    )
    for name, arm in result["arms"].items():
        assert [len(ids) for ids in arm["token_ids"]] == [MAX_TOKENS] * NUM_PROMPTS, name
    sps, budget = result["arms"]["sps"]["admission"], result["arms"]["budget"]["admission"]
    assert sps["proposed"] > 0, sps
    # Every compacted decode-only step replays a FULL graph; a step that also carries
    # prompts (dspark_mixed_steps, on with compact verification) takes vLLM's mixed-batch
    # dispatch by design.
    decode_only = budget["steps"] - budget["mixed_steps"]
    assert decode_only > 0 and budget["graph_steps"] == decode_only, budget
    # The SPS curve reaches the largest decode step the engine can run.
    curve = result["arms"]["sps"]["gate"]["sps_curve"]
    assert curve[-1][0] == MAX_NUM_SEQS * (1 + NUM_DRAFTS), curve
