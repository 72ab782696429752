"""What vLLM's front end pays per engine step, per request chunk and per token (CPU only).

    python benchmarks/frontend_cost.py                # writes
        benchmarks/results/frontend_cost_<commit>_cpu.json

A served engine step reaches the API-server process as one ``EngineCoreOutputs``: one
``EngineCoreOutput`` (a chunk) per running request, carrying that step's new token ids (one
without speculation, 1 + accepted drafts with it). vLLM 0.26.0's ``AsyncLLM`` output
handler then works per chunk: ``OutputProcessor.process_outputs`` updates the request's
stats, detokenizes the new ids incrementally, builds a ``RequestOutput`` (DELTA) and puts it
in the request's ``RequestOutputCollector``; each request's ``generate()`` task wakes, and
the completions endpoint turns the delta into one server-sent event. This script drives
that path with synthetic steps, no engine and no GPU, for every ``--requests`` N and
``--tokens`` t (new tokens per chunk), and fits the step time (the least of ``--repeats``
round-robin rounds' medians) as ``a + b*N + c*N*t`` (least squares in relative error): a
per step, b per request chunk, c per token.

Variants (each fitted on its own; log_stats on, as `vllm serve` runs by default):
- ``token_ids``: ``process_outputs`` with ``detokenize=False`` (the timed region is that call).
- ``text``: the same with incremental detokenization (``vllm bench serve`` streams text).
- ``served``: what the API-server process does per step, end to end in one asyncio loop:
  msgpack-decode the step's frames (as the engine client does), ``process_outputs`` in
  slices of ``VLLM_V1_OUTPUT_PROC_CHUNK_SIZE`` as ``AsyncLLM``'s output handler does, and
  one task per request that drains its queue as ``AsyncLLM.generate`` does and serialises
  each delta as the completions endpoint's ``data: {...}`` line. Not covered: the HTTP
  write per event, Prometheus recording, the ZMQ receive.

Token ids come from the embedded pair's held-out prompts and are detokenized with its
byte-level BPE tokenizer (8,192 ids), so the text path decodes real merges. Every request
stays unfinished while timed, and every step waits until each request's task has taken its
chunk (the front end keeps up), so no deltas merge in a queue. The machine is this CPU; a
GPU host's API-server core will differ.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from serve_bench import git_commit

REPO = Path(__file__).resolve().parents[1]
PAIR_TARGET = REPO / "vllm_dspark" / "data" / "tiny_pair" / "target"
HELDOUT_PROMPTS = PAIR_TARGET.parent / "heldout_prompts.json"
VARIANTS = ("token_ids", "text", "served")
MODEL_NAME = "tiny-pair"


@dataclass(frozen=True)
class Fit:
    """Step time (µs) as ``per_step + per_chunk*N + per_token*N*t``."""

    per_step_us: float
    per_chunk_us: float
    per_token_us: float
    max_relative_residual: float

    def step_us(self, num_requests: int, tokens_per_chunk: float) -> float:
        return (
            self.per_step_us
            + self.per_chunk_us * num_requests
            + self.per_token_us * num_requests * tokens_per_chunk
        )

    def us_per_token(self, tokens_per_chunk: float) -> float:
        """Front-end time per streamed token at many requests (the per-step term spread)."""
        return self.per_chunk_us / tokens_per_chunk + self.per_token_us


def fit_step_cost(points: list[dict]) -> Fit:
    """``a + b*N + c*N*t`` through each point's step time, least squares in relative error
    (each row divided by its time), so one request's 10 µs weighs as much as 256 requests'
    10 ms."""
    requests = np.array([p["requests"] for p in points], dtype=float)
    tokens = np.array([p["tokens_per_chunk"] for p in points], dtype=float)
    step_us = np.array([p["step_us"] for p in points])
    design = np.stack([np.ones_like(requests), requests, requests * tokens], axis=1)
    coef, *_ = np.linalg.lstsq(design / step_us[:, None], np.ones_like(step_us), rcond=None)
    residual = np.abs(design @ coef - step_us) / step_us
    return Fit(*(float(c) for c in coef), max_relative_residual=float(residual.max()))


def load_tokenizer(detokenize: bool):
    """The embedded pair's tokenizer (vLLM's cached wrapper), or None for token ids only."""
    if not detokenize:
        return None
    from vllm.tokenizers import get_tokenizer

    return get_tokenizer(str(PAIR_TARGET))


def token_stream() -> list[int]:
    """Every held-out prompt's ids end to end: the text the synthetic steps emit."""
    prompts = json.loads(HELDOUT_PROMPTS.read_text())
    return [token for prompt in prompts for token in prompt["prompt_token_ids"]]


