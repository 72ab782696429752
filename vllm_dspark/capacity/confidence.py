"""The DSpark confidence head in inference, and its per-position temperatures.

Stock vLLM 0.26.0 skips the ``confidence_head.*`` weights of a DSpark checkpoint (also
``mtp.<stage>.confidence_head.*`` for DeepSeek-V4). The head is one linear layer over
``[h_k ; markov_w1[x_{k-1}]]``, giving the logit z_k of "draft k survives given drafts
1..k-1 did"; two config.json keys add the draft distribution's top-1 log-probability l_k
(``confidence_head_draft_logprob``) and log(1 - exp(l_k))
(``confidence_head_draft_miss_logprob``). Both depend on x_{k-1}, never on x_k, so decisions
on them stay lossless. Its weight is one row shared by every position or one row per
position. It runs in fp32 inside the captured draft graph. Temperatures T_k (Sequential
Temperature Scaling) divide z_k; they come from ``dspark_confidence_temperature``, else the
checkpoint's ``dspark_calibration.json``, else are 1.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from vllm_dspark.capacity.confidence_kernel import confidence_logit
from vllm_dspark.config import KEY_PREFIX, DSparkOptionError
from vllm_dspark.triton_path import use_triton

CALIBRATION_FILE = "dspark_calibration.json"
PREFIX = "confidence_head."
# Its tensors' names: a DSpark checkpoint's own, or, where the DSpark module ships inside
# the target's checkpoint (DeepSeek-V4: mtp.0-2.*), under the stage that holds it.
TENSOR_NAME = re.compile(r"(?:mtp\.\d+\.)?confidence_head\.(weight|bias)")
INDEX_FILE = "model.safetensors.index.json"
DRAFT_LOGPROB_KEY = "confidence_head_draft_logprob"
DRAFT_MISS_LOGPROB_KEY = "confidence_head_draft_miss_logprob"
# log(1 - e^l) is -inf at l = 0 and amplifies a rounding of l by e^l / (1 - e^l): l is
# capped at log(0.999) first, so that kernels rounding l differently (vLLM's and the
# reference's, bf16 logits) read the same input.
TOP1_LOGPROB_CAP = -1e-3


def top1_logprob(logits: torch.Tensor) -> torch.Tensor:
    """log max_v softmax(logits)_v in float32. [..., V] -> [...]."""
    logits = logits.float()
    return logits.amax(dim=-1) - torch.logsumexp(logits, dim=-1)


def draft_statistics(top1: torch.Tensor, logprob: bool, miss_logprob: bool) -> torch.Tensor:
    """The confidence inputs read from the draft distribution: [..., 0-2] from its top-1
    log-probability l [...]: l, log(1 - e^l), as asked."""
    parts = []
    if logprob:
        parts.append(top1)
    if miss_logprob:
        parts.append(torch.log(-torch.expm1(top1.clamp(max=TOP1_LOGPROB_CAP))))
    return torch.stack(parts, dim=-1) if parts else top1.new_zeros((*top1.shape, 0))


# JSON files: the config, the shard index and the calibration file. One pattern for all,
# so that the head and its temperatures share one snapshot (and one Hub request).
JSON_FILES = ("*.json",)


@functools.cache
def _checkpoint_files(model: str, patterns: tuple[str, ...], download_dir: str | None) -> Path:
    """The checkpoint's folder holding the files ``patterns`` match: the folder itself, or
    a Hub snapshot of just those files (in vLLM's download_dir where one is set), fetched
    once per process."""
    path = Path(model)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, allow_patterns=list(patterns), cache_dir=download_dir))


def _confidence_tensors(
    model: str, directory: Path, download_dir: str | None
) -> dict[str, torch.Tensor]:
    """The confidence head's tensors by ``weight`` / ``bias``, read from the shards that
    hold them (a DeepSeek-V4 checkpoint has dozens; its index names the one). ``directory``:
    the checkpoint's folder with its JSON files."""
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = sorted({f for n, f in weight_map.items() if TENSOR_NAME.fullmatch(n)})
        directory = _checkpoint_files(model, tuple(shards), download_dir) if shards else directory
        files = [directory / shard for shard in shards]
    else:
        directory = _checkpoint_files(model, ("*.safetensors",), download_dir)
        files = sorted(directory.glob("*.safetensors"))
    tensors, names = {}, {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
                match = TENSOR_NAME.fullmatch(name)
                if match is None:
                    continue
                if match[1] in tensors:
                    raise DSparkOptionError(
                        f"vllm-dspark: {model} holds two confidence heads, {names[match[1]]} "
                        f"and {name}; a DSpark drafter has one."
                    )
                tensors[match[1]], names[match[1]] = handle.get_tensor(name), name
    return tensors


class ConfidenceHead(torch.nn.Module):
    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        draft_logprob: bool,
        draft_miss_logprob: bool = False,
    ):
        super().__init__()
        bias = bias if bias is not None else torch.zeros(weight.shape[0])
        # [1 or K, inputs]: one row shared by every position, or one per position.
        self.weight = torch.nn.Parameter(weight.float(), requires_grad=False)
        self.bias = torch.nn.Parameter(bias.float().reshape(-1), requires_grad=False)
        self.reads_draft_logprob = draft_logprob
        self.reads_draft_miss_logprob = draft_miss_logprob

    @property
    def per_position(self) -> bool:
        return self.weight.shape[0] > 1

    def forward(
        self,
        hidden: torch.Tensor,
        markov_embed: torch.Tensor,
        logits: torch.Tensor,
        position: int = 0,
        kernel: bool | None = None,
    ) -> torch.Tensor:
        """Confidence logits z_k of draft position ``position`` (0-based): [rows, H],
        [rows, r], draft logits [rows, V] -> [rows]. ``kernel``: whether one Triton kernel
        computes it (:mod:`vllm_dspark.capacity.confidence_kernel`; by default on a GPU),
        else PyTorch (the CPU path, and what the kernel is tested on)."""
        row = position if self.per_position else 0
        use_kernel = use_triton(logits) if kernel is None else kernel
        if use_kernel:
            return confidence_logit(
                hidden,
                markov_embed,
                logits,
                self.weight[row],
                self.bias[row],
                self.reads_draft_logprob,
                self.reads_draft_miss_logprob,
                TOP1_LOGPROB_CAP,
            )
        parts = [hidden.float(), markov_embed.float()]
        if self.reads_draft_logprob or self.reads_draft_miss_logprob:
            top1 = top1_logprob(logits)
            parts.append(
                draft_statistics(top1, self.reads_draft_logprob, self.reads_draft_miss_logprob)
            )
        features = torch.cat(parts, dim=-1)
        return features @ self.weight[row] + self.bias[row]

    @classmethod
    def from_checkpoint(
        cls,
        model: str,
        hidden_and_rank: int,
        num_drafts: int,
        device: torch.device,
        download_dir: str | None = None,
    ):
        directory = _checkpoint_files(model, JSON_FILES, download_dir)
        config = json.loads((directory / "config.json").read_text())
        draft_logprob = bool(config.get(DRAFT_LOGPROB_KEY, False))
        draft_miss_logprob = bool(config.get(DRAFT_MISS_LOGPROB_KEY, False))
        tensors = _confidence_tensors(model, directory, download_dir)
        if "weight" not in tensors:
            raise DSparkOptionError(
                f"vllm-dspark: the draft checkpoint {model} declares a confidence head but "
                f"holds no {PREFIX}weight (nor mtp.<stage>.{PREFIX}weight)."
            )
        weight = tensors["weight"]
        weight = weight.reshape(1, -1) if weight.dim() < 2 else weight
        in_features = hidden_and_rank + int(draft_logprob) + int(draft_miss_logprob)
        if weight.shape[1] != in_features:
            layout = (
                "hidden ; markov embedding"
                + " ; draft log-probability" * draft_logprob
                + " ; draft miss log-probability" * draft_miss_logprob
            )
            raise DSparkOptionError(
                f"vllm-dspark: {PREFIX}weight of {model} has {weight.shape[1]} "
                f"inputs; this drafter's [{layout}] has {in_features}."
            )
        if 1 < weight.shape[0] < num_drafts:
            raise DSparkOptionError(
                f"vllm-dspark: {PREFIX}weight of {model} has one row per draft position for "
                f"{weight.shape[0]} positions; num_speculative_tokens={num_drafts} needs "
                f"{num_drafts} (or one shared row)."
            )
        head = cls(weight, tensors.get("bias"), draft_logprob, draft_miss_logprob)
        return head.to(device)


def resolve_temperatures(
    configured: list[float] | None,
    model: str,
    num_drafts: int,
    device: torch.device,
    download_dir: str | None = None,
) -> torch.Tensor:
    """Per-position temperatures [K]: the option, else the checkpoint's, else ones."""
    temperatures = configured
    if temperatures is None:
        directory = _checkpoint_files(model, JSON_FILES, download_dir)
        calibration = directory / CALIBRATION_FILE
        if calibration.is_file():
            temperatures = json.loads(calibration.read_text())["temperatures"]
    if temperatures is None:
        temperatures = [1.0] * num_drafts
    if len(temperatures) < num_drafts:
        raise DSparkOptionError(
            f"vllm-dspark: {KEY_PREFIX}confidence_temperature has {len(temperatures)} values; "
            f"num_speculative_tokens={num_drafts} needs one per draft position."
        )
    return torch.tensor(temperatures[:num_drafts], dtype=torch.float32, device=device)
