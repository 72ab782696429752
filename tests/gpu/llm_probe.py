"""Run in a subprocess on a GPU: greedy generation with vLLM's LLM().

Takes one JSON argument: {"target", "draft" (or null for no speculation), "dummy"
(dummy weights), "options" (extra speculative-config keys), "prompts" (token-id lists),
"max_tokens", optional "gpu_memory_utilization", "dtype", "enable_prefix_caching",
"switch" (a list of [name, capacity options] measured one after another in this engine,
:mod:`vllm_dspark.engine_control`), "poison_freed_memory" (after the warm-up, fill the
GPU memory the engine does not hold with NaN, then hand it back to the allocator),
"tensor_parallel_size", "max_num_seqs"}.
Prints one JSON line: the token ids per prompt, the spec-decode counts, the plugin's
admission counts (compacted steps), the run's tokens per second, and whether vllm-dspark's
patches were applied.
"""

import json
import os
import sys
import time
from dataclasses import asdict


def fixed_kv_cache_bytes() -> int | None:
    """DSPARK_PROBE_KV_CACHE_BYTES: a fixed KV-cache size, so that vLLM skips its memory
    profiling, which other engines starting on the same GPU would disturb (several probes
    run at once on one GPU in tools/device/gpu_stage.sh hardening)."""
    value = os.environ.get("DSPARK_PROBE_KV_CACHE_BYTES")
    return int(value) if value else None


def poison_freed_memory(worker, chunk_bytes: int = 256 << 20) -> int:
    """Runs in the worker: the next bytes the caching allocator hands out hold NaN, up to
    DSPARK_PROBE_POISON_GIB (default: all free memory) (memory held by tensors and
    CUDA-graph pools is untouched). Returns the bytes."""
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()
    chunks = []
    limit = float(os.environ.get("DSPARK_PROBE_POISON_GIB", "inf")) * (1 << 30)
    while torch.cuda.mem_get_info()[0] > 2 * chunk_bytes and len(chunks) * chunk_bytes < limit:
        chunks.append(torch.full((chunk_bytes // 4,), float("nan"), device="cuda"))
    poisoned = len(chunks) * chunk_bytes
    del chunks  # back to the allocator's cache, NaN inside
    return poisoned


def main(spec: dict) -> None:
    # Multi-GPU machines here must keep NVLink multicast off (the device's KINDS.md).
    for name in ("NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS", "TORCH_SYMM_MEM_DISABLE_MULTICAST"):
        os.environ.setdefault(name, "0" if name == "NCCL_NVLS_ENABLE" else "1")
    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import EngineArgs

    from vllm_dspark.metrics import (
        AdmissionCounts,
        SpecDecodeCounts,
        admission_counts,
        admission_counts_per_rank,
    )
    from vllm_dspark.patches.wrapping import ORIGINAL_ATTR

    speculative = None
    if spec["draft"]:
        speculative = {"method": "dspark", "model": spec["draft"], "num_speculative_tokens": 7}
        speculative.update(spec.get("options", {}))
    if speculative or spec.get("poison_freed_memory"):
        # admission_counts() and the poisoning call into the worker.
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    start = time.perf_counter()
    llm = LLM(
        model=spec["target"],
        load_format="dummy" if spec.get("dummy") else "auto",
        skip_tokenizer_init=spec.get("dummy", False),
        dtype=spec.get("dtype", "bfloat16"),
        max_model_len=1024,
        max_num_seqs=spec.get("max_num_seqs", 64),
        tensor_parallel_size=spec.get("tensor_parallel_size", 1),
        gpu_memory_utilization=spec.get("gpu_memory_utilization", 0.3),
        kv_cache_memory_bytes=fixed_kv_cache_bytes(),
        enable_prefix_caching=spec.get("enable_prefix_caching"),
        seed=0,
        disable_log_stats=False,
        speculative_config=speculative,
    )
    load_s = time.perf_counter() - start
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up
    poisoned = 0
    if spec.get("poison_freed_memory"):
        poisoned = llm.collective_rpc(poison_freed_memory)[0]

    def admission() -> AdmissionCounts:
        return admission_counts(llm) if speculative else AdmissionCounts()

    def measure() -> dict:
        before, admitted_before = SpecDecodeCounts.from_metrics(llm.get_metrics()), admission()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        counts = SpecDecodeCounts.from_metrics(llm.get_metrics()) - before
        admitted = admission() - admitted_before
        token_ids = [list(out.outputs[0].token_ids) for out in outputs]
        return {
            "token_ids": token_ids,
            "spec_decode": asdict(counts),
            "admission": asdict(admitted),
            "acceptance_length": counts.acceptance_length if counts.drafts else None,
            "tok_s": sum(map(len, token_ids)) / seconds,
        }

    result = {
        "patched": hasattr(EngineArgs.create_speculative_config, ORIGINAL_ATTR),
        "load_s": round(load_s, 1),
        "poisoned_bytes": poisoned,
    }
    if "switch" in spec:
        # Several capacity arms of one engine: {"arms": {name: measurement}}.
        from vllm_dspark.engine_control import switch_capacity

        result["arms"] = {}
        for name, updates in spec["switch"]:
            switch_capacity(llm, **updates)
            llm.generate(prompts[:4], params, use_tqdm=False)
            result["arms"][name] = measure()
    else:
        result |= measure()
    if speculative:
        result["admission_per_rank"] = [asdict(c) for c in admission_counts_per_rank(llm)]
    print("PROBE " + json.dumps(result))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