def engine_request(request_id: str, prompt: list[int], detokenize: bool):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine import EngineCoreRequest

    params = SamplingParams(
        max_tokens=1 << 20,
        detokenize=detokenize,
        output_kind=RequestOutputKind.DELTA,
        ignore_eos=True,
    )
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        mm_features=None,
        sampling_params=params,
        pooling_params=None,
        arrival_time=time.time(),
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
        external_req_id=request_id,
    )


def synthetic_steps(num_requests: int, tokens_per_chunk: int, steps: int) -> list:
    """``steps`` EngineCoreOutputs, each one chunk of ``tokens_per_chunk`` ids a request
    (request i reads the token stream from its own offset)."""
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs

    stream = token_stream()
    out = []
    for step in range(steps):
        chunks = []
        for i in range(num_requests):
            start = (i * 997 + step * tokens_per_chunk) % (len(stream) - tokens_per_chunk)
            ids = stream[start : start + tokens_per_chunk]
            chunks.append(EngineCoreOutput(request_id=f"r{i}", new_token_ids=ids))
        out.append(EngineCoreOutputs(outputs=chunks, timestamp=time.monotonic()))
    return out


class StepBarrier:
    """Set once every request's task has taken its chunk of the current step."""

    def __init__(self, num_requests: int):
        self.num_requests = num_requests
        self.taken = 0
        self.done = asyncio.Event()

    def reset(self) -> None:
        self.taken = 0
        self.done.clear()

    def chunk_taken(self) -> None:
        self.taken += 1
        if self.taken == self.num_requests:
            self.done.set()


async def request_outputs(queue):
    """One request's deltas, drained as ``AsyncLLM.generate`` drains its collector."""
    while True:
        out = queue.get_nowait() or await queue.get()
        yield out
        if out.finished:
            return


async def stream_completion(request_id: str, queue, barrier: StepBarrier) -> None:
    """The completions endpoint's per-delta work: one ``data: {...}`` event per output."""
    from vllm.entrypoints.openai.completion.protocol import (
        CompletionResponseStreamChoice,
        CompletionStreamResponse,
    )

    created = int(time.time())
    async for out in request_outputs(queue):
        for completion in out.outputs:
            event = CompletionStreamResponse(
                id=request_id,
                created=created,
                model=MODEL_NAME,
                choices=[
                    CompletionResponseStreamChoice(
                        index=completion.index,
                        text=completion.text,
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                    )
                ],
            )
            line = f"data: {event.model_dump_json(exclude_unset=True)}\n\n"
            assert line.startswith("data: {")
        barrier.chunk_taken()


async def time_steps(
    variant: str, num_requests: int, tokens_per_chunk: int, steps: int, warmup: int
) -> list[float]:
    """µs of each of ``steps`` timed steps (after ``warmup`` untimed ones) of one variant."""
    from vllm import envs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector
    from vllm.v1.metrics.stats import IterationStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    detokenize = variant != "token_ids"
    served = variant == "served"
    processor = OutputProcessor(load_tokenizer(detokenize), log_stats=True)
    prompts = json.loads(HELDOUT_PROMPTS.read_text())
    queues = {}
    for i in range(num_requests):
        request_id = f"r{i}"
        queues[request_id] = RequestOutputCollector(RequestOutputKind.DELTA, request_id)
        request = engine_request(
            request_id, prompts[i % len(prompts)]["prompt_token_ids"], detokenize
        )
        processor.add_request(request, prompt=None, queue=queues[request_id])

    step_outputs = synthetic_steps(num_requests, tokens_per_chunk, warmup + steps)
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    frames = [encoder.encode(outputs) for outputs in step_outputs] if served else []
    barrier = StepBarrier(num_requests)
    tasks = (
        [asyncio.create_task(stream_completion(r, q, barrier)) for r, q in queues.items()]
        if served
        else []
    )
    slice_size = envs.VLLM_V1_OUTPUT_PROC_CHUNK_SIZE
    times = []
    for step, outputs in enumerate(step_outputs):
        barrier.reset()
        start = time.perf_counter()
        if served:
            outputs = decoder.decode(frames[step])
            chunks = outputs.outputs
            for first in range(0, len(chunks), slice_size):
                processor.process_outputs(
                    chunks[first : first + slice_size], outputs.timestamp, IterationStats()
                )
                if first + slice_size < len(chunks):
                    await asyncio.sleep(0)
            await barrier.done.wait()
        else:
            processor.process_outputs(outputs.outputs, outputs.timestamp, IterationStats())
        elapsed = time.perf_counter() - start
        if not served:
            for queue in queues.values():
                assert queue.get_nowait() is not None
        if step >= warmup:
            times.append(elapsed * 1e6)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return times


