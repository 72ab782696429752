"""Run in a subprocess on a GPU: greedy generation with vLLM's LLM().

Reads one JSON object on standard input: {"target", "draft" (or null for no speculation),
"draft_in_target" (with a null "draft": speculate with the drafter the target's checkpoint
holds, DeepSeek-V4's DSpark module: no "model" in the speculative config), "dummy" (dummy
weights), "options" (extra speculative-config keys), "prompts" (token-id
lists), "max_tokens" (one for all prompts, or a list with one per prompt), optional
"gpu_memory_utilization", "dtype", "enable_prefix_caching", "switch" (a list of [name,
capacity options] measured one after another in this engine,
:mod:`vllm_dspark.bench.engine_control`), "poison_freed_memory" (after the warm-up, fill the GPU
memory the engine does not hold with NaN, then hand it back to the allocator),
"check_draft_slots" (after the warm-up, check every step's per-request-slot draft buffers:
:func:`install_draft_slot_check`), "tensor_parallel_size", "max_num_seqs", "cudagraph_mode"
and "compile" (:func:`compilation_config`), "sync_segments" (the engine core in this
process, each segment of a PIECEWISE breakable graph synchronised:
:func:`install_segment_sync`), "eager_draft" (the engine core in this process, the
drafter without CUDA graphs: :func:`install_eager_draft`), "breakable_env" (vLLM's
breakable CUDA graphs switched on before vLLM is imported: :func:`main`), "margins" (also
return, per prompt and output position, the top-two logprob gap: :func:`top_two_gap`),
"engine" (further LLM() arguments, e.g. kv_cache_dtype and block_size), "accept_by_target" (with
dspark_synthetic_confidence: drafts accepted as the target chooses, the synthetic
confidences steering capacity control alone: offline_sweep.accept_by_target)}. Prints
one JSON line: the token ids per prompt, the spec-decode counts, the plugin's admission
counts (compacted steps), the run's tokens per second, whether vllm-dspark's patches were
applied, with "check_draft_slots" the check's counts ("draft_slots"), and with
"sync_segments" the segment counts of the breakable graphs replayed ("breakable_segments")."""

import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


def compilation_config(spec: dict) -> dict | None:
    """vLLM's compilation option for the probe: ``cudagraph_mode`` when given; with
    ``"compile": false`` no torch.compile (mode 0), FULL decode graphs captured from the
    eager model (``FULL_DECODE_ONLY`` unless ``cudagraph_mode`` says otherwise)."""
    config = {}
    if spec.get("compile") is False:
        config = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    if spec.get("cudagraph_mode"):
        config["cudagraph_mode"] = spec["cudagraph_mode"]
    return config or None


def speculative_config(spec: dict) -> dict | None:
    """DSpark with 7 drafts and the spec's options (which may name another method) from
    the "draft" folder, or with "draft_in_target" from the target's checkpoint (no
    "model": vLLM takes the target's path, as for DeepSeek-V4); None without either."""
    if not (spec["draft"] or spec.get("draft_in_target")):
        return None
    speculative = {"method": "dspark", "num_speculative_tokens": 7}
    if spec["draft"]:
        speculative["model"] = spec["draft"]
    return speculative | spec.get("options", {})


def top_two_gap(position: dict) -> float:
    """One output position's logprobs (vLLM's {token: Logprob}, two or more ranks): the
    most likely token's logprob minus the second's, how near a tie the greedy choice was."""
    by_rank = {logprob.rank: logprob.logprob for logprob in position.values()}
    return round(by_rank[1] - by_rank[2], 7)


def segment_name(segment) -> str:
    """One replayed segment of a breakable CUDA graph: a captured graph, or the eager
    break (an op and the layer whose module it was called on)."""
    if getattr(segment, "__self__", None) is not None:
        return "a captured graph"
    contents = [cell.cell_contents for cell in segment.__closure__]
    closure = dict(zip(segment.__code__.co_freevars, contents, strict=True))
    owner = (closure.get("weak_args") or (None,))[0]  # the module the op was called on
    op = f"{type(owner).__name__}.{getattr(closure.get('fn'), '__name__', 'op')}"
    return f"the eager {op} of {getattr(owner, 'prefix', 'an unnamed module')}"


