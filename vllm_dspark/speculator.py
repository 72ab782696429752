"""vllm-dspark's speculators: stock DSpark and DFlash with the plugin's options applied.

They are chosen by :mod:`vllm_dspark.patches.speculator_selection` only when an option
is set. Drafting goes through :class:`~vllm_dspark.head.draft_heads.DraftHeads`,
which is the stock bf16 path unless an FP8 head option is on.
"""

from __future__ import annotations

import inspect

import torch
from vllm.config import VllmConfig
from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample
from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator
from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator

from vllm_dspark.capacity.allocation import (
    admission_budget,
    budget_capacity,
    prefix_survival,
    sps_best_count,
    sps_table_from_curve,
    threshold_count,
)
from vllm_dspark.capacity.calibration_stats import CalibrationStats
from vllm_dspark.capacity.confidence import ConfidenceHead, resolve_temperatures
from vllm_dspark.capacity.stale_budget import StaleBudget
from vllm_dspark.capacity.synthetic import SyntheticConfidence
from vllm_dspark.config import KEY_PREFIX, DSparkOptionError, DSparkOptions
from vllm_dspark.head.draft_heads import DraftHeads

_PROPOSE_SIGNATURE = inspect.signature(DSparkSpeculator.propose)


class DSparkPluginSpeculator(DSparkSpeculator):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, options: DSparkOptions):
        super().__init__(vllm_config, device)
        self.options = options
        self.confidence: ConfidenceHead | None = None
        self.synthetic: SyntheticConfidence | None = None
        self.calibration: CalibrationStats | None = None
        shape = (self.max_num_reqs, self.num_speculative_steps)
        # Per batch row of the last proposal: confidence logits and prefix survival.
        self.confidence_logits = torch.zeros(shape, dtype=torch.float32, device=device)
        self.survival = torch.ones(shape, dtype=torch.float32, device=device)
        # Per request slot: the survival of the drafts it waits to have verified.
        self.slot_survival = torch.ones(shape, dtype=torch.float32, device=device)
        if options.synthetic_confidence is not None:
            self.synthetic = SyntheticConfidence(
                options.synthetic_confidence[: self.num_speculative_steps], device
            )
            self.temperatures = torch.ones(self.num_speculative_steps, device=device)
        # Read by patches/compact_verification.py.
        self.controls_capacity = options.capacity != "off"
        # threshold and sps: the budget comes from an earlier proposal (stale_budget.py).
        self.stale_budget = None
        if options.capacity in ("threshold", "sps"):
            cap = options.budget_frac * self.num_speculative_steps
            self.stale_budget = StaleBudget(device, cap)
        self.sps_table = None
        if options.capacity == "sps":
            max_tokens = self.max_num_reqs * (1 + self.num_speculative_steps)
            self.sps_table = sps_table_from_curve(options.sps_curve, max_tokens).to(device)
        self.drafts_proposed = 0  # in compacted steps, for the admitted share
        self.drafts_admitted = 0
        if self.controls_capacity:
            _check_compaction_supported(vllm_config)

    def load_draft_model(self, target_model, target_attn_layer_names):
        model = super().load_draft_model(target_model, target_attn_layer_names)
        # After loading, so the LM head is the target's, shared (DSpark aliases it).
        self.heads = DraftHeads(model, self.options, self.max_num_reqs * self.num_speculative_steps)
        if self.options.needs_confidence and self.synthetic is None:
            checkpoint = self.draft_model_config.model
            rank = model.model.markov_head.markov_w1.weight.shape[1]
            self.confidence = ConfidenceHead.from_checkpoint(
                checkpoint, self.hidden_size + rank, self.device
            )
            self.temperatures = resolve_temperatures(
                self.options.confidence_temperature,
                checkpoint,
                self.num_speculative_steps,
                self.device,
            )
        if self.options.confidence_metrics:
            self.calibration = CalibrationStats(self.num_speculative_steps, self.device)
        return model

    def propose(self, *args, **kwargs):
        # The runner passes these by position or by name; bind to read them either way.
        call = _PROPOSE_SIGNATURE.bind(self, *args, **kwargs).arguments
        real_step = not call.get("dummy_run", False)
        input_batch = call["input_batch"]
        slots = input_batch.idx_mapping
        if self.calibration is not None and real_step:
            # The drafts just verified are the ones each slot proposed last step.
            num_verified = input_batch.cu_num_logits[1:] - input_batch.cu_num_logits[:-1] - 1
            num_accepted = (call["num_sampled"] - 1).clamp_(min=0)
            self.calibration.observe(self.slot_survival[slots], num_verified, num_accepted)
        drafts = super().propose(*args, **kwargs)
        if self.has_confidence and real_step:
            survival = self.survival[: input_batch.num_reqs]
            self.slot_survival[slots] = survival
            if self.stale_budget is not None:
                self.stale_budget.record(self.wanted_drafts(survival), input_batch.num_reqs)
        return drafts

    @property
    def has_confidence(self) -> bool:
        return self.confidence is not None or self.synthetic is not None

    def wanted_drafts(self, survival: torch.Tensor) -> torch.Tensor:
        """How many of these proposals' drafts the mode would verify (device scalar)."""
        if self.options.capacity == "threshold":
            return threshold_count(survival, self.options.confidence_threshold)
        return sps_best_count(survival, self.sps_table)

    def set_attn(
        self, model_state, kv_cache_config, block_tables, target_input_buffers, target_attn_groups
    ):
        super().set_attn(
            model_state, kv_cache_config, block_tables, target_input_buffers, target_attn_groups
        )
        if self.controls_capacity:
            _check_compaction_backends(target_attn_groups)

    def admission_budget(self, num_reqs: int) -> int:
        """How many drafts a decode step of ``num_reqs`` requests verifies (host-known):
        ceil(R*K*budget_frac), or less where an earlier proposal wanted less."""
        cap = admission_budget(num_reqs, self.num_speculative_steps, self.options.budget_frac)
        if self.stale_budget is None:
            return cap
        wanted = round(self.stale_budget.per_request() * num_reqs)
        # At least one draft: a compacted step always has drafts to verify.
        return max(1, min(cap, wanted))

    def verify_capacity(self, slots: torch.Tensor, budget: int) -> torch.Tensor:
        """k_r of each request: the ``budget`` best slots by proposal-time survival."""
        return budget_capacity(self.slot_survival[slots], budget)

    def record_admission(self, num_reqs: int, budget: int) -> None:
        self.drafts_proposed += num_reqs * self.num_speculative_steps
        self.drafts_admitted += budget

    def _sample_sequential(self, num_reqs: int, head_hidden: torch.Tensor) -> None:
        """The sequential Markov stage, drafting through ``self.heads``.

        The same sampling as stock DSpark: base logits of every (request, position)
        from one LM-head pass, then left to right a Markov bias from the previous
        token, and a greedy or Gumbel sample per position. Runs inside the captured
        draft graph.
        """
        num_drafts = self.num_speculative_steps
        num_rows = num_reqs * num_drafts
        hidden = head_hidden[self.sample_indices[:num_rows]]
        base = self.heads.dspark_logits(hidden)
        base = base.view(num_reqs, num_drafts, base.shape[-1])
        hidden = hidden.view(num_reqs, num_drafts, hidden.shape[-1])
        slots = self.sample_idx_mapping[:num_rows].view(num_reqs, num_drafts)
        positions = self.sample_pos[:num_rows].view(num_reqs, num_drafts)
        # Position 1's previous token is the anchor: the input id at query offset 0.
        previous = self.input_buffers.input_ids[self._anchor_idx[:num_reqs]]
        for step in range(num_drafts):
            markov_embed = self.model.markov_embed(previous)
            logits = base[:, step] + self.heads.markov_bias(markov_embed)
            if self.confidence is not None:
                # c_k reads h_k, the previous token and the distribution draft k is drawn
                # from, never draft k itself.
                self.confidence_logits[:num_reqs, step] = self.confidence(
                    hidden[:, step], markov_embed, logits
                )
            if self.draft_logits is None:
                index = self.heads.dspark_greedy(logits, hidden[:, step], markov_embed)
                tokens = self.model.map_draft_to_target(index)
            else:
                if self._d2t_scatter_index is not None:
                    # Sample in target vocabulary: scatter the reduced draft vocabulary.
                    scattered = self._draft_scatter_buf[:num_reqs]
                    scattered.index_copy_(1, self._d2t_scatter_index, logits.to(scattered.dtype))
                    logits = scattered
                # The target verifies position Q with the Gumbel key of Q - 1.
                tokens = gumbel_sample(
                    logits,
                    slots[:, step],
                    self.temperature,
                    self.seeds,
                    positions[:, step] - 1,
                    apply_temperature=True,
                    output_processed_logits=self.draft_logits,
                    output_processed_logits_col=self._step_cols[step],
                    use_fp64=self.use_fp64_gumbel,
                )
            self.draft_tokens[:num_reqs, step] = tokens
            previous = tokens
        if self.synthetic is not None:
            self.confidence_logits[:num_reqs] = self.synthetic.draw(num_reqs)
        if self.has_confidence:
            self.survival[:num_reqs] = prefix_survival(
                self.confidence_logits[:num_reqs], self.temperatures
            )


