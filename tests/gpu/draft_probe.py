"""Run in a subprocess on a GPU: the drafts vLLM proposes right after a prompt.

Reads one JSON object on standard input {"target", "draft", "options", "prompts", "dtype"}.
For each prompt it generates one token greedily, so the speculator's last proposal is for
the context ``prompt + [that token]``, and reads that proposal (and, with a confidence head,
its confidence logits) out of the worker. Prints one JSON line."""

import json
import os
import sys


def read_last_proposal(worker) -> dict:
    speculator = worker.model_runner.speculator
    proposal = {"drafts": speculator.draft_tokens[0].tolist()}
    if getattr(speculator, "confidence", None) is not None:
        proposal["confidence_logits"] = speculator.confidence_logits[0].tolist()
    return proposal


def main(spec: dict) -> None:
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # read_last_proposal travels
    from vllm import LLM, SamplingParams

    speculative = {"method": "dspark", "model": spec["draft"], "num_speculative_tokens": 7}
    llm = LLM(
        model=spec["target"],
        dtype=spec.get("dtype", "float32"),
        max_model_len=1024,
        max_num_seqs=8,
        gpu_memory_utilization=0.1,
        seed=0,
        speculative_config={**speculative, **spec.get("options", {})},
    )
    params = SamplingParams(temperature=0.0, max_tokens=1)
    rows = []
    for prompt in spec["prompts"]:
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        rows.append(
            {
                "first_token": out.outputs[0].token_ids[0],
                **llm.collective_rpc(read_last_proposal)[0],
            }
        )
    print("PROBE " + json.dumps(rows))


if __name__ == "__main__":
    main(json.load(sys.stdin))
