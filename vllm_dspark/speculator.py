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
from vllm.v1.worker.gpu.spec_decode.dflash.cudagraph import DFlashCudaGraphManager
from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator
from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator

from vllm_dspark.capacity.allocation import (
    UNCOMPUTED_SURVIVAL,
    prefix_survival,
)
from vllm_dspark.capacity.calibration_stats import CalibrationStats
from vllm_dspark.capacity.confidence import ConfidenceHead, resolve_temperatures
from vllm_dspark.capacity.controller import CapacityController, ProposalPlan
from vllm_dspark.capacity.online_sts import OnlineSTS
from vllm_dspark.capacity.plain_steps import without_dynamic_sd_table
from vllm_dspark.capacity.startup_checks import check_compaction_backends
from vllm_dspark.config import DSparkOptions
from vllm_dspark.context_kv import GraphedContextKV
from vllm_dspark.head.draft_heads import DraftHeads

_PROPOSE_SIGNATURE = inspect.signature(DSparkSpeculator.propose)


def point_mass_draws(
    draft_logits: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor, first: int = 0
) -> None:
    """Record positions ``first``.. of each request as drawn from a point mass on its token:
    a step that cannot be compacted verifies them anyway, and probabilistic verification
    stays exact for any draft distribution the drafts were really drawn from.
    draft_logits: [max_num_reqs, K, V], rows by request slot as vLLM's samplers index them
    (written in place); slots, tokens: [R] per batch row. A padded row of a graph replay
    (slot -1, which would index the last slot) repeats row 0's writes, which agree with
    them. No host sync: runs inside the captured draft graph."""
    num_drafts, vocab = draft_logits.shape[1:]
    rows = torch.arange(slots.shape[0], device=slots.device)
    rows = torch.where(slots >= 0, rows, 0)
    slots, tokens = slots[rows].long(), tokens[rows].long()
    positions = torch.arange(first, num_drafts, device=slots.device)
    flat_rows = slots[:, None] * num_drafts + positions  # [R, K - first]
    flat = draft_logits.view(-1, vocab)
    flat.index_fill_(0, flat_rows.flatten(), float("-inf"))
    flat.view(-1).index_fill_(0, (flat_rows * vocab + tokens[:, None]).flatten(), 0.0)


def propose_without_drafting(speculator, call: dict) -> torch.Tensor:
    """A proposal the draft gate skips (DSpark or DFlash), with none of the drafting
    prologue. ``call``: the proposal's arguments by name.

    The next drafting proposal attends to this step's tokens, so their context K/V is
    stored, at the positions and KV slots the target just used: the drafter's context slots
    are the target's slot mapping of the draft KV-cache groups, which stock computes again
    from the same block tables (``tests/cpu/test_context_kv.py``). The drafts are
    placeholders nothing verifies (the next step's budget is 0; a step that verifies them
    anyway reads them as point masses). No host sync."""
    input_batch = call["input_batch"]
    num_reqs, num_tokens = input_batch.num_reqs, input_batch.num_tokens
    aux = call["aux_hidden_states"]
    if aux:
        hidden = speculator.model.combine_hidden_states(torch.cat(aux, dim=-1))
    else:
        hidden = call["last_hidden_states"]
    speculator.hidden_states[:num_tokens].copy_(hidden[:num_tokens])
    speculator.context_positions[:num_tokens].copy_(input_batch.positions[:num_tokens])
    target_slots = speculator.block_tables.slot_mappings[speculator.draft_kv_cache_group_ids]
    speculator._context_slot_mappings[:, :num_tokens].copy_(target_slots[:, :num_tokens])
    speculator.model.precompute_and_store_context_kv(
        speculator.hidden_states[:num_tokens],
        speculator.context_positions[:num_tokens],
        speculator.context_kv.slots(num_tokens),
    )
    slots = input_batch.idx_mapping
    anchor = call["last_sampled"].view(-1)[slots.long()]
    speculator.draft_tokens[:num_reqs] = anchor.unsqueeze(1)
    if speculator.draft_logits is not None:
        point_mass_draws(speculator.draft_logits, slots, anchor)
    return speculator.draft_tokens[:num_reqs]


