"""vllm-dspark's options: one typed object, validated once at start-up.

Users set options as ``dspark_*`` keys of ``--speculative-config`` (or of
``LLM(speculative_config=...)``) and as ``VLLM_DSPARK_*`` environment variables;
the environment wins. The resolved options travel to every vLLM process inside
``VllmConfig.additional_config["dspark"]`` (and so take part in its hash); with
no option set nothing is stored there and vLLM runs exactly as stock.

Validation happens in two steps, both before the engine starts:

1. :func:`resolve_options` parses and type-checks the raw values (unknown or
   misspelt keys, wrong types, NaN or infinite numbers, out-of-range numbers,
   malformed curves, options set for a mode that does not use them);
2. :func:`check_against_speculative_config` checks them against the speculative
   config vLLM built (method, K against the drafter's block and the per-position
   lists, token ids against the draft vocabulary, draft checkpoint);
Every failure raises :class:`DSparkOptionError` naming the key, the bad value and
the valid choices.
"""

from __future__ import annotations

import difflib
import functools
import itertools
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

KEY_PREFIX = "dspark_"
ENV_PREFIX = "VLLM_DSPARK_"
ADDITIONAL_CONFIG_KEY = "dspark"

# Methods whose drafters this plugin extends.
SUPPORTED_METHODS = ("dspark", "dflash")
# Capacity modes that rank drafts by the DSpark confidence head.
CONFIDENCE_MODES = ("threshold", "budget", "sps")

# Options given as a list, inline or in a JSON file: the key a file may hold it under.
LIST_FILE_KEYS = {
    "sps_curve": "curve",
    "confidence_temperature": "temperatures",
    "draft_vocab": "token_ids",
}

# Options with one value per draft position: exactly num_speculative_tokens of them.
PER_POSITION_OPTIONS = ("confidence_temperature", "synthetic_confidence")

StrictFloat = Annotated[float, Strict()]
StrictBool = Annotated[bool, Strict()]


class DSparkOptionError(ValueError):
    """A vllm-dspark option is unknown, malformed, or does not fit the config."""


def _valid(text: str) -> dict[str, Any]:
    # Human-readable valid range, shown in error messages and by `vllm-dspark doctor`.
    return {"valid": text}


