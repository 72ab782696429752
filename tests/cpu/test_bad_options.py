"""Bad inputs found open by a table of user mistakes: each fails while vLLM builds the
engine config, with a vllm-dspark message that names the key, the value given and what is
valid. Cases go through ``EngineArgs(...).create_engine_config()`` with the tiny
checkpoints (block_size 7, 4096 tokens); files they read live in ``{tmp}``."""

import json
import os

import pytest

from vllm_dspark.config import DSparkOptionError, DSparkOptions

K = 7  # the tiny drafters' block size
VOCAB = 4096  # their vocabulary
SPS = {"dspark_capacity": "sps"}
BUDGET = {"dspark_capacity": "budget"}
CURVE = [[1, 100.0], [8, 90.0]]
NAN, INF = float("nan"), float("inf")


def temperatures(n):
    return [1.0 + i / 10 for i in range(n)]


def spec(model_dirs, draft, options):
    """``draft`` None: the options alone, no method, model or K."""
    if draft is None:
        return dict(options)
    base = {"method": draft, "model": model_dirs[draft], "num_speculative_tokens": K}
    return base | options


def fill(value, tmp):
    """``{tmp}`` in the table's strings, as this test's folder."""
    if isinstance(value, str):
        return value.replace("{tmp}", str(tmp))
    if isinstance(value, dict):
        return {fill(k, tmp): fill(v, tmp) for k, v in value.items()}
    if isinstance(value, list):
        return [fill(v, tmp) for v in value]
    return value