class PluginSpeculator:
    """Mixed into stock DSpark's and DFlash's speculators: the plugin's options, the
    capacity controller the speculator holds (:mod:`vllm_dspark.capacity.controller`),
    and with ``dspark_dynamic_depth`` one draft graph manager per depth d = 1..K, each
    capturing a proposal that computes d positions, so that switching depth replays
    another graph and never recaptures (eager proposals read the depth too)."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, options: DSparkOptions):
        super().__init__(vllm_config, device)
        self.options = options
        self.controller = CapacityController(
            vllm_config, device, options, self.num_speculative_steps, self.max_num_reqs
        )
        self._depth_graphs: dict[int, DFlashCudaGraphManager] = {}

    @property
    def draft_depth(self) -> int:
        """Positions the running proposal computes (all K unless dynamic depth)."""
        return self.controller.draft_depth

    def init_cudagraph_manager(self, cudagraph_mode) -> None:
        """The drafter's graph managers, listed without plain steps' Dynamic SD table
        (:func:`~vllm_dspark.capacity.plain_steps.without_dynamic_sd_table`)."""
        with without_dynamic_sd_table(self.vllm_config):
            super().init_cudagraph_manager(cudagraph_mode)
            if self.options.dynamic_depth:
                self._init_depth_graphs()

    def _init_depth_graphs(self) -> None:
        full = self.query_cudagraph_manager
        self._depth_graphs = {
            depth: DFlashCudaGraphManager(
                self.vllm_config,
                self.device,
                full.cudagraph_mode,
                decode_query_len=self.num_query_per_req,
            )
            for depth in range(1, self.num_speculative_steps)
        }
        self._depth_graphs[self.num_speculative_steps] = full
        self.controller.varies_depth = True

    def capture(self) -> None:
        if not self._depth_graphs:
            super().capture()
        else:
            for depth in self._depth_graphs:
                self._use_depth(depth)
                super().capture()
            self._use_depth(self.num_speculative_steps)
        self.capture_context_kv(self.query_cudagraph_manager.pool)

    def draft_graph_managers(self) -> dict:
        """{depth: its draft graph manager}, on which the draft gate's costs are timed: one
        per depth with dynamic depth, else the full depth's (none before graphs exist)."""
        if self._depth_graphs:
            return dict(self._depth_graphs)
        graphs = self.query_cudagraph_manager
        return {self.num_speculative_steps: graphs} if graphs else {}

    def set_attn(
        self, model_state, kv_cache_config, block_tables, target_input_buffers, target_attn_groups
    ):
        super().set_attn(
            model_state, kv_cache_config, block_tables, target_input_buffers, target_attn_groups
        )
        if self.controller.controls_capacity and self.options.varlen_verify:
            check_compaction_backends(target_attn_groups, self.draft_attn_layer_names)

    def _use_depth(self, depth: int) -> None:
        self.controller.draft_depth = depth
        self.query_cudagraph_manager = self._depth_graphs[depth]

    def _plan_proposal(self, call: dict) -> ProposalPlan:
        """The controller's plan for a real proposal, its depth's graphs selected."""
        plan = self.controller.plan_proposal(call["input_batch"], call["num_sampled"])
        if self._depth_graphs:
            self.query_cudagraph_manager = self._depth_graphs[self.draft_depth]
        return plan


