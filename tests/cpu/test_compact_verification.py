"""The runner-side rewrite of a uniform verification batch (CPU, real vLLM InputBatch):
through the PyTorch layout, and through the Triton kernel under Triton's interpreter
(:mod:`triton_interpreter`), the path a GPU takes."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from triton_interpreter import interpreted, run_interpreted

from vllm_dspark.capacity.controller import StepPlan, TimedStep

K = 7


@pytest.fixture
def speculator(plugin_speculator):
    return plugin_speculator(dspark_capacity="budget", dspark_budget_frac=0.25)


def uniform_batch(num_reqs, computed):
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

    buffers = InputBuffers(max_num_reqs=16, max_num_tokens=256, device=torch.device("cpu"))
    batch = InputBatch.make_dummy(num_reqs, num_reqs * (1 + K), buffers)
    n = num_reqs * (1 + K)
    buffers.input_ids[:n] = torch.arange(1000, 1000 + n, dtype=torch.int32)
    buffers.positions[:n] = torch.tensor(
        [computed[r] + j for r in range(num_reqs) for j in range(1 + K)]
    )
    buffers.seq_lens[:num_reqs] = torch.tensor([c + 1 + K for c in computed], dtype=torch.int32)
    return batch, buffers


def runner_with(speculator, buffers, max_len=10_000):
    """A runner as compaction reads it: input buffers, the speculator, and per request
    slot the longest its sequence may grow (prompt + max_tokens)."""
    max_seq_len = np.full(16, max_len, dtype=np.int32)
    return SimpleNamespace(
        input_buffers=buffers,
        speculator=speculator,
        req_states=SimpleNamespace(max_seq_len=max_seq_len),
    )


def test_kernel_path_under_triton_interpreter():
    assert run_interpreted(__file__) == 1


def test_compacted_batch_verifies_the_budgets_best_prefixes(speculator):
    check_compacted_batch(speculator)


@interpreted
def test_interpreted_kernel_path_writes_the_same_batch(speculator):
    check_compacted_batch(speculator)


def check_compacted_batch(speculator):
    from vllm_dspark.verify.layout import compact_input_batch

    num_reqs = 3
    batch, buffers = uniform_batch(num_reqs, computed=[10, 20, 30])
    batch.idx_mapping = torch.tensor([5, 2, 9], dtype=torch.int32)  # request slots
    batch.idx_mapping_np = batch.idx_mapping.numpy()
    # Slot 5 is confident, slot 2 not at all, slot 9 in between.
    speculator.controller.slot_survival[5] = torch.linspace(0.99, 0.9, K)
    speculator.controller.slot_survival[2] = torch.full((K,), 0.01)
    speculator.controller.slot_survival[9] = torch.tensor([0.95, 0.5, 0.1, 0.05, 0.04, 0.03, 0.02])
    budget = speculator.controller.admission_budget(num_reqs)  # ceil(3 * 7 * 0.25) = 6
    assert budget == 6
    compact = compact_input_batch(runner_with(speculator, buffers), batch, StepPlan(budget))
    # Best 6: slot 5's first five (0.99 .. 0.93 > 0.5) and slot 9's first (0.95).
    lengths = [1 + 5, 1 + 0, 1 + 1]
    assert compact.num_tokens == num_reqs + budget == sum(lengths)
    assert compact.cu_num_logits.tolist() == [0, 6, 7, 9]
    assert buffers.query_start_loc[:4].tolist() == [0, 6, 7, 9]
    expected_ids = list(range(1000, 1006)) + [1008] + [1016, 1017]
    assert buffers.input_ids[:9].tolist() == expected_ids
    assert buffers.positions[:9].tolist() == [10, 11, 12, 13, 14, 15, 20, 30, 31]
    assert buffers.seq_lens[:3].tolist() == [10 + 6, 20 + 1, 30 + 2]
    assert compact.expanded_idx_mapping.tolist() == [5] * 6 + [2] + [9] * 2
    assert compact.expanded_local_pos.tolist() == [0, 1, 2, 3, 4, 5, 0, 0, 1]
    assert compact.logits_indices.tolist() == list(range(9))
    assert compact.num_draft_tokens == budget
    assert (
        speculator.controller.drafts_admitted == budget
        and speculator.controller.drafts_proposed == num_reqs * K
    )
    assert (speculator.controller.compacted_steps, speculator.controller.graph_steps) == (1, 0)


def test_drafts_a_request_cannot_emit_before_max_tokens_go_to_the_others(speculator):
    from vllm_dspark.verify.layout import compact_input_batch

    batch, buffers = uniform_batch(3, computed=[10, 20, 30])
    batch.idx_mapping = torch.tensor([5, 2, 9], dtype=torch.int32)
    batch.idx_mapping_np = batch.idx_mapping.numpy()
    speculator.controller.slot_survival[[5, 2, 9]] = torch.linspace(0.99, 0.9, K)  # alike
    # Slot 5 (11 tokens so far) may reach 13: two more, one of them the bonus token, so one
    # draft of use. Slot 2 (21 so far) was finished by the step before (async scheduling
    # still scheduled it): none. Slot 9 may grow past this step.
    runner = runner_with(speculator, buffers)
    runner.req_states.max_seq_len[[5, 2, 9]] = [13, 20, 1000]
    budget = speculator.controller.admission_budget(3)  # ceil(3 * 7 * 0.25) = 6
    compact = compact_input_batch(runner, batch, StepPlan(budget))
    # Without the caps each would verify 2 drafts; capped, slot 9 takes the rest.
    assert compact.cu_num_logits.tolist() == [0, 2, 3, 9]
    assert compact.num_tokens == 3 + budget
    assert buffers.seq_lens[:3].tolist() == [10 + 2, 20 + 1, 30 + 6]


def test_a_masked_batch_runs_every_draft_and_verifies_the_admitted_ones(plugin_speculator):
    """dspark_varlen_verify=false: the uniform inputs stay as they are (the target runs all
    K drafts); the logits verified, the per-request draft counts and their request maps are
    those of the compacted step, and the drafts run but not verified count as rejected."""
    import dataclasses

    from vllm_dspark.patches import compact_verification as patch
    from vllm_dspark.verify.layout import masked_input_batch

    speculator = plugin_speculator(
        dspark_capacity="budget", dspark_budget_frac=0.25, dspark_varlen_verify=False
    )
    num_reqs = 3
    batch, buffers = uniform_batch(num_reqs, computed=[10, 20, 30])
    uniform = num_reqs * (1 + K)
    batch = dataclasses.replace(
        batch,
        idx_mapping=torch.tensor([5, 2, 9], dtype=torch.int32),
        idx_mapping_np=np.array([5, 2, 9], dtype=np.int32),
        logits_indices=torch.arange(uniform),  # every token's logits, as for decode
    )
    inputs_before = [t.clone() for t in (buffers.input_ids, buffers.positions, buffers.seq_lens)]
    speculator.controller.slot_survival[5] = torch.linspace(0.99, 0.9, K)
    speculator.controller.slot_survival[2] = torch.full((K,), 0.01)
    speculator.controller.slot_survival[9] = torch.tensor([0.95, 0.5, 0.1, 0.05, 0.04, 0.03, 0.02])
    budget = speculator.controller.admission_budget(num_reqs)
    masked = masked_input_batch(runner_with(speculator, buffers), batch, StepPlan(budget, True))
    # As compacted: slot 5 verifies 5 drafts, slot 2 none, slot 9 one.
    assert masked.cu_num_logits.tolist() == [0, 6, 7, 9]
    assert masked.expanded_idx_mapping.tolist() == [5] * 6 + [2] + [9] * 2
    assert masked.expanded_local_pos.tolist() == [0, 1, 2, 3, 4, 5, 0, 0, 1]
    assert masked.num_draft_tokens == budget and masked.num_draft_tokens_per_req is None
    # But from the uniform layout, whose inputs are untouched.
    assert masked.logits_indices.tolist() == [0, 1, 2, 3, 4, 5, 8, 16, 17]
    assert masked.num_tokens == uniform
    after = (buffers.input_ids, buffers.positions, buffers.seq_lens)
    assert all(torch.equal(a, b) for a, b in zip(after, inputs_before, strict=True))
    assert speculator.controller.masked_drafts.tolist() == [K - 5, K, K - 1]
    assert (
        speculator.controller.drafts_admitted == budget
        and speculator.controller.compacted_steps == 1
    )
    # The step's sampling counts them rejected, once.
    runner = SimpleNamespace(speculator=speculator)

    def sample(self):
        return "output", torch.tensor([3, 1, 2]), torch.tensor([2, 0, 0])

    sample_masked = patch._make_sample_wrapper(sample)
    assert sample_masked(runner)[2].tolist() == [2 + K - 5, K, K - 1]
    assert sample_masked(runner)[2].tolist() == [2, 0, 0]


def test_a_masked_step_keeps_the_uniform_forward(plugin_speculator):
    """With varlen_verify=false the step's dispatch and forward stay vLLM's uniform ones
    (no compact budget), and the step's forward is timed at R (1 + K) tokens."""
    from vllm_dspark.patches import compact_verification as patch

    speculator = plugin_speculator(
        dspark_capacity="budget", dspark_budget_frac=0.25, dspark_varlen_verify=False
    )
    seen = run_decode_step(speculator, patch._step_plan_var.get)
    assert seen == StepPlan(4, masked=True)  # ceil(2 * 7 * 0.25) verified, nothing compacted
    assert speculator.controller.timed_step == TimedStep(2 * (1 + K), 2)
    assert patch._step_plan_var.get() is None  # reset after the step


