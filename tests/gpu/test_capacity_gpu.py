"""On a GPU, with the embedded pair: budget capacity with compact verification keeps
greedy outputs identical to no speculation and verifies fewer drafts."""

import json
from pathlib import Path

import pytest
from subprocess_probe import run_probe

from vllm_dspark.demo import EMBEDDED_PAIR, load_prompts

LLM_PROBE = Path(__file__).with_name("llm_probe.py")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (EMBEDDED_PAIR / "draft").is_dir(), reason="embedded pair not built"),
]


def test_budget_capacity_is_lossless_and_verifies_less():
    spec = {
        "target": str(EMBEDDED_PAIR / "target"),
        "draft": None,
        "prompts": load_prompts(num_prompts=48),
        "max_tokens": 64,
    }
    draft = str(EMBEDDED_PAIR / "draft")
    capacity = {
        "dspark_capacity": "budget",
        "dspark_budget_frac": 0.5,
        "dspark_varlen_verify": True,
    }
    baseline = run_probe(LLM_PROBE, json.dumps(spec))
    fixed = run_probe(LLM_PROBE, json.dumps({**spec, "draft": draft}))
    budget = run_probe(LLM_PROBE, json.dumps({**spec, "draft": draft, "options": capacity}))
    assert fixed["token_ids"] == baseline["token_ids"]
    assert budget["token_ids"] == baseline["token_ids"]
    # vLLM counts every scheduled draft; the accepted ones can only come from admitted ones.
    assert 0 < budget["spec_decode"]["accepted_tokens"] <= fixed["spec_decode"]["accepted_tokens"]