class DSparkPluginSpeculator(PluginSpeculator, GraphedContextKV, DSparkSpeculator):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, options: DSparkOptions):
        super().__init__(vllm_config, device, options)
        self.confidence: ConfidenceHead | None = None
        self.synthetic = None  # calibrated synthetic confidence (a benchmark option)
        self.calibration: CalibrationStats | None = None
        self.online_sts: OnlineSTS | None = None
        shape = (self.max_num_reqs, self.num_speculative_steps)
        # Per batch row of the last proposal: confidence logits and prefix survival.
        self.confidence_logits = torch.zeros(shape, dtype=torch.float32, device=device)
        self.survival = torch.ones(shape, dtype=torch.float32, device=device)
        # Per request slot: the raw confidence logits of the drafts it waits to have verified.
        self.slot_confidence_logits = torch.zeros(shape, dtype=torch.float32, device=device)
        if options.synthetic_confidence is not None:
            from vllm_dspark.bench.synthetic import SyntheticConfidence

            self.synthetic = SyntheticConfidence(
                options.synthetic_confidence[: self.num_speculative_steps], device
            )
            self.temperatures = torch.ones(self.num_speculative_steps, device=device)
            # Per request slot: the survival its drafts are accepted by, kept at every
            # proposal (the controller's copy is not kept while sps rests).
            self.synthetic_slot_survival = torch.ones(shape, dtype=torch.float32, device=device)

    def load_draft_model(self, target_model, target_attn_layer_names):
        model = super().load_draft_model(target_model, target_attn_layer_names)
        # After loading, so the LM head is the target's, shared (DSpark aliases it).
        self.heads = DraftHeads(model, self.options, self.max_num_reqs * self.num_speculative_steps)
        if self.heads.vocab_ids is not None and self.draft_logits is not None:
            # Sampled drafts: stock's reduced-vocabulary path scatters each position's
            # logits into these target columns of a -inf buffer before sampling.
            self._d2t_scatter_index = self.heads.target_ids
            self._draft_scatter_buf = torch.full(
                (self.max_num_reqs, self.vocab_size),
                float("-inf"),
                dtype=self.draft_logits.dtype,
                device=self.device,
            )
        if self.options.needs_confidence and self.synthetic is None:
            checkpoint = self.draft_model_config.model
            download_dir = self.vllm_config.load_config.download_dir
            rank = model.model.markov_head.markov_w1.weight.shape[1]
            # The head reads the drafter's last hidden state: the model's hidden size, not
            # vLLM's self.hidden_size (hc_mult times wider for DeepSeek-V4's residuals).
            self.confidence = ConfidenceHead.from_checkpoint(
                checkpoint,
                self.draft_model_config.get_hidden_size() + rank,
                self.num_speculative_steps,
                self.device,
                download_dir,
            )
            self.temperatures = resolve_temperatures(
                self.options.confidence_temperature,
                checkpoint,
                self.num_speculative_steps,
                self.device,
                download_dir,
            )
        if self.options.online_sts:
            self.online_sts = OnlineSTS(self.temperatures.clone())
        self.record_calibration(self.options.confidence_metrics)
        return model

    def record_calibration(self, recording: bool) -> None:
        """Start the confidence head's calibration statistics afresh (``recording``) or
        stop them, and route verified steps to whatever reads them (with online STS)."""
        self.calibration = None
        if recording:
            self.calibration = CalibrationStats(self.num_speculative_steps, self.device)
        reading = self.calibration is not None or self.online_sts is not None
        self.controller.verification_reader = self._read_verification if reading else None

    def propose(self, *args, **kwargs):
        # The runner passes these by position or by name; bind to read them either way.
        call = _PROPOSE_SIGNATURE.bind(self, *args, **kwargs).arguments
        if call.get("dummy_run", False):
            return super().propose(*args, **kwargs)
        plan = self._plan_proposal(call)
        drafts = super().propose(*args, **kwargs) if plan.drafting else self._propose_skipped(call)
        num_reqs, slots = call["input_batch"].num_reqs, call["input_batch"].idx_mapping
        if self.synthetic is not None:
            self.synthetic_slot_survival[slots] = self.survival[:num_reqs]
        if self.has_confidence and not plan.resting:
            self.slot_confidence_logits[slots] = self.confidence_logits[:num_reqs]
            self.controller.observe_proposal(slots, self.survival[:num_reqs])
        return drafts

    def _propose_skipped(self, call: dict) -> torch.Tensor:
        """Without drafting; survivals below every admission."""
        drafts = propose_without_drafting(self, call)
        self.survival[: call["input_batch"].num_reqs] = UNCOMPUTED_SURVIVAL
        return drafts

    def _read_verification(self, slots, num_verified, num_accepted) -> None:
        """Feeds the calibration metrics and online STS: each slot's drafts proposed last
        step against what this step verified and accepted of them."""
        if self.calibration is not None:
            survival = self.controller.slot_survival[slots]
            self.calibration.observe(survival, num_verified, num_accepted)
        if self.online_sts is not None:
            self.online_sts.observe(
                self.slot_confidence_logits[slots], num_verified, num_accepted, self.temperatures
            )
            self.online_sts.maybe_refit(self.temperatures)

    @property
    def has_confidence(self) -> bool:
        return self.confidence is not None or self.synthetic is not None

    def _sample_sequential(self, num_reqs: int, head_hidden: torch.Tensor) -> None:
        """The sequential Markov stage, drafting through ``self.heads``.

        The same sampling as stock DSpark: base logits of every (request, position)
        from one LM-head pass, then left to right a Markov bias from the previous
        token, and a greedy or Gumbel sample per position. Runs inside the captured
        draft graph.
        """
        num_drafts, depth = self.num_speculative_steps, self.draft_depth
        num_rows = num_reqs * num_drafts
        # The first ``depth`` positions of each request (all K unless dynamic depth).
        rows = self.sample_indices[:num_rows].view(num_reqs, num_drafts)[:, :depth]
        hidden = head_hidden[rows.reshape(-1)]
        base = self.heads.dspark_logits(hidden)
        base = base.view(num_reqs, depth, base.shape[-1])
        hidden = hidden.view(num_reqs, depth, hidden.shape[-1])
        slots = self.sample_idx_mapping[:num_rows].view(num_reqs, num_drafts)
        positions = self.sample_pos[:num_rows].view(num_reqs, num_drafts)
        # Position 1's previous token is the anchor: the input id at query offset 0.
        previous = self.input_buffers.input_ids[self._anchor_idx[:num_reqs]]
        for step in range(depth):
            markov_embed = self.model.markov_embed(previous)
            logits = base[:, step] + self.heads.markov_bias(markov_embed)
            if self.confidence is not None:
                # c_k reads h_k, the previous token and the distribution draft k is drawn
                # from, never draft k itself.
                self.confidence_logits[:num_reqs, step] = self.confidence(
                    hidden[:, step], markov_embed, logits, step
                )
            if self.draft_logits is None:
                index = self.heads.dspark_greedy(logits, hidden[:, step], markov_embed)
                tokens = self.heads.to_target(index)
            else:
                if self._d2t_scatter_index is not None:
                    # Sample in target vocabulary: scatter the reduced draft vocabulary.
                    scattered = self._draft_scatter_buf[:num_reqs]
                    kept = self.heads.kept_columns(logits)
                    scattered.index_copy_(1, self._d2t_scatter_index, kept.to(scattered.dtype))
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
        if depth < num_drafts:
            # Positions not computed: a valid token id, never admitted (survival below all).
            self.draft_tokens[:num_reqs, depth:] = previous.unsqueeze(1)
            if self.draft_logits is not None:
                point_mass_draws(self.draft_logits, slots[:, 0], previous, first=depth)
        if self.synthetic is not None:
            seeds = self.seeds[slots[:, 0]]
            self.confidence_logits[:num_reqs] = self.synthetic.draw(seeds, positions)
        if self.has_confidence:
            self.survival[:num_reqs] = prefix_survival(
                self.confidence_logits[:num_reqs], self.temperatures
            )
            if depth < num_drafts:
                self.survival[:num_reqs, depth:] = UNCOMPUTED_SURVIVAL


