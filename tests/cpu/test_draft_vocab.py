"""dspark_draft_vocab: drafting over part of the vocabulary (CPU, a fake draft model)."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vllm_dspark.config import DSparkOptionError, DSparkOptions, resolve_options
from vllm_dspark.head.draft_heads import DraftHeads
from vllm_dspark.speculator import DSparkPluginSpeculator

K, R, H, V, RANK = 4, 3, 16, 64, 4
SUBSET = [0, 3, 5, 8, 13, 21, 34, 55, 60, 63]


@pytest.fixture(autouse=True)
def one_rank(monkeypatch):
    import vllm.distributed

    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_world_size", lambda: 1)


def fake_model(scale: float = 1.0, reduced: bool = False):
    """What DraftHeads reads of a DSpark draft model: a linear LM head and Markov
    projection over V tokens behind a LogitsProcessor that scales."""
    gen = torch.Generator().manual_seed(0)
    lm_head = torch.nn.Linear(H, V, bias=False)
    markov_w2 = torch.nn.Linear(RANK, V, bias=False)
    with torch.no_grad():
        lm_head.weight.copy_(torch.randn(V, H, generator=gen))
        markov_w2.weight.copy_(torch.randn(V, RANK, generator=gen))
    embed = torch.randn(V, RANK, generator=gen)
    return SimpleNamespace(
        logits_processor=SimpleNamespace(org_vocab_size=V, scale=scale, soft_cap=None),
        lm_head=lm_head,
        model=SimpleNamespace(markov_head=SimpleNamespace(markov_w2=markov_w2)),
        compute_logits=lambda h: scale * lm_head(h),
        compute_draft_logits=lambda h: scale * lm_head(h),
        markov_bias=lambda e: scale * markov_w2(e),
        markov_embed=lambda t: embed[t],
        map_draft_to_target=lambda i: i,
        draft_id_to_target_id=torch.zeros(V, dtype=torch.long) if reduced else None,
    )


def heads(model, draft_vocab=None) -> DraftHeads:
    return DraftHeads(model, DSparkOptions(draft_vocab=draft_vocab), max_rows=R * K)


@pytest.mark.parametrize("option", [SUBSET, list(reversed(SUBSET))])
def test_the_heads_score_the_subsets_rows_and_map_back_to_token_ids(option):
    model = fake_model(scale=0.5)
    draft = heads(model, option)
    assert draft.vocab_ids.tolist() == SUBSET  # in increasing order, whatever the list's
    hidden = torch.randn(5, H, generator=torch.Generator().manual_seed(1))
    embed = torch.randn(5, RANK, generator=torch.Generator().manual_seed(2))
    full = model.compute_logits(hidden)
    with torch.no_grad():
        torch.testing.assert_close(draft.dspark_logits(hidden), full[:, SUBSET])
        torch.testing.assert_close(draft.markov_bias(embed), model.markov_bias(embed)[:, SUBSET])
        # Greedy: the best token among the subset's, as a token id.
        best = full[:, SUBSET].argmax(dim=-1)
        assert torch.equal(draft.greedy_tokens(hidden), torch.tensor(SUBSET)[best])
        assert torch.equal(draft.to_target(best), torch.tensor(SUBSET)[best])
        # Sampling: probability 0 outside the subset, the subset's softmax inside.
        probs = draft.target_logits(draft.logits(hidden)).softmax(dim=-1)
    outside = torch.ones(V, dtype=torch.bool)
    outside[SUBSET] = False
    assert (probs[:, outside] == 0).all()
    torch.testing.assert_close(probs[:, SUBSET], full[:, SUBSET].softmax(dim=-1))


def test_the_first_n_ids_and_no_subset_at_all():
    model = fake_model()
    hidden = torch.randn(5, H, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert heads(model, 10).vocab_ids.tolist() == list(range(10))
        whole = heads(model, V)  # every token: the same drafts as the model's own head
        assert torch.equal(whole.greedy_tokens(hidden), model.compute_logits(hidden).argmax(-1))
    stock = heads(model)
    assert stock.vocab_ids is None and not stock.private
    assert stock.lm_weight.data_ptr() == model.lm_head.weight.data_ptr()  # no copy


@pytest.mark.parametrize(
    "option,match",
    [(V + 1, f"vocabulary has {V}"), ([1, V], f"token ids up to {V}")],
)
def test_ids_past_the_vocabulary_fail_at_load(option, match):
    with pytest.raises(DSparkOptionError, match=match):
        heads(fake_model(), option)


def test_a_draft_with_its_own_reduced_vocabulary_is_refused():
    with pytest.raises(DSparkOptionError, match="dspark_draft_vocab needs a full-vocabulary"):
        heads(fake_model(reduced=True), 10)
    assert heads(fake_model(reduced=True)).vocab_ids is None


def test_the_option_reads_a_count_a_list_or_a_file(tmp_path):
    path = tmp_path / "vocab.json"
    path.write_text('{"token_ids": [7, 2, 9]}')
    assert resolve_options({"dspark_draft_vocab": 32768}, {})[0].draft_vocab == 32768
    assert resolve_options({"dspark_draft_vocab": str(path)}, {})[0].draft_vocab == [7, 2, 9]
    environ = {"VLLM_DSPARK_DRAFT_VOCAB": "[4, 1]"}
    assert resolve_options({}, environ)[0].draft_vocab == [4, 1]
    for bad, message in [
        (0, "greater than 0"),
        ([3, 3], "must not repeat"),
        ([-1], ">= 0"),
        (1.5, "valid integer"),
        ("missing.json", "no such file"),
    ]:
        with pytest.raises(DSparkOptionError, match=f"dspark_draft_vocab.*{message}"):
            resolve_options({"dspark_draft_vocab": bad}, {})


def dspark_drafter(model, draft_vocab):
    """Just what ``_sample_sequential`` reads, greedy, with real DraftHeads."""
    return SimpleNamespace(
        num_speculative_steps=K,
        draft_depth=K,
        sample_indices=torch.arange(R * K),
        sample_idx_mapping=torch.arange(R).repeat_interleave(K),
        sample_pos=torch.arange(R * K),
        input_buffers=SimpleNamespace(input_ids=torch.arange(40, 40 + R * K)),
        _anchor_idx=torch.arange(R) * K,
        model=model,
        heads=heads(model, draft_vocab),
        confidence=None,
        draft_logits=None,
        synthetic=None,
        has_confidence=False,
        draft_tokens=torch.full((R, K), -1, dtype=torch.long),
    )


def test_dspark_drafts_the_markov_chain_restricted_to_the_subset():
    model = fake_model()
    drafter = dspark_drafter(model, SUBSET)
    hidden = torch.randn(R * K, H, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        DSparkPluginSpeculator._sample_sequential(drafter, R, hidden)
        # Reference: each position's full logits plus the Markov bias of the previous
        # token, the argmax over the subset's columns.
        previous = drafter.input_buffers.input_ids[drafter._anchor_idx]
        base = model.compute_logits(hidden).view(R, K, V)
        expected = []
        for step in range(K):
            logits = base[:, step] + model.markov_bias(model.markov_embed(previous))
            previous = torch.tensor(SUBSET)[logits[:, SUBSET].argmax(dim=-1)]
            expected.append(previous)
    assert torch.equal(drafter.draft_tokens, torch.stack(expected, dim=1))
    assert set(drafter.draft_tokens.flatten().tolist()) <= set(SUBSET)


def test_the_vocabulary_tool_keeps_the_most_frequent_ids(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    from draft_vocab import main

    corpus = tmp_path / "prompts.json"
    # Token 9 four times, 7 three times, 2 and 5 twice, 1 once.
    corpus.write_text(json.dumps([[9, 9, 7, 2], {"prompt_token_ids": [9, 7, 5, 2, 9, 7, 5, 1]}]))
    out = tmp_path / "vocab.json"
    assert main(["--size", "3", "--corpus", str(corpus), "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    # 2 and 5 tie for the third place: the lower id wins.
    assert record["token_ids"] == [2, 7, 9]
    assert record["coverage"] == round(9 / 12, 4)
    assert record["first_ids_coverage"] == round(3 / 12, 4)  # ids 0..2: token 2 twice, 1 once
    # What the option reads back.
    assert resolve_options({"dspark_draft_vocab": str(out)}, {})[0].draft_vocab == [2, 7, 9]


def test_the_vocabulary_tool_tokenizes_text(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    from draft_vocab import main

    from vllm_dspark.demo import EMBEDDED_PAIR

    text = tmp_path / "traffic.txt"
    text.write_text("def main():\n    return 0\n" * 20)
    out = tmp_path / "vocab.json"
    tokenizer = str(EMBEDDED_PAIR / "target")
    assert (
        main(["--size", "4", "--corpus", str(text), "--tokenizer", tokenizer, "--out", str(out)])
        == 0
    )
    record = json.loads(out.read_text())
    assert len(record["token_ids"]) == 4 and record["tokens_counted"] > 0
    assert 0 < record["coverage"] <= 1
