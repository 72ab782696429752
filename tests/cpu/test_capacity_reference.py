"""The capacity modes keep speculative decoding lossless (pure-PyTorch reference)."""

import pytest
import torch
from reference_step import Admission, ToyPair, first_tokens

from vllm_dspark.capacity.allocation import (
    budget_capacity,
    masked_forward_table,
    padded_to_graph_sizes,
    prefix_survival,
    sps_best_count,
    sps_table_from_curve,
    threshold_count,
)

VOCAB, REQS, DRAFTS = 5, 4, 4
BATCHES = 5000  # x REQS requests = 20,000 samples per mode
SPS = sps_table_from_curve([(1, 100.0), (8, 96.0), (12, 70.0), (20, 30.0)], 64)

MODES = {
    "off": dict(mode="off"),
    "threshold": dict(mode="threshold", threshold=0.3),
    "budget": dict(mode="budget", budget_frac=0.4),
    "sps": dict(mode="sps", sps_table=SPS),
    "acceptance": dict(mode="acceptance"),
}


def admission(mode: str, **overrides) -> Admission:
    """A fresh admission (threshold and sps keep state across steps)."""
    return Admission(**(MODES[mode] | overrides))


def chi_square_p_value(samples: torch.Tensor, expected_probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=expected_probs.numel()).double()
    expected = expected_probs.flatten() * samples.numel()
    statistic = ((counts - expected) ** 2 / expected).sum()
    dof = expected.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), statistic / 2))


