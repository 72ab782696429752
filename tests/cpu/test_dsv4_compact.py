"""Compact verification on DeepSeek-V4's attention (patches/dsv4_compact.py), on a CPU.

A compacted batch (verify/layout.py's rewrite, on vLLM's own InputBatch) is handed to
vLLM's ``DefaultModelState.prepare_attn``: the builders must see the host placeholder
layout (verify/host_layout.py), map tokens to requests from the device offsets, and the
indexer must flatten its decode rows by the device lengths. The four DeepSeek-V4 builders
themselves run under Triton's interpreter (:mod:`triton_interpreter`), once on a compacted
batch and once on the same batch uncompacted: every token kept must get the same metadata.
Not run here: FlashMLA's tile planner (a CUDA extension, stubbed) and the kernels that
read the metadata (the forward), which tests/gpu/test_dsv4_lossless_gpu.py runs.
"""

import dataclasses
from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from triton_interpreter import interpreted, run_interpreted

from vllm_dspark.capacity.controller import StepPlan
from vllm_dspark.capacity.startup_checks import DSV4_COMPACTION_BACKENDS

K = 7
MAX_MODEL_LEN, BLOCK = 1024, 256  # DeepSeek-V4's KV blocks: 256 tokens
BLOCKS_PER_REQ = MAX_MODEL_LEN // BLOCK
WINDOW = 16

# (decoding requests' contexts, prompt chunks (context, length), padded rows)
DECODE_ONLY = ([252, 130, 600], [], 0)
MIXED = ([252, 130], [(0, 5), (40, 20)], 0)
PADDED = ([252, 130, 600], [], 3)


@pytest.fixture(autouse=True)
def unpinned(monkeypatch):
    """vLLM's host token map pins its copy, which needs a CUDA driver."""
    from vllm.utils import torch_utils

    monkeypatch.setattr(torch_utils, "PIN_MEMORY", False)


@pytest.fixture
def speculator(plugin_speculator):
    from vllm_dspark.patches import dsv4_compact

    dsv4_compact.apply()  # as building a capacity speculator does in a worker
    return plugin_speculator(
        K, dspark_capacity="budget", dspark_budget_frac=0.25, dspark_varlen_verify=True
    )


def input_buffers():
    """The runner's persistent input buffers."""
    from vllm.v1.worker.gpu.input_batch import InputBuffers

    return InputBuffers(max_num_reqs=16, max_num_tokens=256, device=torch.device("cpu"))


def stock_batch(computed, prompts, padded, buffers=None):
    """vLLM's batch of a verification step, host fields included: the decoding requests
    first (1 + K tokens each, context ``computed[r]``), then prompt chunks (context,
    length), then ``padded`` empty rows (as a FULL graph pads them); ids 1000, 1001, ...
    Written into ``buffers`` (new ones by default)."""
    from vllm.v1.worker.gpu.input_batch import InputBatch

    decodes, num_reqs = len(computed), len(computed) + len(prompts)
    rows = num_reqs + padded
    lengths = [1 + K] * decodes + [n for _, n in prompts]
    starts = np.cumsum([0, *lengths]).astype(np.int32)
    total = int(starts[-1])
    buffers = input_buffers() if buffers is None else buffers
    batch = InputBatch.make_dummy(num_reqs, total, buffers)
    firsts = [*computed, *(c for c, _ in prompts)]
    positions = [firsts[r] + j for r in range(num_reqs) for j in range(lengths[r])]
    seq_lens = [firsts[r] + lengths[r] for r in range(num_reqs)] + [0] * padded
    buffers.input_ids[:total] = torch.arange(1000, 1000 + total, dtype=torch.int32)
    buffers.positions[:total] = torch.tensor(positions)
    buffers.seq_lens[:rows] = torch.tensor(seq_lens, dtype=torch.int32)
    buffers.query_start_loc[: num_reqs + 1] = torch.from_numpy(starts)
    buffers.query_start_loc[num_reqs + 1 :] = total
    host_starts = np.full(rows + 1, total, dtype=np.int32)
    host_starts[: num_reqs + 1] = starts
    slots = torch.arange(num_reqs, dtype=torch.int32)
    batch = dataclasses.replace(
        batch,
        req_ids=[f"r{r}" for r in range(num_reqs)],
        num_reqs_after_padding=rows,
        idx_mapping=slots,
        idx_mapping_np=slots.numpy(),
        num_scheduled_tokens=np.array(lengths, dtype=np.int32),
        query_start_loc=buffers.query_start_loc[: rows + 1],
        query_start_loc_np=host_starts,
        seq_lens=buffers.seq_lens[:rows],
        seq_lens_cpu_upper_bound=torch.tensor(seq_lens, dtype=torch.int32),
        is_prefilling_np=np.array([False] * decodes + [True] * len(prompts)),
        logits_indices=torch.tensor(
            [*range(decodes * (1 + K)), *(int(starts[r + 1]) - 1 for r in range(decodes, num_reqs))]
        ),
    )
    return batch, buffers


def compacted_batch(speculator, case, survival, buffers=None, budget=None):
    """The stock batch of ``case`` compacted as the runner's patch compacts it (the
    controller admits ``budget`` drafts, by default its own budget, the most likely ones
    of ``survival``); returns the batch, its buffers and the step's plan."""
    from vllm_dspark.verify.layout import compact_input_batch

    computed, prompts, padded = case
    batch, buffers = stock_batch(computed, prompts, padded, buffers)
    decodes = len(computed)
    speculator.controller.slot_survival[:decodes] = survival[:decodes]
    if budget is None:
        budget = speculator.controller.admission_budget(decodes)
    plan = StepPlan(budget)
    if prompts:
        plan = StepPlan(budget, mixed=(decodes, batch.num_tokens - (decodes * K - budget)))
    runner = SimpleNamespace(
        input_buffers=buffers,
        speculator=speculator,
        req_states=SimpleNamespace(max_seq_len=np.full(16, 10_000, dtype=np.int32)),
    )
    compact = compact_input_batch(runner, batch, plan)
    # Run as the compacted step's dispatch pads it: PIECEWISE, not padded.
    return dataclasses.replace(compact, num_tokens_after_padding=compact.num_tokens), buffers, plan