class DFlashPluginSpeculator(PluginSpeculator, GraphedContextKV, DFlashSpeculator):
    def propose(self, *args, **kwargs):
        call = _PROPOSE_SIGNATURE.bind(self, *args, **kwargs).arguments
        if call.get("dummy_run", False) or self._plan_proposal(call).drafting:
            return super().propose(*args, **kwargs)
        return propose_without_drafting(self, call)

    def load_draft_model(self, target_model, target_attn_layer_names):
        model = super().load_draft_model(target_model, target_attn_layer_names)
        self.heads = DraftHeads(model, self.options, self.max_num_reqs * self.num_speculative_steps)
        return model

    def _generate_draft(self, num_reqs, num_tokens_padded, *args, **kwargs) -> None:
        """Stock's parallel block forward; then, at a depth d below K, the LM head and
        sampling over the first d positions of each request only (DFlash's costliest
        per-position work at a large batch: R*K rows against the vocabulary). The block
        keeps its K mask tokens, so the d drafts are the ones full depth would draw.
        Positions d..K-1 repeat the last draft, recorded as drawn from a point mass on it
        (see :func:`point_mass_draws`): only a step vLLM verifies uncompacted reads them."""
        depth, num_drafts = self.draft_depth, self.num_speculative_steps
        if depth == num_drafts:
            return super()._generate_draft(num_reqs, num_tokens_padded, *args, **kwargs)
        hidden = self._run_model(num_tokens_padded, *args, **kwargs)
        num_rows = num_reqs * num_drafts

        def leading(buffer: torch.Tensor) -> torch.Tensor:
            return buffer[:num_rows].view(num_reqs, num_drafts)[:, :depth].reshape(-1)

        # As stock: sample_pos is the drafted token's position; sample_draft adds one.
        tokens = self.sample_draft(
            hidden[leading(self.sample_indices)],
            leading(self.sample_pos) - 2,
            leading(self.sample_idx_mapping),
            self.temperature,
            self.seeds,
            leading(self.sample_col),
            self.draft_logits,
        ).view(num_reqs, depth)
        last = tokens[:, -1]
        self.draft_tokens[:num_reqs, :depth] = tokens
        self.draft_tokens[:num_reqs, depth:] = last.unsqueeze(1)
        if self.draft_logits is not None:
            slots = self.sample_idx_mapping[:num_rows].view(num_reqs, num_drafts)[:, 0]
            point_mass_draws(self.draft_logits, slots, last, first=depth)

    def sample_draft(
        self, hidden_states, positions, idx_mapping, temperature, seeds, draft_step, draft_logits
    ) -> torch.Tensor:
        if not self.heads.private:
            return super().sample_draft(
                hidden_states, positions, idx_mapping, temperature, seeds, draft_step, draft_logits
            )
        if draft_logits is None:
            return self.heads.greedy_tokens(hidden_states)
        # As stock: the draft's Gumbel key is offset by one to match the target's.
        return gumbel_sample(
            self.heads.target_logits(self.heads.logits(hidden_states)),
            idx_mapping,
            temperature,
            seeds,
            positions + 1,
            apply_temperature=True,
            output_processed_logits=draft_logits,
            output_processed_logits_col=draft_step,
            use_fp64=self.use_fp64_gumbel,
        )
