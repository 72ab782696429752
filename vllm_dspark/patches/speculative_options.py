"""Take vllm-dspark's options out of the speculative config before vLLM validates it.

What: wraps ``EngineArgs.create_speculative_config``. The ``dspark_*`` keys of the
speculative-config dict are set aside, merged with the ``VLLM_DSPARK_*`` environment
(which wins, with a log line), validated, checked against the ``SpeculativeConfig``
vLLM then builds from the remaining keys, and stored in
``EngineArgs.additional_config["dspark"]``, from which ``VllmConfig`` carries them to
every engine-core and worker process. With no option set it calls the stock method
and stores nothing, so the config (and its hash) stays stock. Options written into
``additional_config["dspark"]`` by hand are refused, since they would skip these checks;
so are ``dspark_*`` options whose speculative config vLLM cannot build without method
dspark or dflash. ``dspark_plain_steps`` also
sets the Dynamic SD table of :func:`vllm_dspark.capacity.plain_steps.dynamic_sd_table`.
Why: ``SpeculativeConfig`` is a pydantic dataclass with ``extra="forbid"``, so an
unknown key fails, and vLLM has no way for a plugin to declare speculative options.
Upstream: no plugin-extensible speculative config in vLLM 0.26.0 (a speculator
registry is proposed in vllm-project/vllm#36219).
Remove when: vLLM lets plugins declare speculative-config fields.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError
from vllm.engine.arg_utils import EngineArgs
from vllm.logger import init_logger

from vllm_dspark.capacity import plain_steps
from vllm_dspark.config import (
    ADDITIONAL_CONFIG_KEY,
    KEY_PREFIX,
    SUPPORTED_METHODS,
    DSparkOptionError,
    DSparkOptions,
    check_against_speculative_config,
    resolve_options,
)
from vllm_dspark.patches.wrapping import wrap

# Under vLLM's logger namespace, so that our lines share its handlers and format.
logger = init_logger(f"vllm.{__name__}")


def _split_keys(spec: dict[str, Any] | None) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(vLLM's keys, our keys as given). Ours start with ``dspark_`` in any case and with
    '-' for '_' (which vLLM accepts too), so that a misspelt one gets our message, not
    vLLM's "unexpected keyword argument"."""
    if spec is None:
        return None, {}

    def is_ours(key: str) -> bool:
        return key.replace("-", "_").lower().startswith(KEY_PREFIX)

    ours = {k: v for k, v in spec.items() if is_ours(k)}
    theirs = {k: v for k, v in spec.items() if not is_ours(k)}
    return theirs, ours


def _refuse_options_in_additional_config(additional_config: Any, options: DSparkOptions) -> None:
    """``additional_config["dspark"]`` carries the options resolved here; one set there by
    hand would skip their checks. Accepted only as what this build stores anyway (an
    engine's args built again)."""
    if not isinstance(additional_config, dict):
        return  # refused below where options are set
    stored = additional_config.get(ADDITIONAL_CONFIG_KEY)
    if stored is None or stored == options.non_default():
        return
    example = (
        ", ".join(f'"{KEY_PREFIX}{k}": {json.dumps(v)}' for k, v in stored.items())
        if isinstance(stored, dict) and stored
        else f'"{KEY_PREFIX}capacity": "budget"'
    )
    raise DSparkOptionError(
        f"vllm-dspark: additional_config[{ADDITIONAL_CONFIG_KEY!r}]={stored!r} is not read: "
        "it is where vllm-dspark keeps the options it took from --speculative-config. Valid: "
        f"set them as dspark_* keys of --speculative-config ({{..., {example}}}) or as "
        "VLLM_DSPARK_* environment variables."
    )


def _vllm_reason(error: Exception) -> str:
    """The first sentence of vLLM's reason."""
    text = str(error)
    if isinstance(error, ValidationError) and error.errors():
        text = error.errors()[0]["msg"].removeprefix("Value error, ")
    return text.split(". ")[0].rstrip(".")


def _make_wrapper(create_speculative_config):
    def create_speculative_config_with_dspark(self: EngineArgs, *args, **kwargs):
        stock_keys, our_keys = _split_keys(self.speculative_config)
        options, overrides = resolve_options(our_keys)
        for line in overrides:
            logger.warning("vllm-dspark: %s (the environment wins).", line)
        _refuse_options_in_additional_config(self.additional_config, options)
        self.speculative_config = stock_keys
        try:
            speculative_config = create_speculative_config(self, *args, **kwargs)
        except ValueError as error:
            # Without method dspark or dflash our options cannot apply; say so first.
            method = (stock_keys or {}).get("method")
            if not options.active or stock_keys is None or method in SUPPORTED_METHODS:
                raise
            given = ", ".join(f"{KEY_PREFIX}{k}={v!r}" for k, v in options.non_default().items())
            raise DSparkOptionError(
                f"vllm-dspark: options {given} need a speculative config with method 'dspark' "
                f"or 'dflash'; got {f'method={method!r}' if method else 'no method'}, from which "
                f"vLLM could not build one: {_vllm_reason(error)}. Valid: "
                '--speculative-config \'{"method": "dspark", "model": <draft>, '
                '"num_speculative_tokens": <K>, ...}\'.'
            ) from error
        finally:
            # Put our keys back so that building the config again sees them again.
            if our_keys:
                self.speculative_config = {**(self.speculative_config or {}), **our_keys}
        check_against_speculative_config(options, speculative_config)
        if options.plain_steps:
            if self.data_parallel_size > 1:
                raise DSparkOptionError(
                    f"vllm-dspark: {KEY_PREFIX}plain_steps=True with data_parallel_size="
                    f"{self.data_parallel_size}: data-parallel ranks would schedule different "
                    "draft counts (vLLM refuses Dynamic SD there too). Valid: "
                    "data_parallel_size=1."
                )
            # The table that captures one-token decode graphs for the plain steps.
            speculative_config.num_speculative_tokens_per_batch_size = plain_steps.dynamic_sd_table(
                speculative_config.num_speculative_tokens
            )
        if options.active:
            if not isinstance(self.additional_config, dict):
                raise DSparkOptionError(
                    "vllm-dspark: options need additional_config to be a dict; got "
                    f"{type(self.additional_config).__name__}."
                )
            self.additional_config = {
                **self.additional_config,
                ADDITIONAL_CONFIG_KEY: options.non_default(),
            }
            logger.info("vllm-dspark options: %s", options.non_default())
        return speculative_config

    return create_speculative_config_with_dspark


def apply() -> None:
    wrap(EngineArgs, "create_speculative_config", _make_wrapper)