def survivals(seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(16, K, generator=gen).sort(dim=1, descending=True).values


@contextmanager
def running(plan):
    """Inside ``execute_model`` of a step with ``plan``, as the runner's patch sets it."""
    from vllm_dspark.patches import compact_verification

    token = compact_verification._step_plan_var.set(plan)
    try:
        yield
    finally:
        compact_verification._step_plan_var.reset(token)


# The host placeholder layout.


def test_placeholder_puts_the_drafts_on_the_first_rows_and_keeps_the_prompts():
    from vllm_dspark.verify.host_layout import placeholder_query_lens, placeholder_query_start_loc

    stock = np.array([8, 8, 8, 5, 20], dtype=np.int32)  # three decoding, two prompt chunks
    assert placeholder_query_lens(stock, 3, 10).tolist() == [8, 4, 1, 5, 20]
    assert placeholder_query_lens(stock, 3, 0).tolist() == [1, 1, 1, 5, 20]
    assert placeholder_query_lens(stock, 3, 21).tolist() == stock.tolist()
    assert placeholder_query_lens(stock[:1], 1, 3).tolist() == [4]
    with pytest.raises(ValueError, match="22 drafts do not fit"):
        placeholder_query_lens(stock, 3, 22)
    assert stock.tolist() == [8, 8, 8, 5, 20]  # the runner's counts are not written
    lens = np.array([8, 4, 1], dtype=np.int32)
    assert placeholder_query_start_loc(lens, 5).tolist() == [0, 8, 12, 13, 13, 13]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("case", [DECODE_ONLY, MIXED, PADDED], ids=["decode", "mixed", "padded"])
def test_placeholder_agrees_with_the_compacted_device_layout(speculator, case, seed):
    """The host total is the device's, the decoding rows bound the device's (1 to 1 + K,
    their maximum at least the device's), prompt and padded rows equal the device's, and
    more than one decoding row with a budget short of all drafts is never uniform."""
    from vllm_dspark.patches.dsv4_compact import placeholder_batch

    batch, buffers, plan = compacted_batch(speculator, case, survivals(seed))
    stock_host = batch.query_start_loc_np.copy()
    placeholder = placeholder_batch(batch, plan)
    decodes, rows = len(case[0]), batch.num_reqs_after_padding
    device = buffers.query_start_loc[: rows + 1].numpy()
    host = placeholder.query_start_loc_np
    assert (
        host[-1]
        == device[-1]
        == batch.num_tokens
        == decodes + plan.budget + sum(n for _, n in case[1])
    )
    assert host[decodes:].tolist() == device[decodes:].tolist()  # prompts, padding
    host_rows, device_rows = np.diff(host[: decodes + 1]), np.diff(device[: decodes + 1])
    assert host_rows.sum() == device_rows.sum() == decodes + plan.budget
    assert host_rows.min() >= 1 and host_rows.max() <= 1 + K
    assert host_rows.max() >= device_rows.max()
    assert placeholder.num_scheduled_tokens.tolist() == np.diff(host[: batch.num_reqs + 1]).tolist()
    if decodes > 1 and 0 < plan.budget < decodes * K:
        assert len(set(host_rows.tolist())) > 1
    assert batch.query_start_loc_np.tolist() == stock_host.tolist()  # the runner's own


# What prepare_attn hands the builders, and the token map.


class RecordingBuilder:
    """A metadata builder that keeps what it is given and asks for the token map, as
    DeepSeek-V4's sliding-window, FlashMLA and compressor builders do."""

    def __init__(self, name):
        self.buffer = torch.full((256,), -7, dtype=torch.int32)
        self.seen = []
        self.name = name

    def build(self, common_prefix_len, common_attn_metadata):
        token_map = common_attn_metadata.token_to_req_indices(self.buffer)
        self.seen.append((common_attn_metadata, token_map.clone(), token_map.data_ptr()))
        return self


def group(name):
    backend = SimpleNamespace(get_name=lambda: name)
    builder = RecordingBuilder(name)
    return SimpleNamespace(
        backend=backend, layer_names=[f"{name}.0"], get_metadata_builder=lambda i=0: builder
    )


def prepare_attn(batch, groups, full_graph=False, tables=None):
    """vLLM's ``DefaultModelState.prepare_attn`` (with the plugin's wrapper) on ``batch``;
    its block table and slot mapping written into ``tables`` (:class:`BlockTables`) when
    given, as the runner writes its persistent ones, else into new tensors."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    rows, num_tokens = batch.num_reqs_after_padding, batch.num_tokens_after_padding
    block_tables, slots = (block_table(rows),), slot_mapping(batch, num_tokens)[None]
    if tables is not None:
        block_tables, slots = tables.write(block_tables[0], slots)
    mode = CUDAGraphMode.FULL if full_graph else CUDAGraphMode.PIECEWISE
    return DefaultModelState.prepare_attn(
        MODEL_STATE, batch, mode, block_tables, slots, [groups], KV_CACHE_CONFIG
    )


# What prepare_attn reads of vLLM's model state and KV-cache config.
MODEL_STATE = SimpleNamespace(
    max_model_len=MAX_MODEL_LEN, supports_mm_inputs=False, encoder_cache=None
)
KV_CACHE_CONFIG = SimpleNamespace(kv_cache_groups=[None])


def block_table(rows):
    """Request r's KV blocks: 100 r + 1, ..., 100 r + BLOCKS_PER_REQ."""
    base = 100 * torch.arange(rows, dtype=torch.int32)[:, None]
    return base + torch.arange(1, BLOCKS_PER_REQ + 1, dtype=torch.int32)


def token_rows(batch):
    """Each real token's batch row, from the device offsets."""
    starts = batch.query_start_loc[: batch.num_reqs + 1].tolist()
    return [r for r in range(batch.num_reqs) for _ in range(starts[r + 1] - starts[r])]


def slot_mapping(batch, num_slots):
    """KV slots of the batch's tokens (as the runner computes them), -1 past them."""
    table = block_table(batch.num_reqs_after_padding)
    slots = torch.full((num_slots,), -1, dtype=torch.int64)
    for t, r in enumerate(token_rows(batch)):
        pos = int(batch.positions[t])
        slots[t] = int(table[r, pos // BLOCK]) * BLOCK + pos % BLOCK
    return slots


def host_token_map(common, query_start_loc_cpu, num_tokens):
    """vLLM's own map, from the host offsets ``query_start_loc_cpu``."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from vllm_dspark.patches.wrapping import original

    common = dataclasses.replace(
        common, query_start_loc_cpu=query_start_loc_cpu, _token_to_req_indices_cache=None
    )
    stock = original(CommonAttentionMetadata, "token_to_req_indices")
    return stock(common, torch.zeros(256, dtype=torch.int32))[:num_tokens].clone()


@pytest.mark.parametrize("case", [DECODE_ONLY, MIXED, PADDED], ids=["decode", "mixed", "padded"])
def test_builders_see_the_placeholder_and_map_tokens_from_the_device(speculator, case):
    from vllm_dspark.patches.dsv4_compact import placeholder_batch

    # Slot 1 confident, slot 0 not at all, slot 2 in between: the device rows differ from
    # the placeholder's, which puts the drafts first.
    survival = torch.zeros(16, K)
    survival[0] = 0.01
    survival[1] = torch.linspace(0.99, 0.9, K)
    survival[2] = torch.tensor([0.95, 0.5, 0.1, 0.05, 0.04, 0.03, 0.02])
    batch, buffers, plan = compacted_batch(speculator, case, survival)
    full_graph = case is PADDED
    if full_graph:  # padded to a graph's size: padded rows and padded tokens
        batch = dataclasses.replace(batch, num_tokens_after_padding=batch.num_tokens + 5)
    groups = [group("DEEPSEEK_SPARSE_SWA"), group("FLASHMLA_SPARSE_DSV4")]
    with running(plan):
        prepare_attn(batch, groups, full_graph)
    swa, flashmla = (g.get_metadata_builder() for g in groups)
    (common, token_map, address), (_, reused, reused_address) = swa.seen[0], flashmla.seen[0]
    expected = placeholder_batch(batch, plan)
    assert common.query_start_loc_cpu.tolist() == expected.query_start_loc_np.tolist()
    assert common.max_query_len == expected.num_scheduled_tokens.max()
    num_tokens = batch.num_tokens_after_padding if full_graph else batch.num_tokens
    assert common.num_actual_tokens == num_tokens
    # The map of the true layout, into the first builder's buffer, which the next reuses.
    truth = host_token_map(common, common.query_start_loc.clone(), num_tokens)
    assert token_map.tolist() == truth.tolist()
    assert token_map[: batch.num_tokens].tolist() == token_rows(batch)
    assert address == swa.buffer.data_ptr() and (reused_address, reused.tolist()) == (
        address,
        token_map.tolist(),
    )
    if full_graph:
        assert set(token_map[batch.num_tokens :].tolist()) == {0}  # padded tokens, in range
    # vLLM's host map of the placeholder would misplace tokens.
    placeholder_map = host_token_map(common, common.query_start_loc_cpu, num_tokens)
    assert placeholder_map.tolist() != truth.tolist()
    # The runner's own batch keeps its stock host layout.
    assert batch.num_scheduled_tokens[0] == 1 + K


def test_stock_steps_masked_steps_and_other_backends_see_the_stock_layout(speculator):
    batch, _, plan = compacted_batch(speculator, DECODE_ONLY, survivals(0))
    stock_host = batch.query_start_loc_np.tolist()
    for step_plan, name in [
        (None, "DEEPSEEK_SPARSE_SWA"),  # no compacted plan running
        (StepPlan(plan.budget, masked=True), "DEEPSEEK_SPARSE_SWA"),  # masked: uniform batch
        (plan, "FLASH_ATTN"),  # reads the device offsets itself
    ]:
        groups = [group(name)]
        with running(step_plan):
            prepare_attn(batch, groups)
        common, token_map, _ = groups[0].get_metadata_builder().seen[0]
        assert common.query_start_loc_cpu.tolist() == stock_host
        # vLLM's map, from the host offsets.
        assert token_map.tolist() == [r for r in range(3) for _ in range(1 + K)][: len(token_map)]


# The indexer's decode rows.


def dsv4_config():
    """What DeepSeek-V4's metadata builders read of a VllmConfig (DSpark, K drafts)."""
    return SimpleNamespace(
        speculative_config=SimpleNamespace(
            num_speculative_tokens=K, parallel_drafting=True, use_dspark=lambda: True
        ),
        parallel_config=SimpleNamespace(
            decode_context_parallel_size=1,
            prefill_context_parallel_size=1,
            cp_kv_cache_interleave_size=1,
        ),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=64, max_num_seqs=8),
        model_config=SimpleNamespace(
            max_model_len=MAX_MODEL_LEN,
            hf_config=SimpleNamespace(
                index_topk=64, sliding_window=WINDOW, compress_ratios=[0, 4, 128]
            ),
        ),
        attention_config=SimpleNamespace(use_fp4_indexer_cache=False),
    )


def mla_spec(ratio):
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return MLAAttentionSpec(
        block_size=BLOCK, num_kv_heads=1, head_size=512, dtype=torch.bfloat16, compress_ratio=ratio
    )


def indexer_builder(monkeypatch):
    from vllm.v1.attention.backends.mla import indexer

    monkeypatch.setattr(indexer, "num_compute_units", lambda device_index: 4)
    return indexer.DeepseekV32IndexerMetadataBuilder(
        mla_spec(4), ["indexer"], dsv4_config(), torch.device("cpu")
    )


class KernelLaunches:
    """Counts the launches of a Triton kernel (``kernel[grid](...)``) and runs it (or
    nothing, where this process has no Triton)."""

    def __init__(self, kernel=None):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid] if self.kernel is not None else lambda *args, **kwargs: None


def test_the_indexer_flattens_a_compacted_batch_by_its_device_lengths(speculator, monkeypatch):
    """Two decoding requests of 3 and 1 device tokens, whose host lengths read uniform
    (2 and 2: a layout the placeholder never writes, the worst the indexer could be
    given): compacted, every token gets its own context length and its request's blocks;
    the uniform kernel (request = token // 2) is not launched. Outside a compacted step
    vLLM's uniform branch runs."""
    from vllm.v1.attention.backends.mla import indexer

    from vllm_dspark.patches import dsv4_compact

    builder = indexer_builder(monkeypatch)
    launches = KernelLaunches()
    monkeypatch.setattr(indexer, "_prepare_uniform_decode_kernel", launches)
    seq_lens = torch.tensor([200 + 3, 40 + 1], dtype=torch.int32)  # contexts 200 and 40
    query_start_loc = torch.tensor([0, 3], dtype=torch.int32)
    table = block_table(2)

    def decode_rows():
        return builder._prepare_decode_tensors(
            seq_lens=seq_lens,
            block_table=table,
            decode_lens=torch.tensor([3, 1], dtype=torch.int32),
            decode_lens_cpu=torch.tensor([2, 2], dtype=torch.int32),
            query_start_loc=query_start_loc,
            num_decodes=2,
            num_decode_tokens=4,
            use_native=False,
            next_n=1 + K,
            max_decode_len=2,
        )

    token = dsv4_compact._compacted_var.set(True)
    try:
        lens, rows, decode_lens, batch_size, requires_padding = decode_rows()
    finally:
        dsv4_compact._compacted_var.reset(token)
    assert launches.grids == []
    assert lens.tolist() == [201, 202, 203, 41]  # each token's position + 1
    assert rows.tolist() == [table[0].tolist()] * 3 + [table[1].tolist()]
    assert decode_lens.tolist() == [1] * 4 and (batch_size, requires_padding) == (4, False)
    decode_rows()
    assert launches.grids == [(4,)]  # stock: the uniform kernel


# Start-up.


def dsv4_groups(flattening=True, flashinfer=False):
    names = [
        "FLASHINFER_MLA_SPARSE_DSV4" if flashinfer else "FLASHMLA_SPARSE_DSV4",
        "DEEPSEEK_SPARSE_SWA",
        "CompressorBackend",
        "DEEPSEEK_V4_INDEXER",
    ]
    builder = SimpleNamespace(use_flattening=flattening)
    return [
        [
            SimpleNamespace(
                backend=SimpleNamespace(get_name=lambda name=name: name),
                layer_names=[f"model.layers.2.{name}"],
                get_metadata_builder=lambda i=0: builder,
            )
            for name in names
        ]
    ]


@pytest.mark.parametrize(
    "family,flattening,flashinfer,accepted",
    [
        (90, True, False, True),  # Hopper: FlashMLA, the indexer flattens
        (100, True, False, False),  # Blackwell
        (90, False, False, False),  # 1 + K of 1 or 2: the indexer keeps uniform rows
        (100, True, True, False),  # FlashInfer's sparse backend
    ],
)
def test_start_up_takes_deepseek_v4_on_hopper_only(
    monkeypatch, family, flattening, flashinfer, accepted
):
    from vllm.platforms import current_platform

    from vllm_dspark.capacity.startup_checks import check_compaction_backends
    from vllm_dspark.config import DSparkOptionError

    monkeypatch.setattr(
        current_platform, "is_device_capability_family", lambda capability: capability == family
    )
    groups = dsv4_groups(flattening, flashinfer)
    if accepted:
        check_compaction_backends(groups, set())
        return
    with pytest.raises(DSparkOptionError) as error:
        check_compaction_backends(groups, set())
    message = str(error.value)
    assert "FLASHMLA_SPARSE_DSV4 on SM90 (Hopper) with at least 2 drafts" in message
    assert "dspark_varlen_verify=false" in message and "FLASH_ATTN" not in message


def test_deepseek_v4_acceptance_takes_no_other_backend(monkeypatch):
    """Beside DeepSeek-V4's accepted backends, one neither list takes is refused."""
    from vllm.platforms import current_platform

    from vllm_dspark.capacity.startup_checks import check_compaction_backends
    from vllm_dspark.config import DSparkOptionError

    monkeypatch.setattr(current_platform, "is_device_capability_family", lambda c: c == 90)
    groups = dsv4_groups()
    groups[0].append(
        SimpleNamespace(
            backend=SimpleNamespace(get_name=lambda: "FLASHINFER"), layer_names=["model.x"]
        )
    )
    with pytest.raises(DSparkOptionError, match="backend FLASHINFER here"):
        check_compaction_backends(groups, set())


# Compact FULL graphs.


def graph_config(num_drafts=K, varlen_verify=True):
    """What replays_varlen_graphs reads of a VllmConfig beside the layers."""
    from vllm_dspark.config import ADDITIONAL_CONFIG_KEY

    options = {"capacity": "sps", "varlen_verify": varlen_verify}
    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=num_drafts),
        additional_config={ADDITIONAL_CONFIG_KEY: options},
    )