@pytest.mark.parametrize(
    ("options", "compacted"),
    [
        ({"dspark_budget_frac": 0.25}, True),
        ({"dspark_budget_frac": 0.25, "dspark_varlen_verify": False}, False),  # masked
        ({"dspark_budget_frac": 1.0}, False),  # every draft: vLLM's own step
    ],
)
def test_a_step_is_marked_compacted_for_the_overhead_fit(plugin_speculator, options, compacted):
    """The step overhead times compacted steps apart (their premium C,
    capacity/step_overhead.py): only a step whose batch is rewritten counts as one."""
    speculator = plugin_speculator(dspark_capacity="budget", **options)
    step = run_decode_step(speculator, lambda: speculator.controller.timed_step)
    assert step.compacted is compacted


def run_decode_step(speculator, observe):
    """One decode step of two requests with K drafts each through the execute wrapper;
    returns what ``observe()`` read inside the step."""
    from vllm_dspark.patches import compact_verification as patch

    seen = []
    runner = SimpleNamespace(
        speculator=speculator,
        req_states=SimpleNamespace(req_id_to_index={"a": 0, "b": 1}),
        sampler=SimpleNamespace(returns_logprobs=lambda slots: False),
    )
    step = scheduler_output({"a": 1 + K, "b": 1 + K}, {"a": [-1] * K, "b": [-1] * K})
    step.num_spec_tokens_to_schedule = K
    patch._make_execute_wrapper(lambda self, output: seen.append(observe()))(runner, step)
    assert len(seen) == 1
    return seen[0]


def scheduler_output(counts, drafts, structured=False, new=()):
    return SimpleNamespace(
        num_scheduled_tokens=counts,
        total_num_scheduled_tokens=sum(counts.values()),
        scheduled_spec_decode_tokens=drafts,
        has_structured_output_requests=structured,
        scheduled_new_reqs=list(new),
        num_spec_tokens_to_schedule=K,
    )


def plan_step(runner, scheduler_output):
    """The controller's plan for a scheduled step, as the execute wrapper asks for it."""
    from vllm_dspark.verify.layout import step_facts

    return runner.speculator.controller.plan_step(step_facts(runner, scheduler_output))


def test_only_decode_steps_without_host_side_layouts_are_compacted(speculator):

    runner = SimpleNamespace(
        speculator=speculator,
        req_states=SimpleNamespace(req_id_to_index={"a": 0, "b": 1}),
        sampler=SimpleNamespace(returns_logprobs=lambda slots: bool((slots == 1).any())),
    )
    decode = {"a": 1 + K}
    drafts = {"a": [-1] * K}
    assert plan_step(runner, scheduler_output(decode, drafts)).budget == 2  # ceil(7 * 0.25)
    # A prefill in the batch, structured output, or a request asking for logprobs: no.
    assert plan_step(runner, scheduler_output({"a": 1 + K, "b": 40}, drafts)) is None
    assert plan_step(runner, scheduler_output(decode, drafts, structured=True)) is None
    both = {"a": 1 + K, "b": 1 + K}
    assert plan_step(runner, scheduler_output(both, {"a": [-1] * K, "b": [-1] * K})) is None
    assert plan_step(runner, scheduler_output({}, {})) is None
    # A new or resumed request whose prompt is cached but for one token: vLLM pads it to
    # 1 + K with placeholder drafts, and the runner has no slot for it yet.
    padded = {"a": 1 + K, "new": 1 + K}
    new_drafts = {"a": [-1] * K, "new": [-1] * K}
    assert plan_step(runner, scheduler_output(padded, new_drafts, new=["new"])) is None


def test_with_mixed_steps_a_step_with_prompts_compacts_its_decoding_requests(plugin_speculator):

    # Mixed steps are on by default with compact verification.
    speculator = plugin_speculator(
        dspark_capacity="budget", dspark_budget_frac=0.25, dspark_varlen_verify=True
    )
    logprobs = set()  # the request slots wanting logprobs
    runner = SimpleNamespace(
        speculator=speculator,
        req_states=SimpleNamespace(req_id_to_index={"a": 0, "b": 1, "c": 2}),
        sampler=SimpleNamespace(returns_logprobs=lambda slots: bool(logprobs & set(slots))),
    )
    drafts = {"a": [-1] * K, "b": [-1] * K}
    # Two decoding requests, a new one's prompt (40 tokens) and another's chunk (30):
    # 2 * 8 + 70 tokens, 4 drafts verified of 14, so 10 fewer.
    counts = {"a": 1 + K, "b": 1 + K, "new": 40, "c": 30}
    step = plan_step(runner, scheduler_output(counts, drafts, new=["new"]))
    assert step == StepPlan(4, mixed=(2, 2 * (1 + K) + 70 - 10))
    # Timed for the step overhead with its 70 prompt tokens: 2 decoding requests, 4 drafts.
    assert speculator.controller.timed_step == TimedStep(2 + 4 + 70, 2, prompt_tokens=70)
    # Turned off, such a step verifies all K drafts.
    unmixed = SimpleNamespace(**vars(runner))
    unmixed.speculator = plugin_speculator(
        dspark_capacity="budget",
        dspark_budget_frac=0.25,
        dspark_varlen_verify=True,
        dspark_mixed_steps=False,
    )
    assert plan_step(unmixed, scheduler_output(counts, drafts, new=["new"])) is None
    # Still uncompacted: a request wanting logprobs (host-side layout), old or new; a prompt
    # chunk of exactly 1 + K tokens (vLLM would sort it among the decoding ones), a
    # request with some drafts but not K, or no decoding request at all.
    logprobs_new = SimpleNamespace(
        req_id="new", sampling_params=SimpleNamespace(logprobs=2, prompt_logprobs=None)
    )
    assert plan_step(runner, scheduler_output(counts, drafts, new=[logprobs_new])) is None
    # vLLM's own parameters: logprobs of chosen token ids count too; none, compacted.
    from vllm import SamplingParams

    for params, compacted in [
        (SamplingParams(logprob_token_ids=[5]), False),
        (SamplingParams(prompt_logprobs=1), False),
        (SamplingParams(), True),
    ]:
        new = SimpleNamespace(req_id="new", sampling_params=params)
        step = plan_step(runner, scheduler_output(counts, drafts, new=[new]))
        assert (step is not None) == compacted, params
    logprobs.add(2)  # request c
    assert plan_step(runner, scheduler_output(counts, drafts, new=["new"])) is None
    logprobs.clear()
    assert plan_step(runner, scheduler_output(counts | {"c": 1 + K}, drafts)) is None
    short = drafts | {"c": [-1] * 2}
    assert plan_step(runner, scheduler_output(counts | {"c": 3}, short)) is None
    assert plan_step(runner, scheduler_output({"new": 40}, {}, new=["new"])) is None
    # A new request padded to decode shape (its placeholder drafts never proposed) is a
    # prompt request here: it has drafts, so the step stays uncompacted.
    padded = drafts | {"new": [-1] * K}
    assert plan_step(runner, scheduler_output(counts | {"new": 1 + K}, padded, new=["new"])) is None


