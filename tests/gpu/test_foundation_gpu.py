"""On a GPU: with the plugin loaded and no option set, DSpark output is stock's.

Set DSPARK_RESULTS_DIR to also write ``foundation_gpu.json`` there.
"""

import json
from pathlib import Path

import pytest
from gpu_results import write_result
from subprocess_probe import run_probe, without_dspark_plugin

LLM_PROBE = Path(__file__).with_name("llm_probe.py")

NUM_PROMPTS, MAX_TOKENS = 8, 64


@pytest.mark.gpu
def test_dspark_output_is_stock_with_plugin_loaded(model_dirs):
    spec = {
        "target": model_dirs["target"],
        "draft": model_dirs["dspark"],
        "dummy": True,
        "prompts": [[3 + (17 * i + 5 * j) % 4000 for j in range(32)] for i in range(NUM_PROMPTS)],
        "max_tokens": MAX_TOKENS,
    }
    stock = run_probe(LLM_PROBE, stdin=json.dumps(spec), plugins=without_dspark_plugin())
    with_plugin = run_probe(LLM_PROBE, stdin=json.dumps(spec))
    identical = stock["token_ids"] == with_plugin["token_ids"]
    write_result(
        "foundation_gpu.json",
        "DSPARK_RESULTS_DIR=$OUT pytest tests/gpu/test_foundation_gpu.py",
        {
            "setup": {
                "target": "tiny Qwen3 (4 layers, hidden 256, vocab 4096), dummy weights",
                "draft": "Qwen3DSparkModel, 1 layer, k=7, standard rejection sampling",
                "prompts": NUM_PROMPTS,
                "max_tokens": MAX_TOKENS,
                "sampling": "greedy, bf16",
            },
            "result": {
                "greedy_token_ids_identical": identical,
                "plugin_loaded": {
                    "stock_arm": stock["patched"],
                    "plugin_arm": with_plugin["patched"],
                },
                "spec_decode_stock": stock["spec_decode"],
                "spec_decode_plugin": with_plugin["spec_decode"],
                "engine_load_s": {"stock": stock["load_s"], "plugin": with_plugin["load_s"]},
            },
        },
    )
    assert not stock["patched"] and with_plugin["patched"]
    assert all(len(ids) == MAX_TOKENS for ids in stock["token_ids"])
    assert stock["spec_decode"]["drafts"] > 0
    assert identical
