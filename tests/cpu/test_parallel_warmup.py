"""vllm_dspark.bench.parallel_warmup: the stock DeepGEMM warmup's GEMMs, split among
processes that make them with the same shapes, dtypes and strides, before the stock warmup
runs; inert unless its variable is set, and harmless when a worker fails."""

import pytest
import torch

from vllm_dspark.bench import parallel_warmup
from vllm_dspark.patches.wrapping import original


@pytest.fixture
def stock(monkeypatch):
    """vLLM's warmup helpers, with three FP8 linears (two of one shape) and one module
    DeepGEMM does not back."""
    from vllm.model_executor.warmup import deep_gemm_warmup as stock

    class Linear(torch.nn.Module):
        def __init__(self, n, k, deep_gemm=True):
            super().__init__()
            self.weight = torch.empty(n, k, dtype=torch.float8_e4m3fn)
            # Column-major scales, as a kernel may keep them: strides must travel.
            self.weight_scale_inv = torch.empty(k // 128, n // 128).t()
            self.deep_gemm = deep_gemm

    model = torch.nn.Sequential(
        Linear(256, 512), Linear(256, 512), Linear(384, 128), Linear(128, 128, False)
    )
    monkeypatch.setattr(
        stock, "_fp8_linear_may_use_deep_gemm", lambda m: getattr(m, "deep_gemm", False)
    )
    monkeypatch.setattr(
        stock,
        "_extract_data_from_linear_base_module",
        lambda m: (m.weight, m.weight_scale_inv, [128, 128]),
    )
    monkeypatch.setattr(
        stock, "_get_fp8_gemm_nt_m_values", lambda w, max_tokens: [max_tokens, 2, 1]
    )
    monkeypatch.setattr(stock, "FP8_GEMM_NT_WARMUP_CACHE", set())
    return stock, model


def test_jobs_are_the_stock_warmups_shapes_once_each(stock):
    module, model = stock
    jobs = parallel_warmup.gemm_jobs(model, max_tokens=64)
    assert [job["weight"]["shape"] for job in jobs] == [[256, 512], [384, 128]]
    assert jobs[0]["scale"] == {"shape": [2, 4], "stride": [1, 2], "dtype": "float32"}
    assert all(job["m"] == [1, 2, 64] for job in jobs)
    module.FP8_GEMM_NT_WARMUP_CACHE.add(torch.Size([256, 512]))  # warmed already
    assert [job["weight"]["shape"] for job in parallel_warmup.gemm_jobs(model, 64)] == [[384, 128]]


@pytest.mark.parametrize("workers", [1, 3, 8])
def test_each_gemm_goes_to_one_worker_in_contiguous_runs(workers):
    jobs = [{"weight": "a", "m": list(range(1, 11))}, {"weight": "b", "m": [1, 2]}]
    shares = parallel_warmup.split_jobs(jobs, workers)
    assert 1 <= len(shares) <= workers and all(shares)
    for name, m_values in (("a", range(1, 11)), ("b", [1, 2])):
        runs = [job["m"] for share in shares for job in share if job["weight"] == name]
        assert sum(runs, []) == list(m_values)  # all of them, once, in order


def test_workers_make_the_stock_calls(stock):
    _, model = stock
    calls = []

    def gemm(activations, weights, out):
        calls.append((activations, weights, out))

    jobs = parallel_warmup.gemm_jobs(model, max_tokens=64)
    assert parallel_warmup.run_jobs(jobs, gemm, torch.device("cpu"), block=128) == 6
    (a, a_scale), (w, w_scale), out = calls[2]  # the first weight at 64 tokens
    linear = model[0]
    assert (a.shape, a.dtype, a_scale.shape, a_scale.dtype) == (
        (64, 512),
        torch.float8_e4m3fn,
        (64, 4),
        torch.float32,
    )
    assert (w.shape, w.dtype, w.stride()) == (
        linear.weight.shape,
        linear.weight.dtype,
        linear.weight.stride(),
    )
    assert (w_scale.shape, w_scale.stride()) == (
        linear.weight_scale_inv.shape,
        linear.weight_scale_inv.stride(),
    )
    assert (out.shape, out.dtype) == ((64, 256), torch.bfloat16)


def test_inert_unless_the_variable_is_set(stock, monkeypatch):
    _, model = stock
    parallel_warmup.apply()
    import vllm.model_executor.warmup.kernel_warmup as kernel_warmup

    warmed, compiled = [], []
    wrapper = parallel_warmup._make_wrapper(lambda model, max_tokens: warmed.append(max_tokens))
    monkeypatch.setattr(
        parallel_warmup,
        "compile_in_parallel",
        lambda jobs, workers, device: compiled.append(workers) or [0],
    )
    monkeypatch.delenv(parallel_warmup.WORKERS_ENV, raising=False)
    wrapper(model, 64)
    assert (warmed, compiled) == ([64], [])
    monkeypatch.setenv(parallel_warmup.WORKERS_ENV, "4")
    wrapper(model, 64)
    assert (warmed, compiled) == ([64, 64], [4])
    # vLLM's own warmup is timed either way (the serial baseline; what workers left).
    logged = []
    monkeypatch.setattr(parallel_warmup.logger, "info", lambda msg, *args: logged.append(msg))
    monkeypatch.delenv(parallel_warmup.WORKERS_ENV)
    wrapper(model, 64)
    assert [msg.split(" took")[0] for msg in logged] == ["vllm-dspark: vLLM's DeepGEMM warmup"]
    # kernel_warmup calls the wrapper; the stock function stays behind it.
    assert original(kernel_warmup, "deep_gemm_warmup") is not kernel_warmup.deep_gemm_warmup


def test_a_failed_worker_leaves_the_stock_warmup_to_compile(stock, monkeypatch):
    """Without a GPU every worker fails: the wrapper says so and the stock warmup runs."""
    _, model = stock
    monkeypatch.setenv(parallel_warmup.WORKERS_ENV, "2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    jobs = parallel_warmup.gemm_jobs(model, max_tokens=64)
    codes = parallel_warmup.compile_in_parallel(jobs, 2)
    assert len(codes) == 2 and all(code != 0 for code in codes)
    warmed = []
    monkeypatch.setattr(parallel_warmup, "compile_in_parallel", lambda *args: codes)
    parallel_warmup._make_wrapper(lambda model, max_tokens: warmed.append(max_tokens))(model, 64)
    assert warmed == [64]


def test_a_failure_before_the_workers_start_leaves_the_stock_warmup_to_compile(stock, monkeypatch):
    _, model = stock
    monkeypatch.setenv(parallel_warmup.WORKERS_ENV, "2")

    def broken(*args):
        raise OSError("no processes here")

    monkeypatch.setattr(parallel_warmup, "compile_in_parallel", broken)
    warmed = []
    parallel_warmup._make_wrapper(lambda model, max_tokens: warmed.append(max_tokens))(model, 64)
    assert warmed == [64]


def test_tensor_parallel_ranks_split_the_shares(monkeypatch):
    """Rank 1 of 2 runs shares 1 and 3 of 4, on its own GPU."""
    import json
    import subprocess

    import torch.distributed as dist

    started = []

    class Process:
        def __init__(self, command):
            started.append((json.loads(open(command[-2]).read()), command[-1]))

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(subprocess, "Popen", Process)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    jobs = [{"weight": "a", "m": [1, 2, 3, 4]}]
    assert parallel_warmup.compile_in_parallel(jobs, 4, device=1) == [0, 0]
    assert started == [([{"weight": "a", "m": [2]}], "1"), ([{"weight": "a", "m": [4]}], "1")]


def test_workers_still_running_at_the_deadline_are_killed(monkeypatch):
    """One deadline for all the workers, not one per worker waited on in turn."""
    import subprocess
    import time

    killed = []

    class Stuck:
        def __init__(self, command):
            pass

        def wait(self, timeout=None):
            if timeout is None:
                return -9
            time.sleep(timeout)
            raise subprocess.TimeoutExpired("worker", timeout)

        def kill(self):
            killed.append(self)

    monkeypatch.setattr(subprocess, "Popen", Stuck)
    monkeypatch.setattr(parallel_warmup, "WORKER_TIMEOUT_S", 0.3)
    start = time.monotonic()
    jobs = [{"weight": "a", "m": [1, 2, 3]}]
    assert parallel_warmup.compile_in_parallel(jobs, 3) == [-9, -9, -9]
    assert len(killed) == 3 and time.monotonic() - start < 0.6