def _check_compaction_supported(vllm_config: VllmConfig) -> None:
    """Compact verification rewrites per-token inputs on the GPU: refuse the features
    that keep their own host-side per-request layout of the batch."""
    parallel = vllm_config.parallel_config
    unsupported = {
        "LoRA": vllm_config.lora_config is not None,
        "decode context parallelism": parallel.decode_context_parallel_size > 1,
        "prefill context parallelism": getattr(parallel, "prefill_context_parallel_size", 1) > 1,
        "a hybrid (Mamba) target": vllm_config.model_config.is_hybrid,
    }
    found = [name for name, present in unsupported.items() if present]
    if found:
        raise DSparkOptionError(
            f"vllm-dspark: {KEY_PREFIX}varlen_verify does not support {', '.join(found)} in "
            f"this version. Valid here: {KEY_PREFIX}capacity=off."
        )


def _check_compaction_backends(target_attn_groups) -> None:
    """The target's attention must take device-chosen query lengths: FlashAttention 3."""
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version

    names = {group.backend.get_name() for groups in target_attn_groups for group in groups}
    if names != {"FLASH_ATTN"} or get_flash_attn_version() != 3:
        raise DSparkOptionError(
            f"vllm-dspark: {KEY_PREFIX}varlen_verify needs the target to run FlashAttention 3 "
            f"(found {', '.join(sorted(names))}); on Hopper pass --attention-backend FLASH_ATTN."
        )


class DFlashPluginSpeculator(DFlashSpeculator):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, options: DSparkOptions):
        super().__init__(vllm_config, device)
        self.options = options

    def load_draft_model(self, target_model, target_attn_layer_names):
        model = super().load_draft_model(target_model, target_attn_layer_names)
        self.heads = DraftHeads(model, self.options, self.max_num_reqs * self.num_speculative_steps)
        return model

    def sample_draft(
        self, hidden_states, positions, idx_mapping, temperature, seeds, draft_step, draft_logits
    ) -> torch.Tensor:
        if self.heads.lm_head is None:
            return super().sample_draft(
                hidden_states, positions, idx_mapping, temperature, seeds, draft_step, draft_logits
            )
        if draft_logits is None:
            return self.heads.greedy_tokens(hidden_states)
        # As stock: the draft's Gumbel key is offset by one to match the target's.
        return gumbel_sample(
            self.heads.logits(hidden_states),
            idx_mapping,
            temperature,
            seeds,
            positions + 1,
            apply_temperature=True,
            output_processed_logits=draft_logits,
            output_processed_logits_col=draft_step,
            use_fp64=self.use_fp64_gumbel,
        )