@pytest.mark.parametrize(
    "names,family,num_drafts,varlen_verify,reason",
    [
        (DSV4_COMPACTION_BACKENDS, 90, K, True, None),
        (DSV4_COMPACTION_BACKENDS, 100, K, True, "on SM90 with 2 drafts or more"),
        (DSV4_COMPACTION_BACKENDS, 90, 1, True, "on SM90 with 2 drafts or more"),  # no flattening
        (DSV4_COMPACTION_BACKENDS, 90, K, False, "started with varlen_verify=false"),
        (("DEEPSEEK_SPARSE_SWA", "FLASH_ATTN"), 90, K, True, "backends DEEPSEEK_SPARSE_SWA, FL"),
    ],
    ids=["hopper", "blackwell", "one-draft", "masked", "mixed-backends"],
)
def test_deepseek_v4_replays_compact_graphs_on_hopper_when_started_compact(
    monkeypatch, names, family, num_drafts, varlen_verify, reason
):
    """Every layer (the draft's too) on DeepSeek-V4's backends, SM90, 2 drafts or more and
    an engine started compact: compact graphs; otherwise none, and why is logged."""
    import vllm.config
    from vllm.platforms import current_platform

    from vllm_dspark.verify import compact_graphs

    layers = {
        f"l{i}": SimpleNamespace(
            get_attn_backend=lambda name=name: SimpleNamespace(get_name=lambda: name),
            head_size=512,
        )
        for i, name in enumerate(names)
    }
    monkeypatch.setattr(vllm.config, "get_layers_from_vllm_config", lambda config, kind: layers)
    monkeypatch.setattr(current_platform, "is_device_capability_family", lambda c: c == family)
    logged = []
    monkeypatch.setattr(compact_graphs, "no_compact_graphs", logged.append)
    config = graph_config(num_drafts, varlen_verify)
    assert compact_graphs.replays_varlen_graphs(config) is (reason is None)
    assert len(logged) == (reason is not None) and all(reason in line for line in logged)


