"""Run in a subprocess on a GPU: seeded samples of a few prompts' first tokens from one
engine, in each of the modes it is switched to.

Reads one JSON object on standard input: {"target", "draft" (null: no speculation),
"options" (start-up ``dspark_`` keys), "dtype", "prompts" (token-id lists), "copies"
(samples per prompt and setting), "max_tokens", "settings" ({name: SamplingParams keywords,
temperature at least}), "modes" ([[name, capacity updates or null, always_accept]]: each
switched to in turn, :mod:`vllm_dspark.bench.engine_control`; ``always_accept`` makes vLLM's
rejection sampler accept every verified draft, a deliberately lossy verifier), "biased_settings"
(the settings the always-accepting modes sample), "seed_base", "repeat" (requests of the
reproducibility batch)}. Every request has a seed of its own, from a range no other mode,
setting or probe shares (so the samples are independent). Prints one JSON line: per mode,
per setting, the output token ids (in request order; request i samples prompt i mod P) and
the spec-decode counts; and whether a seeded batch of ``repeat`` requests run twice gave
identical outputs."""

import json
import os
import sys
from dataclasses import asdict

# Seeds per (mode, setting): more than any sampling run here takes.
SEED_STRIDE = 1 << 20


def set_always_accept(worker, on: bool) -> None:
    """Runs in the worker: vLLM's synthetic acceptance with every rate 1 (each verified
    draft accepted whatever the target says), or back to real verification."""
    import torch

    sampler = worker.model_runner.rejection_sampler
    steps = sampler.num_speculative_steps
    rates = torch.ones(steps, dtype=torch.float32, device=worker.model_runner.device)
    sampler.synthetic_conditional_rates = rates if on else None


def main(spec: dict) -> None:
    from vllm import LLM, SamplingParams

    from vllm_dspark.bench.engine_control import switch_capacity
    from vllm_dspark.metrics import SpecDecodeCounts

    speculative = None
    if spec["draft"]:
        speculative = {"method": "dspark", "model": spec["draft"], "num_speculative_tokens": 7}
        speculative |= spec.get("options", {})
        # Switching modes and the always-accepting sampler call into the worker.
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    kv_cache = os.environ.get("DSPARK_PROBE_KV_CACHE_BYTES")
    llm = LLM(
        model=spec["target"],
        skip_tokenizer_init=True,
        dtype=spec.get("dtype", "float32"),
        max_model_len=1024,
        max_num_seqs=512,
        gpu_memory_utilization=0.1,
        kv_cache_memory_bytes=int(kv_cache) if kv_cache else None,
        seed=0,
        disable_log_stats=False,
        speculative_config=speculative,
    )
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]
    copies, max_tokens = spec["copies"], spec["max_tokens"]
    batch = [prompts[i % len(prompts)] for i in range(copies * len(prompts))]

    def sample(settings: dict, first_seed: int, count: int, tokens: int) -> list[list[int]]:
        params = [
            SamplingParams(max_tokens=tokens, ignore_eos=True, seed=first_seed + i, **settings)
            for i in range(count)
        ]
        outputs = llm.generate(batch[:count], params, use_tqdm=False)
        return [list(out.outputs[0].token_ids) for out in outputs]

    result = {"modes": {}}
    settings = spec["settings"]
    for mode_index, (name, updates, always_accept) in enumerate(spec["modes"]):
        if updates is not None:
            switch_capacity(llm, **updates)
        if speculative:
            llm.collective_rpc(set_always_accept, args=(always_accept,))
        names = spec["biased_settings"] if always_accept else list(settings)
        measured = {}
        for setting_index, setting in enumerate(settings):
            if setting not in names:
                continue
            first_seed = spec["seed_base"] + (mode_index * len(settings) + setting_index) * (
                SEED_STRIDE
            )
            before = SpecDecodeCounts.from_metrics(llm.get_metrics())
            token_ids = sample(settings[setting], first_seed, len(batch), max_tokens)
            counts = SpecDecodeCounts.from_metrics(llm.get_metrics()) - before
            measured[setting] = {"token_ids": token_ids, "spec_decode": asdict(counts)}
        # The same seeded requests twice in a row: the same outputs.
        first = next(iter(settings.values()))
        repeat_seed = spec["seed_base"] + (len(spec["modes"]) * len(settings) + mode_index) * (
            SEED_STRIDE
        )
        runs = [sample(first, repeat_seed, spec["repeat"], 16) for _ in range(2)]
        result["modes"][name] = {"settings": measured, "reproducible": runs[0] == runs[1]}
    print("PROBE " + json.dumps(result), flush=True)  # before any hang at exit


if __name__ == "__main__":
    main(json.load(sys.stdin))
