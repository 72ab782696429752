"""On a GPU, with the embedded pair: padded rows of a draft graph replay write no request's
draft slots.

Hardening case 4 (stale draft-slot writes). A draft step replays the FULL CUDA graph
captured for the smallest size that holds the batch, so a batch between two captured
sizes runs padded sample rows. What a proposal produces is kept per request slot (the
runner's draft tokens; with probabilistic drafting stock's draft logits; with the plugin
the slots' survival and confidence logits), and a padded row must write none of it: not
a free slot (slot 0 included), not a running request's. All 64 prompts start at once, so
every request slot is taken (slot 0 too), and their output lengths are spread over 8-260
tokens so the batch shrinks about one request per step, through sizes vLLM has no draft
graph for. Before every step the rows of the slots not in the batch are filled with a
sentinel; after it they must still hold it, and the batch's rows must hold exactly what
the proposal returned (``install_draft_slot_check`` in ``llm_probe.py``). Stock DSpark
(our plugin not loaded) and the plugin with every capacity option run that way; whether
stock fails is recorded, not assumed. The padded replays are counted: the case must have
been exercised.

Set DSPARK_RESULTS_DIR to also write ``draft_slots.json`` there.
"""

import pytest
from gpu_options import EVERY_CAPACITY_OPTION
from gpu_results import write_result
from pair_probe import run_pair

from vllm_dspark.demo import EMBEDDED_PAIR, load_prompts

# As many prompts as the probe's max_num_seqs: every request slot is taken at the start.
NUM_PROMPTS, MAX_NUM_SEQS = 64, 64
# At least this many draft graph replays padded beyond their batch (about 20-30 expected).
MIN_PADDED_REPLAYS = 10

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (EMBEDDED_PAIR / "draft").is_dir(), reason="embedded pair not built"),
]


def max_tokens_per_prompt() -> list[int]:
    """8, 12, ..., 260 tokens, permuted (37 is prime to 64), so requests finish about one
    per step in an order unrelated to their slots; the first and the last prompt get the
    two shortest (8 and 12), so that slot 0 is freed within a few steps whether vLLM hands
    it to the first request admitted or to the last (the H200 run of 66818bd gave the last
    prompt 116 tokens, and stock's slot 0 was busy in every padded replay)."""
    lengths = [8 + 4 * (i * 37 % NUM_PROMPTS) for i in range(NUM_PROMPTS)]
    last = lengths.index(12)
    lengths[last], lengths[-1] = lengths[-1], lengths[last]
    return lengths


def run(options: dict, plugin: bool) -> dict:
    return run_pair(
        options,
        plugin,
        prompts=load_prompts(num_prompts=NUM_PROMPTS),
        max_tokens=max_tokens_per_prompt(),
        max_num_seqs=MAX_NUM_SEQS,
        check_draft_slots=True,
    )


def summary(arm: dict) -> dict:
    check = arm["draft_slots"]
    wrong_rows = sum(check["stale_rows"].values()) + sum(check["mismatched_rows"].values())
    return {
        "fails": wrong_rows > 0,
        **check,
        "acceptance_length": arm["acceptance_length"],
        "proposals_skipped": arm["admission"]["proposals_skipped"],
        "patched": arm["patched"],
    }


def test_padded_draft_rows_write_no_request_slot():
    record = {
        "stock": summary(run({}, plugin=False)),
        "plugin": summary(run(EVERY_CAPACITY_OPTION, plugin=True)),
    }
    write_result(
        "draft_slots.json",
        "DSPARK_RESULTS_DIR=$OUT pytest tests/gpu/test_draft_slots_gpu.py",
        {
            "setup": f"embedded pair, {NUM_PROMPTS} prompts at once (max_num_seqs "
            f"{MAX_NUM_SEQS}), 8-260 tokens each, greedy, float32, k=7; before every step "
            "the slot rows not in the batch hold a sentinel, checked after it with the "
            "batch's rows against the proposal",
            "options": EVERY_CAPACITY_OPTION,
            "stock_fails": record["stock"]["fails"],
            "plugin_passes": not record["plugin"]["fails"],
            **record,
        },
    )
    assert not record["stock"]["patched"] and record["plugin"]["patched"]
    # Each arm checked the buffers it has: the plugin's speculator is in use.
    assert "draft_tokens" in record["stock"]["stale_rows"]
    assert {"draft_tokens", "slot_survival", "slot_confidence_logits"} <= set(
        record["plugin"]["stale_rows"]
    )
    for name, arm in record.items():
        assert arm["padded_replays"] >= MIN_PADDED_REPLAYS, (name, arm)
        assert arm["padded_replays_slot0_free"] > 0, (name, arm)
    assert not record["plugin"]["fails"], record["plugin"]
