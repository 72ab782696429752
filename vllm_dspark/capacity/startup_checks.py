"""What capacity control needs of the engine it starts in, checked at start-up, so that an
unsupported setup fails there with the option to change rather than mid-serving: the
target's attention backends and features that keep their own host-side layout of a batch
(compact verification), FULL decode CUDA graphs (``sps_curve=auto`` profiles them), and
the graph sizes a step pads to (the SPS table is read at those sizes)."""

from __future__ import annotations

from vllm.config import VllmConfig

from vllm_dspark.config import KEY_PREFIX, DSparkOptionError


def graph_sizes(vllm_config: VllmConfig) -> list[int]:
    """The token counts the runner pads a step to (its CUDA-graph sizes; none when eager)."""
    from vllm.config.compilation import CUDAGraphMode

    compilation = vllm_config.compilation_config
    if compilation.cudagraph_mode in (None, CUDAGraphMode.NONE):
        return []
    return list(compilation.cudagraph_capture_sizes or ())


# Attention backends that build a compacted batch's metadata from device-side query
# offsets, taking the host's per-request lengths as upper bounds (FlashInfer plans on the
# host's layout, so it is not among them).
COMPACTION_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN")
# DeepSeek-V4's, which read host lengths: they take a compacted batch through the wrappers
# of vllm_dspark.patches.dsv4_compact (a host placeholder layout, the token map from the
# device offsets, the indexer's flattened variable-length rows), on Hopper, where the
# indexer flattens its decode rows (on Blackwell it keeps them uniform per request).
DSV4_COMPACTION_BACKENDS = (
    "FLASHMLA_SPARSE_DSV4",
    "DEEPSEEK_SPARSE_SWA",
    "CompressorBackend",
    "DEEPSEEK_V4_INDEXER",
)
DSV4_INDEXER = "DEEPSEEK_V4_INDEXER"


def has_full_decode_graphs(vllm_config: VllmConfig) -> bool:
    """Whether the target captures FULL decode CUDA graphs, which ``auto`` times."""
    from vllm.config.compilation import CUDAGraphMode

    mode = vllm_config.compilation_config.cudagraph_mode
    return mode is not None and mode.decode_mode() == CUDAGraphMode.FULL


def refuse_sps_profiling(vllm_config: VllmConfig) -> None:
    mode = vllm_config.compilation_config.cudagraph_mode
    raise DSparkOptionError(
        f"vllm-dspark: {KEY_PREFIX}sps_curve='auto' profiles the target's FULL decode CUDA "
        f"graphs at start-up, and this engine captures none (cudagraph_mode={mode}, "
        "enforce_eager turns them off). Valid here: a curve, e.g. the JSON "
        "benchmarks/profile_dspark_sps_curve.py writes."
    )


def check_compaction_supported(vllm_config: VllmConfig) -> None:
    """Compact verification rewrites per-token inputs on the GPU: refuse the features
    that keep their own host-side per-request layout of the batch."""
    parallel = vllm_config.parallel_config
    unsupported = {
        "LoRA": vllm_config.lora_config is not None,
        "decode context parallelism": parallel.decode_context_parallel_size > 1,
        "prefill context parallelism": getattr(parallel, "prefill_context_parallel_size", 1) > 1,
        "a hybrid (Mamba) target": vllm_config.model_config.is_hybrid,
    }
    found = [name for name, present in unsupported.items() if present]
    if found:
        raise DSparkOptionError(
            f"vllm-dspark: {KEY_PREFIX}varlen_verify does not support {', '.join(found)} in "
            f"this version. Valid here: {KEY_PREFIX}capacity=off."
        )


def check_compaction_backends(attn_groups, draft_layer_names) -> None:
    """The target's attention must take a batch whose per-request query lengths were
    chosen on the GPU, from device-side query offsets and upper bounds on the host:
    FlashAttention (2 or 3) and Triton attention do, and DeepSeek-V4's backends on SM90
    with the plugin's wrappers. (FULL graphs of such batches are captured for
    FlashAttention 3 and DeepSeek-V4's backends: :mod:`vllm_dspark.verify.compact_graphs`.)"""
    target = [
        group
        for groups in attn_groups
        for group in groups
        if not set(group.layer_names) <= draft_layer_names
    ]
    names = {group.backend.get_name() for group in target}
    deepseek_v4 = bool(names & set(DSV4_COMPACTION_BACKENDS))
    accepted = set(COMPACTION_BACKENDS)
    if deepseek_v4 and dsv4_compaction_ready(target):
        accepted |= set(DSV4_COMPACTION_BACKENDS)
    unsupported = names - accepted
    if unsupported:
        backends = (
            "--attention-backend FLASHMLA_SPARSE_DSV4 on SM90 (Hopper) with at least 2 drafts"
            if deepseek_v4
            else f"--attention-backend {' or '.join(COMPACTION_BACKENDS)}"
        )
        raise DSparkOptionError(
            f"vllm-dspark: {KEY_PREFIX}varlen_verify cannot run the target's attention "
            f"backend {', '.join(sorted(unsupported))} here. Valid here: {backends}; or "
            f"{KEY_PREFIX}varlen_verify=false, which verifies the admitted drafts of an "
            f"uncompacted batch (the target then runs every draft); or {KEY_PREFIX}capacity=off."
        )


def dsv4_compaction_ready(target_groups) -> bool:
    """Whether DeepSeek-V4's backends take a compacted batch here: on SM90 (Hopper),
    with every indexer flattening its decode rows (it does unless 1 + K is 1 or 2)."""
    from vllm.platforms import current_platform

    return current_platform.is_device_capability_family(90) and all(
        group.get_metadata_builder().use_flattening
        for group in target_groups
        if group.backend.get_name() == DSV4_INDEXER
    )