def test_mixed_steps_need_compact_verification():
    from vllm_dspark.config import DSparkOptions

    with pytest.raises(ValueError, match="mixed_steps only applies with dspark_varlen_verify"):
        DSparkOptions(capacity="sps", mixed_steps=True)
    # Unset, it follows compact verification; set, it is what was asked.
    assert not DSparkOptions(capacity="sps").compacts_mixed_steps
    assert DSparkOptions(capacity="sps", varlen_verify=True).compacts_mixed_steps
    assert DSparkOptions(capacity="sps", varlen_verify=True, mixed_steps=True).compacts_mixed_steps
    off = DSparkOptions(capacity="sps", varlen_verify=True, mixed_steps=False)
    assert not off.compacts_mixed_steps
    assert off.non_default()["mixed_steps"] is False


@pytest.fixture
def mixed_speculator(plugin_speculator):
    return plugin_speculator(
        dspark_capacity="budget",
        dspark_budget_frac=0.25,
        dspark_varlen_verify=True,
        dspark_mixed_steps=True,
    )


def compact_mixed(speculator, computed: list[int], prompts: list[tuple[int, int]], slots):
    """A stock mixed batch, as vLLM lays it out (the decoding requests first, 1 + K tokens
    and logits each, then each prompt chunk (computed, length) with one logit at its last
    token; input ids 1000, 1001, ...), compacted by the admission budget. Returns the
    compact batch, the buffers and the stock per-request (ids, positions, seq_len)."""
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

    from vllm_dspark.verify.layout import compact_input_batch

    decodes, num_reqs = len(computed), len(computed) + len(prompts)
    lengths = [1 + K] * decodes + [n for _, n in prompts]
    starts = [*np.cumsum([0, *lengths])]
    total = starts[-1]
    buffers = InputBuffers(max_num_reqs=16, max_num_tokens=256, device=torch.device("cpu"))
    batch = InputBatch.make_dummy(num_reqs, total, buffers)
    buffers.input_ids[:total] = torch.arange(1000, 1000 + total, dtype=torch.int32)
    firsts = [*computed, *(c for c, _ in prompts)]
    positions = [firsts[r] + j for r in range(num_reqs) for j in range(lengths[r])]
    buffers.positions[:total] = torch.tensor(positions)
    seq_lens = [firsts[r] + lengths[r] for r in range(num_reqs)]
    buffers.seq_lens[:num_reqs] = torch.tensor(seq_lens, dtype=torch.int32)
    buffers.query_start_loc[: num_reqs + 1] = torch.tensor(starts, dtype=torch.int32)
    batch.idx_mapping = torch.tensor(slots, dtype=torch.int32)
    batch.idx_mapping_np = batch.idx_mapping.numpy()
    batch.req_ids = [f"r{r}" for r in range(num_reqs)]
    batch.logits_indices = torch.tensor(
        [*range(decodes * (1 + K)), *(starts[r + 1] - 1 for r in range(decodes, num_reqs))]
    )
    stock = [
        (
            list(range(1000 + starts[r], 1000 + starts[r + 1])),
            positions[starts[r] : starts[r + 1]],
            seq_lens[r],
        )
        for r in range(num_reqs)
    ]
    budget = speculator.controller.admission_budget(decodes)
    num_tokens = total - (decodes * K - budget)
    plan = StepPlan(budget, mixed=(decodes, num_tokens))
    compact = compact_input_batch(runner_with(speculator, buffers), batch, plan)
    return compact, buffers, stock


def test_a_mixed_step_compacts_its_decoding_requests_and_moves_the_prompts_up(mixed_speculator):
    """Two decoding requests lead the batch (K drafts each), then a prompt chunk of 5
    tokens: the decoding ones keep 1 + k_r tokens, the prompt's tokens, its one logit and
    its query offsets move up by the drafts dropped; its sequence length stays."""
    speculator = mixed_speculator
    speculator.controller.slot_survival[5] = torch.linspace(0.99, 0.9, K)
    speculator.controller.slot_survival[2] = torch.full((K,), 0.01)
    # ceil(2 * 7 * 0.25) = 4 drafts: slot 5's first four, none of slot 2's.
    compact, buffers, _ = compact_mixed(speculator, [10, 20], [(50, 5)], [5, 2, 9])
    num_tokens = (1 + 4) + 1 + 5
    assert compact.num_tokens == num_tokens
    expected_ids = [*range(1000, 1005), 1008, *range(1016, 1021)]
    assert buffers.input_ids[:num_tokens].tolist() == expected_ids
    assert buffers.positions[:num_tokens].tolist() == [10, 11, 12, 13, 14, 20, *range(50, 55)]
    assert buffers.query_start_loc[:4].tolist() == [0, 5, 6, 11]
    assert buffers.seq_lens[:3].tolist() == [10 + 5, 20 + 1, 55]
    assert compact.logits_indices.tolist() == [0, 1, 2, 3, 4, 5, 10]
    assert compact.cu_num_logits.tolist() == [0, 5, 6, 7]
    assert compact.expanded_idx_mapping.tolist() == [5] * 5 + [2, 9]
    assert compact.expanded_local_pos.tolist() == [0, 1, 2, 3, 4, 0, 0]
    assert compact.num_draft_tokens == 4
    # Admission counted over the decoding requests alone.
    assert (
        speculator.controller.drafts_proposed == 2 * K
        and speculator.controller.drafts_admitted == 4
    )
    assert (speculator.controller.compacted_steps, speculator.controller.mixed_steps) == (1, 1)


@pytest.mark.parametrize("seed", range(20))
def test_every_mixed_batch_keeps_each_requests_leading_tokens_in_order(mixed_speculator, seed):
    """Random mixed batches: request r keeps the first 1 + k_r of its stock tokens
    (decoding, sum k_r the budget) or all of them (prompt chunk), in batch order, with
    their positions; logits at every kept token of a decoding request and at a prompt's
    last; sequence lengths short by the drafts dropped."""
    gen = torch.Generator().manual_seed(seed)
    decodes = int(torch.randint(1, 6, (1,), generator=gen))
    prompts = [
        (
            int(torch.randint(0, 40, (1,), generator=gen)),
            int(torch.randint(1, 30, (1,), generator=gen)),
        )
        for _ in range(int(torch.randint(1, 4, (1,), generator=gen)))
    ]
    slots = torch.randperm(16, generator=gen)[: decodes + len(prompts)].tolist()
    survival = torch.rand(16, K, generator=gen).sort(dim=1, descending=True).values
    mixed_speculator.controller.slot_survival[:16] = survival
    computed = torch.randint(0, 50, (decodes,), generator=gen).tolist()
    compact, buffers, stock = compact_mixed(mixed_speculator, computed, prompts, slots)
    kept = (compact.cu_num_logits[1:] - compact.cu_num_logits[:-1]).tolist()
    k = [n - 1 for n in kept[:decodes]]
    assert sum(k) == mixed_speculator.controller.admission_budget(decodes) and max(k) <= K
    assert kept[decodes:] == [1] * len(prompts)
    lengths = [1 + k_r for k_r in k] + [len(ids) for ids, _, _ in stock[decodes:]]
    ids = [t for (tokens, _, _), n in zip(stock, lengths, strict=True) for t in tokens[:n]]
    pos = [p for (_, where, _), n in zip(stock, lengths, strict=True) for p in where[:n]]
    assert compact.num_tokens == len(ids)
    assert buffers.input_ids[: len(ids)].tolist() == ids
    assert buffers.positions[: len(ids)].tolist() == pos
    starts = [0, *np.cumsum(lengths)]
    assert buffers.query_start_loc[: len(starts)].tolist() == starts
    dropped = [K - k_r for k_r in k] + [0] * len(prompts)
    expected_lens = [seq_len - d for (_, _, seq_len), d in zip(stock, dropped, strict=True)]
    assert buffers.seq_lens[: len(stock)].tolist() == expected_lens
    logits = [*range(starts[decodes]), *(starts[r + 1] - 1 for r in range(decodes, len(stock)))]
    assert compact.logits_indices.tolist() == logits
    rows = [r for r, n in enumerate(kept) for _ in range(n)]
    assert compact.expanded_idx_mapping.tolist() == [slots[r] for r in rows]


def test_a_step_admitting_every_draft_runs_uncompacted(plugin_speculator):

    full = plugin_speculator(dspark_capacity="budget", dspark_budget_frac=1.0)
    runner = SimpleNamespace(
        speculator=full,
        req_states=SimpleNamespace(req_id_to_index={"a": 0, "b": 1}),
        sampler=SimpleNamespace(returns_logprobs=lambda slots: False),
    )
    both = {"a": 1 + K, "b": 1 + K}
    assert plan_step(runner, scheduler_output(both, {"a": [-1] * K, "b": [-1] * K})) is None
    # Counted as admitted on the host; no compacted step.
    assert (full.controller.drafts_proposed, full.controller.drafts_admitted) == (2 * K, 2 * K)
    assert full.controller.compacted_steps == 0


