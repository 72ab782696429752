"""The vocabulary projections a drafter runs: the LM head and DSpark's Markov head.

:class:`DraftHeads` is what the plugin's speculators call for draft logits, Markov
biases and greedy draft tokens. By default it calls the draft model's own (bf16)
layers, exactly as stock vLLM does. With ``dspark_fp8_draft_head`` it keeps a private
rowwise-FP8 copy of the LM head (the target's, which the drafter shares) and runs the
Triton kernels of :mod:`vllm_dspark.head.fp8_head_kernel`; ``dspark_fp8_markov_head``
does the same for the Markov head's projection. The bf16 weights stay untouched:
verification runs the target's own head, so outputs stay lossless.

Greedy DSpark drafting with an FP8 head picks its token among the FP8 logits' top
``rescore.RESCORE_CANDIDATES`` by the bf16 weights' own dot products (a gather of a few weight
rows per draft row): e4m3 rounding alone flipped 1.9% of the embedded pair's draft argmaxes
on the H200 (hidden 256), and rescoring brought every one back
(``benchmarks/results/fp8_pair.json``).
"""

from __future__ import annotations

import torch
from vllm.logger import init_logger

from vllm_dspark.config import KEY_PREFIX, DSparkOptionError, DSparkOptions
from vllm_dspark.head.fp8_head_kernel import HeadWorkspace, fp8_head_argmax, fp8_head_logits
from vllm_dspark.head.fp8_rowwise import Fp8RowwiseWeight
from vllm_dspark.head.rescore import rescored_argmax

logger = init_logger(f"vllm.{__name__}")

# e4m3 tensor-core matmuls exist from Ada (8.9) and Hopper (9.0) on.
MIN_FP8_CAPABILITY = (8, 9)


def _check_fp8_supported(option: str, head: torch.nn.Module) -> None:
    from vllm.distributed import get_tensor_model_parallel_world_size

    device = head.weight.device
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_FP8_CAPABILITY:
        raise DSparkOptionError(
            f"vllm-dspark: {KEY_PREFIX}{option} needs a GPU with FP8 (e4m3) support, compute "
            f"capability 8.9 or newer; {torch.cuda.get_device_name(device)} has "
            f"{capability[0]}.{capability[1]}. Valid here: {KEY_PREFIX}{option}=false."
        )
    tp = get_tensor_model_parallel_world_size()
    if tp > 1:
        raise DSparkOptionError(
            f"vllm-dspark: {KEY_PREFIX}{option} does not handle a vocabulary-sharded head yet "
            f"(tensor parallel size {tp}). Valid with tensor parallelism: "
            f"{KEY_PREFIX}{option}=false."
        )


def _quantize(option: str, head: torch.nn.Module) -> Fp8RowwiseWeight:
    _check_fp8_supported(option, head)
    fp8 = Fp8RowwiseWeight.from_weight(head.weight.data)
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


class DraftHeads:
    def __init__(self, model: torch.nn.Module, options: DSparkOptions, max_rows: int):
        self.model = model
        processor = model.logits_processor
        # What the draft's LogitsProcessor would apply after the projection.
        self.vocab_limit = processor.org_vocab_size
        self.scale = processor.scale
        if processor.soft_cap is not None and (options.fp8_draft_head or options.fp8_markov_head):
            raise DSparkOptionError(
                f"vllm-dspark: {KEY_PREFIX}fp8_draft_head does not apply logit soft-capping, "
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
        if getattr(model, "draft_id_to_target_id", None) is not None and options.fp8_draft_head:
            raise DSparkOptionError(
                f"vllm-dspark: {KEY_PREFIX}fp8_draft_head needs a full-vocabulary draft; this "
                "draft has a reduced vocabulary (d2t)."
            )
        self.lm_head = (
            _quantize("fp8_draft_head", model.lm_head) if options.fp8_draft_head else None
        )
        self.markov = None
        if options.fp8_markov_head:
            self.markov = _quantize("fp8_markov_head", model.model.markov_head.markov_w2)
        # Preallocated once, so that captured graphs never allocate kernel scratch space.
        self.lm_head_workspace = self.lm_head and HeadWorkspace.allocate(max_rows, self.lm_head)
        self.markov_workspace = self.markov and HeadWorkspace.allocate(max_rows, self.markov)

    def _scaled(self, logits: torch.Tensor) -> torch.Tensor:
        return logits * self.scale if self.scale != 1.0 else logits

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of the LM head. [rows, H] -> [rows, V]."""
        if self.lm_head is None:
            return self.model.compute_logits(hidden)
        out = fp8_head_logits(
            hidden, self.lm_head, vocab_limit=self.vocab_limit, workspace=self.lm_head_workspace
        )
        return self._scaled(out)

    def dspark_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """DSpark's base logits: the LM head without the d2t scatter."""
        if self.lm_head is None:
            return self.model.compute_draft_logits(hidden)
        return self.logits(hidden)

    def markov_bias(self, markov_embed: torch.Tensor) -> torch.Tensor:
        """DSpark's Markov transition bias. [rows, r] -> [rows, V]."""
        if self.markov is None:
            return self.model.markov_bias(markov_embed)
        out = fp8_head_logits(
            markov_embed, self.markov, vocab_limit=self.vocab_limit, workspace=self.markov_workspace
        )
        return self._scaled(out)

    def dspark_greedy(
        self, logits: torch.Tensor, hidden: torch.Tensor, markov_embed: torch.Tensor
    ) -> torch.Tensor:
        """DSpark's greedy draft from its logits (LM head + Markov bias) at one position:
        their argmax, with FP8 heads rescored by the bf16 weights (module docstring)."""
        if self.lm_head is None and self.markov is None:
            return logits.argmax(dim=-1)
        return rescored_argmax(
            logits,
            hidden,
            self.model.lm_head.weight,
            markov_embed,
            self.model.model.markov_head.markov_w2.weight,
            self.scale,
        )

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """Argmax of the LM head's logits; with FP8 no [rows, V] logits are written."""
        if self.lm_head is None:
            return self.model.compute_logits(hidden).argmax(dim=-1)
        if self.scale <= 0:  # a non-positive scale would reorder the logits
            return self.logits(hidden).argmax(dim=-1)
        index, _ = fp8_head_argmax(
            hidden, self.lm_head, vocab_limit=self.vocab_limit, workspace=self.lm_head_workspace
        )
        # A NaN row gives -1: propose token 0 instead, which verification then rejects
        # like any wrong draft (a -1 would be read as an input id next step).
        return index.clamp_(min=0)
