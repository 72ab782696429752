"""Serving sweep: a real `vllm serve` per arm, driven by the OpenAI client.

    python benchmarks/serve_sweep.py --arms benchmarks/arms/qwen3_8b_synthetic.json \
        --concurrency 1,16,64,256 --out benchmarks/results/serve_sweep.json

The arms file is a list of {"name", "model", "server_args", "env"} (``env`` optional);
``{target}`` and ``{draft}`` in them stand for the model pair: the embedded trained
pair (``--pair embedded``) or config-only checkpoints of a shape with dummy weights
(``--pair qwen3-8b``; the arms then pass ``--load-format dummy``).
For each arm the script starts `vllm serve` on loopback (with the plugin, which vLLM
loads itself), waits for health, and for each concurrency c keeps c streaming
completions in flight until ``--rounds * c`` requests are done, from a fixed set of
token-id prompts (``--prompt-len`` tokens, ``--output-len`` output tokens, EOS
ignored), from one client process per 32 streams (so that parsing the streams never
becomes the limit; each row gives the clients' CPU time per token). It scrapes
`/metrics` before and after each concurrency for the spec-decode counters, and writes
JSON rows {arm, concurrency, output_tok_s, tpot_p50_ms, tpot_p99_ms, ttft_p50_ms,
acceptance_length, admitted_per_req} plus a PNG of throughput against concurrency.
Every server it started is stopped, even on failure.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from serving import scrape_metrics, vllm_server
from shapes import SHAPES, write_shape

from vllm_dspark.demo import EMBEDDED_PAIR

COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted": "vllm:spec_decode_num_accepted_tokens",
}


def read_counters(text: str) -> dict[str, float]:
    """Sum of each spec-decode counter over its label sets."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = dict.fromkeys(COUNTERS, 0.0)
    names = {name: key for key, name in COUNTERS.items()}
    for family in text_string_to_metric_families(text):
        key = names.get(family.name)
        if key is None:
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                totals[key] += sample.value
    return totals


def make_prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


async def one_request(client, model: str, prompt: list[int], output_len: int) -> dict:
    start = time.perf_counter()
    first = None
    tokens = 0
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=output_len,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices and first is None:
            first = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    first = first or end
    return {"ttft": first - start, "tpot": (end - first) / max(1, tokens - 1), "tokens": tokens}


# Streams per client process. One Python process parses about 12,000 streamed chunks per
# second (85 us each, measured against a stub server): at 256 streams of one token per
# chunk a single client would time itself, not the server.
STREAMS_PER_CLIENT = 32


def client_processes(concurrency: int) -> int:
    return -(-concurrency // STREAMS_PER_CLIENT)


async def drive_streams(base_url: str, model: str, prompts, streams: int, output_len: int):
    """Keep ``streams`` completions in flight until ``prompts`` are done; the results and
    the moment the last one ended (time.monotonic)."""
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0) as client:
        queue = list(prompts)
        results = []

        async def worker():
            while queue:
                results.append(await one_request(client, model, queue.pop(), output_len))

        await asyncio.gather(*(worker() for _ in range(streams)))
    return results, time.monotonic()


def client_process(base_url, model, prompts, streams, output_len, start_at):
    """One client process: waits for the common start, then drives its share."""
    time.sleep(max(0.0, start_at - time.monotonic()))
    cpu = time.process_time()
    results, ended = asyncio.run(drive_streams(base_url, model, prompts, streams, output_len))
    return results, ended, time.process_time() - cpu


