"""DeepSeek-V4's DSpark module: what the plugin reads differently from a Qwen3 drafter.

Its weights ship in the target's sharded checkpoint under ``mtp.<stage>.``, its config is
the target's (no ``enable_confidence_head``), and its ``compute_logits`` normalises the
backbone's output before the LM head. CPU, fake checkpoints and a fake draft model."""

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from vllm_dspark.capacity.confidence import ConfidenceHead
from vllm_dspark.config import (
    DEEPSEEK_V4_DSPARK,
    DSparkOptionError,
    DSparkOptions,
    _draft_has_confidence_head,
)
from vllm_dspark.head.draft_heads import DraftHeads

HIDDEN, RANK, K = 12, 4, 5


def write_sharded(directory, shards: dict[str, dict[str, torch.Tensor]]) -> None:
    """safetensors shards and the index that maps each tensor to its shard."""
    directory.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for file, tensors in shards.items():
        save_file(tensors, str(directory / file))
        weight_map |= dict.fromkeys(tensors, file)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps({"architectures": ["DeepseekV4ForCausalLM"]}))


def test_the_confidence_head_loads_from_its_mtp_stage_in_a_sharded_target_checkpoint(tmp_path):
    weight = torch.randn(1, HIDDEN + RANK)
    write_sharded(
        tmp_path,
        {
            "model-00001-of-00003.safetensors": {"model.embed.weight": torch.randn(8, HIDDEN)},
            "model-00002-of-00003.safetensors": {"mtp.0.main_proj.weight": torch.randn(4, 4)},
            "model-00003-of-00003.safetensors": {
                "mtp.2.confidence_head.weight": weight,
                "mtp.2.markov_head.markov_w1.weight": torch.randn(8, RANK),
            },
        },
    )
    # A shard the index does not name for the head is never opened: make it unreadable.
    (tmp_path / "model-00001-of-00003.safetensors").write_bytes(b"not a safetensors file")
    head = ConfidenceHead.from_checkpoint(str(tmp_path), HIDDEN + RANK, K, "cpu")
    hidden, markov = torch.randn(3, HIDDEN), torch.randn(3, RANK)
    expected = torch.cat([hidden, markov], dim=-1) @ weight[0]  # no bias in the checkpoint
    torch.testing.assert_close(head(hidden, markov, torch.randn(3, 8), 4), expected)


def test_two_confidence_heads_or_none_fail_with_their_names(tmp_path):
    two = tmp_path / "two"
    write_sharded(
        two,
        {
            "a.safetensors": {"mtp.1.confidence_head.weight": torch.randn(1, HIDDEN + RANK)},
            "b.safetensors": {"mtp.2.confidence_head.weight": torch.randn(1, HIDDEN + RANK)},
        },
    )
    with pytest.raises(DSparkOptionError, match="two confidence heads, mtp.1.*and mtp.2"):
        ConfidenceHead.from_checkpoint(str(two), HIDDEN + RANK, K, "cpu")
    none = tmp_path / "none"
    write_sharded(none, {"a.safetensors": {"mtp.2.norm.weight": torch.randn(HIDDEN)}})
    with pytest.raises(DSparkOptionError, match=r"nor mtp.<stage>.confidence_head.weight"):
        ConfidenceHead.from_checkpoint(str(none), HIDDEN + RANK, K, "cpu")


@pytest.mark.parametrize(
    "architecture,declared,expected",
    [
        (DEEPSEEK_V4_DSPARK, None, True),  # the target's config says nothing of the head
        (DEEPSEEK_V4_DSPARK, False, False),
        ("Qwen3DSparkModel", None, False),
        ("Qwen3DSparkModel", True, True),
    ],
)
def test_which_drafts_are_taken_to_have_a_confidence_head(architecture, declared, expected):
    hf_config = SimpleNamespace(architectures=[architecture])
    if declared is not None:
        hf_config.enable_confidence_head = declared
    speculative_config = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf_config))
    assert _draft_has_confidence_head(speculative_config) is expected


class DSparkDeepseekV4ForCausalLM(SimpleNamespace):
    """Named as vLLM's DeepSeek-V4 DSpark module, whose compute_logits normalises first."""


