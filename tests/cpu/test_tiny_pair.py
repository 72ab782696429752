"""The tiny-pair trainer: drafter semantics, losses, calibration math, export vs vLLM."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from lab.tiny_pair import calibration as cal
from lab.tiny_pair import corpus, export
from lab.tiny_pair.loss import DSparkLossWeights, dspark_loss, position_weights, total_variation
from lab.tiny_pair.train import OptimConfig, TimedTraining, make_optimizer
from vllm_dspark.capacity.confidence import TOP1_LOGPROB_CAP
from vllm_dspark.tiny_pair import load
from vllm_dspark.tiny_pair.drafter import (
    DrafterConfig,
    DSparkDrafter,
    SharedTargetWeights,
    block_attention_mask,
)
from vllm_dspark.tiny_pair.reference import load_reference_pair, propose_draft_tokens
from vllm_dspark.tiny_pair.target import TargetConfig, build_target, target_features

VOCAB = 320
TARGET = TargetConfig(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=256,
)


def tiny_drafter_config(**overrides) -> DrafterConfig:
    fields = dict(
        vocab_size=VOCAB,
        target_hidden_size=TARGET.hidden_size,
        target_layer_ids=[0, 2],
        mask_token_id=2,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=256,
        markov_rank=4,
    )
    return DrafterConfig(**(fields | overrides))


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    target = build_target(TARGET).eval().requires_grad_(False)
    drafter = DSparkDrafter(tiny_drafter_config()).eval().requires_grad_(False)
    # Training starts the Markov bias at zero; make it matter here.
    torch.nn.init.normal_(drafter.markov_head.markov_w2.weight, std=0.5)
    torch.nn.init.normal_(drafter.confidence_head.weight, std=0.5)
    shared = SharedTargetWeights(target.model.embed_tokens.weight, target.lm_head.weight)
    return target, drafter, shared


def test_block_mask_sees_earlier_context_and_own_block_only():
    mask = block_attention_mask(torch.tensor([[3, 6]]), context_len=8, block_size=2)[0]
    assert mask.shape == (4, 8 + 4)
    context, block = mask[:, :8], mask[:, 8:]
    assert context[:2].tolist() == [[True] * 3 + [False] * 5] * 2  # anchor 3: positions 0..2
    assert context[2:].tolist() == [[True] * 6 + [False] * 2] * 2  # anchor 6: positions 0..5
    # Non-causal inside a block (the anchor sees the masks after it), blind across blocks.
    assert block.tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]]


def test_many_anchor_pass_equals_one_anchor_per_truncated_context(pair):
    """vLLM drafts each request from exactly the context positions before its anchor."""
    target, drafter, shared = pair
    ids = torch.randint(3, VOCAB, (2, 24))
    features = target_features(target, ids, drafter.config.target_layer_ids)
    anchors = torch.tensor([[1, 5, 12, 17], [3, 4, 9, 16]])
    batched = drafter.propose(
        features.aux_hidden, anchors, ids.gather(1, anchors), shared, keep_logits=True
    )
    for b in range(2):
        for a, p in enumerate(anchors[b].tolist()):
            alone = drafter.propose(
                features.aux_hidden[b : b + 1, :p],
                torch.tensor([[p]]),
                ids[b : b + 1, p : p + 1],
                shared,
                keep_logits=True,
            )
            torch.testing.assert_close(alone.logits[0, 0], batched.logits[b, a])
            assert alone.tokens[0, 0].tolist() == batched.tokens[b, a].tolist()


def test_drafts_ignore_context_at_and_after_the_anchor(pair):
    target, drafter, shared = pair
    ids = torch.randint(3, VOCAB, (1, 20))
    aux = target_features(target, ids, drafter.config.target_layer_ids).aux_hidden
    anchor, token = torch.tensor([[10]]), ids[:, 10:11]
    base = drafter.propose(aux, anchor, token, shared, keep_logits=True).logits
    later = aux.clone()
    later[:, 10:] += 5.0
    torch.testing.assert_close(drafter.propose(later, anchor, token, shared, True).logits, base)
    earlier = aux.clone()
    earlier[:, 9] += 5.0
    assert not torch.allclose(drafter.propose(earlier, anchor, token, shared, True).logits, base)


def test_markov_bias_uses_the_previous_draft(pair):
    target, drafter, shared = pair
    ids = torch.randint(3, VOCAB, (1, 16))
    aux = target_features(target, ids, drafter.config.target_layer_ids).aux_hidden
    anchor = torch.tensor([[15]])
    proposal = drafter.propose(aux, anchor, ids[:, 15:], shared, keep_logits=True)
    block = drafter.backbone(aux, anchor, ids[:, 15:], shared)
    previous = torch.cat([ids[:, 15:], proposal.tokens[0, :, :-1]], dim=1)[None]
    logits, confidence = drafter.heads(block.hidden, block.base_logits, previous)
    torch.testing.assert_close(logits, proposal.logits)
    torch.testing.assert_close(confidence, proposal.confidence_logits)
    assert proposal.tokens.tolist() == logits.argmax(-1).tolist()


def test_reference_proposal_matches_the_batched_drafter(pair):
    target, drafter, shared = pair
    ids = torch.randint(3, VOCAB, (1, 30))
    features = target_features(target, ids, drafter.config.target_layer_ids)
    batched = drafter.propose(features.aux_hidden, torch.tensor([[29]]), ids[:, 29:], shared)
    reference = propose_draft_tokens(target, drafter, ids[0].tolist())
    assert reference.tokens == batched.tokens[0, 0].tolist()
    assert len(reference.tokens) == drafter.config.block_size
    np.testing.assert_allclose(
        reference.confidence_logits, batched.confidence_logits[0, 0].numpy(), rtol=1e-5
    )
    assert np.all(np.diff(reference.survival) <= 0)


def test_total_variation_bounds():
    p = torch.softmax(torch.randn(5, 11), dim=-1)
    assert torch.allclose(total_variation(p.log(), p), torch.zeros(5), atol=1e-6)
    one_hot_a, one_hot_b = torch.eye(4)[[0]], torch.eye(4)[[3]]
    assert total_variation((one_hot_a + 1e-30).log(), one_hot_b).item() == pytest.approx(1.0)


def test_loss_is_zero_tv_for_a_perfect_draft_and_trains_only_the_drafter(pair):
    _, drafter, _ = pair
    target_logits = torch.randn(2, 3, 7, VOCAB)
    target_probs = torch.softmax(target_logits, dim=-1)
    _, stats = dspark_loss(
        target_logits, torch.zeros(2, 3, 7), target_probs, DSparkLossWeights(), 4.0
    )
    assert stats["tv"].item() == pytest.approx(0.0, abs=1e-5)
    assert stats["top1"].item() == 1.0

    weights = position_weights(7, 4.0)
    assert torch.allclose(weights, torch.exp(-torch.arange(7) / 4.0))

    trainable = DSparkDrafter(drafter.config)
    embedding = torch.randn(VOCAB, 32)
    shared = SharedTargetWeights(embedding, embedding)
    aux = torch.randn(2, 12, 64)
    anchors = torch.tensor([[2, 4], [1, 5]])
    block = trainable.backbone(aux, anchors, torch.tensor([[5, 6], [7, 8]]), shared)
    previous = torch.randint(0, VOCAB, (2, 2, 7))
    logits, confidence = trainable.heads(block.hidden, block.base_logits, previous)
    loss, stats = dspark_loss(
        logits, confidence, torch.softmax(torch.randn_like(logits), -1), DSparkLossWeights(), 4.0
    )
    loss.backward()
    assert torch.isfinite(loss)
    assert 0.0 <= stats["tv"].item() <= 1.0
    assert trainable.fc.weight.grad is not None
    assert trainable.confidence_head.weight.grad.abs().sum() > 0
    assert "embed_tokens" not in " ".join(n for n, _ in trainable.named_parameters())


def test_ece_and_auroc_on_hand_computed_cases():
    predicted = np.array([0.1, 0.1, 0.9, 0.9])
    observed = np.array([0, 1, 1, 1])
    # bin of 0.1: mean pred 0.1, mean obs 0.5; bin of 0.9: 0.9 vs 1.0 -> (2*0.4 + 2*0.1) / 4
    assert cal.expected_calibration_error(predicted, observed) == pytest.approx(0.25)
    assert cal.expected_calibration_error(np.array([0.3] * 10), np.r_[[1] * 3, [0] * 7]) == (
        pytest.approx(0.0)
    )
    assert cal.auroc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    assert cal.auroc([0.1, 0.2, 0.3], [0, 1, 1]) == pytest.approx(1.0)
    assert cal.auroc([0.3, 0.2, 0.1], [0, 1, 1]) == pytest.approx(0.0)
    assert cal.auroc([0.5, 0.5], [0, 1]) == pytest.approx(0.5)
    assert cal.auroc([0.1, 0.2], [1, 1]) is None


def test_sts_fixes_overconfident_logits_and_keeps_the_ranking():
    rng = np.random.default_rng(0)
    true_logits = rng.normal(1.0, 1.5, size=(20000, 7))
    accepted = rng.random((20000, 7)) < cal.sigmoid(true_logits)
    overconfident = 3.0 * true_logits
    fit = cal.fit_sequential_temperature_scaling(overconfident[:10000], accepted[:10000])
    assert len(fit.temperatures) == 7
    assert all(2.0 < t < 4.5 for t in fit.temperatures), fit.temperatures
    report = cal.calibration_report(overconfident[10000:], accepted[10000:], fit.temperatures)
    assert all(a <= b + 1e-9 for a, b in zip(report["ece_sts"], report["ece_raw"], strict=True))
    assert max(report["ece_sts"]) < 0.02
    assert report["auroc_sts"][0] == pytest.approx(report["auroc"][0])
    scaled = cal.sigmoid(overconfident / np.asarray(fit.temperatures))
    raw = cal.sigmoid(overconfident)
    for k in range(7):
        assert (
            np.argsort(scaled[:, k], kind="stable") == np.argsort(raw[:, k], kind="stable")
        ).all()


def test_heldout_split_is_by_path_and_deduplicates(tmp_path):
    relpaths = [f"pkg{i}/mod{j}.py" for i in range(20) for j in range(10)]
    heldout = [p for p in relpaths if corpus.is_heldout(p)]
    assert 0 < len(heldout) < 30 and heldout == [p for p in relpaths if corpus.is_heldout(p)]
    files = []
    for relpath in relpaths:
        path = tmp_path / relpath.replace("/", "_")
        path.write_text("x = 1\n" if relpath.endswith("mod0.py") else f"# {relpath}\n")
        files.append(corpus.SourceFile(relpath, str(path)))
    train, held = corpus.read_split_texts(files, 10**6, 10**6)
    assert train.count("x = 1\n") + held.count("x = 1\n") == 1
    assert not set(train) & set(held)


def test_training_resumes_from_its_checkpoint(tmp_path):
    model = torch.nn.Linear(3, 3)
    optim = OptimConfig()

    def loop():
        generator = torch.Generator().manual_seed(0)
        return TimedTraining(
            tmp_path / "checkpoint.pt",
            model,
            make_optimizer(model, optim, torch.device("cpu")),
            generator,
            time_budget_s=1e9,
            max_steps=5,
            checkpoint_every_s=1e9,
        )

    first = loop()
    progress = type("Bar", (), {"update": lambda self: None, "set_postfix": lambda s, **k: None})()
    for _ in range(3):
        first.after_step({"loss": 1.0}, progress)
    first.save()
    second = loop()
    assert second.step == 3 and second.progress == pytest.approx(0.6)


@pytest.fixture(scope="module")
def exported_pair(pair, tmp_path_factory):
    """A random (untrained) pair exported exactly as the trainer exports."""
    target, drafter, _ = pair
    root = tmp_path_factory.mktemp("tiny_pair")
    texts = [f"def f{i}(x):\n    return x * {i}\n" for i in range(200)]
    tokenizer = corpus.train_tokenizer(texts, vocab_size=VOCAB)
    tokenizer.save(str(root / "tokenizer.json"))
    special_ids = {t: tokenizer.token_to_id(t) for t in corpus.SPECIAL_TOKENS}
    target.to(torch.bfloat16).save_pretrained(root / "work_target")
    target.float()
    export.export_target(
        root / "work_target", root / "tokenizer.json", special_ids, root / "target"
    )
    calibration = {"method": "sts", "temperatures": [1.0] * 7}
    export.export_draft(drafter, special_ids, calibration, root / "draft")
    return root


def test_export_layout_and_names(exported_pair):
    draft = json.loads((exported_pair / "draft" / "config.json").read_text())
    assert draft["architectures"] == ["Qwen3DSparkModel"]
    assert draft["dflash_config"] == {"mask_token_id": 2, "target_layer_ids": [0, 2]}
    assert draft["enable_confidence_head"] and draft["confidence_head_with_markov"]
    assert draft[load.DRAFT_LOGPROB_KEY] is False
    names = export.describe_tensor_file(exported_pair / "draft" / "model.safetensors")
    assert names["confidence_head.weight"] == [1, 32 + 4]
    assert names["markov_head.markov_w1.weight"] == [VOCAB, 4]
    assert not any("embed_tokens" in n or "lm_head" in n for n in names)
    assert json.loads((exported_pair / "target" / "generation_config.json").read_text()) == {
        "eos_token_id": 0,
        "pad_token_id": 1,
    }


def test_exported_target_loads_and_generates_in_transformers(exported_pair):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(exported_pair / "target")
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.mask_token_id) == (0, 1, 2)
    ids = tokenizer("def f3(x):\n", return_tensors="pt").input_ids
    assert tokenizer.decode(ids[0]) == "def f3(x):\n"
    model = AutoModelForCausalLM.from_pretrained(exported_pair / "target")
    out = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 5)


def test_reference_pair_round_trips_through_the_export(pair, exported_pair):
    target, drafter, _ = pair
    loaded_target, loaded_drafter, temperatures = load_reference_pair(exported_pair)
    assert temperatures == [1.0] * 7
    rounded = DSparkDrafter(drafter.config)
    rounded.load_state_dict(export.round_like_export(drafter.state_dict()))
    for name, tensor in rounded.state_dict().items():
        assert torch.equal(tensor, loaded_drafter.state_dict()[name]), name
    ids = torch.randint(3, VOCAB, (12,)).tolist()
    assert len(propose_draft_tokens(loaded_target, loaded_drafter, ids).tokens) == 7


def test_export_loads_in_vllm(vllm_cpu, exported_pair):
    from lab.tiny_pair.vllm_check import check_pair_against_vllm

    report = check_pair_against_vllm(exported_pair / "target", exported_pair / "draft")
    assert report.ok, report.problems
    assert "model.fc.weight" in report.loaded
    assert "model.layers.1.self_attn.qkv_proj.weight" in report.loaded
    assert set(report.aliased) >= {"model.embed_tokens.weight", "lm_head.weight"}
    assert report.skipped_by_vllm == ["confidence_head.bias", "confidence_head.weight"]


def test_vllm_check_catches_a_missing_tensor(vllm_cpu, exported_pair, tmp_path):
    from lab.tiny_pair.vllm_check import check_pair_against_vllm

    broken = tmp_path / "draft"
    broken.mkdir()
    for name in ("config.json", "dspark_calibration.json"):
        (broken / name).write_text((exported_pair / "draft" / name).read_text())
    tensors = load_file(exported_pair / "draft" / "model.safetensors")
    del tensors["layers.1.self_attn.k_norm.weight"]
    save_file(tensors, broken / "model.safetensors")
    report = check_pair_against_vllm(exported_pair / "target", broken)
    assert report.problems == [
        "draft: vLLM parameter model.layers.1.self_attn.k_norm.weight was not loaded"
    ]


def test_confidence_grad_scale_changes_gradients_not_values(pair):
    _, drafter, _ = pair
    hidden = torch.randn(1, 2, 7, 32, requires_grad=True)
    base_logits = torch.randn(1, 2, 7, VOCAB)
    previous = torch.randint(0, VOCAB, (1, 2, 7))
    grads = {}
    for scale in (1.0, 0.25, 0.0):
        hidden.grad = None
        _, confidence = drafter.heads(hidden, base_logits, previous, confidence_grad_scale=scale)
        confidence.sum().backward()
        grads[scale] = (confidence.detach(), hidden.grad.clone())
    torch.testing.assert_close(grads[0.25][0], grads[1.0][0])
    torch.testing.assert_close(grads[0.25][1], 0.25 * grads[1.0][1])
    assert grads[0.0][1].abs().sum() == 0


def test_position_heads_learn_each_positions_conditional_acceptance():
    rng = np.random.default_rng(1)
    n, k, d = 20000, 3, 4
    inputs = rng.normal(size=(n, k, d)) * [1.0, 2.0, 0.5, 1.0] + [0.0, 1.0, 0.5, 0.0]
    true_w = np.array([[1.5, -1.0, 0.5, 0.0], [0.0, 0.5, 2.0, -1.0], [-1.0, 0.0, 0.0, 1.0]])
    true_b = np.array([1.5, 1.0, 0.5])
    accepted = rng.random((n, k)) < cal.sigmoid(np.einsum("nkd,kd->nk", inputs, true_w) + true_b)
    # Rows after a rejection carry garbage labels: the fit must not read them.
    reached = np.concatenate([np.ones((n, 1), bool), np.cumprod(accepted, 1)[:, :-1] > 0], 1)
    accepted = np.where(reached, accepted, rng.random((n, k)) < 0.01)
    weight, bias = cal.fit_position_heads(inputs, accepted, l2=0.0)
    assert weight.shape == (k, d) and bias.shape == (k,)
    # Raw-input weights (the standardisation folded back), each position its own.
    fitted = cal.sigmoid(np.einsum("nkd,kd->nk", inputs, weight) + bias)
    truth = cal.sigmoid(np.einsum("nkd,kd->nk", inputs, true_w) + true_b)
    for position in range(k):
        rows = reached[:, position]
        assert np.abs(fitted[rows, position] - truth[rows, position]).mean() < 0.02
    np.testing.assert_allclose(weight[0], true_w[0], atol=0.15)


def test_refit_position_heads_reads_the_draft_statistics():
    from lab.tiny_pair.evaluate import VerifyRecords, head_logits, refit_position_heads

    rng = np.random.default_rng(2)
    n, k, d = 20000, 2, 3
    logprob = -rng.exponential(0.7, size=(n, k))
    miss = np.log(-np.expm1(logprob))
    # Acceptance follows the top-1's log-odds, l - log(1 - e^l), which no head over l
    # alone (linear in l) can represent.
    accepted = rng.random((n, k)) < cal.sigmoid(logprob - miss)
    records = VerifyRecords(
        confidence_logits=np.zeros((n, k)),
        accepted=accepted,
        acceptance_lengths=np.ones(n, dtype=np.int64),
        draft_logprob=logprob,
        confidence_inputs=rng.normal(size=(n, k, d + 1)),  # a column past hidden+rank: dropped
    )
    head = refit_position_heads(records, d)
    assert head["weight"].shape == (k, d + 2) and head["weight"].dtype == torch.float32
    np.testing.assert_allclose(head["weight"][:, :d], 0.0, atol=0.1)
    np.testing.assert_allclose(head["weight"][:, d], 1.0, atol=0.15)
    np.testing.assert_allclose(head["weight"][:, d + 1], -1.0, atol=0.15)
    # sigmoid(l - log(1 - e^l)) = e^l: the head recovers the top-1's own probability.
    error = np.abs(cal.sigmoid(head_logits(records, head, d)) - np.exp(logprob))
    assert error.mean() < 0.01 and error.max() < 0.06


@pytest.fixture(scope="module")
def logprob_drafter(pair):
    torch.manual_seed(1)
    config = tiny_drafter_config(confidence_draft_logprob=True, confidence_draft_miss_logprob=True)
    drafter = DSparkDrafter(dataclasses.replace(config, confidence_head_rows=config.block_size))
    torch.nn.init.normal_(drafter.markov_head.markov_w2.weight, std=0.5)
    torch.nn.init.normal_(drafter.confidence_head.weight, std=0.5)
    return drafter.eval().requires_grad_(False)


def test_confidence_head_reads_the_draft_top1_logprob(pair, logprob_drafter):
    target, _, shared = pair
    ids = torch.randint(3, VOCAB, (2, 24))
    features = target_features(target, ids, logprob_drafter.config.target_layer_ids)
    anchors = torch.tensor([[10, 17], [12, 20]])
    proposal = logprob_drafter.propose(
        features.aux_hidden,
        anchors,
        ids.gather(1, anchors),
        shared,
        keep_logits=True,
        keep_confidence_inputs=True,
    )
    top1 = torch.log_softmax(proposal.logits.float(), dim=-1).amax(dim=-1)
    torch.testing.assert_close(proposal.draft_logprob, top1)
    torch.testing.assert_close(proposal.confidence_inputs[..., -2], top1)
    capped = top1.clamp(max=TOP1_LOGPROB_CAP)
    torch.testing.assert_close(proposal.confidence_inputs[..., -1], torch.log(1 - capped.exp()))
    # Row j of the head scores position j.
    head = logprob_drafter.confidence_head
    expected = torch.einsum("bajd,jd->baj", proposal.confidence_inputs, head.weight) + head.bias
    torch.testing.assert_close(proposal.confidence_logits, expected.float())
    shared = (proposal.confidence_inputs @ head.weight[0] + head.bias[0]).float()
    assert not torch.allclose(proposal.confidence_logits[..., 1:], shared[..., 1:])


def test_plugin_confidence_head_follows_the_checkpoint_layout(
    pair, logprob_drafter, exported_pair, tmp_path
):
    from vllm_dspark.capacity.confidence import ConfidenceHead
    from vllm_dspark.config import DSparkOptionError

    special_ids = {t: i for i, t in enumerate(corpus.SPECIAL_TOKENS)}
    calibration = {"method": "sts", "temperatures": [1.0] * 7}
    export.export_draft(logprob_drafter, special_ids, calibration, tmp_path / "draft")
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert config[load.DRAFT_LOGPROB_KEY] is True
    assert config[load.DRAFT_MISS_LOGPROB_KEY] is True
    assert "log(1 - exp(" in config["confidence_head_input"]
    draft = tmp_path / "draft"
    assert load.load_drafter_from_export(draft)[0].config == logprob_drafter.config
    hidden_and_rank = 32 + 4
    head = ConfidenceHead.from_checkpoint(str(draft), hidden_and_rank, 7, "cpu")
    assert head.reads_draft_logprob and head.reads_draft_miss_logprob and head.per_position
    hidden, markov = torch.randn(5, 32), torch.randn(5, 4)
    logits = torch.randn(5, VOCAB) * 3
    top1 = torch.log_softmax(logits, dim=-1).amax(dim=-1, keepdim=True)
    miss = torch.log(1 - top1.clamp(max=TOP1_LOGPROB_CAP).exp())
    features = torch.cat([hidden, markov, top1, miss], dim=-1)
    ours = logprob_drafter.confidence_head(features)  # [5, 7]: one column per position
    for position in (0, 3, 6):
        torch.testing.assert_close(head(hidden, markov, logits, position), ours[:, position])
    # Rows for 7 positions cannot serve 8 drafts.
    with pytest.raises(DSparkOptionError, match="7 positions; num_speculative_tokens=8"):
        ConfidenceHead.from_checkpoint(str(draft), hidden_and_rank, 8, "cpu")
    # A checkpoint without the keys keeps the paper's shared [hidden ; markov] head.
    plain = ConfidenceHead.from_checkpoint(str(exported_pair / "draft"), hidden_and_rank, 8, "cpu")
    assert not plain.reads_draft_logprob and not plain.per_position
    torch.testing.assert_close(plain(hidden, markov, logits, 5), plain(hidden, markov, logits))
    config[load.DRAFT_MISS_LOGPROB_KEY] = False  # now the file's head is one input too wide
    (draft / "config.json").write_text(json.dumps(config))
    with pytest.raises(DSparkOptionError, match="has 38 inputs.*has 37"):
        ConfidenceHead.from_checkpoint(str(draft), hidden_and_rank, 7, "cpu")


def test_draft_statistics_cap_the_top1_before_the_miss_log_probability():
    from vllm_dspark.capacity.confidence import draft_statistics

    top1 = torch.tensor([0.0, -1e-9, -0.5])
    stats = draft_statistics(top1, logprob=True, miss_logprob=True)
    assert stats.shape == (3, 2) and torch.isfinite(stats).all()
    torch.testing.assert_close(stats[:, 0], top1)
    floor = math.log(-math.expm1(TOP1_LOGPROB_CAP))
    torch.testing.assert_close(
        stats[:, 1], torch.tensor([floor, floor, math.log(1 - math.exp(-0.5))])
    )
    assert draft_statistics(top1, logprob=False, miss_logprob=False).shape == (3, 0)


def test_the_model_card_states_the_heads_layout():
    from vllm_dspark.demo import EMBEDDED_PAIR

    training = json.loads((EMBEDDED_PAIR / "training.json").read_text())
    report = json.loads((EMBEDDED_PAIR / "eval.json").read_text())
    sizes = dict.fromkeys(
        ("target_parameters", "target_bytes", "draft_parameters", "draft_bytes"), 1
    ) | {"heldout_prompts": 256}
    refitted = export.model_card(sizes, report, training)
    assert "`confidence_head.weight` [7, 290]" in refitted and "log(1 - exp(" in refitted
    report["setup"]["confidence_head_refitted_on_calibration_split"] = False
    as_trained = export.model_card(sizes, report, training)
    assert "`confidence_head.weight` [1, 288]" in as_trained and "log(1 - exp(" not in as_trained