def graph_manager():
    """What the graph patches read of vLLM's target graph manager: FULL decode graphs,
    up to 4 requests of 1 + K tokens, capture sizes 1 to 32; vLLM's own uniform decode
    graph of 2 requests listed."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

    decode = BatchExecutionDescriptor(CUDAGraphMode.FULL, 16, 2, uniform_token_count=1 + K)
    return SimpleNamespace(
        vllm_config=None,
        cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
        dp_size=1,
        decode_query_len=1 + K,
        max_num_reqs=4,
        compilation_config=SimpleNamespace(
            cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32], max_cudagraph_capture_size=32
        ),
        _capture_descs={CUDAGraphMode.FULL: [decode]},
        graphs={},
    )


def captured_layouts(monkeypatch, manager, attn_groups) -> dict:
    """The graph patches' capture of ``manager``'s FULL graphs, vLLM's ``capture`` and
    ``ModelCudaGraphManager.capture`` stood in for: {descriptor: its dummy batch's query
    lengths}; every graph listed is captured."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.input_batch import InputBatch

    from vllm_dspark.patches import compact_graphs as graphs_patch
    from vllm_dspark.patches import dsv4_compact

    stock_make_dummy = InputBatch.make_dummy.__func__
    wrapped = classmethod(graphs_patch._make_dummy_batch_wrapper(stock_make_dummy))
    monkeypatch.setattr(InputBatch, "make_dummy", wrapped)
    buffers = input_buffers()
    layouts = {}

    def create_forward_fn(desc, warmup):
        batch = InputBatch.make_dummy(desc.num_reqs, desc.num_tokens, buffers)
        layouts[desc] = batch.num_scheduled_tokens.tolist()

    def capture(manager, create_forward_fn):
        for desc in manager._capture_descs[CUDAGraphMode.FULL]:
            create_forward_fn(desc, warmup=False)
            manager.graphs[desc] = "graph"

    def model_capture(
        manager, model, model_state, input_buffers, intermediate_tensors, block_tables,
        attn_groups, kv_cache_config, has_lora=False,
    ):  # fmt: skip
        graphs_patch._make_capture_wrapper(capture)(manager, create_forward_fn)

    dsv4_compact._make_capture_wrapper(model_capture)(
        manager, None, None, buffers, None, None, attn_groups, None, has_lora=False
    )
    return layouts


