"""On a GPU, with the embedded pair: sampled speculative decoding is lossless, as a
distribution.

At temperature 1, and at temperature 1 with top-k and top-p, the first three tokens of a
few held-out prompts are sampled 20,000 times per arm (each request seeded, no seed shared
between arms) and compared with no speculation's by a chi-square test of homogeneity
(``tests/sampling_stats.py``): stock DSpark with fixed k=7 (the plugin inert), and every
capacity mode switched in one engine (``off``, i.e. fixed k through the plugin's
speculator; ``threshold``, ``budget``, ``sps`` with compact verification, dynamic depth and
plain steps; ``acceptance``). A second sample of no speculation (``nospec-control``) shows
the test passing where nothing differs. Each must reach p >= ``LOSSLESS_P``. A
deliberately lossy verifier, stock's rejection sampler accepting every draft (``biased``),
must be caught: p < ``BIASED_P``. The same seeded requests run twice in a row give the
same outputs with no speculation, stock and fixed k (adaptive modes decide from what they
measured before, so theirs are recorded only). That holds only where vLLM schedules
deterministically: its reproducibility guide asks for the engine core in the caller's
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) or batch invariance. In a process of its own
the core can start a batch before all its requests arrive, and float32 logits of another
batch shape can flip a sample (at 639951a on an H100, no speculation's own first repeat
differed); so the engines run in-process.

Three engines (no speculation, stock, the plugin's capacity engine), float32 (bf16 logits
of one context differ by batch shape, a fixed shift 20,000 samples could see), run side by
side with fixed KV caches and compile caches of their own. Set DSPARK_RESULTS_DIR to write
``sampling_lossless.json``: rows of {mode, sampling, p_value, samples, ...}.
"""

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from gpu_results import write_result
from sampling_stats import bin_first_tokens, homogeneity
from subprocess_probe import run_probe

from vllm_dspark.demo import EMBEDDED_PAIR, load_prompts

PROBE = Path(__file__).parent / "sampling_probe.py"
NUM_PROMPTS, COPIES, FIRST_TOKENS = 4, 5000, 3  # 20,000 samples per arm and setting
# Fourteen lossless comparisons: at 1e-3 each, about 1.4% of correct runs would fail.
LOSSLESS_P, BIASED_P = 1e-3, 0.01
SETTINGS = {
    "temperature-1": {"temperature": 1.0},
    "top-k-top-p": {"temperature": 1.0, "top_k": 50, "top_p": 0.9},
}
# The capacity engine starts with what every mode switched to needs (vllm_dspark.
# engine_control); sps runs test_pair_arms_gpu's made-up curve, whose optimum moves with
# the load, so that it compacts (this pair's own costs may admit every draft).
CAPACITY_START = {
    "dspark_capacity": "sps",
    "dspark_varlen_verify": True,
    "dspark_dynamic_depth": True,
    "dspark_plain_steps": True,
}
CAPACITY_MODES = {
    "off": {"capacity": "off"},
    "threshold": {"capacity": "threshold", "confidence_threshold": 0.5, "varlen_verify": True},
    "budget": {"capacity": "budget", "budget_frac": 0.5, "varlen_verify": True},
    "sps": {
        "capacity": "sps",
        "varlen_verify": True,
        "dynamic_depth": True,
        "plain_steps": True,
        "sps_curve": [[1, 1000.0], [128, 900.0], [512, 400.0], [2048, 120.0]],
        "step_overhead_ms": 0.5,
    },
    "acceptance": {"capacity": "acceptance", "varlen_verify": True},
}
# Engines: (draft, start-up options, [[mode, switch updates, always accept]]).
ENGINES = {
    "nospec": (False, {}, [["nospec", None, False], ["nospec-control", None, False]]),
    "stock": (True, {}, [["stock", None, False], ["biased", None, True]]),
    "capacity": (True, CAPACITY_START, [[m, u, False] for m, u in CAPACITY_MODES.items()]),
}
DETERMINISTIC = ("nospec", "nospec-control", "stock", "off")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (EMBEDDED_PAIR / "draft").is_dir(), reason="embedded pair not built"),
]