# How many segments the breakable graphs replayed had (one: no eager break, attention
# captured inside the graph).
REPLAYED_SEGMENTS: set[int] = set()


def install_segment_sync() -> None:
    """Wait for every segment of a breakable CUDA graph's replay (vLLM runs DeepSeek-V4's
    PIECEWISE steps so: captured graphs, its attention eager between them), so that a
    fault names the segment it happened in rather than the next launch."""
    import torch
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture

    def replay(self) -> None:
        REPLAYED_SEGMENTS.add(len(self.segments))
        for index, segment in enumerate(self.segments):
            segment()
            try:
                torch.cuda.synchronize()
            except Exception as error:
                where = f"segment {index} of {len(self.segments)}, {segment_name(segment)}"
                raise RuntimeError(f"breakable CUDA graph replay faulted in {where}") from error

    BreakableCUDAGraphCapture.replay = replay


def install_eager_draft() -> None:
    """Draft without CUDA graphs while the target keeps its own (vLLM has no option for
    it): whether the drafter's graph capture is what breaks the target's graphs."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    init_cudagraph_manager = DFlashSpeculator.init_cudagraph_manager
    DFlashSpeculator.init_cudagraph_manager = lambda self, mode: init_cudagraph_manager(
        self, CUDAGraphMode.NONE
    )


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


def install_draft_slot_check(worker) -> None:
    """Runs in the worker: hardening case 4, stale draft-slot writes. A draft graph replayed
    for more requests than the batch holds has padded sample rows; none of them may write
    a request slot's draft state. Around every step's ``sample_tokens`` (sampling, the
    proposal, and the runner storing its drafts by slot), the slot rows not in the batch
    hold a sentinel in every per-slot buffer a proposal's results land in: the runner's
    ``req_states.draft_tokens`` ([max_num_reqs, K], stock and plugin), the speculator's
    ``draft_logits`` (probabilistic drafting only) and the plugin's ``slot_survival`` and
    ``slot_confidence_logits``. Afterwards, on the device (no added host sync), it counts
    the rows of slots not in the batch that lost the sentinel, and the batch's slot rows
    that differ from what the proposal returned (the drafts; with a confidence head also
    the survival and confidence logits); then the rows that still hold the sentinel get
    their contents back, so nothing after the step sees it. On the host it counts the
    draft graph replays (``run_fullgraph`` of the speculator's draft graph managers, every
    depth's with dynamic depth), and those padded beyond the batch, split by whether slot
    0 was in the batch."""
    import torch

    runner = worker.model_runner
    speculator = runner.speculator
    names = ["steps", "proposals", "free_slot_rows", "full_replays", "padded_replays"]
    names += ["padded_rows", "padded_replays_slot0_free", "padded_replays_slot0_busy"]
    check = {"counts": dict.fromkeys(names, 0), "stale": {}, "mismatched": {}}
    check["drafts"] = check["replayed"] = None
    runner.dspark_draft_slot_check = check

    def slot_buffer(name):
        """A buffer by request slot: the controller holds the survivals."""
        owner = getattr(speculator, "controller", None) if name == "slot_survival" else speculator
        return getattr(owner, name, None)

    def slot_buffers() -> dict:
        buffers = {"draft_tokens": runner.req_states.draft_tokens}
        for name in ("draft_logits", "slot_survival", "slot_confidence_logits"):
            if slot_buffer(name) is not None:
                buffers[name] = slot_buffer(name)
        return buffers

    def sentinel(buffer):
        return torch.finfo(buffer.dtype).min if buffer.is_floating_point() else -7

    def by_row(mask, buffer):
        return mask.view(-1, *[1] * (buffer.dim() - 1))

    def count(kind: str, name: str, rows) -> None:
        counters = check[kind]
        if name not in counters:
            counters[name] = torch.zeros((), dtype=torch.int64, device=rows.device)
        counters[name].add_(rows.sum())

    def differing_rows(a, b):
        return (a != b).flatten(1).any(1)

    propose = speculator.propose

    def propose_and_keep(*args, **kwargs):
        drafts = propose(*args, **kwargs)
        if not kwargs.get("dummy_run", False):
            check["drafts"] = drafts.clone()
        return drafts

    speculator.propose = propose_and_keep  # instance attributes shadow the class's methods
    managers = [speculator.query_cudagraph_manager]
    managers += getattr(speculator, "_depth_graphs", {}).values()
    for manager in {id(m): m for m in managers if m is not None}.values():

        def replay(desc, run=manager.run_fullgraph):
            check["replayed"] = desc
            return run(desc)

        manager.run_fullgraph = replay

    sample_tokens = runner.sample_tokens

    @torch.inference_mode()  # as vLLM's own: its buffers may be inference tensors
    def sample_tokens_checked(*args, **kwargs):
        state = runner.execute_model_state
        if state is None:
            return sample_tokens(*args, **kwargs)
        batch = state.input_batch
        num_reqs = batch.num_reqs
        slots = batch.idx_mapping[:num_reqs].long()
        buffers = slot_buffers()
        num_slots = runner.req_states.draft_tokens.shape[0]
        free = torch.ones(num_slots, dtype=torch.bool, device=slots.device)
        free[slots] = False
        saved = {name: buffer.clone() for name, buffer in buffers.items()}
        for buffer in buffers.values():
            buffer.masked_fill_(by_row(free, buffer), sentinel(buffer))
        check["drafts"] = check["replayed"] = None
        output = sample_tokens(*args, **kwargs)
        for name, buffer in buffers.items():
            held = buffer == sentinel(buffer)
            count("stale", name, free & ~held.flatten(1).all(1))
            buffer.copy_(torch.where(by_row(free, buffer) & held, saved[name], buffer))
        drafts = check["drafts"]
        if drafts is not None:
            stored = runner.req_states.draft_tokens[slots]
            count("mismatched", "draft_tokens", differing_rows(stored, drafts))
            if getattr(speculator, "has_confidence", False):
                for name, source in (
                    ("slot_survival", speculator.survival),
                    ("slot_confidence_logits", speculator.confidence_logits),
                ):
                    stored = slot_buffer(name)[slots]
                    count("mismatched", name, differing_rows(stored, source[:num_reqs]))
        counts, desc = check["counts"], check["replayed"]
        counts["steps"] += 1
        counts["proposals"] += drafts is not None
        counts["free_slot_rows"] += num_slots - num_reqs
        if desc is not None:
            counts["full_replays"] += 1
            padded_to = desc.num_reqs or num_reqs
            if padded_to > num_reqs:
                counts["padded_replays"] += 1
                counts["padded_rows"] += padded_to - num_reqs
                slot0 = "busy" if 0 in batch.idx_mapping_np[:num_reqs] else "free"
                counts[f"padded_replays_slot0_{slot0}"] += 1
        return output

    runner.sample_tokens = sample_tokens_checked


def worker_pid(worker) -> int:
    """The process the worker runs in (the engine core's at TP 1), where the model runs."""
    return os.getpid()


def read_draft_slot_check(worker) -> dict:
    """Runs in the worker: :func:`install_draft_slot_check`'s counts so far."""
    check = worker.model_runner.dspark_draft_slot_check
    return {
        **check["counts"],
        "stale_rows": {name: int(rows) for name, rows in check["stale"].items()},
        "mismatched_rows": {name: int(rows) for name, rows in check["mismatched"].items()},
    }


def main(spec: dict) -> None:
    if spec.get("breakable_env"):
        # vLLM 0.26.0 sets this for DeepSeek-V4 only once its config is built, after
        # building the model config imported the model's modules, whose attention then
        # stays inside captured graphs where the engine core is forked from this process.
        os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "1"
    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import EngineArgs

    from vllm_dspark.bench import DUMMY_WEIGHTS_EXTENSION
    from vllm_dspark.metrics import (
        AdmissionCounts,
        SpecDecodeCounts,
        admission_counts,
        admission_counts_per_rank,
        gate_inputs,
    )
    from vllm_dspark.patches.wrapping import ORIGINAL_ATTR

    speculative = speculative_config(spec)
    if spec.get("accept_by_target"):
        # Before the engine starts: its processes import the helper from this path.
        sys.path.insert(0, str(BENCHMARKS))
        from offline_sweep import accept_by_target
    if spec.get("sync_segments") or spec.get("eager_draft"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the patches reach the engine
    if spec.get("sync_segments"):
        install_segment_sync()
    if spec.get("eager_draft"):
        install_eager_draft()
    if speculative or spec.get("poison_freed_memory"):
        # admission_counts(), the poisoning and the draft-slot check call into the worker.
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    start = time.perf_counter()
    engine = dict(
        model=spec["target"],
        load_format="dummy" if spec.get("dummy") else "auto",
        worker_extension_cls=DUMMY_WEIGHTS_EXTENSION if spec.get("dummy") else "",
        skip_tokenizer_init=spec.get("dummy", False),
        dtype=spec.get("dtype", "bfloat16"),
        max_model_len=1024,
        max_num_seqs=spec.get("max_num_seqs", 64),
        max_num_batched_tokens=spec.get("max_num_batched_tokens"),
        tensor_parallel_size=spec.get("tensor_parallel_size", 1),
        gpu_memory_utilization=spec.get("gpu_memory_utilization", 0.3),
        kv_cache_memory_bytes=fixed_kv_cache_bytes(),
        enable_prefix_caching=spec.get("enable_prefix_caching"),
        compilation_config=compilation_config(spec),
        seed=0,
        disable_log_stats=False,
        speculative_config=speculative,
    )
    llm = LLM(**(engine | spec.get("engine", {})))
    load_s = time.perf_counter() - start
    if spec.get("accept_by_target"):
        accept_by_target(llm, True)
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]
    max_tokens = spec["max_tokens"]
    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(prompts)
    top = 2 if spec.get("margins") else None
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=top)
        for n in max_tokens
    ]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
    poisoned = 0
    if spec.get("poison_freed_memory"):
        poisoned = llm.collective_rpc(poison_freed_memory)[0]
    if spec.get("check_draft_slots"):
        llm.collective_rpc(install_draft_slot_check)

    def admission() -> AdmissionCounts:
        return admission_counts(llm) if speculative else AdmissionCounts()

    def cache_hits() -> int:
        """Prompt tokens served from the prefix cache so far."""
        return sum(m.value for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits")

    def measure() -> dict:
        before, admitted_before = SpecDecodeCounts.from_metrics(llm.get_metrics()), admission()
        hits_before = cache_hits()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        counts = SpecDecodeCounts.from_metrics(llm.get_metrics()) - before
        admitted = admission() - admitted_before
        token_ids = [list(out.outputs[0].token_ids) for out in outputs]
        margins = (
            [[top_two_gap(p) for p in out.outputs[0].logprobs] for out in outputs] if top else None
        )
        return {
            "token_ids": token_ids,
            "margins": margins,
            "spec_decode": asdict(counts),
            "admission": asdict(admitted),
            "acceptance_length": counts.acceptance_length if counts.drafts else None,
            "prefix_cache_hit_tokens": cache_hits() - hits_before,
            "tok_s": sum(map(len, token_ids)) / seconds,
        }

    result = {
        "patched": hasattr(EngineArgs.create_speculative_config, ORIGINAL_ATTR),
        "accepted_by_target": bool(spec.get("accept_by_target")),
        "load_s": round(load_s, 1),
        "poisoned_bytes": poisoned,
    }
    if "switch" in spec:
        # Several capacity arms of one engine: {"arms": {name: measurement}}.
        from vllm_dspark.bench.engine_control import switch_capacity

        result["arms"] = {}
        for name, updates in spec["switch"]:
            switch_capacity(llm, **updates)
            llm.generate(prompts[:4], params[:4], use_tqdm=False)
            result["arms"][name] = measure() | {"gate": gate_inputs(llm)}
    else:
        result |= measure()
    if speculative:
        result["admission_per_rank"] = [asdict(c) for c in admission_counts_per_rank(llm)]
        result["worker_pids"] = llm.collective_rpc(worker_pid)
        result["probe_pid"] = os.getpid()
    if spec.get("check_draft_slots"):
        result["draft_slots"] = llm.collective_rpc(read_draft_slot_check)[0]
    if spec.get("sync_segments"):
        result["breakable_segments"] = sorted(REPLAYED_SEGMENTS)
    print("PROBE " + json.dumps(result), flush=True)  # before any hang at exit


if __name__ == "__main__":
    main(json.load(sys.stdin))