def test_deepseek_v4_captures_one_token_graphs_for_steps_that_admit_no_draft(monkeypatch):
    """Beside the variable-length compact graphs (captured on queries of 1 + K), a
    DeepSeek-V4 target captures one-token graphs up to max_num_seqs (on one token a
    request, vLLM's plain decode layout); a compacted step that admits no draft replays
    the smallest that holds its requests, any other compacted step a variable-length
    graph, and a step without a one-token graph to take runs as vLLM runs a mixed batch.
    A FlashAttention target captures no one-token graph."""
    from vllm.config.compilation import CUDAGraphMode

    from vllm_dspark.patches import compact_graphs as graphs_patch
    from vllm_dspark.patches import compact_verification as patch

    monkeypatch.setattr(graphs_patch, "replays_varlen_graphs", lambda vllm_config: True)
    flash = graph_manager()
    graphs_patch._make_candidates_wrapper(lambda m: None)(flash)
    varlen = list(getattr(flash, graphs_patch.COMPACT_GRAPHS_ATTR))
    flash_layouts = captured_layouts(monkeypatch, flash, [[group("FLASH_ATTN")]])
    assert getattr(flash, graphs_patch.COMPACT_GRAPHS_ATTR) == varlen
    assert all(desc.uniform_token_count != 1 for desc in flash_layouts)

    manager = graph_manager()
    graphs_patch._make_candidates_wrapper(lambda m: None)(manager)
    layouts = captured_layouts(monkeypatch, manager, dsv4_groups())
    compact = getattr(manager, graphs_patch.COMPACT_GRAPHS_ATTR)
    kinds = [(d.num_tokens, d.num_reqs, d.uniform_token_count) for d in compact]
    assert kinds == [
        (1, 1, 1),
        (2, 2, None),
        (2, 2, 1),
        (4, 4, None),
        (4, 4, 1),
        (8, 4, None),
        (16, 4, None),
        (32, 4, None),
    ]
    assert set(compact) <= set(manager._capture_descs[CUDAGraphMode.FULL])
    assert {(d.num_tokens, d.uniform_token_count): lengths for d, lengths in layouts.items()} == {
        (1, 1): [1],
        (2, 1): [1, 1],
        (4, 1): [1, 1, 1, 1],
        (2, None): [2, 0],
        (4, None): [4, 0, 0, 0],
        (8, None): [8, 0, 0, 0],
        (16, None): [8, 8, 0, 0],
        (16, 1 + K): [8, 8],  # vLLM's own uniform decode graph, as vLLM lays it out
        (32, None): [8, 8, 8, 8],
    }

    def stock_dispatch(manager, num_reqs, num_tokens, uniform, *args, **kw):
        return ("stock", num_reqs, num_tokens, uniform), None

    dispatch = patch._make_dispatch_wrapper(stock_dispatch)

    def dispatched(num_reqs, budget):
        token = patch._step_plan_var.set(StepPlan(budget))
        try:
            desc, _ = dispatch(manager, num_reqs, num_reqs * (1 + K), 1 + K, 1, 0)
        finally:
            patch._step_plan_var.reset(token)
        if isinstance(desc, tuple):
            return desc
        return desc.num_tokens, desc.num_reqs, desc.uniform_token_count

    assert dispatched(3, 0) == (4, 4, 1)  # no draft admitted: a one-token graph
    assert dispatched(1, 0) == (1, 1, 1)
    assert dispatched(2, 2) == (4, 4, None)  # 4 tokens, drafts among them: variable-length
    assert dispatched(3, 1) == (4, 4, None)
    assert dispatched(4, 9) == (16, 4, None)
    del manager.graphs[compact[4]]  # the one-token graph of 4 was not captured
    assert dispatched(3, 0) == ("stock", 3, 3, None)  # not a variable-length graph