class DSparkOptions(BaseModel):
    """Every option of vllm-dspark; the defaults are stock vLLM's behaviour."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, use_attribute_docstrings=True, allow_inf_nan=False
    )

    capacity: Literal["off", "threshold", "budget", "sps", "acceptance"] = Field(
        "off", json_schema_extra=_valid("one of: off, threshold, budget, sps, acceptance")
    )
    """How many of the K drafts each request verifies per target step. ``off``: all K
    (stock). ``threshold``: as many of the highest-survival slots as reached
    ``confidence_threshold`` last step. ``budget``: the highest-survival (request,
    position) slots of the batch, up to ceil(R*K*budget_frac). ``sps``: as many as
    maximised expected tokens per second on the target's SPS curve last step.
    ``acceptance``: the same depth for every request, the one of most expected tokens per
    second from the recent acceptance per position and the SPS curve (no confidence head
    needed; DFlash too)."""

    confidence_threshold: StrictFloat = Field(
        0.5, gt=0.0, lt=1.0, json_schema_extra=_valid("a number in (0, 1)")
    )
    """Survival threshold of ``capacity=threshold``."""

    budget_frac: StrictFloat = Field(
        1.0, gt=0.0, le=1.0, json_schema_extra=_valid("a number in (0, 1]")
    )
    """Cap on admitted drafts per step as a fraction of R*K (``budget`` and ``sps``)."""

    sps_curve: Literal["auto"] | list[tuple[int, float]] = Field(
        "auto",
        json_schema_extra=_valid(
            '"auto", a JSON list of [tokens_per_step, steps_per_second] pairs with '
            "tokens strictly increasing and speeds > 0, or the path of a JSON file "
            "holding such a list"
        ),
    )
    """Target steps per second against tokens per step, for ``capacity=sps`` and
    ``acceptance``; ``auto`` profiles it at start-up from CUDA-graph replays (without FULL
    graphs, ``acceptance`` follows the accepted length alone)."""

    step_overhead_ms: Literal["auto"] | Annotated[float, Field(ge=0.0)] = Field(
        "auto", json_schema_extra=_valid('"auto" or a number of milliseconds >= 0')
    )
    """Time per target step that the SPS curve leaves out (scheduling, input preparation,
    sampling, output handling), for ``capacity=sps`` and ``acceptance``: ``auto`` fits it
    while serving, per step, per verified draft and per compacted step; a number fixes
    the per-step part (0: the curve alone)."""

    confidence_temperature: list[StrictFloat] | None = Field(
        None,
        json_schema_extra=_valid(
            "a JSON list of positive numbers, one per draft position (num_speculative_tokens "
            'of them), or the path of a JSON file holding such a list or {"temperatures": [...]}'
        ),
    )
    """Per-position temperatures of the confidence head, one per draft position; unset
    means the draft checkpoint's ``dspark_calibration.json`` when present (its first K),
    else 1."""

    online_sts: StrictBool = Field(False, json_schema_extra=_valid("true or false"))
    """Refit the per-position confidence temperatures while serving (online
    Sequential Temperature Scaling)."""

    dynamic_depth: StrictBool = Field(False, json_schema_extra=_valid("true or false"))
    """Compute only as many draft positions as recent load admits (``acceptance``: the
    depth the next step verifies)."""

    varlen_verify: StrictBool = Field(False, json_schema_extra=_valid("true or false"))
    """With a capacity mode, how the admitted drafts are verified: true, packed without
    padding (compact variable-length verification; FlashAttention or Triton attention);
    false, masked (the target still runs every draft; any attention backend)."""

    mixed_steps: bool | None = Field(None, strict=True, json_schema_extra=_valid("true or false"))
    """Steps that also carry prompts (a new request's prefill, the chunk of a long one)
    verify only the admitted drafts too, not all K; unset, on with ``varlen_verify``.
    False: they verify every draft. In a server whose requests arrive one by one most
    steps carry a prompt."""

    plain_steps: StrictBool = Field(False, json_schema_extra=_valid("true or false"))
    """``capacity=sps``: while the draft gate is closed, the scheduler schedules plain
    decode steps (no drafts: nothing verified, no rejection sampling) instead of
    speculative steps that verify nothing."""

    gate_objective: Literal["step", "batch"] = Field(
        "step", json_schema_extra=_valid('"step" or "batch"')
    )
    """``capacity=sps``: what the draft gate maximises. ``step``: the tokens per second of
    each step (the mean request's survivals), for servers whose batch refills. ``batch``:
    how soon the running requests all finish (the survivals of the request that drafts
    worst), for offline batches submitted at once, which last as long as their slowest
    request (``benchmarks/batch_steps.py``)."""

    confidence_metrics: StrictBool = Field(False, json_schema_extra=_valid("true or false"))
    """Measure the confidence head's calibration (per-position ECE and AUROC) while
    serving, without changing what is verified."""

    fp8_draft_head: StrictBool = Field(False, json_schema_extra=_valid("true or false"))
    """Draft with a private rowwise-FP8 copy of the LM head; verification keeps bf16."""

    fp8_markov_head: StrictBool = Field(False, json_schema_extra=_valid("true or false"))
    """Also use rowwise FP8 for the DSpark Markov head's vocabulary projection."""

    fp8_draft_backbone: StrictBool = Field(False, json_schema_extra=_valid("true or false"))
    """Run the drafter's own layers in rowwise FP8, converted from its bf16 weights once it
    has loaded (:mod:`vllm_dspark.draft_fp8`). Verification keeps the target's weights."""

    draft_vocab: Annotated[int, Strict(), Field(gt=0)] | list[Annotated[int, Strict()]] | None = (
        Field(
            None,
            json_schema_extra=_valid(
                "a positive integer N (the first N token ids), a JSON list of token ids, or "
                'the path of a JSON file holding such a list or {"token_ids": [...]}'
            ),
        )
    )
    """Draft over part of the vocabulary (frequency-ranked drafting): the draft LM head
    and DSpark's Markov projection score only these tokens, which cuts their cost at large
    batches; verification still scores the whole vocabulary, so outputs stay the target's
    and only acceptance can drop. N keeps token ids 0..N-1 (a byte-level BPE vocabulary
    is ordered by merge rank, which follows frequency); a list keeps the ids it names (the
    most frequent on your own traffic)."""

    synthetic_confidence: list[Annotated[float, Field(gt=0.0, lt=1.0)]] | None = Field(
        None,
        json_schema_extra=_valid(
            "a JSON list of numbers in (0, 1), one per draft position (num_speculative_tokens "
            "of them; benchmarks only)"
        ),
    )
    """Benchmarks with dummy weights only: instead of a confidence head and real
    verification, draw each draft's confidence c = sigmoid(b_k + 2 N(0, 1)), its mean at
    position k this list's k-th value (the conditional acceptance rate), and accept the
    draft with probability c (given its prefix was accepted), so confidence is calibrated
    by construction (:mod:`vllm_dspark.bench.synthetic`)."""

    @field_validator(*LIST_FILE_KEYS, mode="before")
    @classmethod
    def _load_list(cls, value: Any, info: ValidationInfo) -> Any:
        # A string other than a keyword: an inline JSON list or a JSON file's path.
        if isinstance(value, str) and value != "auto":
            return _load_json_list(value, key=LIST_FILE_KEYS[info.field_name])
        return value

    @field_validator("sps_curve")
    @classmethod
    def _check_curve(cls, value: Any) -> Any:
        if value == "auto":
            return value
        if len(value) < 2:
            raise ValueError("needs at least two points")
        tokens = [t for t, _ in value]
        if any(b <= a for a, b in itertools.pairwise(tokens)) or tokens[0] < 1:
            raise ValueError("tokens per step must be positive and strictly increasing")
        if any(speed <= 0 for _, speed in value):
            raise ValueError("steps per second must be positive")
        return value

    @field_validator("draft_vocab")
    @classmethod
    def _check_draft_vocab(cls, value: int | list[int] | None) -> int | list[int] | None:
        if isinstance(value, list):
            if not value or min(value) < 0:
                raise ValueError("token ids must be a non-empty list of integers >= 0")
            if len(set(value)) != len(value):
                raise ValueError("token ids must not repeat")
        return value

    @field_validator("confidence_temperature")
    @classmethod
    def _check_temperatures(cls, value: list[float] | None) -> list[float] | None:
        if value is not None and (not value or any(t <= 0 for t in value)):
            raise ValueError("temperatures must be a non-empty list of positive numbers")
        return value

    @model_validator(mode="after")
    def _check_modes(self) -> DSparkOptions:
        # An option set for a mode that does not read it would be silently ignored; one
        # given at its default (a switch turning dynamic depth off) changes nothing.
        needs = {
            "confidence_threshold": ("threshold",),
            "budget_frac": ("budget", "sps"),
            "sps_curve": ("sps", "acceptance"),
            "step_overhead_ms": ("sps", "acceptance"),
            "confidence_temperature": CONFIDENCE_MODES,
            "online_sts": CONFIDENCE_MODES,
            "dynamic_depth": (*CONFIDENCE_MODES, "acceptance"),
            "varlen_verify": (*CONFIDENCE_MODES, "acceptance"),
            "mixed_steps": (*CONFIDENCE_MODES, "acceptance"),
            "plain_steps": ("sps", "acceptance"),
            "gate_objective": ("sps",),
        }
        for name, modes in needs.items():
            default = type(self).model_fields[name].get_default(call_default_factory=True)
            if getattr(self, name) != default and self.capacity not in modes:
                choices = ", ".join(f"{KEY_PREFIX}capacity={m}" for m in modes)
                raise ValueError(
                    f"{KEY_PREFIX}{name} only applies with {choices}; "
                    f"{KEY_PREFIX}capacity is {self.capacity!r}"
                )
        if self.mixed_steps and not self.varlen_verify:
            raise ValueError(
                f"{KEY_PREFIX}mixed_steps only applies with {KEY_PREFIX}varlen_verify=true "
                "(a masked step runs every draft anyway)"
            )
        return self

    @property
    def compacts_mixed_steps(self) -> bool:
        """Whether steps that carry prompts compact their decoding requests."""
        return self.varlen_verify if self.mixed_steps is None else self.mixed_steps

    @property
    def needs_confidence(self) -> bool:
        """Whether drafting must run the checkpoint's confidence head."""
        return (
            self.capacity in CONFIDENCE_MODES
            or self.confidence_metrics
            or self.online_sts
            or self.synthetic_confidence is not None
        )

    @property
    def active(self) -> bool:
        """Whether any option differs from stock behaviour."""
        return bool(self.non_default())

    def non_default(self) -> dict[str, Any]:
        """The options that differ from their defaults, JSON-serialisable."""
        return self.model_dump(mode="json", exclude_defaults=True)

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> DSparkOptions:
        """The options carried by a ``VllmConfig`` (defaults when none were set)."""
        extra = vllm_config.additional_config
        stored = extra.get(ADDITIONAL_CONFIG_KEY) if isinstance(extra, dict) else None
        return cls.model_validate(stored or {})


OPTION_NAMES = tuple(DSparkOptions.model_fields)


def _load_json_list(text: str, key: str) -> Any:
    """A JSON list given inline, or the path of a JSON file with a list (or {key: list})."""
    if text.lstrip().startswith("["):
        return _parse_json(text, "inline JSON list")
    path = Path(text).expanduser()
    if path.is_dir():
        raise ValueError(f"{text} is a directory, not a JSON file")
    if not path.is_file():
        raise ValueError(f"not a JSON list and no such file: {text}")
    data = _parse_json(path.read_text(), f"file {text}")
    return data[key] if isinstance(data, dict) and key in data else data


def _parse_json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"the {what} is not valid JSON ({error})") from None


def _env_name(option: str) -> str:
    return ENV_PREFIX + option.upper()


def _closest(name: str, choices: list[str]) -> str:
    match = difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
    return f" Did you mean {match[0]}?" if match else ""


def register_environment_variables() -> None:
    """Declare the ``VLLM_DSPARK_*`` variables that are set to vLLM, which warns about
    every ``VLLM_*`` variable it does not know. Only set ones: each declared variable
    enters vLLM's compile-cache key, which stays stock when no option is set."""
    import vllm.envs

    for name in OPTION_NAMES:
        env = _env_name(name)
        if env in os.environ and env not in vllm.envs.environment_variables:
            vllm.envs.environment_variables[env] = functools.partial(os.getenv, env)


def _parse_env_value(option: str, text: str) -> Any:
    """Environment values are strings: read booleans and JSON, keep the rest as text."""
    if DSparkOptions.model_fields[option].annotation in (bool, bool | None):
        lowered = text.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


# Errors of a value of the right type that breaks a bound.
_BOUND_ERRORS = frozenset(
    {
        "greater_than",
        "greater_than_equal",
        "less_than",
        "less_than_equal",
        "finite_number",
        "too_short",
        "too_long",
    }
)


def _error_rank(item: dict) -> tuple[int, int]:
    """Which of an option's errors to report: a union (``"auto"`` or a number) reports one
    per branch, and the telling one is our own check, then a broken bound, then a wrong
    type; a keyword branch's "Input should be 'auto'" only when nothing else failed. Of
    equals, the one that got deepest into the value."""
    kind = item["type"]
    if kind == "value_error":
        rank = 0
    elif kind in _BOUND_ERRORS:
        rank = 1
    else:
        rank = 3 if kind == "literal_error" else 2
    return rank, -len(item["loc"])


def _format_errors(error: ValidationError, sources: Mapping[str, str], raw: Mapping) -> str:
    # One message per option.
    by_option: dict[str | None, dict] = {}
    for item in error.errors():
        option = item["loc"][0] if item["loc"] else None
        if option not in by_option or _error_rank(item) < _error_rank(by_option[option]):
            by_option[option] = item
    lines = []
    for option, item in by_option.items():
        message = item["msg"].removeprefix("Value error, ")
        # Where in a list the bad item sits, e.g. [1][1] for a curve's second speed.
        where = "".join(f"[{i}]" for i in item["loc"][1:] if isinstance(i, int))
        if where:
            message += f" at {where}"
        if option in sources:
            valid = DSparkOptions.model_fields[option].json_schema_extra["valid"]
            lines.append(
                f"{sources[option]}={raw[option]!r} is invalid: {message}. Valid: {valid}."
            )
        else:  # a check across options
            lines.append(message + ".")
    return "vllm-dspark: " + " ".join(lines)


def resolve_options(
    spec_keys: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> tuple[DSparkOptions, list[str]]:
    """Parse ``dspark_*`` keys and ``VLLM_DSPARK_*`` variables into options.

    Returns the options and one log line per environment variable that overrode a key.
    """
    environ = os.environ if environ is None else environ
    raw: dict[str, Any] = {}
    sources: dict[str, str] = {}
    given_as: dict[str, str] = {}  # the spelling each option came under
    keys = [KEY_PREFIX + name for name in OPTION_NAMES]
    for key, value in spec_keys.items():
        # vLLM reads '-' as '_' in key names; so do we.
        canonical = key.replace("-", "_")
        name = canonical.removeprefix(KEY_PREFIX)
        if not canonical.startswith(KEY_PREFIX) or name not in OPTION_NAMES:
            lowered = canonical.lower()
            case = " (option keys are lower case)" if lowered != canonical else ""
            raise DSparkOptionError(
                f"vllm-dspark: unknown option {key!r}={value!r} in the speculative config"
                f"{case}.{_closest(lowered, keys)} Valid options: {', '.join(keys)}."
            )
        if name in raw:
            raise DSparkOptionError(
                f"vllm-dspark: {KEY_PREFIX}{name} is given twice, as {given_as[name]!r}="
                f"{raw[name]!r} and {key!r}={value!r}. Valid: one of the two spellings."
            )
        raw[name], sources[name], given_as[name] = value, KEY_PREFIX + name, key
    overrides = []
    env_names = [_env_name(name) for name in OPTION_NAMES]
    for env, text in sorted(environ.items()):
        if not env.upper().startswith(ENV_PREFIX):
            continue
        name = env.upper().removeprefix(ENV_PREFIX).lower()
        if not env.startswith(ENV_PREFIX) or name not in OPTION_NAMES:
            case = " (variable names are upper case)" if env != env.upper() else ""
            raise DSparkOptionError(
                f"vllm-dspark: unknown environment variable {env}={text!r}{case}."
                f"{_closest(env.upper(), env_names)} Valid variables: {', '.join(env_names)}."
            )
        value = _parse_env_value(name, text)
        if name in raw:
            overrides.append(f"{env}={text} overrides {sources[name]}={raw[name]!r}")
        raw[name], sources[name] = value, env
    try:
        return DSparkOptions(**raw), overrides
    except ValidationError as error:
        raise DSparkOptionError(_format_errors(error, sources, raw)) from None


# vLLM's name for DeepSeek-V4's DSpark module, configured by the target's own config.json.
DEEPSEEK_V4_DSPARK = "DSparkDraftModel"


def _draft_has_confidence_head(speculative_config: Any) -> bool:
    """``enable_confidence_head`` of the draft's config. DeepSeek-V4's DSpark module, whose
    config is the target's, is taken to have one unless it says otherwise; its load then
    fails with a clear message where the checkpoint holds none."""
    draft = getattr(speculative_config, "draft_model_config", None)
    hf_config = getattr(draft, "hf_config", None)
    default = DEEPSEEK_V4_DSPARK in (getattr(hf_config, "architectures", None) or ())
    return bool(getattr(hf_config, "enable_confidence_head", default))


def _label(name: str) -> str:
    """How the user set an option: its variable where the environment set it, else its key."""
    env = _env_name(name)
    return env if env in os.environ else KEY_PREFIX + name


def _brief(values: list) -> str:
    return repr(values) if len(values) <= 8 else f"[{', '.join(map(repr, values[:8]))}, ...]"


def _check_against_drafter(options: DSparkOptions, speculative_config: Any) -> None:
    """K against the drafter's block and the per-position lists; the draft vocabulary's
    token ids against the draft model's vocabulary."""
    num_drafts = getattr(speculative_config, "num_speculative_tokens", None)
    draft = getattr(speculative_config, "draft_model_config", None)
    hf_config = getattr(draft, "hf_config", None)
    model = getattr(speculative_config, "model", None)
    # A DSpark/DFlash checkpoint drafts one block of block_size positions in one pass;
    # DeepSeek-V4's DSpark module, configured by the target's config, is left to vLLM.
    block_size = getattr(hf_config, "block_size", None)
    is_deepseek_v4 = DEEPSEEK_V4_DSPARK in (getattr(hf_config, "architectures", None) or ())
    if isinstance(num_drafts, int) and isinstance(block_size, int) and not is_deepseek_v4:
        if num_drafts > block_size:
            set_keys = ", ".join(KEY_PREFIX + name for name in options.non_default())
            raise DSparkOptionError(
                f"vllm-dspark: num_speculative_tokens={num_drafts} is more than the "
                f"{block_size} positions the drafter {model} drafts (block_size={block_size} "
                f"in its config.json); {set_keys} need K within its block. Valid: "
                f"num_speculative_tokens from 1 to {block_size}."
            )
    # Per-position lists: one value per draft position, like vLLM's synthetic_acceptance_rates.
    for name in PER_POSITION_OPTIONS:
        values = getattr(options, name)
        if values is not None and isinstance(num_drafts, int) and len(values) != num_drafts:
            raise DSparkOptionError(
                f"vllm-dspark: {_label(name)} has {len(values)} values ({_brief(values)}); "
                f"num_speculative_tokens={num_drafts} needs one per draft position. "
                f"Valid: exactly {num_drafts} values."
            )
    vocab_size = getattr(hf_config, "vocab_size", None)
    if options.draft_vocab is None or not isinstance(vocab_size, int):
        return
    valid = (
        f"the draft model {model} has {vocab_size} tokens (ids 0..{vocab_size - 1}). Valid: "
        f"a count from 1 to {vocab_size}, or token ids below {vocab_size}."
    )
    if isinstance(options.draft_vocab, int) and options.draft_vocab > vocab_size:
        raise DSparkOptionError(
            f"vllm-dspark: {_label('draft_vocab')}={options.draft_vocab} keeps token ids "
            f"0..{options.draft_vocab - 1}; {valid}"
        )
    if isinstance(options.draft_vocab, list):
        outside = sorted(i for i in options.draft_vocab if i >= vocab_size)
        if outside:
            raise DSparkOptionError(
                f"vllm-dspark: {_label('draft_vocab')} names token ids outside the draft "
                f"vocabulary: {_brief(outside)} ({len(outside)} of {len(options.draft_vocab)} "
                f"ids); {valid}"
            )


def check_against_speculative_config(options: DSparkOptions, speculative_config: Any) -> None:
    """Refuse options that do not fit the speculative config vLLM built."""
    if not options.active:
        return
    set_keys = ", ".join(KEY_PREFIX + name for name in options.non_default())
    if speculative_config is None:
        raise DSparkOptionError(
            f"vllm-dspark: {set_keys} set but speculative decoding is off; pass "
            '--speculative-config with "method": "dspark" or "dflash".'
        )
    method = speculative_config.method
    if method not in SUPPORTED_METHODS:
        raise DSparkOptionError(
            f"vllm-dspark: {set_keys} need speculative method dspark or dflash; "
            f"got method={method!r}."
        )
    # The confidence modes rank drafts by confidence, which DFlash lacks.
    dspark_only = [
        name
        for name in (
            *(("capacity",) if options.capacity in CONFIDENCE_MODES else ()),
            "confidence_metrics",
            "online_sts",
            "fp8_markov_head",
            "synthetic_confidence",
        )
        if name in options.non_default()
    ]
    if method != "dspark" and dspark_only:
        name = dspark_only[0]
        raise DSparkOptionError(
            f"vllm-dspark: {KEY_PREFIX}{name}={getattr(options, name)!r} needs method "
            f"'dspark' (a drafter with a confidence/Markov head); got method={method!r}. "
            f"Valid with {method}: {KEY_PREFIX}capacity=off or acceptance."
        )
    _check_against_drafter(options, speculative_config)
    if options.plain_steps and speculative_config.num_speculative_tokens_per_batch_size:
        raise DSparkOptionError(
            f"vllm-dspark: {KEY_PREFIX}plain_steps=True decides the drafts each step "
            "schedules, which vLLM's Dynamic SD table num_speculative_tokens_per_batch_size "
            "also does; set one of the two."
        )
    draft = getattr(speculative_config, "draft_model_config", None)
    # A quantised checkpoint, or the speculative config's own "quantization" key.
    draft_quantization = getattr(
        getattr(draft, "hf_config", None), "quantization_config", None
    ) or getattr(draft, "quantization", None)
    draft_dtype = getattr(draft, "dtype", None)
    if options.fp8_draft_backbone and draft_dtype not in (None, torch.bfloat16, torch.float16):
        raise DSparkOptionError(
            f"vllm-dspark: {KEY_PREFIX}fp8_draft_backbone=True quantises a bf16 or fp16 draft "
            f"(rowwise FP8 GEMMs), and this engine runs {draft_dtype}. Valid here: --dtype "
            f"bfloat16, or {KEY_PREFIX}fp8_draft_backbone=false."
        )
    if options.fp8_draft_backbone and draft_quantization:
        method = (
            draft_quantization.get("quant_method")
            if isinstance(draft_quantization, dict)
            else draft_quantization
        )
        raise DSparkOptionError(
            f"vllm-dspark: {KEY_PREFIX}fp8_draft_backbone=True quantises a bf16 draft; "
            f"{speculative_config.model} is already quantised ({method}). Valid here: "
            f"{KEY_PREFIX}fp8_draft_backbone=false."
        )
    if options.synthetic_confidence is not None:
        if getattr(speculative_config, "rejection_sample_method", None) == "synthetic":
            raise DSparkOptionError(
                f"vllm-dspark: {KEY_PREFIX}synthetic_confidence replaces vLLM's synthetic "
                "acceptance; drop rejection_sample_method='synthetic' (valid: 'standard')."
            )
        return  # no confidence head is read
    if options.needs_confidence and not _draft_has_confidence_head(speculative_config):
        name = next(n for n in ("capacity", "confidence_metrics", "online_sts") if n in dspark_only)
        raise DSparkOptionError(
            f"vllm-dspark: {KEY_PREFIX}{name}={getattr(options, name)!r} needs a draft "
            "checkpoint with a confidence head (enable_confidence_head: true in its "
            f"config.json); {speculative_config.model} has none. Valid without one: "
            f"{KEY_PREFIX}capacity=off."
        )