# (case, draft, --speculative-config keys, environment, files under {tmp}, substrings of
# the message: key, value and what is valid)
BAD = [
    # 1. NaN and infinity, inline, in JSON files and in the environment.
    (
        "threshold nan",
        "dspark",
        {"dspark_capacity": "threshold", "dspark_confidence_threshold": NAN},
        {},
        {},
        ["dspark_confidence_threshold=nan", "finite number", "a number in (0, 1)"],
    ),
    (
        "threshold inf",
        "dspark",
        {"dspark_capacity": "threshold", "dspark_confidence_threshold": INF},
        {},
        {},
        ["dspark_confidence_threshold=inf", "finite number", "a number in (0, 1)"],
    ),
    (
        "budget fraction nan",
        "dspark",
        BUDGET | {"dspark_budget_frac": NAN},
        {},
        {},
        ["dspark_budget_frac=nan", "finite number", "a number in (0, 1]"],
    ),
    (
        "step overhead inf",
        "dspark",
        SPS | {"dspark_step_overhead_ms": INF},
        {},
        {},
        ["dspark_step_overhead_ms=inf", "finite number", '"auto" or a number of milliseconds'],
    ),
    (
        "step overhead -inf",
        "dspark",
        SPS | {"dspark_step_overhead_ms": -INF},
        {},
        {},
        ["dspark_step_overhead_ms=-inf", "finite number", '"auto" or a number of milliseconds'],
    ),
    (
        "curve speed nan",
        "dspark",
        SPS | {"dspark_sps_curve": [[1, 100.0], [8, NAN]]},
        {},
        {},
        ["dspark_sps_curve=[[1, 100.0], [8, nan]]", "finite number at [1][1]", "speeds > 0"],
    ),
    (
        "curve speed inf",
        "dspark",
        SPS | {"dspark_sps_curve": [[1, INF], [8, 90.0]]},
        {},
        {},
        ["dspark_sps_curve=", "finite number at [0][1]", "speeds > 0"],
    ),
    (
        "temperature nan",
        "dspark",
        BUDGET | {"dspark_confidence_temperature": [1.0, NAN] + [1.0] * (K - 2)},
        {},
        {},
        ["dspark_confidence_temperature=[1.0, nan", "finite number at [1]", "positive numbers"],
    ),
    (
        "temperature -inf",
        "dspark",
        BUDGET | {"dspark_confidence_temperature": [-INF] * K},
        {},
        {},
        ["dspark_confidence_temperature=[-inf", "finite number at [0]", "positive numbers"],
    ),
    (
        "synthetic confidence nan",
        "dspark",
        {"dspark_synthetic_confidence": [NAN] * K},
        {},
        {},
        ["dspark_synthetic_confidence=[nan", "finite number at [0]", "numbers in (0, 1)"],
    ),
    (
        "curve file with Infinity",
        "dspark",
        SPS | {"dspark_sps_curve": "{tmp}/curve.json"},
        {},
        {"curve.json": '{"curve": [[1, 100.0], [8, Infinity]]}'},
        ["dspark_sps_curve='{tmp}/curve.json'", "finite number at [1][1]", "speeds > 0"],
    ),
    (
        "temperature file with NaN",
        "dspark",
        BUDGET | {"dspark_confidence_temperature": "{tmp}/t.json"},
        {},
        {"t.json": '{"temperatures": [1.0, NaN, 1.0, 1.0, 1.0, 1.0, 1.0]}'},
        ["dspark_confidence_temperature='{tmp}/t.json'", "finite number at [1]", "positive"],
    ),
    (
        "env step overhead NaN",
        "dspark",
        SPS,
        {"VLLM_DSPARK_STEP_OVERHEAD_MS": "NaN"},
        {},
        ["VLLM_DSPARK_STEP_OVERHEAD_MS=nan", "finite number", '"auto" or a number'],
    ),
    (
        "env step overhead inf",
        "dspark",
        SPS,
        {"VLLM_DSPARK_STEP_OVERHEAD_MS": "inf"},
        {},
        ["VLLM_DSPARK_STEP_OVERHEAD_MS='inf'", "finite number", '"auto" or a number'],
    ),
    (
        "env budget Infinity",
        "dspark",
        BUDGET,
        {"VLLM_DSPARK_BUDGET_FRAC": "Infinity"},
        {},
        ["VLLM_DSPARK_BUDGET_FRAC=inf", "finite number", "(0, 1]"],
    ),
    (
        "env threshold nan",
        "dspark",
        {"dspark_capacity": "threshold"},
        {"VLLM_DSPARK_CONFIDENCE_THRESHOLD": "nan"},
        {},
        ["VLLM_DSPARK_CONFIDENCE_THRESHOLD='nan'", "a number in (0, 1)"],
    ),
    (
        "env temperatures with NaN",
        "dspark",
        BUDGET,
        {"VLLM_DSPARK_CONFIDENCE_TEMPERATURE": json.dumps([1.0] * (K - 1) + [NAN])},
        {},
        ["VLLM_DSPARK_CONFIDENCE_TEMPERATURE=[1.0", "finite number at [6]", "positive"],
    ),
    (
        "env curve with Infinity",
        "dspark",
        SPS,
        {"VLLM_DSPARK_SPS_CURVE": "[[1, 100.0], [8, Infinity]]"},
        {},
        ["VLLM_DSPARK_SPS_CURVE=[[1, 100.0], [8, inf]]", "finite number at [1][1]", "speeds"],
    ),
    (
        "env synthetic confidence with NaN",
        "dspark",
        {},
        {"VLLM_DSPARK_SYNTHETIC_CONFIDENCE": json.dumps([0.5] * (K - 1) + [NAN])},
        {},
        ["VLLM_DSPARK_SYNTHETIC_CONFIDENCE=[0.5", "finite number at [6]", "in (0, 1)"],
    ),
    # 2. Per-position lists: exactly K values.
    (
        "temperatures too short",
        "dspark",
        BUDGET | {"dspark_confidence_temperature": [1.0, 1.1, 1.2]},
        {},
        {},
        [
            "dspark_confidence_temperature has 3 values ([1.0, 1.1, 1.2])",
            "num_speculative_tokens=7",
            "exactly 7 values",
        ],
    ),
    (
        "temperatures too long",
        "dspark",
        BUDGET | {"dspark_confidence_temperature": temperatures(K + 1)},
        {},
        {},
        ["dspark_confidence_temperature has 8 values ([1.0", "exactly 7 values"],
    ),
    (
        "temperature file too long",
        "dspark",
        BUDGET | {"dspark_confidence_temperature": "{tmp}/t.json"},
        {},
        {"t.json": json.dumps({"temperatures": temperatures(K + 2)})},
        ["dspark_confidence_temperature has 9 values", "exactly 7 values"],
    ),
    (
        "env temperatures too short",
        "dspark",
        BUDGET,
        {"VLLM_DSPARK_CONFIDENCE_TEMPERATURE": "[1.0, 1.5]"},
        {},
        ["VLLM_DSPARK_CONFIDENCE_TEMPERATURE has 2 values ([1.0, 1.5])", "exactly 7 values"],
    ),
    (
        "temperatures of a smaller K",
        "dspark",
        BUDGET | {"num_speculative_tokens": 3, "dspark_confidence_temperature": temperatures(K)},
        {},
        {},
        ["dspark_confidence_temperature has 7 values", "num_speculative_tokens=3", "exactly 3"],
    ),
    (
        "synthetic confidence too long",
        "dspark",
        {"dspark_synthetic_confidence": [0.8] * (K + 1)},
        {},
        {},
        ["dspark_synthetic_confidence has 8 values ([0.8", "exactly 7 values"],
    ),
    # 3. Draft-vocabulary token ids outside the drafter's vocabulary.
    (
        "draft vocab count past the vocabulary",
        "dspark",
        {"dspark_draft_vocab": VOCAB + 1},
        {},
        {},
        ["dspark_draft_vocab=4097", "4096 tokens", "a count from 1 to 4096"],
    ),
    (
        "draft vocab id past the vocabulary",
        "dspark",
        {"dspark_draft_vocab": [5, VOCAB, 9, VOCAB + 7]},
        {},
        {},
        ["dspark_draft_vocab names token ids outside", "[4096, 4103] (2 of 4 ids)", "below 4096"],
    ),
    (
        "draft vocab file past the vocabulary",
        "dflash",
        {"dspark_draft_vocab": "{tmp}/vocab.json"},
        {},
        {"vocab.json": json.dumps({"token_ids": [0, 1, 99999]})},
        ["dspark_draft_vocab names token ids outside", "[99999] (1 of 3 ids)", "below 4096"],
    ),
    (
        "env draft vocab past the vocabulary",
        "dspark",
        {},
        {"VLLM_DSPARK_DRAFT_VOCAB": "5000"},
        {},
        ["VLLM_DSPARK_DRAFT_VOCAB=5000", "a count from 1 to 4096"],
    ),
    # 4. K past the drafter's block.
    (
        "K past the DSpark block",
        "dspark",
        BUDGET | {"num_speculative_tokens": K + 1},
        {},
        {},
        ["num_speculative_tokens=8", "block_size=7", "dspark_capacity", "from 1 to 7"],
    ),
    (
        "K past the DFlash block",
        "dflash",
        {"dspark_capacity": "acceptance", "num_speculative_tokens": 2 * K},
        {},
        {},
        ["num_speculative_tokens=14", "block_size=7", "from 1 to 7"],
    ),
    # 5. One option under two spellings.
    (
        "two spellings",
        "dspark",
        {"dspark_capacity": "budget", "dspark-capacity": "sps"},
        {},
        {},
        ["dspark_capacity is given twice", "'dspark_capacity'='budget'", "'dspark-capacity'='sps'"],
    ),
    (
        "two spellings, mixed dashes",
        "dspark",
        BUDGET | {"dspark_budget_frac": 0.5, "dspark-budget_frac": 0.5},
        {},
        {},
        ["dspark_budget_frac is given twice", "'dspark-budget_frac'=0.5", "one of the two"],
    ),
    # 7. Keys in the wrong case; options without method dspark or dflash.
    (
        "key in mixed case",
        "dspark",
        {"DSpark_capacity": "budget"},
        {},
        {},
        ["'DSpark_capacity'='budget'", "lower case", "Did you mean dspark_capacity?"],
    ),
    (
        "key in upper case",
        "dspark",
        {"DSPARK_CAPACITY": "budget"},
        {},
        {},
        ["'DSPARK_CAPACITY'='budget'", "lower case", "Did you mean dspark_capacity?"],
    ),
    (
        "dashed key in upper case",
        "dspark",
        {"DSPARK-BUDGET-FRAC": 0.5},
        {},
        {},
        ["'DSPARK-BUDGET-FRAC'=0.5", "lower case", "Did you mean dspark_budget_frac?"],
    ),
    (
        "env in lower case",
        "dspark",
        {},
        {"vllm_dspark_capacity": "budget"},
        {},
        ["vllm_dspark_capacity='budget'", "upper case", "Did you mean VLLM_DSPARK_CAPACITY?"],
    ),
    (
        "options alone",
        None,
        BUDGET,
        {},
        {},
        ["dspark_capacity='budget'", "no method", "method 'dspark' or 'dflash'"],
    ),
    (
        "options and K without method or model",
        None,
        BUDGET | {"num_speculative_tokens": K},
        {},
        {},
        ["dspark_capacity='budget'", "no method", "method 'dspark' or 'dflash'"],
    ),
    (
        "another method vLLM refuses",
        "dspark",
        {"method": "eagle", "dspark_fp8_draft_head": True},
        {},
        {},
        ["dspark_fp8_draft_head=True", "method='eagle'", "method 'dspark' or 'dflash'"],
    ),
    # 8. A bad number where "auto" is also valid.
    (
        "step overhead negative",
        "dspark",
        SPS | {"dspark_step_overhead_ms": -1},
        {},
        {},
        ["dspark_step_overhead_ms=-1", "greater than or equal to 0", '"auto" or a number'],
    ),
    (
        "step overhead not a number",
        "dspark",
        SPS | {"dspark_step_overhead_ms": "fast"},
        {},
        {},
        ["dspark_step_overhead_ms='fast'", "valid number", '"auto" or a number'],
    ),
    (
        "curve a number",
        "dspark",
        SPS | {"dspark_sps_curve": 5},
        {},
        {},
        ["dspark_sps_curve=5", "valid list", '"auto", a JSON list'],
    ),
    (
        "curve token count not an integer",
        "dspark",
        SPS | {"dspark_sps_curve": [[1.5, 100.0], [8, 90.0]]},
        {},
        {},
        ["dspark_sps_curve=[[1.5, 100.0]", "at [0][0]", '"auto", a JSON list'],
    ),
    # 9. A directory where a file is expected; a file that is not JSON.
    (
        "curve directory",
        "dspark",
        SPS | {"dspark_sps_curve": "{tmp}"},
        {},
        {},
        ["dspark_sps_curve='{tmp}'", "{tmp} is a directory", '"auto", a JSON list'],
    ),
    (
        "temperature directory",
        "dspark",
        BUDGET | {"dspark_confidence_temperature": "{tmp}"},
        {},
        {},
        ["dspark_confidence_temperature='{tmp}'", "is a directory", "positive numbers"],
    ),
    (
        "draft vocab directory from the environment",
        "dspark",
        {},
        {"VLLM_DSPARK_DRAFT_VOCAB": "{tmp}"},
        {},
        ["VLLM_DSPARK_DRAFT_VOCAB='{tmp}'", "is a directory", "a positive integer N"],
    ),
    (
        "curve file not JSON",
        "dspark",
        SPS | {"dspark_sps_curve": "{tmp}/curve.json"},
        {},
        {"curve.json": "1 100\n8 90\n"},
        ["dspark_sps_curve='{tmp}/curve.json'", "is not valid JSON", '"auto", a JSON list'],
    ),
    (
        "inline list not JSON",
        "dspark",
        BUDGET | {"dspark_confidence_temperature": "[1.0, 1.2"},
        {},
        {},
        ["dspark_confidence_temperature='[1.0, 1.2'", "not valid JSON", "positive numbers"],
    ),
]