def test_compact_verification_applies_the_deepseek_v4_wrappers():
    import importlib

    from vllm_dspark.patches import compact_verification, dsv4_compact
    from vllm_dspark.patches.wrapping import ORIGINAL_ATTR

    importlib.import_module(compact_verification.RUNNER_MODULE)
    compact_verification.apply()  # as building a capacity speculator does in a worker
    wrapped = {
        dsv4_compact.MODEL_STATE_MODULE: ("DefaultModelState", "prepare_attn"),
        dsv4_compact.BACKEND_MODULE: ("CommonAttentionMetadata", "token_to_req_indices"),
        dsv4_compact.INDEXER_MODULE: (
            "DeepseekV32IndexerMetadataBuilder",
            "_prepare_decode_tensors",
        ),
        dsv4_compact.GRAPHS_MODULE: ("ModelCudaGraphManager", "capture"),
    }
    for module, (owner, method) in wrapped.items():
        cls = getattr(importlib.import_module(module), owner)
        assert hasattr(getattr(cls, method), ORIGINAL_ATTR), (owner, method)


# The four builders under Triton's interpreter.


def test_builders_under_triton_interpreter():
    assert run_interpreted(__file__) == 7


def dsv4_attention_groups(monkeypatch):
    """vLLM's four DeepSeek-V4 metadata builders (sliding window, FlashMLA at ratio 128,
    compressor, indexer at ratio 4) in one KV-cache group, each layer named by its
    backend. FlashMLA's tile planner, a CUDA extension, is stubbed."""
    from vllm.models.deepseek_v4.compressor import CompressorBackend
    from vllm.models.deepseek_v4.sparse_mla import DeepseekV4FlashMLABackend
    from vllm.v1.attention.backends.mla import indexer, sparse_swa
    from vllm.v1.kv_cache_interface import SlidingWindowMLASpec
    from vllm.v1.worker.utils import AttentionGroup

    monkeypatch.setattr(indexer, "num_compute_units", lambda device_index: 4)
    monkeypatch.setattr(sparse_swa, "get_mla_metadata", lambda: (SimpleNamespace(), None))
    window = SlidingWindowMLASpec(
        block_size=BLOCK,
        num_kv_heads=1,
        head_size=512,
        dtype=torch.bfloat16,
        sliding_window=WINDOW,
    )
    specs = {
        sparse_swa.DeepseekSparseSWABackend: window,
        DeepseekV4FlashMLABackend: mla_spec(128),
        CompressorBackend: mla_spec(4),
        indexer.DeepseekV4IndexerBackend: mla_spec(4),
    }
    groups = []
    for backend, spec in specs.items():
        attention = AttentionGroup(backend, [backend.get_name()], spec, 0)
        builder = backend.get_builder_cls()(
            spec, attention.layer_names, dsv4_config(), torch.device("cpu")
        )
        attention.metadata_builders = [builder]
        groups.append(attention)
    return groups


def clone(value):
    return value.clone() if isinstance(value, torch.Tensor) else value


def metadata_of(metadata) -> dict:
    """What the four builders wrote, copied out of their persistent buffers."""
    swa = metadata["DEEPSEEK_SPARSE_SWA"]
    flashmla = metadata["FLASHMLA_SPARSE_DSV4"]
    index = metadata["DEEPSEEK_V4_INDEXER"]
    chunks = index.prefill.chunks if index.prefill is not None else []
    return {
        "swa_split": (swa.num_decodes, swa.num_prefills, swa.num_decode_tokens),
        "token_map": clone(swa.token_to_req_indices),
        "compressor_map": clone(metadata["CompressorBackend"].token_to_req_indices),
        "valid": clone(swa.is_valid_token),
        "swa_decode": (clone(swa.decode_swa_indices), clone(swa.decode_swa_lens)),
        "swa_prefill": (clone(swa.prefill_swa_indices), clone(swa.prefill_swa_lens)),
        "swa_prefill_lens": (clone(swa.prefill_seq_lens), clone(swa.prefill_query_lens_cpu)),
        "c128a_slots": clone(flashmla.slot_mapping),
        "c128a_decode": (
            clone(flashmla.c128a_global_decode_topk_indices),
            clone(flashmla.c128a_decode_topk_lens),
        ),
        "c128a_prefill": clone(flashmla.c128a_prefill_topk_indices),
        "indexer_split": (index.num_decodes, index.num_prefills, index.num_decode_tokens),
        "indexer_slots": clone(index.slot_mapping),
        "indexer_decode": (clone(index.decode.seq_lens), clone(index.decode.block_table)),
        "indexer_prefill": [
            [
                chunk.cu_seqlen_ks.tolist(),
                chunk.cu_seqlen_ke.tolist(),
                chunk.token_to_seq.tolist(),
                chunk.cu_seq_lens.tolist(),
                chunk.token_end - chunk.token_start,
            ]
            for chunk in chunks
        ],
    }


