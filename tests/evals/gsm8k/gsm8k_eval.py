"""GSM8K accuracy of a `vllm serve` configuration, from a local JSONL file.

    python tests/evals/gsm8k/gsm8k_eval.py --config configs/Qwen3-8B-DSpark.yaml \
        --data /path/to/gsm8k_test.jsonl [--base-url http://127.0.0.1:8000]

Each line of the data file is {"question": ..., "answer": "... #### 42"}. The first
``num_fewshot`` lines are the few-shot examples and are not scored. Without
``--base-url`` the script starts the configured server itself and stops it after.
Exits 0 when the accuracy reaches the config's threshold.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import yaml

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


@dataclass
class EvalConfig:
    model_name: str
    accuracy_threshold: float
    num_questions: int
    num_fewshot: int
    server_args: str = ""
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> EvalConfig:
        return cls(**yaml.safe_load(path.read_text()))

    def speculative_config(self) -> dict | None:
        args = shlex.split(self.server_args)
        for flag in ("--speculative-config", "-sc"):
            if flag in args:
                return json.loads(args[args.index(flag) + 1])
        return None


def final_number(text: str) -> str | None:
    """The answer a completion commits to: after '####' if present, else its last number."""
    tail = text.split("####")[-1] if "####" in text else text
    numbers = NUMBER.findall(tail)
    return numbers[-1].replace(",", "").rstrip(".") if numbers else None


def few_shot_prefix(examples: list[dict]) -> str:
    return "".join(f"Question: {e['question']}\nAnswer: {e['answer']}\n\n" for e in examples)


def evaluate(config: EvalConfig, data: list[dict], base_url: str, concurrency: int) -> float:
    from openai import OpenAI

    client = OpenAI(base_url=base_url + "/v1", api_key="unused")
    prefix = few_shot_prefix(data[: config.num_fewshot])
    questions = data[config.num_fewshot :][: config.num_questions]

    def correct(example: dict) -> bool:
        completion = client.completions.create(
            model=config.model_name,
            prompt=prefix + f"Question: {example['question']}\nAnswer:",
            max_tokens=384,
            temperature=0.0,
            stop=["Question:", "\n\n\n"],
        )
        return final_number(completion.choices[0].text) == final_number(example["answer"])

    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(correct, questions))
    return sum(results) / len(results)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True, help="local GSM8K JSONL file")
    parser.add_argument("--base-url", help="an already running server (else start one)")
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()
    config = EvalConfig.load(args.config)
    data = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()]
    if args.base_url:
        accuracy = evaluate(config, data, args.base_url, args.concurrency)
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
        from serving import vllm_server

        with vllm_server(config.model_name, config.server_args, config.env) as base_url:
            accuracy = evaluate(config, data, base_url, args.concurrency)
    passed = accuracy >= config.accuracy_threshold
    print(
        json.dumps(
            {
                "config": args.config.name,
                "accuracy": accuracy,
                "threshold": config.accuracy_threshold,
                "passed": passed,
            }
        )
    )
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
