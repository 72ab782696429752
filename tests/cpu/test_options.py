"""Bad options fail at start-up (engine-config build) with a message naming the key,
the bad value and the valid choices; good ones are parsed and carried."""

import json

import pytest

from vllm_dspark.config import DSparkOptionError, DSparkOptions, resolve_options

K = 7  # the tiny DSpark draft's block size


def spec(model_dirs, draft="dspark", **options):
    if draft == "ngram":
        base = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_max=3)
    else:
        base = dict(method=draft.split("_")[0], model=model_dirs[draft], num_speculative_tokens=K)
    return {**base, **options}


# (case, draft, --speculative-config options, environment, substrings the error must hold)
BAD_INPUTS = [
    (
        "unknown key",
        "dspark",
        {"dspark_capacty": "budget"},
        {},
        ["'dspark_capacty'", "Did you mean dspark_capacity?", "dspark_budget_frac"],
    ),
    (
        "unknown env",
        "dspark",
        {},
        {"VLLM_DSPARK_CAPACTY": "budget"},
        ["VLLM_DSPARK_CAPACTY", "Did you mean VLLM_DSPARK_CAPACITY?"],
    ),
    (
        "bad mode",
        "dspark",
        {"dspark_capacity": "fast"},
        {},
        ["dspark_capacity='fast'", "off, threshold, budget, sps"],
    ),
    (
        "mode wrong type",
        "dspark",
        {"dspark_capacity": 1},
        {},
        ["dspark_capacity=1", "off, threshold, budget, sps"],
    ),
    (
        "threshold above 1",
        "dspark",
        {"dspark_capacity": "threshold", "dspark_confidence_threshold": 1.5},
        {},
        ["dspark_confidence_threshold=1.5", "(0, 1)"],
    ),
    (
        "threshold zero",
        "dspark",
        {"dspark_capacity": "threshold", "dspark_confidence_threshold": 0.0},
        {},
        ["dspark_confidence_threshold=0.0", "(0, 1)"],
    ),
    (
        "threshold string",
        "dspark",
        {"dspark_capacity": "threshold", "dspark_confidence_threshold": "high"},
        {},
        ["'high'", "a number in (0, 1)"],
    ),
    (
        "threshold bool",
        "dspark",
        {"dspark_capacity": "threshold", "dspark_confidence_threshold": True},
        {},
        ["=True", "a number in (0, 1)"],
    ),
    (
        "budget zero",
        "dspark",
        {"dspark_capacity": "budget", "dspark_budget_frac": 0.0},
        {},
        ["dspark_budget_frac=0.0", "(0, 1]"],
    ),
    (
        "budget above 1",
        "dspark",
        {"dspark_capacity": "budget", "dspark_budget_frac": 1.5},
        {},
        ["dspark_budget_frac=1.5", "(0, 1]"],
    ),
    (
        "curve not increasing",
        "dspark",
        {"dspark_capacity": "sps", "dspark_sps_curve": [[1, 100.0], [1, 90.0]]},
        {},
        ["dspark_sps_curve", "strictly increasing"],
    ),
    (
        "curve zero speed",
        "dspark",
        {"dspark_capacity": "sps", "dspark_sps_curve": [[1, 100.0], [8, 0.0]]},
        {},
        ["dspark_sps_curve", "must be positive"],
    ),
    (
        "curve one point",
        "dspark",
        {"dspark_capacity": "sps", "dspark_sps_curve": [[1, 100.0]]},
        {},
        ["dspark_sps_curve", "at least two points"],
    ),
    (
        "curve missing file",
        "dspark",
        {"dspark_capacity": "sps", "dspark_sps_curve": "/nonexistent/curve.json"},
        {},
        ["/nonexistent/curve.json", '"auto"'],
    ),
    (
        "temperature negative",
        "dspark",
        {"dspark_capacity": "budget", "dspark_confidence_temperature": [1.0, -0.5]},
        {},
        ["dspark_confidence_temperature=[1.0, -0.5]", "positive"],
    ),
    (
        "temperature empty",
        "dspark",
        {"dspark_capacity": "budget", "dspark_confidence_temperature": []},
        {},
        ["dspark_confidence_temperature=[]"],
    ),
    (
        "bool wrong type",
        "dspark",
        {"dspark_fp8_draft_head": "maybe"},
        {},
        ["dspark_fp8_draft_head='maybe'", "true or false"],
    ),
    (
        "env bool",
        "dspark",
        {},
        {"VLLM_DSPARK_FP8_DRAFT_HEAD": "maybe"},
        ["VLLM_DSPARK_FP8_DRAFT_HEAD='maybe'", "true or false"],
    ),
    (
        "env out of range",
        "dspark",
        {"dspark_capacity": "threshold"},
        {"VLLM_DSPARK_CONFIDENCE_THRESHOLD": "2"},
        ["VLLM_DSPARK_CONFIDENCE_THRESHOLD=2", "(0, 1)"],
    ),
    (
        "option without its mode",
        "dspark",
        {"dspark_confidence_threshold": 0.7},
        {},
        ["dspark_confidence_threshold only applies with dspark_capacity=threshold", "'off'"],
    ),
    (
        "gate objective not a choice",
        "dspark",
        {"dspark_capacity": "sps", "dspark_varlen_verify": True, "dspark_gate_objective": "tail"},
        {},
        ["dspark_gate_objective", '"step" or "batch"'],
    ),
    (
        "gate objective without sps",
        "dspark",
        {
            "dspark_capacity": "budget",
            "dspark_varlen_verify": True,
            "dspark_gate_objective": "batch",
        },
        {},
        ["dspark_gate_objective only applies with dspark_capacity=sps", "'budget'"],
    ),
    (
        "varlen without capacity",
        "dspark",
        {"dspark_varlen_verify": True},
        {},
        ["dspark_varlen_verify only applies with", "dspark_capacity=sps"],
    ),
    (
        "confidence mode with dflash",
        "dflash",
        {"dspark_capacity": "threshold"},
        {},
        [
            "dspark_capacity='threshold' needs method 'dspark'",
            "method='dflash'",
            "capacity=off or acceptance",
        ],
    ),
    (
        "markov head with dflash",
        "dflash",
        {"dspark_fp8_markov_head": True},
        {},
        ["dspark_fp8_markov_head=True needs method 'dspark'"],
    ),
    (
        "another method",
        "ngram",
        {"dspark_fp8_draft_head": True},
        {},
        ["need speculative method dspark or dflash", "method='ngram'"],
    ),
    (
        "no confidence head",
        "dspark_no_confidence",
        {"dspark_capacity": "budget"},
        {},
        [
            "dspark_capacity='budget' needs a draft checkpoint with a confidence head",
            "dspark_no_confidence",
            "capacity=off",
        ],
    ),
    (
        "synthetic confidence out of range",
        "dspark",
        {"dspark_synthetic_confidence": [0.8, 1.2]},
        {},
        ["dspark_synthetic_confidence", "(0, 1)"],
    ),
    (
        "synthetic confidence too short",
        "dspark",
        {"dspark_synthetic_confidence": [0.8, 0.7]},
        {},
        ["dspark_synthetic_confidence has 2 values", "num_speculative_tokens=7"],
    ),
    (
        "synthetic confidence over vLLM's synthetic acceptance",
        "dspark",
        {
            "dspark_synthetic_confidence": [0.8] * K,
            "rejection_sample_method": "synthetic",
            "synthetic_acceptance_rates": [0.5] * K,
        },
        {},
        ["replaces vLLM's synthetic acceptance", "'standard'"],
    ),
    (
        "dash spelling",
        "dspark",
        {"dspark-capacity": "fastest"},
        {},
        ["dspark_capacity", "one of: off, threshold, budget, sps, acceptance"],
    ),
]