@interpreted
@pytest.mark.parametrize("case", [DECODE_ONLY, MIXED], ids=["decode", "mixed"])
def test_interpreted_builders_give_kept_tokens_their_uncompacted_metadata(
    speculator, monkeypatch, case
):
    """Each token a compacted batch keeps gets from the four builders what the same token
    of the uncompacted batch gets: its request, validity, sliding-window slots, ratio-128
    slots and counts, compressed KV slots, the indexer's context length and block row; the
    prompt chunks' prefill metadata too. Contexts pass the window and a ratio-128
    boundary. The indexer's uniform kernel runs for the uncompacted decode-only batch
    only."""
    from vllm.v1.attention.backends.mla import indexer

    groups = dsv4_attention_groups(monkeypatch)
    launches = KernelLaunches(indexer._prepare_uniform_decode_kernel)
    monkeypatch.setattr(indexer, "_prepare_uniform_decode_kernel", launches)
    # Slot 0 keeps the most drafts, past position 255 (a ratio-128 boundary).
    survival = torch.zeros(16, K)
    survival[0] = torch.linspace(0.99, 0.9, K)
    survival[1] = torch.tensor([0.95, 0.5, 0.1, 0.05, 0.04, 0.03, 0.02])
    survival[2] = 0.01
    compact, buffers, plan = compacted_batch(speculator, case, survival)
    with running(plan):
        got = metadata_of(prepare_attn(compact, groups))
    compacted_launches = len(launches.grids)
    stock, _ = stock_batch(*case)
    want = metadata_of(prepare_attn(stock, groups))
    assert (compacted_launches, len(launches.grids) > 0) == (0, case is DECODE_ONLY)
    assert compact.num_tokens < stock.num_tokens  # drafts were dropped

    # Compact token c of batch row r is the uncompacted token u at the same offset in r.
    rows = token_rows(compact)
    compact_starts = compact.query_start_loc.tolist()
    stock_starts = stock.query_start_loc.tolist()
    pairs = [(c, stock_starts[r] + c - compact_starts[r], r) for c, r in enumerate(rows)]
    swa_decodes, _, _ = got["swa_split"]
    assert got["swa_split"][:2] == want["swa_split"][:2]
    assert got["indexer_split"][:2] == want["indexer_split"][:2]
    assert got["indexer_prefill"] == want["indexer_prefill"]
    for key in ("swa_prefill_lens",):
        assert all(
            torch.equal(a, b) for a, b in zip(got[key], want[key], strict=True) if a is not None
        )
    index_decodes = got["indexer_split"][0]
    swa_shift = (got["swa_split"][2], want["swa_split"][2])
    for c, u, r in pairs:
        assert got["token_map"][c] == want["token_map"][u] == r
        assert got["compressor_map"][c] == r
        assert got["valid"][c] and want["valid"][u]
        assert got["c128a_slots"][c] == want["c128a_slots"][u]
        assert got["indexer_slots"][c] == want["indexer_slots"][u]
        if r < swa_decodes:
            for a, b in zip(got["swa_decode"], want["swa_decode"], strict=True):
                assert torch.equal(a[c], b[u]), (c, u)
            for a, b in zip(got["c128a_decode"], want["c128a_decode"], strict=True):
                assert torch.equal(a[c], b[u]), (c, u)
        else:
            cp, up = c - swa_shift[0], u - swa_shift[1]
            for a, b in zip(got["swa_prefill"], want["swa_prefill"], strict=True):
                assert torch.equal(a[cp], b[up]), (c, u)
            assert torch.equal(got["c128a_prefill"][cp], want["c128a_prefill"][up])
        if r < index_decodes:
            for a, b in zip(got["indexer_decode"], want["indexer_decode"], strict=True):
                assert torch.equal(a[c], b[u]), (c, u)
    # What the comparison covers: full windows, a ratio-128 boundary crossed (a token
    # writing a compressed entry, and one more entry for the tokens after it), ratio-4
    # entries written and read by the indexer.
    assert int(got["swa_decode"][1].max()) == WINDOW
    assert bool((got["c128a_slots"] >= 0).any()) and bool((got["indexer_slots"] >= 0).any())
    first = compact_starts[1]  # request 0's kept tokens, from position 252
    assert got["c128a_decode"][1][:first].tolist() == [1, 1, 1, 2, 2, 2][:first]
    assert int(got["indexer_decode"][0].max()) > 0


# What a compact graph replays: the four builders on its capture layout and on a
# compacted step padded to it, under Triton's interpreter.


class BlockTables:
    """The runner's persistent block table and slot mapping (vLLM's ``BlockTables``): a
    step writes its rows into them; the builders get views of their heads."""

    def __init__(self):
        self.block_table = torch.zeros(16, BLOCKS_PER_REQ, dtype=torch.int32)
        self.slot_mapping = torch.full((1, 256), -1, dtype=torch.int64)

    def write(self, table, slots):
        rows, tokens = table.shape[0], slots.shape[1]
        self.block_table[:rows] = table
        self.slot_mapping.fill_(-1)  # vLLM pads past the step's tokens
        self.slot_mapping[:, :tokens] = slots
        return (self.block_table[:rows],), self.slot_mapping[:, :tokens]

    def dummy(self, rows, tokens):
        """For a capture, as get_dummy_block_tables and get_dummy_slot_mappings give them."""
        self.slot_mapping.fill_(-1)
        return (self.block_table[:rows],), self.slot_mapping[:, :tokens]


