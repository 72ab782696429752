"""On a GPU: a replayed context-K/V graph writes what the eager store writes, at the step's
real slots only, after the memory around it was reused (captured temporaries live with the
graph)."""

import pytest
import torch

from vllm_dspark.context_kv import PAD_SLOT_ID, ContextKVGraphs

pytestmark = pytest.mark.gpu
T, H, NUM_SLOTS = 64, 32, 200


class Drafter(torch.nn.Module):
    """A projection stored by slot, skipping slot -1 (into a trash row) as vLLM's cache
    writes do; two layers, each with its own slot-mapping row."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(H, 2 * H, device="cuda")
        self.caches = [torch.zeros(NUM_SLOTS + 1, H, device="cuda") for _ in range(2)]

    def precompute_and_store_context_kv(self, states, positions, slots=None):
        kv = self.proj(states) + positions[:, None]
        if slots is None:
            return
        for cache, layer_slots, values in zip(self.caches, slots, kv.chunk(2, dim=-1), strict=True):
            cache.index_copy_(0, torch.where(layer_slots >= 0, layer_slots, NUM_SLOTS), values)


@torch.inference_mode()
def test_replays_write_what_the_eager_store_writes_and_nothing_else():
    drafter = Drafter()
    states = torch.randn(T, H, device="cuda")
    positions = torch.randint(0, 4000, (T,), device="cuda")
    slot_rows = torch.zeros(2, T, dtype=torch.long, device="cuda")
    graphs = ContextKVGraphs(drafter, states, positions, slot_rows, [0, 1], (4, 8, 16, 32))
    graphs.capture(torch.cuda.graph_pool_handle())
    assert sorted(graphs.graphs) == [4, 8, 16, 32]
    # Allocations between capture and replay reuse nothing the graphs hold.
    junk = [torch.full((1 << 20,), 7.0, device="cuda") for _ in range(8)]
    generator = torch.Generator(device="cuda").manual_seed(0)
    for num_tokens in (32, 5, 1, 17, 3):  # shrinking and growing: stale slots past the step
        states.normal_(generator=generator)
        chosen = torch.randperm(NUM_SLOTS, device="cuda", generator=generator)
        slot_rows[0, :num_tokens] = chosen[:num_tokens]
        slot_rows[1, :num_tokens] = chosen[num_tokens : 2 * num_tokens]
        for cache in drafter.caches:
            cache.fill_(float("nan"))  # poison: a row written by the replay is finite
        graphs.store(states[:num_tokens], positions[:num_tokens], graphs.slots(num_tokens))
        replayed = [cache[:NUM_SLOTS].clone() for cache in drafter.caches]
        expected = [torch.full_like(cache, float("nan")) for cache in replayed]
        kv = drafter.proj(states[:num_tokens]) + positions[:num_tokens, None]
        for row, values in enumerate(kv.chunk(2, dim=-1)):
            expected[row][slot_rows[row, :num_tokens]] = values
        for got, want in zip(replayed, expected, strict=True):
            torch.testing.assert_close(got, want, equal_nan=True, atol=1e-4, rtol=1e-4)
        assert (slot_rows[:, num_tokens : graphs.bucket(num_tokens)] == PAD_SLOT_ID).all()
    assert all((block == 7.0).all() for block in junk)