@pytest.mark.parametrize(
    "draft,options,environ,expected",
    [case[1:] for case in BAD_INPUTS],
    ids=[case[0] for case in BAD_INPUTS],
)
def test_bad_input_fails_at_startup(
    engine_config, model_dirs, monkeypatch, draft, options, environ, expected
):
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(DSparkOptionError) as error:
        engine_config(spec(model_dirs, draft, **options))
    message = str(error.value)
    assert message.startswith("vllm-dspark: ")
    for text in expected:
        assert text in message


def test_env_without_speculative_config_fails(engine_config, monkeypatch):
    monkeypatch.setenv("VLLM_DSPARK_FP8_DRAFT_HEAD", "1")
    with pytest.raises(DSparkOptionError, match="VLLM_DSPARK|dspark_fp8_draft_head set but"):
        engine_config(None)


def test_environment_wins_and_is_reported():
    options, overrides = resolve_options(
        {"dspark_capacity": "threshold", "dspark_confidence_threshold": 0.3},
        {"VLLM_DSPARK_CONFIDENCE_THRESHOLD": "0.8", "VLLM_DSPARK_ONLINE_STS": "true"},
    )
    assert options.capacity == "threshold"
    assert options.confidence_threshold == 0.8
    assert options.online_sts is True
    assert overrides == [
        "VLLM_DSPARK_CONFIDENCE_THRESHOLD=0.8 overrides dspark_confidence_threshold=0.3"
    ]