@pytest.mark.parametrize(
    "draft,options,environ,files,expected",
    [case[1:] for case in BAD],
    ids=[case[0] for case in BAD],
)
def test_bad_input_fails_at_config_creation(
    engine_config, model_dirs, monkeypatch, tmp_path, draft, options, environ, files, expected
):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    for name, value in fill(environ, tmp_path).items():
        monkeypatch.setenv(name, value)
    with pytest.raises(DSparkOptionError) as error:
        engine_config(spec(model_dirs, draft, fill(options, tmp_path)))
    message = str(error.value)
    assert message.startswith("vllm-dspark: ")
    for text in fill(expected, tmp_path):
        assert text in message
    # A number where "auto" is also valid is told about the number, not the keyword.
    assert "Input should be 'auto'" not in message


# 6. Options written straight into additional_config["dspark"].
@pytest.mark.parametrize(
    "draft,options,stored,expected",
    [
        (None, None, {"capacity": "budget"}, '"dspark_capacity": "budget"'),
        ("dspark", {}, {"capacity": "budget", "budget_frac": 0.5}, '"dspark_budget_frac": 0.5'),
        ("dspark", BUDGET, {"capacity": "sps"}, '"dspark_capacity": "sps"'),
        ("dspark", {}, {"capacity": "fastest"}, '"dspark_capacity": "fastest"'),
        ("dspark", {}, "budget", '"dspark_capacity": "budget"'),
    ],
    ids=["no speculation", "no options", "other options", "bad value", "not a dict"],
)
def test_options_in_additional_config_are_refused(
    engine_config, model_dirs, draft, options, stored, expected
):
    speculative = None if draft is None else spec(model_dirs, draft, options)
    with pytest.raises(DSparkOptionError) as error:
        engine_config(speculative, additional_config={"dspark": stored})
    message = str(error.value)
    assert message.startswith(f"vllm-dspark: additional_config['dspark']={stored!r} is not read")
    assert "--speculative-config" in message and expected in message


