"""The vocabulary projections a drafter runs: the LM head and DSpark's Markov head.

:class:`DraftHeads` is what the plugin's speculators call for draft logits, Markov biases
and greedy draft tokens; by default it calls the draft model's own bf16 layers, as stock.
With ``dspark_draft_vocab`` the heads score a frequency-ranked subset of the vocabulary
only (FR-Spec), on private copies of those rows; :meth:`DraftHeads.target_logits` scatters
logits back with the rest at -inf, so a draft's recorded distribution is what it was drawn
from and rejection sampling stays exact. With ``dspark_fp8_draft_head``
(``dspark_fp8_markov_head``) it keeps a private rowwise-FP8 copy of the LM head (the Markov
projection) run by :mod:`vllm_dspark.head.fp8_head_kernel`; verification keeps the target's
own bf16 head, so outputs stay lossless. Greedy drafting with an FP8 head rescores the FP8
logits' top ``rescore.RESCORE_CANDIDATES`` with the bf16 weights, as e4m3 rounding alone
flips some argmaxes. Under tensor parallelism each rank keeps its own vocabulary shard
(:mod:`vllm_dspark.head.vocab_shards`).
"""

from __future__ import annotations

import torch
from vllm.logger import init_logger

from vllm_dspark.config import KEY_PREFIX, DSparkOptionError, DSparkOptions
from vllm_dspark.head.fp8_head_kernel import HeadWorkspace, fp8_head_argmax, fp8_head_logits
from vllm_dspark.head.fp8_rowwise import Fp8RowwiseWeight
from vllm_dspark.head.rescore import rescored_argmax
from vllm_dspark.head.vocab_shards import (
    VocabShard,
    combine_argmax,
    gather_logits,
    subset_layout,
)

logger = init_logger(f"vllm.{__name__}")

# e4m3 tensor-core matmuls exist from Ada (8.9) and Hopper (9.0) on.
MIN_FP8_CAPABILITY = (8, 9)
# Drafters whose ``compute_logits`` normalises the hidden state before the LM head (the
# speculator hands them the backbone's pre-norm output): DeepSeek-V4's DSpark module. The
# private heads apply the same norm; the confidence head reads the pre-norm state, as the
# speculator passes it.
PRE_HEAD_NORM_DRAFTERS = ("DSparkDeepseekV4ForCausalLM",)


def check_fp8_supported(option: str, weight: torch.Tensor) -> None:
    device = weight.device
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_FP8_CAPABILITY:
        raise DSparkOptionError(
            f"vllm-dspark: {KEY_PREFIX}{option} needs a GPU with FP8 (e4m3) support, compute "
            f"capability 8.9 or newer; {torch.cuda.get_device_name(device)} has "
            f"{capability[0]}.{capability[1]}. Valid here: {KEY_PREFIX}{option}=false."
        )


def _padded_rows(weight: torch.Tensor | None, rows: torch.Tensor, count: int):
    """``weight[rows]`` followed by zero rows up to ``count`` (None stays None)."""
    if weight is None:
        return None
    padded = weight.new_zeros(count, weight.shape[1])
    padded[: len(rows)] = weight[rows]
    return padded


def _quantize(option: str, weight: torch.Tensor) -> Fp8RowwiseWeight:
    check_fp8_supported(option, weight)
    fp8 = Fp8RowwiseWeight.from_weight(weight)
    extra = fp8.weight.numel() * fp8.weight.element_size() + fp8.scale.numel() * 4
    logger.info(
        "vllm-dspark: %s%s: private e4m3 copy of the %dx%d head, +%.1f MiB of GPU memory "
        "(the bf16 head stays for verification).",
        KEY_PREFIX,
        option,
        fp8.vocab,
        fp8.hidden,
        extra / 2**20,
    )
    return fp8


