"""On a GPU, with the embedded pair: a soak with every capacity option on.

2,000 requests of random prompt and output lengths, most sharing one of four long
prefixes (prefix caching on), a KV cache small enough to force preemption, one request in
twenty aborted mid-stream; the plugin's capacity control (sps profiled at start-up,
compact verification, dynamic depth), online STS and the calibration metrics all on.
No crash, every KV block back in the pool, and every finished greedy output identical
to the same request without speculation (float32, so bf16 ties cannot differ), or, where
it is not, diverging first at a position where the reference's two most likely tokens
were within ``TIE_GAP`` in logprob: there the numerical noise between batch shapes (and
between a preempted request's recomputed prefill and its decoded KV) decides, not
speculation. The H200 run of 66818bd found 7 (stock) and 8 (plugin) of ~1,900 requests
differing, three of them the same requests in both arms; the reference now records the
gap at every position, so each divergence is classified instead of assumed. Stock DSpark
(our plugin not loaded) runs the same soak; whether it fails is recorded.

Set DSPARK_RESULTS_DIR to also write ``soak.json`` there.
"""

import json
import random
from pathlib import Path

import pytest
from gpu_options import EVERY_CAPACITY_OPTION
from gpu_results import first_divergences, write_result
from subprocess_probe import run_probe, without_dspark_plugin

from vllm_dspark.demo import EMBEDDED_PAIR, load_prompts

SOAK_PROBE = Path(__file__).with_name("soak_probe.py")
NUM_REQUESTS, NUM_GPU_BLOCKS = 2000, 160
# A top-two logprob gap below this is a float32 near-tie (noise is ~1e-6 here); a real
# divergence is free to happen at any gap.
TIE_GAP = 1e-3

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (EMBEDDED_PAIR / "draft").is_dir(), reason="embedded pair not built"),
]


def soak_requests(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    held_out = load_prompts(num_prompts=256)
    prefixes = [held_out[i] + held_out[i + 1] for i in range(200, 208, 2)]  # 128 tokens
    requests = []
    for i in range(NUM_REQUESTS):
        own = rng.choice(held_out[:200])[: rng.randint(4, 64)]
        prompt = (rng.choice(prefixes) if rng.random() < 0.8 else []) + own
        max_tokens = rng.randint(8, 160)
        abort_after = rng.randint(1, max_tokens - 1) if i % 20 == 0 else None
        requests.append(
            {"id": str(i), "prompt": prompt, "max_tokens": max_tokens, "abort_after": abort_after}
        )
    return requests


def run(requests, options: dict | None, plugin: bool = True) -> dict:
    """The soak with DSpark and these options (None: without speculation, recording the
    top-two logprob gaps)."""
    spec = {
        "margins": options is None,
        "target": str(EMBEDDED_PAIR / "target"),
        "draft": None if options is None else str(EMBEDDED_PAIR / "draft"),
        "options": options or {},
        "requests": requests,
        "num_gpu_blocks": NUM_GPU_BLOCKS,
        "dtype": "float32",
    }
    plugins = None if plugin else without_dspark_plugin()
    return run_probe(SOAK_PROBE, stdin=json.dumps(spec), plugins=plugins, timeout=1200)


def summary(arm: dict, reference: dict) -> dict:
    finished = arm["finished"]
    divergence = first_divergences(finished, reference["finished"], reference["margins"])
    real = [i for i, d in divergence.items() if d["gap"] >= TIE_GAP]
    leaked = arm["free_blocks_before"] - arm["free_blocks_after"]
    return {
        "finished": len(finished),
        "aborted": len(arm["aborted"]),
        "preemptions": arm["preemptions"],
        "leaked_kv_blocks": leaked,
        "greedy_mismatches": len(divergence),
        "mismatches_at_near_ties": len(divergence) - len(real),
        "mismatches_beyond_ties": len(real),
        "divergence": dict(sorted(divergence.items(), key=lambda item: int(item[0]))),
        "passes": not real and leaked == 0 and len(finished) + len(arm["aborted"]) == NUM_REQUESTS,
    }


def test_soak_with_every_option_is_lossless_and_leaks_nothing():
    requests = soak_requests()
    plugin = run(requests, EVERY_CAPACITY_OPTION)
    stock = run(requests, {}, plugin=False)  # stock DSpark, k=7, our plugin not loaded
    # Every request either arm finished, without speculation and without aborts.
    finished = set(plugin["finished"]) | set(stock["finished"])
    reference = run([r | {"abort_after": None} for r in requests if r["id"] in finished], None)
    record = {"stock": summary(stock, reference), "plugin": summary(plugin, reference)}
    write_result(
        "soak.json",
        "DSPARK_RESULTS_DIR=$OUT pytest tests/gpu/test_soak_gpu.py",
        {
            "setup": f"embedded pair, {NUM_REQUESTS} requests, {NUM_GPU_BLOCKS} KV blocks, "
            "prefix caching on, one in twenty aborted, float32, k=7",
            "options": EVERY_CAPACITY_OPTION,
            "stock_fails": not record["stock"]["passes"],
            "plugin_passes": record["plugin"]["passes"],
            **record,
        },
    )
    assert plugin["aborted"] and plugin["preemptions"] > 0
    assert record["plugin"]["passes"], record["plugin"]