def test_an_engines_args_build_their_config_again(engine_config, model_dirs):
    """The options stored in additional_config by a first build are what a second build of
    the same args stores: accepted, and the same config comes out."""
    from vllm.engine.arg_utils import EngineArgs

    speculative = spec(model_dirs, "dspark", BUDGET | {"dspark_varlen_verify": True})
    engine_config(None)  # registers the plugin
    args = EngineArgs(
        model=model_dirs["target"],
        load_format="dummy",
        skip_tokenizer_init=True,
        speculative_config=speculative,
    )
    first = args.create_engine_config()
    assert args.additional_config == {"dspark": {"capacity": "budget", "varlen_verify": True}}
    assert args.create_engine_config().compute_hash() == first.compute_hash()


# Inputs next to the bad ones that must still start.
GOOD = [
    (
        "K at the block size, K temperatures",
        "dspark",
        BUDGET | {"dspark_confidence_temperature": [1.2] * K},
    ),
    (
        "a smaller K, as many temperatures",
        "dspark",
        BUDGET | {"num_speculative_tokens": 3, "dspark_confidence_temperature": [1.2] * 3},
    ),
    ("the whole vocabulary", "dspark", {"dspark_draft_vocab": VOCAB}),
    ("the last token id", "dflash", {"dspark_draft_vocab": [0, VOCAB - 1]}),
    ("dashed key", "dspark", {"dspark-capacity": "budget"}),
    ("method detected from the draft's name", "dspark", BUDGET | {"method": None}),
    ("step overhead a number", "dspark", SPS | {"dspark_step_overhead_ms": 0.5}),
]


