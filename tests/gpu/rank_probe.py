"""One simulated tensor-parallel rank for tests/gpu/test_rank_processes_gpu.py.

Runs the capacity controller's per-step decisions on the GPU, fed from seeded generators:
prefix survivals under the current temperatures, the proposal kernel's counts, admission by
budget, threshold and sps (in turn, 50 steps each), the physical depth that cuts the next
proposal, the compaction kernel's rewrite of the verification buffers, simulated
verification, online STS refits, the acceptance-length depth and the batch gate's slowest
request. Prints ``PROBE``
and JSON: one SHA-256 per step over everything decided, plus what the test checks varied.

    python rank_probe.py POISON_BYTE   (free GPU memory is filled with it first)
"""

import hashlib
import json
import sys

import numpy as np
import torch

from vllm_dspark.capacity.acceptance import AcceptanceDepth, position_counts
from vllm_dspark.capacity.allocation import (
    UNCOMPUTED_SURVIVAL,
    admission_budget,
    budget_capacity,
    prefix_survival,
    sps_table_from_curve,
)
from vllm_dspark.capacity.draft_gate import SlowestRequest
from vllm_dspark.capacity.online_sts import OnlineSTS
from vllm_dspark.capacity.physical_depth import PhysicalDepth
from vllm_dspark.capacity.proposal_kernel import proposal_stats
from vllm_dspark.verify.compaction_kernel import compact_on_device

K, MAX_NUM_REQS, STEPS = 7, 256, 600
# Drafts are accepted with sigmoid(z / T) at these temperatures: STS has something to fit.
TRUE_TEMPERATURES = torch.tensor([1.3, 1.5, 1.7, 1.9, 2.1, 2.3, 2.5])
CURVE = [(1, 250.0), (64, 230.0), (512, 120.0), (2048, 35.0)]


def poison_free_memory(byte: int) -> None:
    """Blocks of many sizes, filled with ``byte`` and freed back to the caching allocator:
    later allocations reuse them, so a kernel that reads memory it never wrote sees
    different values on the two ranks."""
    blocks = [
        torch.full((size,), byte, dtype=torch.uint8, device="cuda")
        for size in (2**e for e in range(9, 27))
        for _ in range(4)
    ]
    torch.cuda.synchronize()
    del blocks


def main() -> None:
    poison_free_memory(int(sys.argv[1]))
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(11)
    host = np.random.default_rng(11)
    temperatures = torch.ones(K, device=device)
    sts = OnlineSTS(torch.ones(K, device=device), refit_every=50)
    depth, acceptance = PhysicalDepth(K), AcceptanceDepth(K)
    slowest = SlowestRequest(MAX_NUM_REQS, K, device)
    table = sps_table_from_curve(CURVE, MAX_NUM_REQS * (1 + K)).to(device)
    owners = [f"req-{i}" for i in range(MAX_NUM_REQS)]
    hashes, trace = [], {"capacity_sums": [], "depths": [], "acceptance_depths": []}
    for step in range(STEPS):
        num_reqs = int(host.integers(1, MAX_NUM_REQS + 1))
        slots = host.permutation(MAX_NUM_REQS)[:num_reqs]
        for slot in slots[: num_reqs // 8]:  # finished requests: new ones take their slots
            owners[slot] = f"req-{step}-{slot}"
        slowest.start([owners[s] for s in slots], slots)
        # Phases of 50 steps: the admission mode turns, drafts are good or poor by turns (so
        # that the depths move). Coarse logits: many survivals tie, ties must break alike.
        phase = step // 50
        shift = 4 if phase % 2 == 0 else -6
        logits = (torch.randn(num_reqs, K, generator=gen, device=device) * 4 + shift).round() / 2
        survival = prefix_survival(logits, temperatures)
        survival[:, depth.depth :] = UNCOMPUTED_SURVIVAL
        stats = proposal_stats(survival, table, 0.002, 2e-5, 0.001, 0.4, MAX_NUM_REQS)
        budget = [
            admission_budget(num_reqs, K, 0.5),
            stats.threshold_count.long(),
            stats.sps_count.long(),
        ][phase % 3]
        capacity = budget_capacity(survival, budget).clamp(max=depth.depth)
        worst = slowest.reading(torch.from_numpy(slots).to(device), survival)

        buffers = {
            "input_ids": torch.randint(
                0, 1000, (MAX_NUM_REQS * (1 + K),), generator=gen, device=device
            ),
            "positions": torch.randint(
                0, 4000, (MAX_NUM_REQS * (1 + K),), generator=gen, device=device
            ),
            "query_start_loc": torch.arange(
                0, (MAX_NUM_REQS + 1) * (1 + K), 1 + K, dtype=torch.int32, device=device
            ),
            "seq_lens": torch.randint(
                1 + K, 500, (MAX_NUM_REQS,), generator=gen, device=device
            ).int(),
        }
        num_tokens = num_reqs + int(capacity.sum())
        compacted = compact_on_device(
            capacity,
            K,
            num_tokens,
            torch.from_numpy(slots).int().to(device),
            **buffers,
            max_num_reqs=MAX_NUM_REQS,
        )

        draws = torch.rand(num_reqs, K, generator=gen, device=device)
        accepted = draws < torch.sigmoid(logits / TRUE_TEMPERATURES.to(device))
        num_accepted = torch.minimum(accepted.int().cumprod(dim=1).sum(dim=1), capacity)
        sts.observe(logits, capacity, num_accepted)
        sts.maybe_refit(temperatures)
        reached, hits = position_counts(capacity, num_accepted, K)
        acceptance.observe(reached.tolist(), hits.tolist())
        acceptance.update(acceptance.length_target())
        depth.observe(num_reqs, int(capacity.max()))

        digest = hashlib.sha256()
        decided = [survival, stats.sps_count, stats.threshold_count, stats.position_sums]
        decided += [capacity, worst, *compacted, *buffers.values(), num_accepted, temperatures]
        for tensor in decided:
            digest.update(tensor.cpu().numpy().tobytes())
        digest.update(f"{depth.depth} {acceptance.depth}".encode())
        hashes.append(digest.hexdigest())
        trace["capacity_sums"].append(num_tokens - num_reqs)
        trace["depths"].append(depth.depth)
        trace["acceptance_depths"].append(acceptance.depth)
    report = {"hashes": hashes, "refits": sts.refits, "temperatures": temperatures.tolist()}
    print("PROBE " + json.dumps(report | trace), flush=True)


if __name__ == "__main__":
    main()