def probe(engine: str, index: int, caches: Path) -> dict:
    draft, options, modes = ENGINES[engine]
    spec = {
        "target": str(EMBEDDED_PAIR / "target"),
        "draft": str(EMBEDDED_PAIR / "draft") if draft else None,
        "options": options,
        "dtype": "float32",
        "prompts": load_prompts(num_prompts=NUM_PROMPTS),
        "copies": COPIES,
        "max_tokens": FIRST_TOKENS,
        "settings": SETTINGS,
        "biased_settings": ["temperature-1"],
        "modes": modes,
        "seed_base": index << 28,  # each engine's own seed range
        "repeat": 256,
    }
    env = (
        "env",
        # A fixed KV cache: vLLM's memory profiling would count the other engines'.
        f"DSPARK_PROBE_KV_CACHE_BYTES={2 << 30}",
        # Deterministic scheduling, for the repeated seeded batch.
        "VLLM_ENABLE_V1_MULTIPROCESSING=0",
        # Compile caches of its own: engines compiling at once could read an entry that
        # another is still writing.
        f"VLLM_CACHE_ROOT={caches}/vllm",
        f"TORCHINDUCTOR_CACHE_DIR={caches}/inductor",
    )
    return run_probe(PROBE, stdin=json.dumps(spec), timeout=540, prefix=env)


@pytest.fixture(scope="module")
def modes(tmp_path_factory) -> dict:
    """Every engine's modes by name, the engines run side by side."""
    root = tmp_path_factory.mktemp("caches")
    with ThreadPoolExecutor(len(ENGINES)) as pool:
        futures = [
            pool.submit(probe, engine, index, root / engine) for index, engine in enumerate(ENGINES)
        ]
        return {name: mode for future in futures for name, mode in future.result()["modes"].items()}


def comparison_rows(modes: dict) -> list[dict]:
    """Each mode and setting against no speculation's samples of that setting."""
    prompt_of = [i % NUM_PROMPTS for i in range(NUM_PROMPTS * COPIES)]

    def binned(mode: str, setting: str):
        return bin_first_tokens(
            modes[mode]["settings"][setting]["token_ids"], prompt_of, FIRST_TOKENS
        )

    rows = []
    for mode, measured in modes.items():
        if mode == "nospec":
            continue
        for setting, sampled in measured["settings"].items():
            result = homogeneity(binned("nospec", setting), binned(mode, setting))
            counts = sampled["spec_decode"]
            drafts = counts["drafts"]
            rows.append(
                {
                    "mode": mode,
                    "sampling": setting,
                    "p_value": result.p_value,
                    "samples": len(sampled["token_ids"]),
                    "statistic": round(result.statistic, 2),
                    "dof": result.dof,
                    "reproducible": measured["reproducible"],
                    # Drafts verified per request and step, and the share of them accepted.
                    "verified_per_step": counts["draft_tokens"] / drafts if drafts else None,
                    "accepted_share": counts["accepted_tokens"] / counts["draft_tokens"]
                    if drafts
                    else None,
                }
            )
    return rows


def test_sampled_outputs_keep_the_targets_distribution(modes):
    rows = comparison_rows(modes)
    write_result(
        "sampling_lossless.json",
        "DSPARK_RESULTS_DIR=$OUT pytest tests/gpu/test_sampling_lossless_gpu.py",
        {
            "setup": f"embedded pair, float32, k=7, {NUM_PROMPTS} held-out prompts x {COPIES} "
            f"seeded samples of {FIRST_TOKENS} tokens per arm and setting, chi-square "
            "homogeneity against no speculation's samples",
            "settings": SETTINGS,
            "rows": rows,
        },
    )
    by_mode = {(row["mode"], row["sampling"]): row for row in rows}
    biased, stock = by_mode["biased", "temperature-1"], by_mode["stock", "temperature-1"]
    # The test can fail: a verifier that accepts every draft (more than stock's real
    # verification does) is caught.
    assert biased["accepted_share"] > stock["accepted_share"], (biased, stock)
    assert biased["p_value"] < BIASED_P, biased
    lossy = [row for row in rows if row["mode"] != "biased" and row["p_value"] < LOSSLESS_P]
    assert not lossy, lossy
    # Budget 0.5 verifies about half of the drafts: the comparison covered compacted steps.
    for setting in SETTINGS:
        assert by_mode["budget", setting]["verified_per_step"] < 0.75 * 7
    assert all(row["samples"] == NUM_PROMPTS * COPIES for row in rows)


def test_seeded_requests_repeat_their_outputs(modes):
    assert {mode: modes[mode]["reproducible"] for mode in DETERMINISTIC} == dict.fromkeys(
        DETERMINISTIC, True
    )
