"""Compile an engine's DeepGEMM linear kernels in parallel processes at start-up.

What: wraps ``deep_gemm_warmup`` where vLLM's ``kernel_warmup`` calls it. Before the
stock warmup runs, the FP8 GEMMs it is about to make (one weight shape per DeepGEMM-backed
linear, at the token counts ``VLLM_DEEP_GEMM_WARMUP`` picks) are split among
``DSPARK_DEEP_GEMM_WARMUP_WORKERS`` subprocesses, which make them on empty tensors of the
same shapes, dtypes and strides through vLLM's own ``fp8_gemm_nt``. The stock warmup then
finds each kernel in DeepGEMM's cache.
Why: DeepGEMM compiles each kernel with ``nvcc`` on first use, one at a time, and a cold
DeepSeek-V4 engine spends most of its start-up doing so (docs/design/deepseek-v4.md).
The processes compile side by side into the one cache (``DG_JIT_CACHE_DIR``), where
DeepGEMM renames each finished kernel into place, as tensor-parallel ranks rely on. They
start no earlier than the warmup, once the KV cache is sized, so that their GPU memory
changes no engine's KV cache.
How: benchmarks only; :mod:`.dummy_weights` (the dummy-weight engines' worker extension)
applies it, and it stays inert unless the variable is above 1. A worker that fails, or a
failure before any starts, costs only its time: the stock warmup compiles what is missing.
Upstream: none; vLLM 0.26.0 warms DeepGEMM serially.
Remove when: vLLM or DeepGEMM compiles a warmup's kernels in parallel.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vllm.logger import init_logger

from vllm_dspark.patches.wrapping import wrap

WORKERS_ENV = "DSPARK_DEEP_GEMM_WARMUP_WORKERS"
WARMUP_MODULE = "vllm.model_executor.warmup.kernel_warmup"
# Far longer than a share should take: workers still running then are killed and the
# stock warmup compiles what they left.
WORKER_TIMEOUT_S = 600

logger = init_logger(f"vllm.{__name__}")


def _tensor_layout(tensor) -> dict:
    return {
        "shape": list(tensor.shape),
        "stride": list(tensor.stride()),
        "dtype": str(tensor.dtype).removeprefix("torch."),
    }


def gemm_jobs(model, max_tokens: int) -> list[dict]:
    """The stock warmup's FP8 GEMMs, one job per weight shape it has not warmed yet:
    the weight's and its scale's layouts and the token counts to run."""
    from vllm.model_executor.warmup import deep_gemm_warmup as stock

    jobs, seen = [], set(stock.FP8_GEMM_NT_WARMUP_CACHE)
    for module in model.modules():
        if not stock._fp8_linear_may_use_deep_gemm(module):
            continue
        weight, scale, _ = stock._extract_data_from_linear_base_module(module)
        if weight.size() in seen:
            continue
        seen.add(weight.size())
        m_values = sorted(stock._get_fp8_gemm_nt_m_values(weight, max_tokens))
        jobs.append(
            {"weight": _tensor_layout(weight), "scale": _tensor_layout(scale), "m": m_values}
        )
    return jobs


def split_jobs(jobs: list[dict], workers: int) -> list[list[dict]]:
    """Each job's token counts cut into ``workers`` contiguous runs, worker i taking run i
    of every job: neighbouring counts mostly share a kernel, so few compile twice."""
    shares: list[list[dict]] = [[] for _ in range(workers)]
    for job in jobs:
        m_values = job["m"]
        for i in range(workers):
            run = m_values[len(m_values) * i // workers : len(m_values) * (i + 1) // workers]
            if run:
                shares[i].append(job | {"m": run})
    return [share for share in shares if share]


def run_jobs(jobs: list[dict], gemm, device, block: int) -> int:
    """Make each job's GEMMs as the stock warmup makes them: activations of M tokens (FP8,
    float32 scales per ``block`` columns) times the weight, into bfloat16. Returns the
    count. Tensors are sized to each call, not to the largest as stock's are, so that a
    worker holds little GPU memory beside the engine."""
    import torch

    def empty(layout: dict):
        dtype = getattr(torch, layout["dtype"])
        return torch.empty_strided(layout["shape"], layout["stride"], dtype=dtype, device=device)

    calls = 0
    for job in jobs:
        weight, scale = empty(job["weight"]), empty(job["scale"])
        n, k = job["weight"]["shape"]
        for m in job["m"]:
            activations = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=device)
            activation_scales = torch.empty((m, k // block), dtype=torch.float32, device=device)
            out = torch.empty((m, n), dtype=torch.bfloat16, device=device)
            gemm((activations, activation_scales), (weight, scale), out)
            calls += 1
    return calls


def compile_in_parallel(jobs: list[dict], workers: int, device: int = 0) -> list[int]:
    """Run this rank's shares of the jobs in subprocesses (this module as a script) on
    GPU ``device``; their exit codes. Tensor-parallel ranks split the ``workers`` shares
    between them: they compile the same kernels into one cache."""
    import torch.distributed as dist

    rank, ranks = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    with tempfile.TemporaryDirectory(prefix="dspark_deep_gemm_") as folder:
        processes = []
        for i, share in enumerate(split_jobs(jobs, workers)[rank::ranks]):
            path = Path(folder) / f"share{i}.json"
            path.write_text(json.dumps(share))
            command = [sys.executable, "-m", __name__, str(path), str(device)]
            processes.append(subprocess.Popen(command))
        deadline, codes = time.monotonic() + WORKER_TIMEOUT_S, []
        for process in processes:
            try:
                codes.append(process.wait(timeout=max(deadline - time.monotonic(), 0)))
            except subprocess.TimeoutExpired:
                process.kill()
                codes.append(process.wait())
        return codes


def _current_device() -> int:
    import torch

    return torch.cuda.current_device() if torch.cuda.is_available() else 0


def _cached_kernels() -> int:
    cache = Path(os.environ.get("DG_JIT_CACHE_DIR", "")) / "cache"
    return len(list(cache.iterdir())) if cache.is_dir() else 0


def _compile_first(model, max_tokens: int, workers: int) -> None:
    jobs = gemm_jobs(model, max_tokens)
    if not jobs:
        return
    before, start = _cached_kernels(), time.monotonic()
    codes = compile_in_parallel(jobs, workers, _current_device())
    logger.info(
        "vllm-dspark: DeepGEMM warmup of %d weight shapes in %d processes took "
        "%.0f s (exit codes %s); DeepGEMM's cache holds %d kernels, %d before",
        len(jobs),
        len(codes),
        time.monotonic() - start,
        codes,
        _cached_kernels(),
        before,
    )


def _make_wrapper(deep_gemm_warmup):
    def warm_in_parallel_first(model, max_tokens: int):
        workers = int(os.environ.get(WORKERS_ENV, "0"))
        if workers > 1:
            # A speed-up only: whatever goes wrong here leaves the compiling to the stock
            # warmup below, never stops the engine.
            try:
                _compile_first(model, max_tokens, workers)
            except Exception:
                logger.exception("vllm-dspark: DeepGEMM's parallel warmup failed")
        # Timed in every engine that wraps it: with workers, what they left to compile;
        # without, the serial baseline they are measured against.
        before, start = _cached_kernels(), time.monotonic()
        result = deep_gemm_warmup(model, max_tokens)
        logger.info(
            "vllm-dspark: vLLM's DeepGEMM warmup took %.0f s; DeepGEMM's cache holds %d "
            "kernels, %d before",
            time.monotonic() - start,
            _cached_kernels(),
            before,
        )
        return result

    return warm_in_parallel_first


def apply() -> None:
    """Wrap the warmup where ``kernel_warmup`` calls it (inert while the variable is
    unset: the wrapper reads it at each start-up)."""
    wrap(importlib.import_module(WARMUP_MODULE), "deep_gemm_warmup", _make_wrapper)


def main(share_path: str, device: str) -> None:
    import torch
    from vllm.utils.deep_gemm import fp8_gemm_nt, get_mk_alignment_for_contiguous_layout

    jobs = json.loads(Path(share_path).read_text())
    torch.cuda.set_device(int(device))
    block = get_mk_alignment_for_contiguous_layout()[0]  # the stock warmup's scale block
    calls = run_jobs(jobs, fp8_gemm_nt, torch.device("cuda", int(device)), block)
    torch.cuda.synchronize()
    print(f"vllm-dspark: {share_path}: {calls} DeepGEMM calls made", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
