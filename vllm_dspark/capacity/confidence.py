"""The DSpark confidence head in inference, and its per-position temperatures.

Stock vLLM 0.26.0 skips the ``confidence_head.*`` weights of a DSpark checkpoint. The
head is one linear layer over ``[h_k ; markov_w1[x_{k-1}]]`` (the backbone's output at
draft position k and the Markov embedding of the previous token), giving the logit z_k
of "draft k survives given drafts 1..k-1 did". A checkpoint whose config.json sets
``confidence_head_draft_logprob`` (the embedded pair does) adds one input: the top-1
log-probability of the draft distribution at k, which depends on x_{k-1} but not on x_k,
so decisions on it stay lossless. It runs in fp32 inside the captured draft graph.
Temperatures T_k (Sequential Temperature Scaling) divide z_k; they come
from ``dspark_confidence_temperature``, else from the checkpoint's
``dspark_calibration.json``, else are 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from vllm_dspark.config import KEY_PREFIX, DSparkOptionError

CALIBRATION_FILE = "dspark_calibration.json"
PREFIX = "confidence_head."
DRAFT_LOGPROB_KEY = "confidence_head_draft_logprob"


def _checkpoint_dir(model: str) -> Path:
    path = Path(model)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, allow_patterns=["*.safetensors", "*.json"]))


class ConfidenceHead(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, draft_logprob: bool):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.float().reshape(1, -1), requires_grad=False)
        self.bias = torch.nn.Parameter(
            (bias if bias is not None else torch.zeros(1)).float().reshape(1), requires_grad=False
        )
        self.reads_draft_logprob = draft_logprob

    def forward(
        self, hidden: torch.Tensor, markov_embed: torch.Tensor, logits: torch.Tensor
    ) -> torch.Tensor:
        """Confidence logits z_k: [rows, H], [rows, r], draft logits [rows, V] -> [rows]."""
        parts = [hidden.float(), markov_embed.float()]
        if self.reads_draft_logprob:
            logits = logits.float()
            top1 = logits.amax(dim=-1) - torch.logsumexp(logits, dim=-1)
            parts.append(top1.unsqueeze(-1))
        features = torch.cat(parts, dim=-1)
        return torch.nn.functional.linear(features, self.weight, self.bias).squeeze(-1)

    @classmethod
    def from_checkpoint(cls, model: str, hidden_and_rank: int, device: torch.device):
        directory = _checkpoint_dir(model)
        config = json.loads((directory / "config.json").read_text())
        draft_logprob = bool(config.get(DRAFT_LOGPROB_KEY, False))
        tensors = {}
        for file in sorted(directory.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    if name.startswith(PREFIX):
                        tensors[name.removeprefix(PREFIX)] = handle.get_tensor(name)
        if "weight" not in tensors:
            raise DSparkOptionError(
                f"vllm-dspark: the draft checkpoint {model} declares a confidence head but "
                f"holds no {PREFIX}weight."
            )
        in_features = hidden_and_rank + int(draft_logprob)
        if tensors["weight"].numel() != in_features:
            layout = "hidden ; markov embedding" + " ; draft log-probability" * draft_logprob
            raise DSparkOptionError(
                f"vllm-dspark: {PREFIX}weight of {model} has {tensors['weight'].numel()} "
                f"inputs; this drafter's [{layout}] has {in_features}."
            )
        return cls(tensors["weight"], tensors.get("bias"), draft_logprob).to(device)


def resolve_temperatures(
    configured: list[float] | None, model: str, num_drafts: int, device: torch.device
) -> torch.Tensor:
    """Per-position temperatures [K]: the option, else the checkpoint's, else ones."""
    temperatures = configured
    if temperatures is None:
        calibration = _checkpoint_dir(model) / CALIBRATION_FILE
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