@pytest.mark.parametrize("text,value", [("1", True), ("0", False), ("yes", True), ("OFF", False)])
def test_environment_booleans(text, value):
    options, _ = resolve_options({}, {"VLLM_DSPARK_FP8_DRAFT_HEAD": text})
    assert options.fp8_draft_head is value
    # A switch whose unset default follows another option reads the same words.
    compact = {"dspark_capacity": "sps", "dspark_varlen_verify": True}
    options, _ = resolve_options(compact, {"VLLM_DSPARK_MIXED_STEPS": text})
    assert options.mixed_steps is value


def test_lists_from_files_and_inline_json(tmp_path):
    curve = tmp_path / "curve.json"
    curve.write_text(json.dumps({"curve": [[1, 200.0], [64, 150.0], [256, 60.0]]}))
    temps = tmp_path / "calibration.json"
    temps.write_text(json.dumps({"temperatures": [1.0, 1.2, 1.5]}))
    options, _ = resolve_options(
        {
            "dspark_capacity": "sps",
            "dspark_sps_curve": str(curve),
            "dspark_confidence_temperature": str(temps),
        },
        {},
    )
    assert options.sps_curve == [(1, 200.0), (64, 150.0), (256, 60.0)]
    assert options.confidence_temperature == [1.0, 1.2, 1.5]
    options, _ = resolve_options(
        {"dspark_capacity": "sps"}, {"VLLM_DSPARK_SPS_CURVE": "[[1, 10.0], [2, 9.0]]"}
    )
    assert options.sps_curve == [(1, 10.0), (2, 9.0)]


def test_defaults_are_inactive():
    options, _ = resolve_options({}, {})
    assert options == DSparkOptions()
    assert not options.active
    # Setting an option to its default value changes nothing either.
    assert not resolve_options({"dspark_capacity": "off"}, {})[0].active


def test_an_option_at_its_default_is_accepted_with_any_mode():
    # What a running engine's capacity switch sends (the pair arms test): dynamic depth
    # turned off while switching to a mode that has none. H200 at c6d6210: refused.
    options = DSparkOptions.model_validate(
        {"capacity": "budget", "plain_steps": False, "dynamic_depth": False}
    )
    assert options.non_default() == {"capacity": "budget"}
    with pytest.raises(ValueError, match="dspark_plain_steps only applies with"):
        DSparkOptions.model_validate({"capacity": "budget", "plain_steps": True})


def test_options_are_carried_in_the_engine_config(engine_config, model_dirs):
    stock = engine_config(spec(model_dirs))
    speculative = spec(
        model_dirs, dspark_capacity="budget", dspark_budget_frac=0.5, dspark_varlen_verify=True
    )
    config = engine_config(speculative)
    assert config.additional_config["dspark"] == {
        "capacity": "budget",
        "budget_frac": 0.5,
        "varlen_verify": True,
    }
    restored = DSparkOptions.from_vllm_config(config)
    assert (restored.capacity, restored.budget_frac, restored.varlen_verify) == (
        "budget",
        0.5,
        True,
    )
    assert DSparkOptions.from_vllm_config(stock) == DSparkOptions()
    # Options change the graphs, so they must change the config hash.
    assert config.compute_hash() != stock.compute_hash()
    # The caller's dict is not consumed: the same options give the same config again.
    assert "dspark_capacity" in speculative
    assert engine_config(speculative).compute_hash() == config.compute_hash()


def test_synthetic_confidence_stands_in_for_a_confidence_head(engine_config, model_dirs):
    config = engine_config(
        spec(
            model_dirs,
            "dspark_no_confidence",
            dspark_synthetic_confidence=[0.8] * K,
            dspark_capacity="budget",
            dspark_varlen_verify=True,
        )
    )
    options = DSparkOptions.from_vllm_config(config)
    assert options.synthetic_confidence == [0.8] * K and options.needs_confidence


@pytest.mark.parametrize("draft,capacity", [("dspark", "threshold"), ("dflash", "acceptance")])
def test_capacity_without_compaction_is_masked_verification(
    engine_config, model_dirs, draft, capacity
):
    """A capacity mode with varlen_verify off starts: its steps run every draft through
    the target and verify the admitted ones (patches/compact_verification.py)."""
    config = engine_config(spec(model_dirs, draft, dspark_capacity=capacity))
    options = DSparkOptions.from_vllm_config(config)
    assert options.capacity == capacity and not options.varlen_verify