def test_stale_record_reads_the_proposal_before_the_last():
    from vllm_dspark.capacity.stale_record import StalePerRequest

    stale = StalePerRequest(torch.device("cpu"), initial_per_request=3.5)
    assert stale.per_request() == 3.5
    stale.record(torch.tensor(8), num_reqs=4)  # proposal 0
    assert stale.per_request() == 3.5  # proposal 0's drafts are the ones being verified
    stale.record(torch.tensor(30), num_reqs=10)  # proposal 1
    assert stale.per_request() == 2.0  # proposal 0: 8 / 4
    stale.record(torch.tensor(0), num_reqs=5)  # proposal 2
    assert stale.per_request() == 3.0  # proposal 1: 30 / 10


@pytest.mark.parametrize(
    "options,wanted",
    [
        # Survivals [0.9, 0.8, 0.6, 0.3, ...] per request: 3 slots each reach 0.5.
        ({"dspark_capacity": "threshold", "dspark_confidence_threshold": 0.5}, 3),
        # SPS flat up to 2 tokens per request, then a cliff: 1 draft per request.
        (
            {
                "dspark_capacity": "sps",
                "dspark_sps_curve": [[1, 100.0], [8, 100.0], [9, 10.0], [64, 10.0]],
            },
            1,
        ),
    ],
)
def test_threshold_and_sps_budgets_follow_the_previous_proposal(plugin_speculator, options, wanted):
    speculator = plugin_speculator(**options)
    survival = torch.tensor([0.9, 0.8, 0.6, 0.3, 0.1, 0.05, 0.01]).repeat(4, 1)
    # Before two proposals: the cap, R * K (budget_frac 1).
    assert speculator.controller.admission_budget(4) == 4 * K
    for _ in range(2):
        speculator.controller.record_proposal(survival)
    assert speculator.controller.admission_budget(4) == 4 * wanted
    assert speculator.controller.admission_budget(8) == 8 * wanted  # scaled to the batch


def test_calibrated_synthetic_cuts_each_request_at_its_first_rejection():
    from vllm_dspark.bench import synthetic_acceptance

    def all_accepted(
        target_logits,
        draft_logits,
        draft_sampled,
        cu_num_logits,
        pos,
        idx_mapping,
        expanded_idx_mapping,
        expanded_local_pos,
        temperature,
        seed,
        num_speculative_steps,
        synthetic_conditional_rates=None,
        use_fp64=False,
    ):
        # vLLM's kernel accepts every verified draft.
        assert synthetic_conditional_rates.tolist() == [1.0] * K
        num_verified = cu_num_logits[1:] - cu_num_logits[:-1] - 1
        return "sampled", (num_verified + 1).to(torch.int32)

    speculator = SimpleNamespace(synthetic_slot_survival=torch.zeros(4, K))
    speculator.synthetic_slot_survival[1] = 1.0  # slot 1: every draft sure to pass
    speculator.synthetic_slot_survival[3, :2] = 1.0  # slot 3: two sure drafts, then none
    speculator.synthetic_slot_survival[2] = 0.5 ** torch.arange(1, K + 1)  # slot 2: each draft 1/2
    synthetic_acceptance._speculator = lambda: speculator
    wrapped = synthetic_acceptance._make_wrapper(all_accepted)
    seeds = torch.tensor([11, 12, 13, 14])  # per slot

    def verify(cu, slots, first_positions):
        """One step: the requests of ``slots`` verify cu[i+1] - cu[i] - 1 drafts each,
        their first logit at ``first_positions`` and the rest one position apart."""
        counts = (cu[1:] - cu[:-1]).tolist()
        runs = zip(first_positions, counts, strict=True)
        pos = torch.cat([first + torch.arange(n) for first, n in runs])
        args = [None, None, None, cu, pos, torch.tensor(slots), None, None, None, seeds, K]
        sampled, num_sampled = wrapped(*args, None, use_fp64=False)
        assert sampled == "sampled" and num_sampled.dtype == torch.int32
        return num_sampled.tolist()

    # Requests of slots 1, 3, 0: 7, 3 and 0 drafts.
    assert verify(torch.tensor([0, 8, 12, 13]), [1, 3, 0], [40, 50, 60]) == [8, 3, 1]
    # Slot 2's draws depend on its seed and positions only, not on the batch around it:
    # alone, packed behind others, or with fewer drafts verified (a prefix of the same).
    alone = verify(torch.tensor([0, 8]), [2], [70])[0]
    packed = verify(torch.tensor([0, 8, 16]), [1, 2], [40, 70])[1]
    assert alone == packed
    assert verify(torch.tensor([0, 3]), [2], [70])[0] == min(alone, 3)
    # Other positions draw anew: over many, each draft passes about half the time.
    lengths = [verify(torch.tensor([0, 8]), [2], [p])[0] - 1 for p in range(0, 4000, 8)]
    assert sum(length >= 1 for length in lengths) / len(lengths) == pytest.approx(0.5, abs=0.07)
    synthetic_acceptance._speculator = None


