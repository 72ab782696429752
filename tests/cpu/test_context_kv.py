"""The drafter's context-K/V store: graph replays chosen only where they write what the
eager store writes, and the skipped proposal's claim that the drafter's context slots are
the target's slot mapping (stock's two Triton kernels under Triton's interpreter)."""

from types import SimpleNamespace

import pytest
import torch
from triton_interpreter import interpreted, run_interpreted

from vllm_dspark.context_kv import PAD_SLOT_ID, ContextKVGraphs

T, H = 64, 4


class FakeDrafter:
    """A drafter whose class method records each eager store."""

    def __init__(self):
        self.stored = []

    def precompute_and_store_context_kv(self, states, positions, slots=None):
        self.stored.append((states.shape[0], slots))


class FakeGraph:
    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


def graphed(layer_rows, sizes=(1, 2, 4, 8, 16, 32)):
    model = FakeDrafter()
    positions, slot_rows = torch.zeros(T, dtype=torch.long), torch.zeros(2, T, dtype=torch.long)
    buffers = (torch.zeros(T, H), positions, slot_rows)
    graphs = ContextKVGraphs(model, *buffers, layer_rows, sizes)
    return model, graphs


def test_the_store_replays_a_graph_only_on_its_own_buffers():
    model, graphs = graphed(layer_rows=[0, 1, 0])
    assert model.precompute_and_store_context_kv == graphs.store  # shadowed on the instance
    other = FakeDrafter().precompute_and_store_context_kv  # not on the class
    assert other.__func__ is FakeDrafter.precompute_and_store_context_kv
    states, positions = graphs.states, graphs.positions
    graphs.store(states[:5], positions[:5], graphs.slots(5))
    assert [n for n, _ in model.stored] == [5]  # no graph captured yet: eager
    graphs.graphs = {size: FakeGraph() for size in graphs.sizes}
    graphs.slot_rows.fill_(7)
    graphs.store(states[:5], positions[:5], graphs.slots(5))
    assert graphs.graphs[8].replays == 1 and len(model.stored) == 1
    # The padded rows of the replay write nothing; the real ones are left as written.
    assert (graphs.slot_rows[:, 5:8] == PAD_SLOT_ID).all()
    assert (graphs.slot_rows[:, :5] == 7).all() and (graphs.slot_rows[:, 8:] == 7).all()
    graphs.store(states[:32], positions[:32], graphs.slots(32))
    assert graphs.graphs[32].replays == 1
    # Eager: past the largest graph, a dummy run (no slots), tensors not the buffers.
    graphs.store(states[:33], positions[:33], graphs.slots(33))
    graphs.store(states[:5], positions[:5], None)
    graphs.store(states[:5].clone(), positions[:5], graphs.slots(5))
    graphs.store(states[:5], positions[:5], graphs.slots(5)[:2])
    assert [n for n, _ in model.stored] == [5, 33, 5, 5, 5]
    assert sum(graph.replays for graph in graphs.graphs.values()) == 2


def test_one_mapping_for_every_layer_is_row_zero():
    model, graphs = graphed(layer_rows=None, sizes=(4, 128))
    assert graphs.sizes == [4]  # sizes past the buffers are never captured
    assert graphs.slots(3).data_ptr() == graphs.slot_rows[0].data_ptr()
    graphs.graphs = {4: FakeGraph()}
    graphs.store(graphs.states[:3], graphs.positions[:3], graphs.slots(3))
    graphs.store(graphs.states[:3], graphs.positions[:3], [graphs.slots(3)])
    assert graphs.graphs[4].replays == 1 and len(model.stored) == 1


def test_a_skipped_proposal_stores_context_at_the_targets_slots():
    from vllm_dspark.capacity.allocation import UNCOMPUTED_SURVIVAL
    from vllm_dspark.speculator import DSparkPluginSpeculator

    K, num_reqs, num_tokens = 3, 3, 5  # two requests decode one token, one verifies 3
    model = FakeDrafter()
    model.combine_hidden_states = lambda x: x[:, :H] + x[:, H:]
    slot_rows = torch.full((1, T), 99, dtype=torch.long)
    fake = SimpleNamespace(
        model=model,
        hidden_states=torch.zeros(T, H),
        context_positions=torch.zeros(T, dtype=torch.long),
        _context_slot_mappings=slot_rows,
        draft_kv_cache_group_ids=[1],
        block_tables=SimpleNamespace(slot_mappings=torch.arange(3 * T).view(3, T)),
        draft_tokens=torch.zeros(4, K, dtype=torch.long),
        survival=torch.ones(4, K),
        draft_logits=torch.zeros(6, K, 50),
    )
    fake.context_kv = ContextKVGraphs(
        model, fake.hidden_states, fake.context_positions, slot_rows, [0, 0], (8,)
    )
    aux = [torch.ones(num_tokens, H), torch.full((num_tokens, H), 2.0)]
    slots = torch.tensor([5, 0, 2], dtype=torch.int32)
    call = {
        "input_batch": SimpleNamespace(
            num_reqs=num_reqs,
            num_tokens=num_tokens,
            positions=torch.tensor([40, 41, 42, 7, 300]),
            idx_mapping=slots,
        ),
        "aux_hidden_states": aux,
        "last_sampled": torch.arange(10, 16).view(6, 1),
    }
    drafts = DSparkPluginSpeculator._propose_skipped(fake, call)
    assert (fake.hidden_states[:num_tokens] == 3.0).all() and (fake.hidden_states[5:] == 0).all()
    assert fake.context_positions[:num_tokens].tolist() == [40, 41, 42, 7, 300]
    assert slot_rows[0, :num_tokens].tolist() == list(range(T, T + num_tokens))  # group 1
    [(stored_tokens, stored_slots)] = model.stored  # one eager store (no graph captured)
    assert stored_tokens == num_tokens and len(stored_slots) == 2  # one per draft layer
    assert all(s.data_ptr() == slot_rows.data_ptr() and len(s) == num_tokens for s in stored_slots)
    # The anchor (the last sampled token) as every draft, survival below all admissions.
    assert drafts.tolist() == [[15] * K, [10] * K, [12] * K]
    assert (fake.survival[:num_reqs] == UNCOMPUTED_SURVIVAL).all()
    # The point masses sit in the rows of the requests' slots, where verification reads.
    assert (fake.draft_logits[slots.long()].argmax(-1) == drafts).all()
    assert (fake.draft_logits[[1, 3, 4]] == 0).all()


