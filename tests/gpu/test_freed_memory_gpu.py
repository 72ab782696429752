"""On a GPU, with the embedded pair: nothing reads memory it does not own.

Hardening cases 2 and 3 (CUDA-graph buffer lifetime, padded replay state). After the
engine has captured its graphs and warmed up, every byte the caching allocator can hand
out next is filled with NaN. A captured graph that kept a pointer into memory freed after
capture, or a padded replay row or eager step that reads stale or uninitialised state,
then reads NaN and derails its request. Stock DSpark (our plugin not loaded) and the
plugin with every capacity option run that way; greedy outputs must equal no
speculation (float32). Whether stock fails is recorded, not assumed.

Set DSPARK_RESULTS_DIR to also write ``freed_memory.json`` there.
"""

import pytest
from gpu_options import EVERY_CAPACITY_OPTION
from gpu_results import write_result
from pair_probe import run_pair

from vllm_dspark.demo import EMBEDDED_PAIR, load_prompts

NUM_PROMPTS, MAX_TOKENS = 64, 96

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (EMBEDDED_PAIR / "draft").is_dir(), reason="embedded pair not built"),
]


def run(options: dict | None, plugin: bool) -> dict:
    prompts = load_prompts(num_prompts=NUM_PROMPTS)
    return run_pair(
        options, plugin, prompts=prompts, max_tokens=MAX_TOKENS, poison_freed_memory=True
    )


def test_poisoned_free_memory_changes_no_output():
    reference = run(options=None, plugin=True)
    stock = run(options={}, plugin=False)
    plugin = run(options=EVERY_CAPACITY_OPTION, plugin=True)
    record = {
        name: {
            "greedy_identical_prompts": sum(
                a == b for a, b in zip(arm["token_ids"], reference["token_ids"], strict=True)
            ),
            "poisoned_gib": round(arm["poisoned_bytes"] / (1 << 30), 1),
        }
        for name, arm in (("stock", stock), ("plugin", plugin))
    }
    write_result(
        "freed_memory.json",
        "DSPARK_RESULTS_DIR=$OUT pytest tests/gpu/test_freed_memory_gpu.py",
        {
            "setup": f"embedded pair, {NUM_PROMPTS} prompts, {MAX_TOKENS} tokens, float32, "
            "free GPU memory filled with NaN after capture and warm-up",
            "options": EVERY_CAPACITY_OPTION,
            "stock_fails": record["stock"]["greedy_identical_prompts"] < NUM_PROMPTS,
            "plugin_passes": record["plugin"]["greedy_identical_prompts"] == NUM_PROMPTS,
            **record,
        },
    )
    assert plugin["poisoned_bytes"] > 1 << 30 and not stock["patched"] and plugin["patched"]
    assert record["plugin"]["greedy_identical_prompts"] == NUM_PROMPTS