def position_record(num_verified: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    """What a verified step records for the acceptance controller (its
    ``Verification.position_counts``)."""
    from vllm_dspark.capacity.acceptance import position_counts

    return torch.cat(position_counts(num_verified, num_accepted, K)).float()


def verify_geometric(depth, num_reqs, rate, gen):
    """One step of requests verifying ``depth`` drafts each, each draft accepted with
    probability ``rate`` given the ones before: (drafts verified, drafts accepted)."""
    draws = torch.rand(num_reqs, depth, generator=gen) < rate
    accepted = torch.cumprod(draws.long(), dim=1).sum(dim=1)
    return torch.full((num_reqs,), depth), accepted


def test_acceptance_counts_are_not_censored_by_the_depth():
    from vllm_dspark.capacity.acceptance import AcceptanceDepth, position_counts

    # Requests verified 7, 7, 3 and 0 drafts and accepted 1, 0, 3 and 0.
    reached, accepted = position_counts(torch.tensor([7, 7, 3, 0]), torch.tensor([1, 0, 3, 0]), K)
    assert reached.tolist() == [3, 2, 1, 0, 0, 0, 0]
    assert accepted.tolist() == [2, 1, 1, 0, 0, 0, 0]
    # Verified to depth 2 only, at an acceptance of 0.8 per position: positions 3..7 take
    # position 2's ratio, so the expected length at full depth is not capped at 2.
    depth, gen = AcceptanceDepth(max_depth=K), torch.Generator().manual_seed(0)
    for _ in range(400):
        depth.observe(*position_counts(*verify_geometric(2, 16, 0.8, gen), K))
    expected = [0.8**j for j in range(1, K + 1)]
    assert depth.survival() == pytest.approx(expected, abs=0.04)
    assert depth.length_target() == 4  # floor(0.8 + ... + 0.8^7 + 1.5) = floor(4.66)


def test_acceptance_depth_drops_at_once_and_climbs_by_one_per_window():
    from vllm_dspark.capacity.acceptance import WINDOW_STEPS, AcceptanceDepth

    depth = AcceptanceDepth(max_depth=K)
    assert depth.update(2) == 2  # at once
    assert [depth.update(5) for _ in range(WINDOW_STEPS)] == [2] * (WINDOW_STEPS - 2) + [3, 3]
    assert [depth.update(5) for _ in range(WINDOW_STEPS)][-1] == 4
    assert depth.update(1) == 1


def test_acceptance_depth_climbs_back_at_once_to_a_depth_it_verified_lately():
    """A depth verified within RECENT_STEPS is no probe: a batch whose prefill steps
    planned a shallower depth returns to it at once, and only past it climbs by one per
    window; once it is long past, the climb is slow again."""
    from vllm_dspark.capacity.acceptance import RECENT_STEPS, WINDOW_STEPS, AcceptanceDepth

    depth = AcceptanceDepth(max_depth=K)
    assert [depth.update(3) for _ in range(10)][-1] == 3
    assert depth.update(1) == 1  # a transient drop
    assert depth.update(3) == 3  # back at once
    assert depth.update(1) == 1
    assert depth.update(5) == 3  # at once as far as depth 3, then probes
    assert [depth.update(5) for _ in range(WINDOW_STEPS)] == [3] * (WINDOW_STEPS - 1) + [4]
    assert depth.update(1) == 1
    assert depth.update(5) == 4  # depth 4 is recent now
    # Past RECENT_STEPS at depth 1, depth 4 is a probe again: one position a window.
    assert [depth.update(1) for _ in range(RECENT_STEPS)][-1] == 1
    assert depth.update(4) == 2 and depth.update(4) == 2


def test_acceptance_depth_follows_the_load_on_the_sps_curve():
    from vllm_dspark.capacity.acceptance import best_depth
    from vllm_dspark.capacity.allocation import sps_table_from_curve

    survival = np.array([0.8**j for j in range(1, K + 1)])
    # The Qwen3-8B shape's curve on the H200 (benchmarks/results/sps_curve_qwen3_8b.json,
    # a few of its points; beyond 512 tokens the table slows in proportion).
    curve = [(1, 190.0), (64, 169.0), (128, 149.0), (256, 111.0), (512, 66.0)]
    table = sps_table_from_curve(curve, 2048)
    assert best_depth(survival, 1, table) == K  # verifying 8 tokens costs about 1
    assert best_depth(survival, 256, table) == 1
    # A step's time outside the curve makes drafts cheaper relative to the step.
    assert best_depth(survival, 256, table, fixed_s=0.008) > 1
    # So does a proposal's own time: the same for every depth...
    at_64 = best_depth(survival, 64, table)
    assert best_depth(survival, 64, table, draft_s=0.008) > at_64
    # ... while one that grows with the depth computed (dynamic depth) makes it shallower.
    growing = 0.002 * np.arange(1, K + 1)
    assert best_depth(survival, 64, table, draft_s=growing) < at_64
    # Masked, every depth runs the K drafts through the target: the deepest pays best.
    assert best_depth(survival, 256, table, masked_step_drafts=K) == K
    # A tiny target (flat curve) with host time per verified draft: a shallow depth pays,
    # unless compacting (any depth short of K) costs more than the drafts it leaves out.
    flat = sps_table_from_curve([(1, 10000.0), (2048, 10000.0)], 2048)
    host = {"fixed_s": 0.0025, "per_draft_s": 2e-5}
    assert best_depth(survival, 64, flat, **host) == 2
    assert best_depth(survival, 64, flat, **host, compaction_s=0.01) == K


def test_masked_sps_verifies_the_drafts_a_compacted_step_would_leave_out(plugin_speculator):
    """sps with dspark_varlen_verify=false weighs the masked step's full forward: on a
    curve where compacting to a few drafts per request saves most of the step, it still
    admits every draft (the record reads the proposal before the last)."""
    curve = [[1, 200.0], [64, 190.0], [128, 180.0], [512, 40.0]]
    survival = torch.tensor([0.9, 0.8, 0.6, 0.3, 0.1, 0.05, 0.01]).repeat(64, 1)
    budgets = {}
    for varlen in (True, False):
        speculator = plugin_speculator(
            dspark_capacity="sps",
            dspark_sps_curve=curve,
            dspark_step_overhead_ms=0.0,
            dspark_varlen_verify=varlen,
        )
        for _ in range(2):
            speculator.controller.record_proposal(survival)
        budgets[varlen] = speculator.controller.admission_budget(64)
    assert budgets[True] <= 64 * 3 and budgets[False] == 64 * K


def test_dflash_acceptance_mode_verifies_one_depth_for_all(plugin_speculator):
    from vllm_dspark.capacity.allocation import verification_counts

    def speculator(**options):
        return plugin_speculator(K, method="dflash", dspark_capacity="acceptance", **options)

    # Three decode requests verified 7 drafts each and accepted 1, 0 and 2; a prefill had
    # none. Survival (2/3, 1/3, 0, ...): the length rule wants floor(1 + 1.5) = 2.
    batch = SimpleNamespace(cu_num_logits=torch.tensor([0, 8, 16, 24, 25]))
    counts = position_record(*verification_counts(batch.cu_num_logits, torch.tensor([2, 1, 3, 1])))
    # sps_curve=auto on this CPU platform, which captures no CUDA graph to profile (as
    # enforce_eager on a GPU): acceptance is not refused, it follows the length rule.
    length_rule = speculator()
    assert (
        not length_rule.controller.needs_sps_profile
        and length_rule.controller.sps_table_host is None
    )
    # A curve that collapses beyond 6 tokens per step (3 requests, one draft each).
    compute_bound = speculator(
        dspark_sps_curve=[[1, 1000.0], [6, 100.0], [9, 10.0], [64, 1.0]],
        dspark_step_overhead_ms=0.0,
    )
    # The budget reads the step before the last: the first two see no counts (depth K at
    # first for the length rule; on the collapsing curve one draft is best from the start).
    for control, expected in ((length_rule, [K, K, 2]), (compute_bound, [1, 1, 1])):
        assert control.controller.controls_capacity
        budgets = []
        for _ in range(3):
            budgets.append(control.controller.admission_budget(3))
            control.controller.record_verification(counts)
        assert budgets == [3 * depth for depth in expected]
        depths = control.controller.verify_capacity(torch.tensor([4, 0, 9]), budgets[-1])
        assert depths.tolist() == [expected[-1]] * 3
    # Fitting the step's overhead, one step in EXPLORE_EVERY verifies half the depth: still
    # one depth for every request. Steps of fewer than EXPLORE_MIN_DRAFTS drafts never do,
    # nor count toward the next that does.
    from vllm_dspark.capacity.controller import EXPLORE_EVERY, EXPLORE_MIN_DRAFTS

    flat = speculator(dspark_sps_curve=[[1, 100.0], [64, 100.0]])
    assert flat.controller.step_overhead.measuring
    small = EXPLORE_MIN_DRAFTS // K
    assert small * K < EXPLORE_MIN_DRAFTS <= (small + 1) * K
    budgets = [flat.controller.admission_budget(small) for _ in range(2 * EXPLORE_EVERY)]
    assert budgets == [small * K] * (2 * EXPLORE_EVERY)
    budgets = [flat.controller.admission_budget(small + 1) for _ in range(EXPLORE_EVERY)]
    assert budgets == [(small + 1) * K] * (EXPLORE_EVERY - 1) + [(small + 1) * (K // 2)]


def test_acceptance_ranks_fed_alike_pick_alike(plugin_speculator):
    """Tensor parallelism: two ranks given the same verification results (and the same
    curve) pick the same depth every step, while the depth moves."""
    options = {"dspark_capacity": "acceptance", "dspark_sps_curve": [[1, 190.0], [2048, 17.0]]}
    ranks = [plugin_speculator(**options) for _ in range(2)]
    gen, depths = torch.Generator().manual_seed(5), []
    for step in range(40):
        num_reqs = 1 + step % 5 * 60
        decisions = [rank.controller.admission_budget(num_reqs) for rank in ranks]
        assert decisions[0] == decisions[1], step
        depths.append(decisions[0] // num_reqs)
        counts = position_record(*verify_geometric(depths[-1], num_reqs, 0.7, gen))
        for rank in ranks:
            rank.controller.record_verification(counts)
    assert len(set(depths)) > 1


def test_ranks_fed_alike_decide_alike(plugin_speculator):
    """Tensor parallelism: every rank must verify the same drafts. Two speculators (two
    ranks) given the same survivals and verification results pick bit-identical budgets
    and capacities, ties included."""
    options = {"dspark_capacity": "threshold", "dspark_confidence_threshold": 0.5}
    ranks = [plugin_speculator(**options) for _ in range(2)]
    gen = torch.Generator().manual_seed(4)
    slots = torch.tensor([3, 0, 7, 5])
    for step in range(6):
        # Coarse values, so that many slots tie.
        survival = torch.cumprod(torch.randint(5, 11, (4, K), generator=gen) / 10.0, dim=1)
        decisions = []
        for rank in ranks:
            budget = rank.controller.admission_budget(len(slots))
            rank.controller.slot_survival[slots] = survival
            decisions.append((budget, rank.controller.verify_capacity(slots, budget)))
            rank.controller.record_proposal(survival)
        (budget_a, capacity_a), (budget_b, capacity_b) = decisions
        assert budget_a == budget_b and torch.equal(capacity_a, capacity_b), step


def test_compact_graphs_cover_every_reachable_size_smallest_first():
    from vllm_dspark.verify.compact_graphs import compact_graph_descriptors, pick_compact_graph

    # 4 requests of up to 1 + 7 tokens: at most 32 tokens, whatever the capture sizes.
    descs = compact_graph_descriptors([64, 1, 8, 16, 32, 8], 4, K, 512)
    assert [(d.num_tokens, d.num_reqs) for d in descs] == [(8, 4), (16, 4), (32, 4)]
    assert all(d.uniform_token_count is None and d.cg_mode.name == "FULL" for d in descs)
    captured = set(descs[1:])
    assert pick_compact_graph(descs, captured, num_reqs=3, num_tokens=9) == descs[1]
    assert pick_compact_graph(descs, captured, num_reqs=1, num_tokens=2) == descs[1]
    assert pick_compact_graph(descs, captured, num_reqs=4, num_tokens=33) is None
    assert pick_compact_graph(descs, set(), num_reqs=1, num_tokens=2) is None
    # vLLM's largest captured size bounds them too.
    assert compact_graph_descriptors([8, 16, 32], 256, K, 16)[-1].num_tokens == 16


def fake_graph_manager(mode, dp_size=1):
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

    decode = BatchExecutionDescriptor(CUDAGraphMode.FULL, 16, 2, uniform_token_count=1 + K)
    return SimpleNamespace(
        vllm_config=None,
        cudagraph_mode=mode,
        dp_size=dp_size,
        decode_query_len=1 + K,
        max_num_reqs=4,
        compilation_config=SimpleNamespace(
            cudagraph_capture_sizes=[8, 16, 32], max_cudagraph_capture_size=32
        ),
        _capture_descs={CUDAGraphMode.FULL: [decode]},
        graphs={},
    )


def test_compact_graphs_are_captured_beside_vllms_and_dispatched_only_for_compact_steps(
    monkeypatch,
):
    from vllm.config.compilation import CUDAGraphMode

    from vllm_dspark.patches import compact_graphs as graphs_patch
    from vllm_dspark.patches import compact_verification as patch

    monkeypatch.setattr(graphs_patch, "replays_varlen_graphs", lambda vllm_config: True)
    manager = fake_graph_manager(CUDAGraphMode.FULL_AND_PIECEWISE)
    graphs_patch._make_candidates_wrapper(lambda m: None)(manager)
    full = manager._capture_descs[CUDAGraphMode.FULL]
    assert [(d.num_tokens, d.uniform_token_count) for d in full] == [
        (32, None),
        (16, 1 + K),
        (16, None),
        (8, None),
    ]
    compact = getattr(manager, graphs_patch.COMPACT_GRAPHS_ATTR)
    manager.graphs = dict.fromkeys(full)  # captured

    calls = []

    def stock_dispatch(manager, num_reqs, num_tokens, uniform, *args, **kw):
        calls.append((num_reqs, num_tokens, uniform))
        return "stock", None

    dispatch = patch._make_dispatch_wrapper(stock_dispatch)
    # Not a compacted step: vLLM's dispatch, untouched.
    assert dispatch(manager, 2, 16, 1 + K, 1, 0, need_eager=False)[0] == "stock"
    token = patch._step_plan_var.set(StepPlan(5))  # 2 requests, 5 drafts admitted: 7 tokens
    try:
        assert dispatch(manager, 2, 16, 1 + K, 1, 0, need_eager=False) == (compact[0], None)
        # Profiling runs eager: vLLM's dispatch, for the compact token count.
        assert dispatch(manager, 2, 16, 1 + K, 1, 0, need_eager=True)[0] == "stock"
    finally:
        patch._step_plan_var.reset(token)
    assert calls == [(2, 16, 1 + K), (2, 7, None)]


def test_compact_graphs_are_captured_on_queries_as_long_as_a_compacted_steps(monkeypatch):
    """FlashAttention 3 fixes its causal mask and kernel at capture from the longest query:
    a compact graph must not be captured on one-token queries (vLLM's dummy layout for a
    graph of at most max_num_seqs tokens), nor vLLM's own graphs on anything but theirs."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

    from vllm_dspark.patches import compact_graphs as graphs_patch

    monkeypatch.setattr(graphs_patch, "replays_varlen_graphs", lambda vllm_config: True)
    stock_make_dummy = InputBatch.make_dummy.__func__
    wrapped = classmethod(graphs_patch._make_dummy_batch_wrapper(stock_make_dummy))
    monkeypatch.setattr(InputBatch, "make_dummy", wrapped)
    manager = fake_graph_manager(CUDAGraphMode.FULL_AND_PIECEWISE)
    graphs_patch._make_candidates_wrapper(lambda m: None)(manager)
    compact = getattr(manager, graphs_patch.COMPACT_GRAPHS_ATTR)
    buffers = InputBuffers(max_num_reqs=4, max_num_tokens=32, device=torch.device("cpu"))
    layouts = {}

    def create_forward_fn(desc, warmup):
        batch = InputBatch.make_dummy(desc.num_reqs, desc.num_tokens, buffers)
        query_start_loc = buffers.query_start_loc[: desc.num_reqs + 1].tolist()
        assert query_start_loc == [0, *np.cumsum(batch.num_scheduled_tokens)]
        assert buffers.seq_lens[: desc.num_reqs].tolist() == batch.num_scheduled_tokens.tolist()
        assert batch.seq_lens_cpu_upper_bound.tolist() == batch.num_scheduled_tokens.tolist()
        layouts[desc] = batch.num_scheduled_tokens.tolist()

    def stock_capture(manager, create_forward_fn):
        for desc in manager._capture_descs[CUDAGraphMode.FULL]:
            create_forward_fn(desc, warmup=False)

    graphs_patch._make_capture_wrapper(stock_capture)(manager, create_forward_fn)
    by_size = {(desc.num_tokens, desc in compact): layout for desc, layout in layouts.items()}
    assert by_size == {
        (32, True): [8, 8, 8, 8],
        (16, False): [8, 8],  # vLLM's uniform decode graph, as vLLM lays it out
        (16, True): [8, 8, 0, 0],  # vLLM's dummy: [4, 4, 4, 4]
        (8, True): [8, 0, 0, 0],  # vLLM's dummy: [2, 2, 2, 2]
    }
    # Outside a compact graph's capture the dummy batch is vLLM's.
    assert InputBatch.make_dummy(4, 8, buffers).num_scheduled_tokens.tolist() == [2, 2, 2, 2]


@pytest.mark.parametrize(
    "mode,dp_size,fa3",
    [("PIECEWISE", 1, True), ("FULL_AND_PIECEWISE", 2, True), ("FULL_AND_PIECEWISE", 1, False)],
)
def test_no_compact_graphs_without_full_decode_graphs_fa3_or_with_data_parallelism(
    monkeypatch, mode, dp_size, fa3
):
    from vllm.config.compilation import CUDAGraphMode

    from vllm_dspark.patches import compact_graphs as graphs_patch

    monkeypatch.setattr(graphs_patch, "replays_varlen_graphs", lambda vllm_config: fa3)
    manager = fake_graph_manager(CUDAGraphMode[mode], dp_size)
    graphs_patch._make_candidates_wrapper(lambda m: None)(manager)
    assert len(manager._capture_descs[CUDAGraphMode.FULL]) == 1
    assert not hasattr(manager, graphs_patch.COMPACT_GRAPHS_ATTR)


def test_sps_auto_is_refused_where_no_full_decode_graph_will_be_captured(plugin_speculator):
    from vllm_dspark.config import DSparkOptionError

    # This CPU platform captures no CUDA graphs, as enforce_eager would on a GPU.
    with pytest.raises(DSparkOptionError, match="sps_curve='auto'.*Valid here: a curve"):
        plugin_speculator(dspark_capacity="sps")


def test_a_profiled_curve_handed_over_ends_the_need_for_a_profile(plugin_speculator):
    controller = plugin_speculator(dspark_capacity="acceptance").controller
    assert controller.needs_sps_profile is False  # no FULL graphs on this CPU platform
    controller.needs_sps_profile = True  # as with sps_curve=auto on a GPU with graphs
    controller.set_sps_curve([[8, 250.0], [64, 125.0]], torch.device("cpu"), profiled=True)
    assert not controller.needs_sps_profile
    assert controller.profiled_sps_curve == [[8, 250.0], [64, 125.0]]


def test_sps_proposals_before_the_curve_is_profiled_record_nothing(sps_speculator):
    """sps_curve=auto has no curve until graph capture, and DeepSeek-V4's attention warm-up
    runs whole steps before it: their proposals are neither weighed nor recorded."""
    controller = sps_speculator().controller
    controller.sps_table = controller.sps_table_host = None  # as sps_curve=auto before capture
    controller.drafted_last = True
    recorded = controller.stale_budget.proposals
    controller.observe_proposal(torch.arange(4), torch.full((4, 7), 0.9))
    assert controller.stale_budget.proposals == recorded
    controller.set_sps_curve([[1, 100.0], [16, 99.0], [128, 20.0]], torch.device("cpu"))
    controller.observe_proposal(torch.arange(4), torch.full((4, 7), 0.9))
    assert controller.stale_budget.proposals == recorded + 1


def test_sps_auto_profiles_after_capture_and_hands_the_curve_over(monkeypatch):
    from vllm_dspark.capacity.allocation import sps_table_from_curve
    from vllm_dspark.patches import sps_autoprofile

    curves, draft_costs = [], []

    def set_sps_curve(curve, device, profiled):
        curves.append((curve, profiled))
        controller.needs_sps_profile = False  # as the controller's own does (test below)

    controller = SimpleNamespace(
        needs_sps_profile=True, set_sps_curve=set_sps_curve, set_draft_cost=draft_costs.append
    )
    speculator = SimpleNamespace(
        controller=controller,
        draft_graph_managers=lambda: {1: "depth-1 graphs", 7: "draft graphs"},
    )
    runner = SimpleNamespace(speculator=speculator, device="cpu")
    monkeypatch.setattr(sps_autoprofile, "time_target_steps", lambda r: [(8, 4.0), (64, 8.0)])
    monkeypatch.setattr(
        sps_autoprofile,
        "time_draft_graphs",
        lambda s, manager: [(1, 0.5), (8, 1.0)] if manager == "draft graphs" else [(1, 0.2)],
    )
    monkeypatch.setattr(sps_autoprofile, "slowest_rank", lambda rows: rows)
    capture = sps_autoprofile._make_wrapper(lambda runner: 123)
    assert capture(runner) == 123
    assert curves == [([[8, 250.0], [64, 125.0]], True)]
    # Each depth's draft graphs, timed the same way.
    assert draft_costs == [{1: [(1, 0.2)], 7: [(1, 0.5), (8, 1.0)]}]
    assert not speculator.controller.needs_sps_profile
    assert capture(runner) == 123 and len(curves) == 1  # once
    table = sps_table_from_curve(curves[0][0], 64)
    assert table[36].item() == pytest.approx(187.5)
    # No graph to time: a start-up error naming the option.
    speculator.controller.needs_sps_profile = True
    monkeypatch.setattr(sps_autoprofile, "time_target_steps", lambda r: [])
    with pytest.raises(Exception, match="sps_curve='auto'"):
        capture(runner)


def test_sps_profile_times_the_captured_uniform_decode_graphs_only():
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

    from vllm_dspark.capacity.sps_profile import decode_graph_shapes

    graphs = {
        BatchExecutionDescriptor(CUDAGraphMode.FULL, 16, 2, uniform_token_count=8): 0,
        BatchExecutionDescriptor(CUDAGraphMode.FULL, 8, 1, uniform_token_count=8): 0,
        BatchExecutionDescriptor(CUDAGraphMode.FULL, 16, 16): 0,  # compact / mixed
        BatchExecutionDescriptor(CUDAGraphMode.PIECEWISE, 32, None): 0,
    }
    runner = SimpleNamespace(cudagraph_manager=SimpleNamespace(graphs=graphs), decode_query_len=8)
    assert decode_graph_shapes(runner) == [(8, 1), (16, 2)]
    assert decode_graph_shapes(SimpleNamespace(cudagraph_manager=None)) == []


def test_sps_profile_times_decode_steps_past_the_largest_graph_too():
    from vllm_dspark.capacity.sps_profile import eager_decode_shapes

    graphs = [(8, 1), (256, 32), (512, 64)]
    runner = SimpleNamespace(decode_query_len=8, max_num_reqs=256, max_num_tokens=8192)
    # One request past the largest graph (the jump to no graph), then 2x, 4x, the most.
    assert eager_decode_shapes(runner, graphs) == [(520, 65), (1024, 128), (2048, 256)]
    # The most a step holds: max_num_batched_tokens over the query length (and max_num_seqs).
    runner.max_num_tokens = 1024
    assert eager_decode_shapes(runner, graphs) == [(520, 65), (1024, 128)]
    runner.max_num_reqs, runner.max_num_tokens = 80, 8192
    assert eager_decode_shapes(runner, graphs) == [(520, 65), (640, 80)]
    # No further than four times the largest graph's requests (a server's 1,024).
    runner.max_num_reqs = 1024
    assert eager_decode_shapes(runner, graphs) == [(520, 65), (1024, 128), (2048, 256)]
    runner.max_num_reqs = 64  # the graphs already reach the largest step
    assert eager_decode_shapes(runner, graphs) == []
    assert eager_decode_shapes(runner, []) == []


@pytest.fixture
def profile_clock(monkeypatch) -> list[float]:
    """torch.cuda.Event on a fake clock: events read ``clock[0]`` (ms) when recorded."""
    clock = [0.0]

    class FakeEvent:
        def __init__(self, enable_timing=False):
            self.at = None

        def record(self):
            self.at = clock[0]

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return end.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    return clock


def profile_runner(execute_model, max_num_reqs: int, max_num_tokens: int) -> SimpleNamespace:
    """The parts of vLLM's runner the SPS profile uses, ``execute_model`` given."""
    return SimpleNamespace(
        decode_query_len=8,
        max_num_reqs=max_num_reqs,
        max_num_tokens=max_num_tokens,
        execute_model=execute_model,
        execute_model_state=None,
        model=SimpleNamespace(compute_logits=lambda hidden: hidden),
        kv_connector=SimpleNamespace(set_disabled=lambda disabled: None),
        vocab_size=1000,
    )


def test_sps_profile_reports_each_shapes_time_per_step(monkeypatch, profile_clock):
    """Every step's time comes out per step, whether its group ran 10 graph replays or 3
    steps without a graph; a step's cost here is 1 ms per 100 tokens on a fake clock."""
    from vllm_dspark.capacity import sps_profile

    def execute_model(scheduled, dummy_run):
        assert dummy_run
        num_tokens = scheduled.total_num_scheduled_tokens
        profile_clock[0] += num_tokens / 100.0
        runner.execute_model_state = SimpleNamespace(hidden_states=torch.zeros(num_tokens, 2))

    runner = profile_runner(execute_model, max_num_reqs=256, max_num_tokens=2048)
    monkeypatch.setattr(sps_profile, "decode_graph_shapes", lambda r: [(8, 1), (512, 64)])
    rows = sps_profile.time_target_steps(runner, repeats=10, eager_repeats=3)
    assert [tokens for tokens, _ in rows] == [8, 512, 520, 1024, 2048]
    assert [ms for _, ms in rows] == pytest.approx([0.08, 5.12, 5.2, 10.24, 20.48])


def test_sps_profile_steps_carry_distinct_tokens_as_decode_steps_do(monkeypatch, profile_clock):
    """vLLM's dummy batches give every token id 0, which routes every token of a MoE
    layer to the same experts; the profile's steps carry random ids below the vocabulary
    instead, the same ones run to run, and vLLM's dummy batches are left as they were."""
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

    from vllm_dspark.capacity import sps_profile

    stock = InputBatch.__dict__["make_dummy"]
    buffers = InputBuffers(max_num_reqs=64, max_num_tokens=512, device=torch.device("cpu"))
    seen = []

    def execute_model(scheduled, dummy_run):
        # As vLLM's runner does for a dummy step: a dummy batch in the persistent buffers.
        num_tokens = scheduled.total_num_scheduled_tokens
        batch = InputBatch.make_dummy(len(scheduled.num_scheduled_tokens), num_tokens, buffers)
        seen.append(batch.input_ids.clone())
        runner.execute_model_state = SimpleNamespace(hidden_states=torch.zeros(num_tokens, 2))

    runner = profile_runner(execute_model, max_num_reqs=64, max_num_tokens=512)
    monkeypatch.setattr(sps_profile, "decode_graph_shapes", lambda r: [(8, 1), (512, 64)])
    sps_profile.time_target_steps(runner, warmup=1, repeats=2, rounds=1)
    assert [len(ids) for ids in seen] == [8] * 3 + [512] * 3
    for ids in seen:
        assert 0 <= int(ids.min()) and int(ids.max()) < 1000
        assert len(set(ids.tolist())) > len(ids) // 2  # distinct, as a decode step's are
    first = list(seen)
    seen.clear()
    sps_profile.time_target_steps(runner, warmup=1, repeats=2, rounds=1)
    assert all(torch.equal(a, b) for a, b in zip(first, seen, strict=True))  # seeded
    assert InputBatch.__dict__["make_dummy"] is stock
    assert int(InputBatch.make_dummy(8, 64, buffers).input_ids.abs().sum()) == 0  # vLLM's zeros

    # The drafter's graphs are replayed over dummy batches with distinct tokens too.
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor
    from vllm.v1.worker.gpu.spec_decode.dflash import cudagraph

    def prepare(num_reqs, num_tokens, input_buffers, *args, **kwargs):
        seen.append(InputBatch.make_dummy(num_reqs, num_tokens, input_buffers).input_ids.clone())

    seen.clear()
    monkeypatch.setattr(cudagraph, "_prepare_dflash_inputs_to_capture", prepare)
    graph = SimpleNamespace(replay=lambda: None)
    desc = BatchExecutionDescriptor(CUDAGraphMode.FULL, 64, 8, uniform_token_count=8)
    speculator = SimpleNamespace(
        vocab_size=1000,
        input_buffers=buffers,
        block_tables=None,
        attn_groups=None,
        kv_cache_config=None,
        max_model_len=64,
        _group_causal=False,
    )
    sps_profile.time_draft_graphs(speculator, SimpleNamespace(graphs={desc: graph}))
    assert len(seen) == 1 and len(set(seen[0].tolist())) > 32


def test_vllms_draft_token_counters_count_the_admitted_drafts(plugin_speculator, speculator):
    """The worker reports K - k_r per request with the step's output; the scheduler folds
    it into vLLM's own statistics, which then count verified drafts per position."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_dspark.patches import admission_metrics

    # A compacted step admitted 5, 0 and 2 of 7 drafts.
    speculator.controller.record_admission(["a", "b", "c"], 7, True, torch.tensor([5, 0, 2]))

    class Async:
        def get_output(self):
            return SimpleNamespace(req_ids=["a", "b", "c"])

    # The step's admissions are folded as it is prepared, on every rank (only one rank's
    # output reaches the scheduler): no get_output needed.
    fingerprint = speculator.controller.admission_fingerprint
    assert fingerprint != 0
    runner = SimpleNamespace(speculator=speculator)
    sample = admission_metrics._make_sample_tokens_wrapper(lambda runner: Async())
    output = sample(runner).get_output()
    assert output.dspark_not_admitted == {"a": 2, "b": 7, "c": 5}
    assert speculator.controller.admission_fingerprint == fingerprint
    other = plugin_speculator(dspark_capacity="budget")
    other.controller.fold_fingerprint(torch.tensor([5, 0, 2]))
    assert other.controller.admission_fingerprint == fingerprint
    other.controller.fold_fingerprint(torch.tensor([5, 0, 2]))
    assert other.controller.admission_fingerprint != fingerprint
    swapped = plugin_speculator(dspark_capacity="budget")
    swapped.controller.fold_fingerprint(torch.tensor([0, 5, 2]))  # same counts, other requests
    assert swapped.controller.admission_fingerprint != fingerprint
    assert sample(runner).get_output() is not None  # the next step had no compaction
    assert not hasattr(sample(runner).get_output(), "dspark_not_admitted")

    stats = []

    def update(scheduler, scheduler_output, model_runner_output):
        # What vLLM's update_from_output does per request for its statistics.
        for req_id, accepted in (("a", 3), ("b", 0), ("c", 1)):
            stats.append(
                Scheduler.make_spec_decoding_stats(
                    scheduler,
                    stats[-1] if stats else None,
                    num_draft_tokens=K,
                    num_accepted_tokens=accepted,
                    num_invalid_spec_tokens=scheduler_output.num_invalid_spec_tokens,
                    request_id=req_id,
                )
            )

    scheduler = SimpleNamespace(log_stats=True, num_spec_tokens=K)
    scheduled = SimpleNamespace(num_invalid_spec_tokens={"d": 1})  # vLLM's own, kept
    admission_metrics._make_update_wrapper(update)(scheduler, scheduled, output)
    assert scheduled.num_invalid_spec_tokens == {"d": 1, "a": 2, "b": 7, "c": 5}
    spec = stats[-1]
    assert (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) == (3, 7, 4)
    assert spec.num_draft_tokens_per_pos == [2, 2, 1, 1, 1, 0, 0]
    assert spec.num_accepted_tokens_per_pos == [2, 1, 1, 0, 0, 0, 0]


def test_compaction_takes_flash_or_triton_attention_for_the_target_alone():
    from vllm_dspark.capacity.startup_checks import check_compaction_backends
    from vllm_dspark.config import DSparkOptionError

    def group(name, layers):
        backend = SimpleNamespace(get_name=lambda: name)
        return SimpleNamespace(backend=backend, layer_names=layers)

    draft = {"draft.0.attn"}
    for target in ("FLASH_ATTN", "TRITON_ATTN"):
        # The draft's own backend does not matter: it runs no compacted batch.
        groups = [[group(target, ["model.0.attn"]), group("FLASHINFER", ["draft.0.attn"])]]
        check_compaction_backends(groups, draft)
    groups = [[group("FLASHINFER", ["model.0.attn"]), group("FLASH_ATTN", ["draft.0.attn"])]]
    with pytest.raises(DSparkOptionError, match="FLASHINFER.*FLASH_ATTN or TRITON_ATTN") as error:
        check_compaction_backends(groups, draft)
    assert "dspark_varlen_verify=false" in str(error.value)  # the masked fallback


@pytest.mark.parametrize(
    "backends,versions,expected",
    [
        (["FLASH_ATTN", "FLASH_ATTN"], {64: 3, 128: 3}, True),
        (["FLASH_ATTN", "TRITON_ATTN"], {64: 3, 128: 3}, False),  # the draft's too
        (["FLASH_ATTN", "FLASH_ATTN"], {64: 3, 128: 2}, False),  # FA2 for one head size
        ([], {}, False),
    ],
)
def test_varlen_graphs_need_flash_attention_3_on_every_layer(
    monkeypatch, backends, versions, expected
):
    import vllm.config
    from vllm.v1.attention.backends import fa_utils

    from vllm_dspark.verify.compact_graphs import replays_varlen_graphs

    def layer(name, head_size):
        backend = SimpleNamespace(get_name=lambda: name)
        return SimpleNamespace(get_attn_backend=lambda: backend, head_size=head_size)

    layers = {f"l{i}": layer(name, (64, 128)[i]) for i, name in enumerate(backends)}
    monkeypatch.setattr(vllm.config, "get_layers_from_vllm_config", lambda config, kind: layers)
    monkeypatch.setattr(fa_utils, "get_flash_attn_version", lambda head_size: versions[head_size])
    assert replays_varlen_graphs(None) is expected


def test_acceptance_varies_its_depth_only_where_the_draft_time_could_move_it(plugin_speculator):
    """Once its overhead is fitted, the acceptance controller halves a step's depth (one
    step in EXPLORE_EVERY) only at a load where DRAFT_TIME_DOUBT more per verified draft
    would change the depth it picks: on a flat curve at 5 requests accepting 0.8 a
    position, K either way; at 64 requests accepting 0.5, K against 3."""
    from vllm_dspark.capacity.controller import EXPLORE_EVERY

    def fitted(rate: float):
        speculator = plugin_speculator(
            K,
            method="dflash",
            dspark_capacity="acceptance",
            dspark_sps_curve=[[1, 100.0], [2048, 100.0]],
        )
        gen = torch.Generator().manual_seed(1)
        for _ in range(200):
            speculator.controller.record_verification(
                position_record(*verify_geometric(K, 8, rate, gen))
            )
            speculator.controller._observe_acceptance()
        speculator.controller.step_overhead.ready = True  # fitted: O = a = b = 0
        return speculator

    light = fitted(0.8)
    assert not light.controller._depth_hinges_on_draft_time(5)
    assert {light.controller.admission_budget(5) for _ in range(2 * EXPLORE_EVERY)} == {5 * K}
    loaded = fitted(0.5)
    assert loaded.controller._depth_hinges_on_draft_time(64)
    budgets = [loaded.controller.admission_budget(64) for _ in range(EXPLORE_EVERY)]
    assert budgets == [64 * K] * (EXPLORE_EVERY - 1) + [64 * (K // 2)]