def capture_metadata(groups, buffers, tables, num_reqs, num_tokens, query_len):
    """What vLLM's capture of a FULL graph of ``num_tokens`` tokens and ``num_reqs``
    requests builds (``prepare_inputs_to_capture``): its dummy batch, laid out by the
    plugin's wrapper with queries of ``query_len``; slot mappings that write nowhere; the
    attention metadata, built for capture."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.input_batch import InputBatch
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    from vllm_dspark.patches import compact_graphs as graphs_patch

    make_dummy = graphs_patch._make_dummy_batch_wrapper(InputBatch.make_dummy.__func__)
    token = graphs_patch._capture_query_len_var.set(query_len)
    try:
        batch = make_dummy(InputBatch, num_reqs, num_tokens, buffers)
    finally:
        graphs_patch._capture_query_len_var.reset(token)
    block_tables, slots = tables.dummy(num_reqs, num_tokens)
    return DefaultModelState.prepare_attn(
        MODEL_STATE,
        batch,
        CUDAGraphMode.NONE,
        block_tables,
        slots,
        [groups],
        KV_CACHE_CONFIG,
        for_capture=True,
    )


# Values of the builders' output that no kernel of a decode-only graph reads: the host
# query offsets and longest query (read for prompts, models/deepseek_v4/nvidia/
# flashmla.py:260-323), and the longest sequence, which the capture takes as max_model_len
# (model_states/default.py, for_capture) where the indexer's top-k reads it
# (model_executor/layers/sparse_attn_indexer.py:613-620): a bound on every replay's.
NOT_READ_BY_GRAPHS = ("query_start_loc_cpu", "max_query_len", "max_seq_len")


def replayed(metadata: dict) -> dict:
    """{field path: what a graph replay takes of it}: a tensor by address, shape, strides
    and dtype (its contents are rewritten before each replay); a FlashMLA tile plan by its
    presence (made inside the graph, from those tensors); any other value as it is (fixed
    at capture)."""
    flat = {}

    def walk(value, path):
        if path.rsplit(".", 1)[-1] in NOT_READ_BY_GRAPHS:
            return
        if isinstance(value, torch.Tensor):
            flat[path] = (value.data_ptr(), tuple(value.shape), value.stride(), value.dtype)
        elif dataclasses.is_dataclass(value):
            for field in dataclasses.fields(value):
                walk(getattr(value, field.name), f"{path}.{field.name}")
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}.{key}")
        elif isinstance(value, list | tuple):
            for index, item in enumerate(value):
                walk(item, f"{path}.{index}")
        elif isinstance(value, SimpleNamespace):  # FlashMLA's planner is stubbed by one
            flat[path] = "tile plan"
        else:
            flat[path] = value

    for name, value in metadata.items():
        walk(value, name)
    return flat


def graph_and_step(speculator, monkeypatch, computed, budget, num_reqs, num_tokens, query_len):
    """The four builders' metadata captured for a graph (``num_tokens``, ``num_reqs``,
    queries of ``query_len``), then that of a compacted decode step of ``computed``
    contexts admitting ``budget`` drafts (the controller's own when None), padded to the
    graph, built in the same persistent buffers; the uniform indexer kernel's launches
    during each; and the step's batch."""
    from vllm.v1.attention.backends.mla import indexer

    groups = dsv4_attention_groups(monkeypatch)
    launches = KernelLaunches(indexer._prepare_uniform_decode_kernel)
    monkeypatch.setattr(indexer, "_prepare_uniform_decode_kernel", launches)
    buffers, tables = input_buffers(), BlockTables()
    graph = capture_metadata(groups, buffers, tables, num_reqs, num_tokens, query_len)
    graph_launches = len(launches.grids)
    case = (computed, [], num_reqs - len(computed))
    step, _, plan = compacted_batch(speculator, case, survivals(1), buffers, budget)
    step = dataclasses.replace(step, num_tokens_after_padding=num_tokens)
    with running(plan):
        metadata = prepare_attn(step, groups, full_graph=True, tables=tables)
    launched = (graph_launches, len(launches.grids) - graph_launches)
    return graph, metadata, launched, step


def differences(graph: dict, step: dict) -> dict:
    captured, replay = replayed(graph), replayed(step)
    return {
        path: (captured.get(path), replay.get(path))
        for path in captured.keys() | replay.keys()
        if captured.get(path) != replay.get(path)
    }


@interpreted
@pytest.mark.parametrize(
    "computed,num_reqs,num_tokens,uniform_capture",
    [
        ([252, 130, 600], 8, 16, False),  # captured on 8 + 8 tokens, then empty rows
        ([252, 130, 600], 8, 64, True),  # on 8 rows of 8: the indexer's uniform kernel
        ([600], 8, 8, False),  # one request
    ],
    ids=["padded", "uniform-capture", "one-request"],
)
def test_interpreted_a_compacted_step_writes_what_its_compact_graph_was_captured_on(
    speculator, monkeypatch, computed, num_reqs, num_tokens, uniform_capture
):
    """Built for a FULL replay, a compacted decode step (placeholder host layout, device
    token map, the indexer's variable rows) hands DeepSeek-V4's kernels the tensors their
    graph was captured on (same addresses, shapes, strides) and the same host values
    (every request a decode, T decode tokens, the indexer's flattened rows unpadded,
    FlashMLA's plans to make), though the capture's indexer may have taken its uniform
    kernel; the step's padded tokens attend nothing."""
    graph, step, launched, batch = graph_and_step(
        speculator, monkeypatch, computed, None, num_reqs, num_tokens, 1 + K
    )
    assert differences(graph, step) == {}
    assert launched == (int(uniform_capture), 0)
    index, swa = step["DEEPSEEK_V4_INDEXER"], step["DEEPSEEK_SPARSE_SWA"]
    assert (index.num_decodes, index.num_decode_tokens) == (num_reqs, num_tokens)
    assert graph["DEEPSEEK_V4_INDEXER"].max_seq_len == MAX_MODEL_LEN >= index.max_seq_len
    real = batch.num_tokens  # R + B
    assert len(computed) < real < num_tokens
    assert index.decode.seq_lens[real:].eq(0).all() and swa.decode_swa_lens[real:].eq(0).all()
    assert swa.token_to_req_indices[real:].eq(0).all()
    assert int(index.decode.seq_lens[:real].min()) > 0


@interpreted
def test_interpreted_a_step_without_drafts_writes_what_its_one_token_graph_was_captured_on(
    speculator, monkeypatch
):
    """A compacted step that admits no draft, padded to a one-token graph of 4 requests:
    the same tensors and host values as that graph's capture (one token a request), but
    for the indexer's ``requires_padding``, set by the step's empty padded row; the graph
    keeps its capture's path, one indexer row per token, which is the step's layout too
    (request r's one token is token r)."""
    graph, step, launched, batch = graph_and_step(
        speculator, monkeypatch, [252, 130, 600], 0, 4, 4, 1
    )
    assert differences(graph, step) == {
        "DEEPSEEK_V4_INDEXER.decode.requires_padding": (False, True)
    }
    assert launched == (0, 0)
    assert batch.num_tokens == 3
    assert batch.query_start_loc.tolist() == [0, 1, 2, 3, 3]
    assert step["DEEPSEEK_V4_INDEXER"].decode.seq_lens.flatten().tolist()[3] == 0


@interpreted
def test_interpreted_a_step_without_drafts_reads_other_buffers_than_a_compact_graph(
    speculator, monkeypatch
):
    """Why a compacted step that admits no draft does not replay a compact graph: the
    indexer keeps per-request rows for it, its context lengths and block rows in other
    tensors than the flattened ones the graph was captured on."""
    graph, step, _, _ = graph_and_step(speculator, monkeypatch, [252, 130, 600], 0, 8, 16, 1 + K)
    differing = differences(graph, step)
    assert {
        "DEEPSEEK_V4_INDEXER.decode.seq_lens",
        "DEEPSEEK_V4_INDEXER.decode.block_table",
        "DEEPSEEK_V4_INDEXER.decode.decode_lens",
    } <= set(differing)
