"""On two or more GPUs: tensor parallelism with every capacity option on, drafting over a
vocabulary subset split over the ranks.

The embedded pair at TP 2 (and 4 where the machine has the GPUs), 500 requests at
concurrency 64, greedy, float32: no hang, outputs identical to TP 1 without speculation,
and every rank's admissions identical step by step (a hash of each compacted step's k_r,
plus every counter), since ranks that admitted differently would verify different batch
shapes and hang or diverge.

Set DSPARK_RESULTS_DIR to also write ``tp.json`` there.
"""

from pathlib import Path

import pytest
import torch
from gpu_options import EVERY_CAPACITY_OPTION
from gpu_results import write_result
from pair_probe import run_pair

from vllm_dspark.demo import EMBEDDED_PAIR, load_prompts

NUM_REQUESTS, MAX_TOKENS, CONCURRENCY = 500, 96, 64
# Every capacity option, and a draft vocabulary of every fourth of the pair's 8,192 ids,
# which each rank keeps its share of.
OPTIONS = EVERY_CAPACITY_OPTION | {"dspark_draft_vocab": list(range(0, 8192, 4))}

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
    ),
    pytest.mark.skipif(not (EMBEDDED_PAIR / "draft").is_dir(), reason="embedded pair not built"),
]
_results: dict = {}

# No NVLink multicast: the variables tools/device/gpu_stage.sh sets (what and why: the
# file's comments), set here too so that the test is safe when run directly.
NO_MULTICAST_ENV = Path(__file__).parents[2] / "tools/device/no_multicast.env"
NO_MULTICAST = dict(
    line.split("=", 1)
    for line in NO_MULTICAST_ENV.read_text().splitlines()
    if line and not line.startswith("#")
)


@pytest.fixture(scope="module", autouse=True)
def no_multicast():
    """The probes' engines inherit the test's environment."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in NO_MULTICAST.items():
            patch.setenv(name, value)
        yield


def requests() -> list[list[int]]:
    """500 prompts: the 256 held-out ones, then their first halves."""
    held_out = load_prompts(num_prompts=256)
    return (held_out + [p[: len(p) // 2] for p in held_out])[:NUM_REQUESTS]


def run(tp: int, options: dict | None) -> dict:
    return run_pair(
        options,
        timeout=480,  # an engine start (~3 min) and 500 requests, with room
        prompts=requests(),
        max_tokens=MAX_TOKENS,
        gpu_memory_utilization=0.2,
        tensor_parallel_size=tp,
        max_num_seqs=CONCURRENCY,
    )


def same_outputs(a: dict, b: dict) -> int:
    """How many requests generated the same tokens in runs ``a`` and ``b``."""
    return sum(x == y for x, y in zip(a["token_ids"], b["token_ids"], strict=True))


@pytest.fixture(scope="module")
def reference() -> dict:
    return run(1, None)


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_capacity_control_agrees_across_ranks(reference, tp):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    nospec, spec = run(tp, None), run(tp, OPTIONS)
    ranks = spec["admission_per_rank"]
    identical = same_outputs(spec, reference)
    _results[f"tp{tp}"] = {
        "greedy_identical_to_tp1_nospec": identical,
        # Where the first count falls short, these say whether tensor parallelism's own
        # reduction order (TP 2 against TP 1, both without speculation) or speculation
        # (at one TP size) changed the outputs.
        "nospec_tp_identical_to_tp1_nospec": same_outputs(nospec, reference),
        "greedy_identical_to_same_tp_nospec": same_outputs(spec, nospec),
        "requests": NUM_REQUESTS,
        "ranks_agree": all(rank == ranks[0] for rank in ranks),
        "admission_rank0": ranks[0],
        "acceptance_length": spec["acceptance_length"],
        "tok_s": {"nospec": nospec["tok_s"], "dspark_all_options": spec["tok_s"]},
    }
    write_result(
        "tp.json",
        "DSPARK_RESULTS_DIR=$OUT pytest tests/gpu/test_tp_gpu.py",
        {
            "setup": f"embedded pair, {NUM_REQUESTS} requests at concurrency {CONCURRENCY}, "
            f"{MAX_TOKENS} tokens, greedy, float32, k=7",
            "options": EVERY_CAPACITY_OPTION | {"dspark_draft_vocab": "every fourth id"},
            **_results,
        },
    )
    assert ranks[0]["steps"] > 0
    assert all(rank == ranks[0] for rank in ranks)
    assert identical == NUM_REQUESTS