def two_token_samples(
    admission: Admission, seed: int, first: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples of output tokens ``first`` and ``first + 1`` (as one index), and their
    target joint. Later tokens come from later steps, where the stateful modes act."""
    pair = ToyPair.random(VOCAB, seed=3)
    start = torch.zeros(BATCHES, REQS, dtype=torch.int64)
    gen = torch.Generator().manual_seed(seed)
    tokens = first_tokens(pair, start, first + 2, DRAFTS, admission, gen)
    # Target marginal of token ``first`` (a Markov chain from x0 = 0), then the next one.
    transition = pair.target_probs(torch.arange(VOCAB))
    marginal = pair.target_probs(torch.tensor(0))
    for _ in range(first):
        marginal = marginal @ transition
    joint = marginal[:, None] * transition
    return tokens[..., first] * VOCAB + tokens[..., first + 1], joint


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("first", [0, 8])
def test_output_distribution_matches_target(mode, first):
    samples, joint = two_token_samples(admission(mode), seed=11, first=first)
    assert samples.numel() == 20_000
    assert chi_square_p_value(samples.flatten(), joint) > 0.01


@pytest.mark.parametrize(
    "mode,depth", [("off", 2), ("off", 0), ("budget", 2), ("sps", 1), ("threshold", 0)]
)
def test_shallow_and_skipped_proposals_keep_the_target_distribution(mode, depth):
    # Dynamic depth (depth < K) and the draft gate (depth 0): uncomputed positions are
    # point-mass draws, verified as such where the step is not compacted ("off").
    samples, joint = two_token_samples(admission(mode, depth=depth), seed=13, first=8)
    assert chi_square_p_value(samples.flatten(), joint) > 0.01


def test_deciding_on_the_current_drafts_confidence_is_caught():
    # DSpark paper, Appendix A: admission that reads the draft it admits biases output.
    leaky = Admission("threshold", threshold=0.5, leak_current_draft=True)
    samples, joint = two_token_samples(leaky, seed=11)
    assert chi_square_p_value(samples.flatten(), joint) < 1e-6


@pytest.mark.parametrize("mode", MODES)
def test_greedy_output_equals_target_greedy(mode):
    pair = ToyPair.random(VOCAB, seed=5)
    start = torch.arange(VOCAB).repeat(8, 1)[:, :REQS]
    tokens = first_tokens(pair, start, 12, DRAFTS, admission(mode), torch.Generator(), greedy=True)
    expected, prev = [], start
    for _ in range(12):
        prev = pair.target_probs(prev).argmax(dim=-1)
        expected.append(prev)
    assert torch.equal(tokens, torch.stack(expected, dim=-1))


def test_survival_is_a_cumulative_product_with_temperatures():
    logits = torch.tensor([[2.0, 0.0, -2.0]])
    temps = torch.tensor([1.0, 2.0, 0.5])
    expected = torch.cumprod(torch.sigmoid(logits / temps), dim=-1)
    assert torch.allclose(prefix_survival(logits, temps), expected)
    assert bool((prefix_survival(logits, temps).diff(dim=-1) <= 0).all())


SURVIVAL = torch.tensor([[0.9, 0.8, 0.1, 0.05], [0.95, 0.3, 0.2, 0.1], [0.5, 0.5, 0.5, 0.4]])


def test_threshold_counts_the_slots_above_it():
    assert threshold_count(SURVIVAL, 0.5).item() == 2 + 1 + 3
    assert threshold_count(SURVIVAL.expand(2, 3, 4), 0.5).tolist() == [6, 6]


def test_budget_admits_the_best_slots_as_prefixes():
    # Best 5: 0.95 (r1), 0.9 (r0), 0.8 (r0), then the ties 0.5, 0.5 of r2 in position order.
    assert budget_capacity(SURVIVAL, 5).tolist() == [2, 1, 2]
    assert budget_capacity(SURVIVAL, 12).tolist() == [4, 4, 4]
    # Batched leading dimensions give the same answer per batch.
    assert budget_capacity(SURVIVAL.expand(2, 3, 4), 5).tolist() == [[2, 1, 2]] * 2


def test_sps_count_maximises_expected_throughput():
    flat_then_cliff = sps_table_from_curve([(1, 100.0), (5, 100.0), (6, 10.0), (64, 10.0)], 64)
    # R = 3, so up to 2 admitted slots keep T <= 5 at full speed; the third costs 10x.
    assert sps_best_count(SURVIVAL, flat_then_cliff).item() == 2
    steady = sps_table_from_curve([(1, 100.0), (64, 100.0)], 64)
    assert sps_best_count(SURVIVAL, steady).item() == 12
    # A dip then a recovery: the full scan finds the later, higher maximum.
    dip = sps_table_from_curve([(1, 100.0), (4, 100.0), (5, 60.0), (14, 100.0), (64, 100.0)], 64)
    assert sps_best_count(SURVIVAL, dip).item() == 12
    assert sps_best_count(SURVIVAL.expand(2, 3, 4), flat_then_cliff).tolist() == [2, 2]


def test_a_masked_step_admits_what_a_compacted_one_leaves_out_to_save_its_forward():
    """Masked, every admission of R = 3 requests runs R (1 + K) = 15 tokens: the drafts
    left out of a compacted step to keep it at full speed save nothing there."""
    flat_then_cliff = sps_table_from_curve([(1, 100.0), (5, 100.0), (6, 10.0), (64, 10.0)], 64)
    masked = masked_forward_table(flat_then_cliff, 3, 4)
    assert masked[3:16].tolist() == [flat_then_cliff[15].item()] * 13
    assert masked[16:].tolist() == flat_then_cliff[16:].tolist()  # other batches: as is
    assert masked_forward_table(flat_then_cliff, 3, 0) is flat_then_cliff  # compacted
    assert sps_best_count(SURVIVAL, flat_then_cliff).item() == 2
    assert sps_best_count(SURVIVAL, masked).item() == 12
    # A per-draft cost still leaves out the drafts whose survival does not pay for it.
    assert sps_best_count(SURVIVAL, masked, per_draft_seconds=0.05).item() < 12


def test_stale_modes_take_their_budget_from_the_previous_step():
    threshold = admission("threshold", threshold=0.5)
    first = threshold.capacity(SURVIVAL[None])  # no history: the full cap, R * K
    assert first.tolist() == [[4, 4, 4]]
    # The previous proposals wanted 6 slots (above 0.5); these get the 6 best.
    lower = SURVIVAL[None] * 0.5
    assert threshold.capacity(lower).sum().item() == 6
    # ...and these lower ones wanted none: at least one slot is still verified.
    assert threshold.capacity(lower).sum().item() == 1


def test_sps_table_interpolates_and_keeps_tokens_per_second_past_its_end():
    table = sps_table_from_curve([(2, 100.0), (4, 50.0)], 8)
    assert table.tolist() == pytest.approx(
        [100.0, 100.0, 100.0, 75.0, 50.0, 40.0, 200 / 6, 200 / 7, 25.0]
    )
    # sps_curve=auto with a single captured decode graph profiles one point: no NaN.
    one_point = sps_table_from_curve([[8, 100.0]], 16).tolist()
    assert one_point[:9] == [100.0] * 9 and one_point[16] == pytest.approx(50.0)


def test_sps_admits_nothing_past_the_profiled_end_for_free():
    # 64 requests, K = 7, every draft 90% likely to survive; the curve ends at 128 tokens
    # per step (the largest captured graph) and is flat up to there.
    survival = torch.full((64, 7), 0.9)
    table = sps_table_from_curve([(1, 100.0), (128, 100.0)], 64 * 8)
    # Past 128 tokens each draft costs its share of a compute-bound step and returns 0.9:
    # admitting up to the curve's end is best.
    assert sps_best_count(survival, table).item() == 128 - 64


@pytest.mark.parametrize("mode", ["threshold", "budget", "sps"])
def test_confidence_modes_really_vary_the_verified_depth(mode):
    # Otherwise the distribution tests above would only re-test fixed depth.
    pair = ToyPair.random(VOCAB, seed=3)
    prev = torch.randint(0, VOCAB, (BATCHES, REQS), generator=torch.Generator().manual_seed(0))
    conf = []
    for _ in range(DRAFTS):
        conf.append(pair.confidence_logits[prev])
        prev = torch.multinomial(pair.draft_probs(prev).view(-1, VOCAB), 1).view(prev.shape)
    survival = prefix_survival(torch.stack(conf, dim=-1), torch.ones(DRAFTS))
    mode_admission = admission(mode)
    mode_admission.capacity(survival)  # the stale modes' first step has no history
    depths = mode_admission.capacity(survival).unique()
    assert len(depths) >= 3 and depths.max() >= 2


def test_synthetic_acceptance_is_calibrated_and_stops_at_the_first_rejection():
    from vllm_dspark.bench.synthetic import (
        LOGIT_SPREAD,
        SyntheticConfidence,
        acceptance_draws,
        accepted_lengths,
    )
    from vllm_dspark.capacity.allocation import conditional_confidence

    means = [0.8, 0.6, 0.5, 0.4]
    # 100,000 requests of distinct seeds, each drafting positions 11..14.
    seeds = torch.arange(100_000) * 7919 - 2**40
    first = torch.full((100_000,), 10)
    positions = first.unsqueeze(1) + torch.arange(1, 5)
    synthetic = SyntheticConfidence(means, torch.device("cpu"))
    logits = synthetic.draw(seeds, positions)
    survival = prefix_survival(logits, torch.ones(4))
    confidence = conditional_confidence(survival)
    torch.testing.assert_close(confidence, torch.sigmoid(logits))
    # The option's values are the mean confidences (not the medians, which the spread
    # would pull away from the means).
    assert torch.sigmoid(logits).mean(dim=0).tolist() == pytest.approx(means, abs=0.005)
    assert torch.sigmoid(logits).median(dim=0).values[0].item() > 0.85
    # The logit noise is normal with the module's spread.
    noise = logits - synthetic.center
    assert noise.mean().item() == pytest.approx(0.0, abs=0.02)
    assert noise.std().item() == pytest.approx(LOGIT_SPREAD, rel=0.01)
    uniform = acceptance_draws(seeds, first, 4)
    lengths = accepted_lengths(confidence, torch.full((100_000,), 4), uniform)
    # Calibrated by construction: the accepted share of drafts reaching position k equals
    # the mean confidence there.
    for k in range(4):
        reached = lengths >= k
        accepted = (lengths[reached] > k).double().mean()
        assert accepted.item() == pytest.approx(confidence[reached, k].mean().item(), abs=0.01)
    # Only verified drafts can be accepted, and only as a prefix.
    sure = torch.ones(3, 4)
    assert accepted_lengths(sure, torch.tensor([0, 2, 4]), torch.zeros(3, 4)).tolist() == [0, 2, 4]
    gap = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    assert accepted_lengths(gap, torch.tensor([4]), torch.full((1, 4), 0.5)).tolist() == [1]


def _auroc(scores: torch.Tensor, positives: torch.Tensor) -> float:
    """P(score of a positive > score of a negative), ties counting half (Mann-Whitney)."""
    ranks = torch.empty_like(scores, dtype=torch.float64)
    ranks[scores.argsort()] = torch.arange(1, len(scores) + 1, dtype=torch.float64)
    n_pos = int(positives.sum())
    n_neg = len(scores) - n_pos
    return float((ranks[positives].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def test_synthetic_confidence_reproduces_the_profile_and_a_trained_heads_discrimination():
    """On the device README's acceptance profile, fixed k=7 accepts 1 + sum(rates) tokens
    per step, and the prefix survival ranks accepted prefixes above rejected ones about as
    well as DSpark's raw head (AUROC 0.81-0.90)."""
    from vllm_dspark.bench.synthetic import (
        SyntheticConfidence,
        acceptance_draws,
        accepted_lengths,
    )

    rates = [0.8, 0.62, 0.48, 0.37, 0.28, 0.21, 0.16]
    from offline_sweep import conditional_rates  # benchmarks/ is on the path

    conditional = conditional_rates(rates)
    num = 200_000
    seeds = torch.arange(num) * 104729 + 17
    first = torch.full((num,), 40)
    positions = first.unsqueeze(1) + torch.arange(1, 8)
    logits = SyntheticConfidence(conditional, torch.device("cpu")).draw(seeds, positions)
    survival = prefix_survival(logits, torch.ones(7))
    uniform = acceptance_draws(seeds, first, 7)
    lengths = accepted_lengths(torch.sigmoid(logits), torch.full((num,), 7), uniform)
    assert 1 + lengths.double().mean().item() == pytest.approx(1 + sum(rates), abs=0.02)
    aurocs = [_auroc(survival[:, k], lengths > k) for k in range(7)]
    assert min(aurocs) > 0.8 and max(aurocs) < 0.9, aurocs


def test_synthetic_draws_are_common_to_every_batch_layout():
    """A draw is a function of (seed, position, stream) alone: the same request drafting
    the same position meets the same draw in any batch (row, companions, packing); draws
    of neighbouring positions and seeds are uncorrelated."""
    from vllm_dspark.bench.synthetic import ACCEPT_STREAM, counter_uniform

    seeds = torch.tensor([5, -(2**62), 2**40 + 3])
    positions = torch.tensor([[100, 101, 102]]).repeat(3, 1)
    alone = counter_uniform(seeds[1:2].unsqueeze(1), positions[1:2], ACCEPT_STREAM)
    batch = counter_uniform(seeds.unsqueeze(1), positions, ACCEPT_STREAM)
    reordered = counter_uniform(seeds.flip(0).unsqueeze(1), positions, ACCEPT_STREAM)
    assert torch.equal(batch[1], alone[0]) and torch.equal(reordered[1], alone[0])
    assert torch.equal(reordered[0], batch[2])
    # Streams, seeds and positions all change the draw.
    assert not torch.equal(counter_uniform(seeds.unsqueeze(1), positions, 1), batch)
    many = counter_uniform(torch.arange(20_000).unsqueeze(1), torch.arange(64), ACCEPT_STREAM)
    assert 0.0 < many.min().item() and many.max().item() < 1.0
    assert many.mean().item() == pytest.approx(0.5, abs=0.002)
    assert many.var().item() == pytest.approx(1 / 12, abs=0.001)
    next_position = (many[:, :-1].flatten(), many[:, 1:].flatten())
    next_seed = (many[:-1].flatten(), many[1:].flatten())
    for pair in (next_position, next_seed):
        assert abs(torch.corrcoef(torch.stack(pair))[0, 1].item()) < 0.01


def test_acceptance_mode_really_changes_the_depth():
    pair = ToyPair.random(VOCAB, seed=3)
    acceptance = admission("acceptance")
    start = torch.zeros(BATCHES, REQS, dtype=torch.int64)
    first_tokens(pair, start, 6, DRAFTS, acceptance, torch.Generator().manual_seed(0))
    depths = acceptance._depth.unique()
    assert len(depths) >= 2 and depths.min() < DRAFTS


def test_a_step_costs_what_the_graph_size_it_is_padded_to_costs():
    linear = sps_table_from_curve([(1, 100.0), (16, 40.0)], 20)
    padded = padded_to_graph_sizes(linear, [1, 2, 4, 8, 16])
    assert padded[3] == linear[4] and padded[5] == padded[8] == linear[8]
    assert padded[9] == padded[16] == linear[16]
    assert torch.equal(padded[17:], linear[17:])  # past the largest graph: no padding
    assert torch.equal(padded_to_graph_sizes(linear, []), linear)  # eager: none


def test_sps_fills_the_graph_size_its_admission_is_padded_to():
    # 64 requests, K = 7, every draft half likely to survive; graphs every 16 tokens. On
    # the interpolated curve the best admission falls between two sizes, where the step
    # pays for the next size anyway; on the padded table it verifies up to that size, for
    # more expected tokens per second at what the steps really cost.
    survival = torch.full((64, 7), 0.5)
    sizes = list(range(64, 513, 16))
    linear = sps_table_from_curve([(64, 100.0), (128, 95.0), (512, 30.0)], 64 * 8)
    padded = padded_to_graph_sizes(linear, sizes)
    on_linear = sps_best_count(survival, linear).item()
    on_padded = sps_best_count(survival, padded).item()
    assert 64 + on_linear not in sizes and 64 + on_padded in sizes

    def rate(admitted: int) -> float:  # expected tokens per second as the steps cost
        return (64 + 0.5 * admitted) * float(padded[64 + admitted])

    assert rate(on_padded) > rate(on_linear)


def test_the_speculators_curve_is_padded_to_its_engines_graph_sizes(sps_speculator):
    from vllm.config.compilation import CUDAGraphMode

    speculator = sps_speculator(num_drafts=3)
    curve = [[1, 100.0], [16, 99.0], [128, 20.0]]
    compilation = speculator.vllm_config.compilation_config
    compilation.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    compilation.cudagraph_capture_sizes = [1, 2, 4, 8, 16, 24, 32]
    speculator.controller.set_sps_curve(curve, speculator.device)
    table = speculator.controller.sps_table_host
    assert table[17] == table[24] == pytest.approx(float(sps_table_from_curve(curve, 24)[24]))
    assert table[33] < table[32]  # past the largest graph: as interpolated
