"""On a GPU, with the embedded pair: does prefix caching starve the drafter?

Tokens restored from the prefix cache never ran through the target in the request that
reuses them, so a DSpark/DFlash drafter, whose context K/V comes from the target's hidden
states, may attend context it never wrote (vllm-project/vllm#47930). Requests sharing a
long prefix run with prefix caching on and off, on stock vLLM (our plugin not loaded) and
with the plugin's speculator; acceptance lengths are compared and greedy outputs must not
depend on caching (float32). The stock arms record whether stock fails the case; the
plugin must keep acceptance within 5%.

Set DSPARK_RESULTS_DIR to also write ``prefix_cache.json`` there.
"""

import pytest
from gpu_results import write_result
from pair_probe import run_pair

from vllm_dspark.demo import EMBEDDED_PAIR, load_prompts

NUM_REQUESTS, MAX_TOKENS, MAX_ACCEPTANCE_GAP = 48, 96, 0.05

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (EMBEDDED_PAIR / "draft").is_dir(), reason="embedded pair not built"),
]


def shared_prefix_prompts() -> list[list[int]]:
    """A 192-token prefix (three held-out prompts) shared by every request, then 32 tokens
    of a held-out prompt of its own."""
    held_out = load_prompts(num_prompts=256)
    prefix = [token for prompt in held_out[200:203] for token in prompt]
    return [prefix + held_out[i][:32] for i in range(NUM_REQUESTS)]


def run(plugin: bool, caching: bool) -> dict:
    return run_pair(
        # Loads the plugin's speculator (capacity control stays off).
        {"dspark_confidence_metrics": True} if plugin else {},
        plugin,
        prompts=shared_prefix_prompts(),
        max_tokens=MAX_TOKENS,
        enable_prefix_caching=caching,
    )


@pytest.fixture(scope="module")
def arms() -> dict:
    return {
        (plugin, caching): run(plugin, caching)
        for plugin in (False, True)
        for caching in (False, True)
    }


def test_prefix_caching_keeps_outputs_and_acceptance(arms):
    record = {}
    for plugin in (False, True):
        off, on = arms[(plugin, False)], arms[(plugin, True)]
        gap = on["acceptance_length"] / off["acceptance_length"] - 1
        record["plugin" if plugin else "stock"] = {
            "acceptance_length_caching_off": off["acceptance_length"],
            "acceptance_length_caching_on": on["acceptance_length"],
            "relative_change": gap,
            "greedy_identical": on["token_ids"] == off["token_ids"],
            # The warm-up's requests share the prefix: with caching on it is served from
            # the cache, which is the case under test.
            "prefix_cache_hit_tokens_caching_on": on["prefix_cache_hit_tokens"],
            "prefix_cache_hit_tokens_caching_off": off["prefix_cache_hit_tokens"],
            "patched": on["patched"],
        }
    write_result(
        "prefix_cache.json",
        "DSPARK_RESULTS_DIR=$OUT pytest tests/gpu/test_prefix_cache_gpu.py",
        {
            "setup": f"embedded pair, {NUM_REQUESTS} requests sharing a 192-token prefix, "
            f"{MAX_TOKENS} tokens, greedy, float32, k=7",
            "stock_fails": abs(record["stock"]["relative_change"]) > MAX_ACCEPTANCE_GAP,
            "plugin_passes": abs(record["plugin"]["relative_change"]) <= MAX_ACCEPTANCE_GAP
            and record["plugin"]["greedy_identical"],
            **record,
        },
    )
    assert not record["stock"]["patched"] and record["plugin"]["patched"]
    for name in ("stock", "plugin"):
        # Every request found the shared prefix in the cache (whole 16-token blocks).
        assert record[name]["prefix_cache_hit_tokens_caching_on"] >= NUM_REQUESTS * 176
        assert record[name]["prefix_cache_hit_tokens_caching_off"] == 0
    for name in ("stock", "plugin"):
        assert record[name]["greedy_identical"], name
    assert abs(record["plugin"]["relative_change"]) <= MAX_ACCEPTANCE_GAP
