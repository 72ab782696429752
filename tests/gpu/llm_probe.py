"""Run in a subprocess on a GPU: greedy generation with vLLM's LLM() and a DSpark draft.

Prints one JSON line: the token ids per prompt, the spec-decode counters, and whether
vllm-dspark's patches were applied in this process.
"""

import json
import sys
import time


def main(target: str, draft: str, num_prompts: int, max_tokens: int) -> None:
    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import EngineArgs

    from vllm_dspark.patches.wrapping import ORIGINAL_ATTR

    start = time.perf_counter()
    llm = LLM(
        model=target,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=1024,
        max_num_seqs=16,
        gpu_memory_utilization=0.3,
        seed=0,
        disable_log_stats=False,
        speculative_config={"method": "dspark", "model": draft, "num_speculative_tokens": 7},
    )
    load_s = time.perf_counter() - start
    prompts = [
        {"prompt_token_ids": [3 + (17 * i + 5 * j) % 4000 for j in range(32)]}
        for i in range(num_prompts)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    counters = {
        metric.name: metric.value
        for metric in llm.get_metrics()
        if metric.name.startswith("vllm:spec_decode") and hasattr(metric, "value")
    }
    print(
        json.dumps(
            {
                "token_ids": [list(out.outputs[0].token_ids) for out in outputs],
                "spec_decode": counters,
                "patched": hasattr(EngineArgs.create_speculative_config, ORIGINAL_ATTR),
                "load_s": round(load_s, 1),
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