def drive(base_url: str, model: str, prompts, concurrency: int, output_len: int):
    """``concurrency`` streams over ceil(concurrency / STREAMS_PER_CLIENT) client processes
    (forked, started together), each with its share of the prompts: every result, the
    seconds from the common start to the last end, and the clients' CPU seconds."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    procs = client_processes(concurrency)
    streams = [concurrency // procs + (i < concurrency % procs) for i in range(procs)]
    shares = [prompts[i::procs] for i in range(procs)]
    start_at = time.monotonic() + 1.0  # every process forked and waiting by then
    with ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("fork")) as pool:
        futures = [
            pool.submit(client_process, base_url, model, share, n, output_len, start_at)
            for share, n in zip(shares, streams, strict=True)
        ]
        done = [future.result() for future in futures]
    results = [result for part, _, _ in done for result in part]
    return results, max(ended for _, ended, _ in done) - start_at, sum(cpu for *_, cpu in done)


def percentile(values: list[float], q: float) -> float:
    return (
        statistics.quantiles(values, n=100, method="inclusive")[q - 1]
        if len(values) > 1
        else values[0]
    )


def run_arm(arm: dict, args) -> list[dict]:
    rows = []
    log = args.out.with_name(f"{args.out.stem}-{arm['name']}.log")
    with vllm_server(arm["model"], arm["server_args"], arm.get("env"), log_path=log) as url:
        served = json.loads(_get(url + "/v1/models"))["data"][0]["id"]
        warm = make_prompts(4, args.prompt_len, args.vocab, seed=99)
        drive(url, served, warm, 4, 8)
        for concurrency in args.concurrency:
            # Warm up at this concurrency first (a new batch size can compile kernels).
            warm = make_prompts(concurrency, args.prompt_len, args.vocab, seed=98)
            drive(url, served, warm, concurrency, 16)
            prompts = make_prompts(args.rounds * concurrency, args.prompt_len, args.vocab)
            before = read_counters(scrape_metrics(url))
            results, seconds, client_cpu = drive(url, served, prompts, concurrency, args.output_len)
            after = read_counters(scrape_metrics(url))
            spec = {key: after[key] - before[key] for key in COUNTERS}
            tokens = sum(r["tokens"] for r in results)
            rows.append(
                {
                    "arm": arm["name"],
                    "concurrency": concurrency,
                    "output_tok_s": round(tokens / seconds, 1),
                    "tpot_p50_ms": round(1000 * percentile([r["tpot"] for r in results], 50), 2),
                    "tpot_p99_ms": round(1000 * percentile([r["tpot"] for r in results], 99), 2),
                    "ttft_p50_ms": round(1000 * percentile([r["ttft"] for r in results], 50), 2),
                    "acceptance_length": (
                        round(1 + spec["accepted"] / spec["drafts"], 3) if spec["drafts"] else None
                    ),
                    # Drafts the engine verified per request and step.
                    "admitted_per_req": (
                        round(spec["draft_tokens"] / spec["drafts"], 3) if spec["drafts"] else None
                    ),
                    "requests": len(results),
                    # Near processes x 1e6 / output_tok_s: the clients were busy throughout.
                    "client_cpu_us_per_token": round(1e6 * client_cpu / tokens, 1),
                    "client_processes": client_processes(concurrency),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for arm in dict.fromkeys(row["arm"] for row in rows):
        points = [(r["concurrency"], r["output_tok_s"]) for r in rows if r["arm"] == arm]
        ax.plot(*zip(*points, strict=True), marker="o", label=arm)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens / s")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", type=Path, required=True)
    parser.add_argument("--pair", default="embedded", choices=["embedded", *SHAPES])
    parser.add_argument("--concurrency", default="1,16,64,256")
    parser.add_argument("--rounds", type=int, default=2, help="requests per slot of concurrency")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=4000, help="prompt token ids drawn below it")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    pair = (
        {name: str(EMBEDDED_PAIR / name) for name in ("target", "draft")}
        if args.pair == "embedded"
        else write_shape(args.pair, Path(tempfile.mkdtemp()))
    )
    text = (
        args.arms.read_text().replace("{target}", pair["target"]).replace("{draft}", pair["draft"])
    )
    arms = json.loads(text)
    rows = []
    for arm in arms:
        rows += run_arm(arm, args)
        # After every server: a later failure keeps these.
        write_record(args.out, arms, rows)
        plot(rows, args.out.with_suffix(".png"))
    return 0


def write_record(path: Path, arms: list[dict], rows: list[dict]) -> None:
    import torch

    record = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "commit": os.environ.get("DSPARK_COMMIT", "unknown"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "arms": arms,
        "rows": rows,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    sys.exit(main())