@pytest.mark.parametrize(
    "draft,options", [case[1:] for case in GOOD], ids=[case[0] for case in GOOD]
)
def test_good_neighbours_start(engine_config, model_dirs, draft, options):
    speculative = {k: v for k, v in spec(model_dirs, draft, options).items() if v is not None}
    config = engine_config(speculative)
    assert DSparkOptions.from_vllm_config(config).active
    assert config.speculative_config.method == draft


# 10. vLLM's warning about unknown VLLM_* variables.
def test_set_variables_are_declared_to_vllm(engine_config, model_dirs, monkeypatch):
    import vllm.envs as envs

    import vllm_dspark

    known = {
        k: v for k, v in envs.environment_variables.items() if not k.startswith("VLLM_DSPARK_")
    }
    monkeypatch.setattr(envs, "environment_variables", known)
    for name in [n for n in os.environ if n.startswith("VLLM_") and n not in known]:
        monkeypatch.delenv(name)
    # No option set: nothing declared, so vLLM's compile-cache key stays stock.
    factors = envs.compile_factors()
    vllm_dspark.register()
    assert envs.environment_variables == known
    assert envs.compile_factors() == factors
    monkeypatch.setenv("VLLM_DSPARK_CAPACITY", "budget")
    vllm_dspark.register()
    assert envs.environment_variables["VLLM_DSPARK_CAPACITY"]() == "budget"
    # Start-up that fails on an unknown VLLM_* variable passes, options applied.
    config = engine_config(spec(model_dirs, "dspark", {}), fail_on_environ_validation=True)
    assert DSparkOptions.from_vllm_config(config).capacity == "budget"
    # A misspelt variable is not declared: vLLM still reports it (and so do we).
    monkeypatch.setenv("VLLM_DSPARK_CAPACTY", "budget")
    vllm_dspark.register()
    with pytest.raises(ValueError, match="Unknown vLLM environment variable detected: VLLM_DSP"):
        envs.validate_environ(hard_fail=True)