# -- stock's context slots are the target's slot mapping ------------------------------------

BLOCK, MAX_REQS, MAX_BLOCKS, MAX_TOKENS = 16, 8, 12, 96
# (query tokens, tokens rejected last step) per batch row: decodes verifying drafts, plain
# decodes, a prefill chunk.
BATCHES = {
    "drafts": [(4, 2), (1, 0), (4, 0), (2, 1)],
    "plain": [(1, 0)] * 5,
    "prefill": [(1, 0), (37, 0), (3, 2)],
}


def test_kernels_under_triton_interpreter():
    assert run_interpreted(__file__) == len(BATCHES)


@interpreted
@pytest.mark.parametrize("batch", BATCHES)
def test_interpreted_context_slots_are_the_targets_slot_mapping(batch):
    from vllm.v1.worker.gpu.block_table import _compute_slot_mappings_kernel
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import prepare_dflash_inputs

    generator = torch.Generator().manual_seed(len(batch))
    rows = BATCHES[batch]
    num_reqs = len(rows)
    query_lens = torch.tensor([n for n, _ in rows])
    query_start_loc = torch.zeros(MAX_REQS + 1, dtype=torch.int32)
    query_start_loc[1 : num_reqs + 1] = query_lens.cumsum(0)
    query_start_loc[num_reqs + 1 :] = query_start_loc[num_reqs]
    num_tokens = int(query_lens.sum())
    starts = torch.randint(0, 120, (num_reqs,), generator=generator)
    positions = torch.zeros(MAX_TOKENS, dtype=torch.int64)
    spans = [start + torch.arange(n) for start, (n, _) in zip(starts, rows, strict=True)]
    positions[:num_tokens] = torch.cat(spans)
    idx_mapping = torch.randperm(MAX_REQS, generator=generator)[:num_reqs].to(torch.int32)
    # Block tables by request slot (the target's) and gathered by batch row (the drafter's).
    tables = torch.randperm(500, generator=generator)[: MAX_REQS * MAX_BLOCKS]
    tables = tables.view(MAX_REQS, MAX_BLOCKS).to(torch.int32).contiguous()
    gathered = torch.zeros_like(tables)
    gathered[:num_reqs] = tables[idx_mapping.long()]

    target = torch.full((1, MAX_TOKENS), 12345, dtype=torch.int64)
    _compute_slot_mappings_kernel[(1, num_reqs + 1)](
        MAX_TOKENS,
        idx_mapping,
        query_start_loc,
        positions,
        torch.tensor([tables.data_ptr()], dtype=torch.uint64),
        torch.tensor([tables.stride(0)], dtype=torch.int64),
        torch.tensor([BLOCK], dtype=torch.int32),
        target,
        target.stride(0),
        0,
        CP_SIZE=1,
        CP_INTERLEAVE=1,
        PAD_ID=PAD_SLOT_ID,
        TRITON_BLOCK_SIZE=64,
    )

    K = 3
    buffers = SimpleNamespace(
        input_ids=torch.zeros(MAX_TOKENS, dtype=torch.int32),
        positions=torch.zeros(MAX_TOKENS, dtype=torch.int64),
        query_start_loc=torch.zeros(MAX_REQS + 1, dtype=torch.int32),
        seq_lens=torch.zeros(MAX_REQS, dtype=torch.int32),
    )
    input_batch = SimpleNamespace(
        num_reqs=num_reqs,
        num_scheduled_tokens=query_lens.numpy(),
        positions=positions,
        query_start_loc=query_start_loc,
        idx_mapping=idx_mapping,
    )
    context_positions = torch.full((MAX_TOKENS,), -7, dtype=torch.int64)
    context_slots = torch.full((MAX_TOKENS,), 12345, dtype=torch.int64)
    prepare_dflash_inputs(
        buffers,
        torch.zeros(MAX_TOKENS, dtype=torch.int64),
        context_positions,
        context_slots,
        torch.zeros(MAX_REQS * K, dtype=torch.int64),
        torch.zeros(MAX_REQS * K, dtype=torch.int64),
        torch.zeros(MAX_REQS * K, dtype=torch.int32),
        input_batch,
        torch.ones(num_reqs, dtype=torch.int32),
        torch.tensor([r for _, r in rows], dtype=torch.int32),
        torch.zeros(MAX_REQS, 1, dtype=torch.int64),
        torch.zeros(MAX_REQS, dtype=torch.int32),
        gathered,
        BLOCK,
        0,
        K,
        K,
        MAX_REQS,
        MAX_TOKENS,
        4096,
        sample_from_anchor=True,
    )
    assert (context_positions[:num_tokens] == positions[:num_tokens]).all()
    assert (context_slots[:num_tokens] == target[0, :num_tokens]).all()
    assert (target[0, :num_tokens] >= 0).all()