def measure(
    variants: list[str],
    requests: list[int],
    tokens: list[int],
    steps: int,
    warmup: int,
    repeats: int = 1,
) -> dict:
    """Every (variant, N, t) point's step time and each variant's fit. The points run
    round-robin ``repeats`` times, so background load spreads over all of them; a point's
    step time is its least round median (other processes only ever add time)."""
    grid = [(v, n, t) for v in variants for n in requests for t in tokens]
    rounds: dict[tuple, list[list[float]]] = {key: [] for key in grid}
    for repeat in range(repeats):
        for key in grid:
            rounds[key].append(asyncio.run(time_steps(*key, steps=steps, warmup=warmup)))
            print(
                f"round {repeat} {key[0]:9s} N={key[1]:4d} t={key[2]}: "
                f"{np.median(rounds[key][-1]):9.1f} us"
            )
    results = {}
    for variant in variants:
        points = []
        for (v, num_requests, tokens_per_chunk), times in rounds.items():
            if v != variant:
                continue
            round_medians = [float(np.median(r)) for r in times]
            step_us = min(round_medians)
            points.append(
                {
                    "requests": num_requests,
                    "tokens_per_chunk": tokens_per_chunk,
                    "step_us": step_us,
                    "round_medians_us": round_medians,
                    "us_per_token": step_us / (num_requests * tokens_per_chunk),
                }
            )
        fit = fit_step_cost(points)
        results[variant] = {
            "fit": {
                "per_step_us": fit.per_step_us,
                "per_chunk_us": fit.per_chunk_us,
                "per_token_us": fit.per_token_us,
                "max_relative_residual": fit.max_relative_residual,
                "us_per_token_t1": fit.us_per_token(1),
                "us_per_token_t3": fit.us_per_token(3),
                "ms_per_step_256_t1": fit.step_us(256, 1) / 1e3,
                "ms_per_step_256_t3": fit.step_us(256, 3) / 1e3,
            },
            "points": points,
        }
    return results


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def provenance(argv: list[str]) -> dict:
    import tokenizers
    import vllm

    return {
        "command": "python benchmarks/frontend_cost.py " + " ".join(argv),
        "commit": git_commit()[:7],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": (
            f"CPU ({cpu_model()}, {os.cpu_count()} cores) of the development machine, "
            "not the GPU host: no GPU involved"
        ),
        "software": {
            "python": platform.python_version(),
            "vllm": vllm.__version__,
            "tokenizers": tokenizers.__version__,
        },
        "setup": (
            "OutputProcessor.process_outputs on synthetic EngineCoreOutputs, DELTA output, "
            "log_stats on, logprobs off, embedded pair's byte-level BPE tokenizer; "
            "fit: step us (least round median) = per_step + per_chunk*N + per_token*N*t"
        ),
    }


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--requests", default="1,16,64,256", help="N, comma-separated")
    parser.add_argument("--tokens", default="1,2,4,8", help="t (tokens per chunk)")
    parser.add_argument("--steps", type=int, default=100, help="timed steps per point and round")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5, help="round-robin rounds")
    parser.add_argument("--out", type=Path, help="default: results/frontend_cost_<commit>_cpu")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {VARIANTS}")
    record = provenance(argv)
    record["load_average_before"] = os.getloadavg()
    record["variants"] = measure(
        variants,
        [int(n) for n in args.requests.split(",")],
        [int(t) for t in args.tokens.split(",")],
        args.steps,
        args.warmup,
        args.repeats,
    )
    record["load_average_after"] = os.getloadavg()
    out = args.out or REPO / "benchmarks" / "results" / f"frontend_cost_{record['commit']}_cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    for variant, result in record["variants"].items():
        fit = result["fit"]
        print(
            f"{variant}: {fit['per_step_us']:.1f} + {fit['per_chunk_us']:.2f}*N "
            f"+ {fit['per_token_us']:.2f}*N*t us (max residual {fit['max_relative_residual']:.0%})"
        )
    print(f"wrote {out}")
    return record


if __name__ == "__main__":
    main()
