"""Every GSM8K eval config names valid vllm-dspark options."""

import sys
from pathlib import Path

import pytest

from vllm_dspark.config import KEY_PREFIX, SUPPORTED_METHODS, resolve_options

EVALS = Path(__file__).parents[1] / "evals" / "gsm8k"
sys.path.insert(0, str(EVALS))

from gsm8k_eval import EvalConfig, final_number  # noqa: E402

CONFIGS = sorted((EVALS / "configs").glob("*.yaml"))


def test_the_configs_the_project_promises_exist():
    names = {path.name for path in CONFIGS}
    assert "DeepSeek-V4-Flash-DSpark-sps-TP4.yaml" in names
    assert sum(name.startswith("Qwen3-8B-DSpark") for name in names) >= 2


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_options_validate(path):
    config = EvalConfig.load(path)
    assert 0 < config.accuracy_threshold <= 1 and config.num_questions > 0
    speculative = config.speculative_config()
    assert speculative is not None, "every eval here measures a speculative arm"
    ours = {k: v for k, v in speculative.items() if k.startswith(KEY_PREFIX)}
    options, _ = resolve_options(ours, config.env)  # raises DSparkOptionError if invalid
    if options.active:
        assert speculative["method"] in SUPPORTED_METHODS


def test_deepseek_tp4_config_is_what_it_says():
    config = EvalConfig.load(EVALS / "configs" / "DeepSeek-V4-Flash-DSpark-sps-TP4.yaml")
    assert "--tensor-parallel-size 4" in config.server_args
    speculative = config.speculative_config()
    assert speculative["num_speculative_tokens"] == 7
    options, _ = resolve_options({k: v for k, v in speculative.items() if k.startswith("dspark")})
    # Compact verification is refused at start-up on DeepSeek-V4's sparse MLA backends.
    assert (options.capacity, options.budget_frac, options.varlen_verify) == ("sps", 0.5, False)
    # The DSpark module ships in the target's checkpoint: vLLM takes the target's path.
    assert "model" not in speculative
    assert config.accuracy_threshold == 0.92


@pytest.mark.parametrize(
    "text,expected",
    [
        ("so she has 5 + 3 = 8 apples.\n#### 8", "8"),
        ("The answer is 1,234.", "1234"),
        ("It costs -3.5 dollars", "-3.5"),
        ("no number here", None),
    ],
)
def test_final_number(text, expected):
    assert final_number(text) == expected