def vocab_subset(option: int | list[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    """``dspark_draft_vocab`` as token ids in increasing order: the first N, or the list's."""
    ids = range(option) if isinstance(option, int) else sorted(option)
    if len(ids) > vocab_size or ids[-1] >= vocab_size:
        raise DSparkOptionError(
            f"vllm-dspark: {KEY_PREFIX}draft_vocab names token ids up to {ids[-1]}; the "
            f"vocabulary has {vocab_size} (ids 0..{vocab_size - 1}). Valid: at most "
            f"{vocab_size} ids below {vocab_size}."
        )
    return torch.tensor(list(ids), dtype=torch.long, device=device)


def _refuse_unsupported(model, options: DSparkOptions, private: list[str]) -> None:
    if model.logits_processor.soft_cap is not None and private:
        raise DSparkOptionError(
            f"vllm-dspark: {KEY_PREFIX}{private[0]} does not apply logit soft-capping, "
            "which this draft model uses."
        )
    dtype = model.lm_head.weight.dtype
    if (options.fp8_draft_head or options.fp8_markov_head) and dtype != torch.bfloat16:
        # The FP8 kernels read bf16 activations and rescore with the bf16 weights.
        raise DSparkOptionError(
            f"vllm-dspark: {KEY_PREFIX}fp8_draft_head and {KEY_PREFIX}fp8_markov_head "
            f"need the model in bfloat16, not {dtype}. Valid here: dtype bfloat16, or "
            "the options off."
        )
    reduced = getattr(model, "draft_id_to_target_id", None) is not None
    if reduced and (options.fp8_draft_head or options.draft_vocab is not None):
        name = "fp8_draft_head" if options.fp8_draft_head else "draft_vocab"
        raise DSparkOptionError(
            f"vllm-dspark: {KEY_PREFIX}{name} needs a full-vocabulary draft; this "
            "draft has a reduced vocabulary (d2t)."
        )


class DraftHeads:
    def __init__(self, model: torch.nn.Module, options: DSparkOptions, max_rows: int):
        from vllm import distributed

        self.model = model
        self.head_norm = (
            model.model.norm if type(model).__name__ in PRE_HEAD_NORM_DRAFTERS else None
        )
        processor = model.logits_processor
        # What the draft's LogitsProcessor would apply after the projection.
        self.vocab_limit = processor.org_vocab_size
        self.scale = processor.scale
        private = [
            name
            for name in ("fp8_draft_head", "fp8_markov_head", "draft_vocab")
            if name in options.non_default()
        ]
        _refuse_unsupported(model, options, private)
        # The rows the heads score: all (the model's own weights; this rank's vocabulary
        # shard under tensor parallelism) or the draft vocabulary's. vocab_ids: the token
        # id of each logits column, where those are not the token ids themselves;
        # columns_kept: which of them are tokens (None: all; under TP the ranks' padding
        # is not).
        self.vocab_ids = self.columns_kept = None
        lm_weight = model.lm_head.weight.data
        markov = getattr(getattr(model, "model", None), "markov_head", None)
        markov_weight = markov.markov_w2.weight.data if markov is not None else None
        # Stock heads (no private option) are the model's own, sharded or not.
        tp = distributed.get_tensor_model_parallel_world_size() if private else 1
        self.shard = VocabShard.of(model.lm_head) if tp > 1 else None
        if self.shard is not None:
            self._all_gather = distributed.tensor_model_parallel_all_gather
            self._all_reduce = distributed.tensor_model_parallel_all_reduce
            if markov is not None and VocabShard.of(markov.markov_w2) != self.shard:
                raise DSparkOptionError(
                    f"vllm-dspark: {KEY_PREFIX}{private[0]} needs the Markov head sharded "
                    "as the LM head under tensor parallelism; they are "
                    f"{VocabShard.of(markov.markov_w2)} and {self.shard}."
                )
        if options.draft_vocab is not None:
            ids = vocab_subset(options.draft_vocab, self.vocab_limit, lm_weight.device)
            if self.shard is None:
                self.vocab_ids = ids
                lm_weight = _padded_rows(lm_weight, ids, len(ids))
                markov_weight = _padded_rows(markov_weight, ids, len(ids))
            else:
                rank = distributed.get_tensor_model_parallel_rank()
                layout = subset_layout(ids, self.shard, rank, tp)
                self.shard, self.vocab_ids = layout.shard, layout.ids
                self.columns_kept = layout.valid
                lm_weight = _padded_rows(lm_weight, layout.local_rows, layout.shard.size)
                markov_weight = _padded_rows(markov_weight, layout.local_rows, layout.shard.size)
            logger.info(
                "vllm-dspark: %sdraft_vocab: drafting over %d of %d tokens (+%.1f MiB of GPU "
                "memory for the heads' rows).",
                KEY_PREFIX,
                len(ids),
                self.vocab_limit,
                sum(
                    w.numel() * w.element_size()
                    for w in (lm_weight, markov_weight)
                    if w is not None
                )
                / 2**20,
            )
        self.lm_weight, self.markov_weight = lm_weight, markov_weight
        self.lm_head = _quantize("fp8_draft_head", lm_weight) if options.fp8_draft_head else None
        self.markov = None
        if options.fp8_markov_head:
            self.markov = _quantize("fp8_markov_head", markov_weight)
        # The heads' rows that are tokens: this rank's (under TP), the subset's, or the
        # processor's unpadded vocabulary.
        self.columns = self.vocab_limit
        if self.shard is not None:
            self.columns = self.shard.valid
        elif self.vocab_ids is not None:
            self.columns = len(self.vocab_ids)
        # Token ids of the columns kept, for scattering logits into the target vocabulary.
        self.target_ids = self.vocab_ids
        if self.columns_kept is not None:
            self.target_ids = self.vocab_ids[self.columns_kept]
        # Preallocated once, so that captured graphs never allocate kernel scratch space.
        self.lm_head_workspace = self.lm_head and HeadWorkspace.allocate(max_rows, self.lm_head)
        self.markov_workspace = self.markov and HeadWorkspace.allocate(max_rows, self.markov)

    @property
    def private(self) -> bool:
        """Whether the LM head runs from this object's weights rather than the model's."""
        return self.lm_head is not None or self.vocab_ids is not None

    def _scaled(self, logits: torch.Tensor) -> torch.Tensor:
        return logits * self.scale if self.scale != 1.0 else logits

    def _head_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the LM head's rows multiply: ``hidden``, normalised where the drafter's own
        ``compute_logits`` does so."""
        return hidden if self.head_norm is None else self.head_norm(hidden)

    def _project(self, x, fp8, workspace, weight) -> torch.Tensor:
        """``x`` through a private head, its FP8 copy or its draft-vocabulary rows; under
        tensor parallelism this rank's rows, gathered over the ranks."""
        if self.shard is None:
            if fp8 is None:
                return self._scaled(torch.nn.functional.linear(x, weight))
            out = fp8_head_logits(x, fp8, vocab_limit=self.columns, workspace=workspace)
            return self._scaled(out)
        # The rows past this rank's tokens at -inf: the gather takes every rank's block whole.
        local = x.new_empty(x.shape[0], self.shard.size)
        if self.columns == 0:
            local.fill_(float("-inf"))
        elif fp8 is None:
            torch.matmul(x, weight.t(), out=local)
            local[:, self.columns :] = float("-inf")
        else:
            fp8_head_logits(x, fp8, vocab_limit=self.columns, workspace=workspace, out=local)
        return self._scaled(gather_logits(local, self.shard, self._all_gather))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of the LM head. [rows, H] -> [rows, V or subset]."""
        if not self.private:
            return self.model.compute_logits(hidden)
        x = self._head_input(hidden)
        return self._project(x, self.lm_head, self.lm_head_workspace, self.lm_weight)

    def dspark_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """DSpark's base logits: the LM head without the d2t scatter."""
        if not self.private:
            return self.model.compute_draft_logits(hidden)
        return self.logits(hidden)

    def markov_bias(self, markov_embed: torch.Tensor) -> torch.Tensor:
        """DSpark's Markov transition bias. [rows, r] -> [rows, V or subset]."""
        if self.markov is None and self.vocab_ids is None:
            return self.model.markov_bias(markov_embed)
        return self._project(markov_embed, self.markov, self.markov_workspace, self.markov_weight)

    def to_target(self, index: torch.Tensor) -> torch.Tensor:
        """Token ids of draft-vocabulary indices (the draft model's d2t map, or the
        draft vocabulary's ids)."""
        if self.vocab_ids is not None:
            return self.vocab_ids[index]
        return self.model.map_draft_to_target(index)

    def kept_columns(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits of the columns that are tokens (``target_ids``), in that order."""
        return logits if self.columns_kept is None else logits[:, self.columns_kept]

    def target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over the target vocabulary: with a draft vocabulary, its columns at their
        token ids and -inf elsewhere (probability 0 for the tokens it never drafts)."""
        if self.vocab_ids is None:
            return logits
        full = logits.new_full((logits.shape[0], self.vocab_limit), float("-inf"))
        return full.index_copy_(1, self.target_ids, self.kept_columns(logits))

    def dspark_greedy(
        self, logits: torch.Tensor, hidden: torch.Tensor, markov_embed: torch.Tensor
    ) -> torch.Tensor:
        """DSpark's greedy draft from its logits (LM head + Markov bias) at one position:
        their argmax (a draft-vocabulary index), with FP8 heads rescored by the bf16 rows
        (module docstring)."""
        if self.lm_head is None and self.markov is None:
            return logits.argmax(dim=-1)
        sharded = {}
        if self.shard is not None:
            sharded = {"first_id": self.shard.start, "all_reduce": self._all_reduce}
        return rescored_argmax(
            logits,
            self._head_input(hidden),
            self.lm_weight,
            markov_embed,
            self.markov_weight,
            self.scale,
            **sharded,
        )

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """Token ids of the LM head's argmax (DFlash); with FP8 no [rows, V] logits are
        written."""
        if not self.private:
            return self.model.compute_logits(hidden).argmax(dim=-1)
        if self.lm_head is None or self.scale <= 0:  # a non-positive scale reorders logits
            index = self.logits(hidden).argmax(dim=-1)
        elif self.columns == 0:  # this rank holds none of the draft vocabulary
            nothing = hidden.new_full((hidden.shape[0],), -1, dtype=torch.long)
            index = combine_argmax(nothing, nothing.float(), self.shard, self._all_gather)
        else:
            index, value = fp8_head_argmax(
                self._head_input(hidden),
                self.lm_head,
                vocab_limit=self.columns,
                workspace=self.lm_head_workspace,
            )
            if self.shard is not None:
                index = combine_argmax(index, value, self.shard, self._all_gather)
            else:
                # A NaN row gives -1: propose the first token instead, which verification
                # rejects like any wrong draft (a -1 would be read as an input id next step).
                index = index.clamp_(min=0)
        return index if self.vocab_ids is None else self.vocab_ids[index]