@pytest.fixture
def one_rank(monkeypatch):
    import vllm.distributed

    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_world_size", lambda: 1)


def test_private_heads_normalise_as_the_drafters_own_head_does(one_rank):
    gen = torch.Generator().manual_seed(0)
    vocab = 32
    lm_head = torch.nn.Linear(HIDDEN, vocab, bias=False)
    norm = torch.nn.RMSNorm(HIDDEN)
    with torch.no_grad():
        lm_head.weight.copy_(torch.randn(vocab, HIDDEN, generator=gen))
        norm.weight.copy_(torch.rand(HIDDEN, generator=gen) + 0.5)
    model = DSparkDeepseekV4ForCausalLM(
        logits_processor=SimpleNamespace(org_vocab_size=vocab, scale=1.0, soft_cap=None),
        lm_head=lm_head,
        model=SimpleNamespace(norm=norm, markov_head=None),
        compute_logits=lambda h: lm_head(norm(h)),
        compute_draft_logits=lambda h: lm_head(norm(h)),
        draft_id_to_target_id=None,
    )
    subset = [1, 4, 9, 16, 25]
    heads = DraftHeads(model, DSparkOptions(draft_vocab=subset), max_rows=8)
    # Large, uneven rows: without the norm the subset's argmax would differ.
    hidden = torch.randn(6, HIDDEN, generator=gen) * torch.arange(1, 7)[:, None] * 10
    with torch.no_grad():
        full = model.compute_logits(hidden)
        torch.testing.assert_close(heads.dspark_logits(hidden), full[:, subset])
        best = torch.tensor(subset)[full[:, subset].argmax(dim=-1)]
        assert torch.equal(heads.greedy_tokens(hidden), best)
        unnormed = lm_head(hidden)[:, subset]
    assert not torch.allclose(unnormed, full[:, subset])


def test_temperatures_come_from_the_option_else_the_checkpoints_calibration(tmp_path):
    from vllm_dspark.capacity.confidence import CALIBRATION_FILE, resolve_temperatures

    write_sharded(tmp_path, {"a.safetensors": {"mtp.2.norm.weight": torch.randn(HIDDEN)}})
    assert resolve_temperatures(None, str(tmp_path), K, "cpu").tolist() == [1.0] * K
    (tmp_path / CALIBRATION_FILE).write_text(json.dumps({"temperatures": [1.5] * 7}))
    assert resolve_temperatures(None, str(tmp_path), K, "cpu").tolist() == [1.5] * K
    assert resolve_temperatures([2.0] * K, str(tmp_path), K, "cpu").tolist() == [2.0] * K
    with pytest.raises(DSparkOptionError, match="has 7 values; num_speculative_tokens=8"):
        resolve_temperatures(None, str(tmp_path), 8, "cpu")


def test_a_hub_checkpoint_is_fetched_once_per_file_set(tmp_path, monkeypatch):
    """The head's config and its temperatures read one snapshot of the checkpoint's JSON
    files; its tensors, one of the shard that holds them."""
    import huggingface_hub

    from vllm_dspark.capacity.confidence import (
        CALIBRATION_FILE,
        ConfidenceHead,
        resolve_temperatures,
    )

    weight = torch.randn(1, HIDDEN + RANK)
    write_sharded(tmp_path, {"b.safetensors": {"mtp.0.confidence_head.weight": weight}})
    (tmp_path / CALIBRATION_FILE).write_text(json.dumps({"temperatures": [1.25] * K}))
    fetched = []

    def snapshot_download(model, allow_patterns, cache_dir):
        fetched.append((model, tuple(allow_patterns)))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    model = f"org/draft-{tmp_path.name}"  # a Hub id no other test fetched
    head = ConfidenceHead.from_checkpoint(model, HIDDEN + RANK, K, "cpu")
    temperatures = resolve_temperatures(None, model, K, "cpu")
    assert torch.equal(head.weight.data, weight) and temperatures.tolist() == [1.25] * K
    assert fetched == [(model, ("*.json",)), (model, ("b.safetensors",))]
