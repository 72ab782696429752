"""Run in a subprocess on a GPU: a soak of the embedded pair through LLMEngine.

Reads one JSON object on standard input: {"target", "draft" (or null), "options", "requests"
(a list of {"id", "prompt", "max_tokens", "abort_after"} where abort_after is null or a
number of output tokens after which the request is aborted), "num_gpu_blocks", "dtype", "margins"}.
Runs the engine core in this process (so its KV-cache pool can be inspected) and prints one
JSON line: the token ids of every request that finished, the ids aborted, the free KV blocks
before and after, and the preemptions vLLM counted; with "margins" true, also per finished
request and output position the gap between the two most likely tokens' logprobs (how near
a tie the greedy choice was)."""

import json
import os
import sys

from llm_probe import fixed_kv_cache_bytes, top_two_gap  # beside this script


def main(spec: dict) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    from vllm import EngineArgs, LLMEngine, SamplingParams

    speculative = None
    if spec["draft"]:
        speculative = {"method": "dspark", "model": spec["draft"], "num_speculative_tokens": 7}
        speculative.update(spec["options"])
    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=spec["target"],
            skip_tokenizer_init=True,
            dtype=spec["dtype"],
            max_model_len=1024,
            max_num_seqs=64,
            num_gpu_blocks_override=spec["num_gpu_blocks"],
            gpu_memory_utilization=0.1,
            kv_cache_memory_bytes=fixed_kv_cache_bytes(),
            enable_prefix_caching=True,
            seed=0,
            disable_log_stats=False,
            speculative_config=speculative,
        )
    )
    pool = engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    abort_after = {}
    top = 2 if spec.get("margins") else None
    for request in spec["requests"]:
        params = SamplingParams(
            temperature=0.0, max_tokens=request["max_tokens"], ignore_eos=True, logprobs=top
        )
        engine.add_request(request["id"], {"prompt_token_ids": request["prompt"]}, params)
        if request["abort_after"] is not None:
            abort_after[request["id"]] = request["abort_after"]
    finished, aborted, margins = {}, set(), {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id in aborted:
                continue
            tokens = list(output.outputs[0].token_ids)
            if output.finished:
                finished[output.request_id] = tokens
                if top:
                    margins[output.request_id] = [
                        top_two_gap(position) for position in output.outputs[0].logprobs
                    ]
            elif len(tokens) >= abort_after.get(output.request_id, 1 << 30):
                engine.abort_request([output.request_id])
                aborted.add(output.request_id)
    preemptions = sum(
        metric.value
        for metric in engine.get_metrics()
        if "preempt" in metric.name and hasattr(metric, "value")
    )
    print(
        "PROBE "
        + json.dumps(
            {
                "finished": finished,
                "aborted": sorted(aborted),
                "free_blocks_before": free_before,
                "free_blocks_after": pool.get_num_free_blocks(),
                "preemptions": preemptions,
                "margins": margins,
            }
        )
    )


if __name__ == "__main__":
    main(json.load(sys.stdin))
