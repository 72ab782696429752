"""The `vllm-dspark` command: `doctor` (can this machine run DSpark?) and `demo` (the embedded
model pair without and with DSpark: served by vLLM on a CUDA GPU, through the PyTorch
reference on a machine without one)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path

# Per path: held-out prompts, output tokens per request, loads (concurrent requests).
GPU_DEFAULTS = {"prompts": 64, "max_tokens": 128, "concurrency": [1, 64]}
CPU_DEFAULTS = {"prompts": 8, "max_tokens": 48, "concurrency": [1, 16, 64]}
# Output tokens: the pair's context is 2,048 tokens, its prompts 64.
MAX_OUTPUT_TOKENS = 1024
# The engine's max_num_seqs; a demo load above it would queue, not run at once.
MAX_CONCURRENCY = 256


def bounded_int(low: int, high: int, what: str = "") -> Callable[[str], int]:
    """An argparse type: an integer in [low, high] (``what`` says where high comes from)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"must be an integer from {low} to {high}{what}, got {text!r}"
            )
        return value

    return parse


def concurrency_list(text: str) -> list[int]:
    """Comma-separated loads, each 1..MAX_CONCURRENCY, e.g. 1,64."""
    parse = bounded_int(1, MAX_CONCURRENCY)
    try:
        loads = [parse(part) for part in text.split(",")]
    except argparse.ArgumentTypeError as error:
        raise argparse.ArgumentTypeError(f"each load {error} (e.g. 1,64)") from None
    return sorted(set(loads))


def output_file(text: str) -> str:
    """A file to write at the end: its folder must exist now, not after minutes of work."""
    folder = Path(text).expanduser().resolve().parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"folder {str(folder)!r} does not exist")
    return text


def plot_file(text: str) -> str:
    """An output file for a matplotlib PNG (matplotlib is in the package's dev extra)."""
    if importlib.util.find_spec("matplotlib") is None:
        raise argparse.ArgumentTypeError("needs matplotlib (pip install matplotlib)")
    return output_file(text)


def build_parser() -> argparse.ArgumentParser:
    from vllm_dspark.demo import draft_block_size, num_heldout_prompts

    block_size = draft_block_size()
    parser = argparse.ArgumentParser(prog="vllm-dspark", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser(
        "doctor",
        help="report versions, options and whether DSpark can run here "
        "(exit status 1 when it cannot)",
    )
    demo = commands.add_parser(
        "demo",
        help="the embedded model pair without and with DSpark",
        description="On a CUDA GPU: the embedded pair served by vLLM with no speculation, "
        "fixed k and the recommended adaptive configuration, at a light and a heavy load. "
        "Without one: the PyTorch reference of a DSpark step on the CPU (not vLLM). vLLM's "
        "own log lines are hidden unless VLLM_LOGGING_LEVEL is set.",
    )
    demo.add_argument(
        "--device",
        choices=["auto", "gpu", "cpu"],
        default="auto",
        help="gpu: vLLM on a CUDA GPU; cpu: the PyTorch reference; auto (default): gpu if "
        "this machine has a CUDA GPU",
    )
    demo.add_argument(
        "--prompts",
        type=bounded_int(1, num_heldout_prompts(), " (the held-out prompts)"),
        help=f"held-out prompts to run (default {GPU_DEFAULTS['prompts']} on a GPU, "
        f"{CPU_DEFAULTS['prompts']} on the CPU)",
    )
    demo.add_argument(
        "--max-tokens",
        # The first token comes from the prompt's forward: speculation starts at the second.
        type=bounded_int(2, MAX_OUTPUT_TOKENS, " (speculation starts at the second token)"),
        help=f"output tokens per request (default {GPU_DEFAULTS['max_tokens']} on a GPU, "
        f"{CPU_DEFAULTS['max_tokens']} on the CPU)",
    )
    demo.add_argument(
        "--k",
        type=bounded_int(1, block_size, " (the drafter's block size)"),
        default=block_size,
        help=f"drafts per step (default {block_size})",
    )
    demo.add_argument(
        "--concurrency",
        type=concurrency_list,
        help="loads, requests submitted at once, comma-separated (default "
        + ",".join(map(str, GPU_DEFAULTS["concurrency"]))
        + " on a GPU; on the CPU the batch sizes whose capacity decisions are shown, "
        + ",".join(map(str, CPU_DEFAULTS["concurrency"]))
        + ")",
    )
    demo.add_argument(
        "--repeats",
        type=bounded_int(1, 50),
        default=3,
        help="GPU: timed repeats per arm and load, the median counts (default 3)",
    )
    demo.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="GPU: the engines' dtype (default bfloat16, the pair's own; in float32 greedy "
        "outputs must be equal token for token)",
    )
    demo.add_argument(
        "--plot",
        metavar="FILE",
        type=plot_file,
        help="write a PNG: tok/s by arm and load (GPU), the confidence head's calibration (CPU)",
    )
    demo.add_argument("--json", metavar="FILE", type=output_file, help="write the results")
    return parser


def cuda_gpu_present() -> bool:
    """Through NVML, as vLLM detects its platform: CUDA itself stays uninitialised, so the
    engines' processes can still start from this one."""
    from vllm.platforms import current_platform

    return current_platform.is_cuda()


def run_demo(args: argparse.Namespace, argv: list[str]) -> int:
    device = args.device
    # Quiet unless asked: the progress lines are the demo's; vLLM's INFO lines would bury them.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    has_gpu = cuda_gpu_present() if device != "cpu" else False
    if device == "auto":
        device = "gpu" if has_gpu else "cpu"
    if device == "gpu" and not has_gpu:
        print(
            "vllm-dspark demo --device gpu: this machine has no CUDA GPU. "
            "`vllm-dspark demo --device cpu` runs the CPU reference; "
            "`vllm-dspark doctor` shows what the machine has."
        )
        return 1
    defaults = GPU_DEFAULTS if device == "gpu" else CPU_DEFAULTS
    prompts = args.prompts or defaults["prompts"]
    max_tokens = args.max_tokens or defaults["max_tokens"]
    concurrency = args.concurrency or defaults["concurrency"]
    if device == "cpu":
        from vllm_dspark.demo.cpu import run_cpu_demo

        if device != args.device:
            print("No CUDA GPU here: running the CPU reference (`--device cpu`).")
        return run_cpu_demo(prompts, max_tokens, args.k, concurrency, args.json, args.plot)
    from vllm_dspark.demo.gpu import run_gpu_demo

    return run_gpu_demo(
        prompts,
        max_tokens,
        args.k,
        args.dtype,
        concurrency,
        args.repeats,
        plot=args.plot,
        json_out=args.json,
        command=" ".join(["vllm-dspark", *argv]),
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)  # exits 2 with a message on a bad argument
    if args.command == "doctor":
        from vllm_dspark.doctor import run_doctor

        return 0 if run_doctor() else 1
    return run_demo(args, argv)


if __name__ == "__main__":
    sys.exit(main())
