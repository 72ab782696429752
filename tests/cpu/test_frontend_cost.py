"""benchmarks/frontend_cost.py at tiny sizes: the fit recovers known costs, and vLLM's front
end pays mostly per request chunk, so a chunk of many tokens costs less per token."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

from frontend_cost import VARIANTS, fit_step_cost, measure  # noqa: E402

REQUESTS = [1, 8, 32]
TOKENS = [1, 8]


def test_the_fit_recovers_per_step_per_chunk_and_per_token_costs():
    points = [
        {"requests": n, "tokens_per_chunk": t, "step_us": 40.0 + 20.0 * n + 1.5 * n * t}
        for n in REQUESTS
        for t in TOKENS
    ]
    fit = fit_step_cost(points)
    assert fit.per_step_us == pytest.approx(40.0)
    assert fit.per_chunk_us == pytest.approx(20.0)
    assert fit.per_token_us == pytest.approx(1.5)
    assert fit.max_relative_residual == pytest.approx(0.0, abs=1e-9)
    assert fit.step_us(256, 3) == pytest.approx(40.0 + 20.0 * 256 + 1.5 * 256 * 3)
    assert fit.us_per_token(4) == pytest.approx(20.0 / 4 + 1.5)


@pytest.fixture(scope="module")
def measured():
    return measure(list(VARIANTS), REQUESTS, TOKENS, steps=15, warmup=3, repeats=2)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_chunk_of_eight_tokens_costs_less_per_token_than_eight_chunks_of_one(measured, variant):
    result = measured[variant]
    assert [(p["requests"], p["tokens_per_chunk"]) for p in result["points"]] == [
        (n, t) for n in REQUESTS for t in TOKENS
    ]
    assert all(p["step_us"] == min(p["round_medians_us"]) for p in result["points"])
    fit = result["fit"]
    assert fit["per_chunk_us"] > 0
    assert fit["us_per_token_t3"] < fit["us_per_token_t1"]
    # At the most requests, a token in a chunk of eight costs under half one alone.
    by_tokens = {p["tokens_per_chunk"]: p for p in result["points"] if p["requests"] == 32}
    assert by_tokens[8]["us_per_token"] < by_tokens[1]["us_per_token"] / 2


def test_serving_a_chunk_costs_more_than_processing_it(measured):
    """Detokenizing adds per-token work; waking each request's task and writing its event
    adds per-chunk work on top of process_outputs."""
    fits = {variant: measured[variant]["fit"] for variant in VARIANTS}
    assert fits["text"]["per_token_us"] > fits["token_ids"]["per_token_us"]
    assert fits["served"]["per_chunk_us"] > fits["text"]["per_chunk_us"]
