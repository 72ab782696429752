"""Accept drafts with their own synthetic confidence (benchmarks with dummy weights).

What: wraps ``rejection_sample`` as bound in ``vllm.v1.worker.gpu.spec_decode.
rejection_sampler``. vLLM's kernel runs in its synthetic mode with every rate at 1 (each
verified draft accepted, the sampled tensor laid out as usual); then each request's
accepted count is cut where a uniform draw first reaches above the draft's confidence
(:func:`vllm_dspark.bench.synthetic.accepted_lengths`), from the confidences the
speculator drew for the drafts being verified; the draw is a function of the request's
seed and the draft's position (common to every arm that drafts it).
Why: vLLM 0.26.0's synthetic acceptance has one rate per position, so a capacity
controller cannot be measured with dummy weights; this makes acceptance follow
per-draft confidences that are calibrated by construction.
Upstream: none (a benchmark device).
Remove when: never needed outside benchmarks; it is applied only with
``dspark_synthetic_confidence``, by :mod:`vllm_dspark.patches.speculator_selection`.
"""

from __future__ import annotations

import inspect
import sys
import weakref

import torch

from vllm_dspark.bench.synthetic import acceptance_draws, accepted_lengths
from vllm_dspark.capacity.allocation import conditional_confidence, verification_counts
from vllm_dspark.patches.wrapping import wrap

SAMPLER_MODULE = "vllm.v1.worker.gpu.spec_decode.rejection_sampler"
_speculator: weakref.ref | None = None


def _make_wrapper(rejection_sample):
    signature = inspect.signature(rejection_sample)

    def rejection_sample_with_synthetic_confidence(*args, **kwargs):
        speculator = _speculator() if _speculator is not None else None
        if speculator is None:
            return rejection_sample(*args, **kwargs)
        call = signature.bind(*args, **kwargs)
        cu_num_logits = call.arguments["cu_num_logits"]
        num_drafts = call.arguments["num_speculative_steps"]
        call.arguments["synthetic_conditional_rates"] = torch.ones(
            num_drafts, device=cu_num_logits.device
        )
        sampled, num_sampled = rejection_sample(*call.args, **call.kwargs)
        num_verified, _ = verification_counts(cu_num_logits, num_sampled)
        slots = call.arguments["idx_mapping"].long()
        confidence = conditional_confidence(speculator.synthetic_slot_survival[slots])
        first_positions = call.arguments["pos"][cu_num_logits[:-1].long()]
        seeds = call.arguments["seed"][slots]
        uniform = acceptance_draws(seeds, first_positions, confidence.shape[1])
        lengths = accepted_lengths(confidence, num_verified, uniform)
        return sampled, torch.minimum(num_sampled, (lengths + 1).to(num_sampled.dtype))

    return rejection_sample_with_synthetic_confidence


def apply(speculator) -> None:
    """Route acceptance through ``speculator``'s synthetic confidences (this process)."""
    global _speculator
    _speculator = weakref.ref(speculator)
    __import__(SAMPLER_MODULE)
    wrap(sys.modules[SAMPLER_MODULE], "rejection_sample", _make_wrapper)
