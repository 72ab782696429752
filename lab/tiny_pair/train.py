"""The tiny-pair pipeline: phases, time budgets, checkpoints and resume.

Phases, each writing into its own folder of the work dir and finishing with a
``done.json`` (a rerun skips finished phases and resumes a training phase from its last
checkpoint):

1. ``corpus``       tokenizer + token arrays of the interpreter's Python sources;
2. ``target``       the Qwen3 target, trained by next-token cross-entropy;
3. ``drafter_data`` target-generated continuations of held-in prompts (mostly greedy);
4. ``drafter``      the DSpark drafter, trained against the frozen target;
5. ``evaluate``     held-out greedy speculative decoding, simulated: on one half of the
                    prompts the confidence head is refitted and STS fitted, the other half
                    is reported (``eval.json``, ``dspark_calibration.json``);
6. ``export``       Hugging Face folders for stock vLLM plus the model card.

Training phases stop on a wall-clock budget; their learning rate follows the fraction of
the budget (or of ``max_steps``) used, so a short budget still ends with a full decay.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import Qwen3ForCausalLM

from vllm_dspark.tiny_pair.drafter import DrafterConfig, DSparkDrafter, SharedTargetWeights
from vllm_dspark.tiny_pair.load import load_drafter_from_export
from vllm_dspark.tiny_pair.target import (
    TargetConfig,
    build_target,
    generate_continuations,
    target_features,
)

from . import export as export_lib
from .calibration import (
    calibration_report,
    fit_sequential_temperature_scaling,
)
from .corpus import MASK_TOKEN, CorpusConfig, CorpusPaths, build_corpus
from .evaluate import (
    EvalConfig,
    acceptance_report,
    greedy_sequences,
    head_logits,
    refit_position_heads,
    sample_prompts,
    simulate_verify_steps,
    with_position_heads,
)
from .loss import DSparkLossWeights, dspark_loss
from .progress import progress_bar

# Training statistics are read back (one GPU sync) every this many steps.
LOG_EVERY = 50

PHASES = ("corpus", "target", "drafter_data", "drafter", "evaluate", "export")
# Seconds held back for the phases without a budget of their own, when a deadline is set.
UNBUDGETED_PHASE_RESERVE_S = {"corpus": 60.0, "evaluate": 60.0, "export": 15.0}


@dataclass
class OptimConfig:
    """AdamW with linear warm-up and cosine decay over the budget."""

    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0


@dataclass
class TargetTrainConfig:
    batch_size: int = 256
    seq_len: int = 512
    time_budget_s: float = 190.0
    max_steps: int = 100_000
    heldout_batches: int = 16
    optim: OptimConfig = field(default_factory=OptimConfig)


@dataclass
class DrafterDataConfig:
    prompt_len: int = 64
    seq_len: int = 512  # prompt + continuation
    generation_batch: int = 1024
    max_sequences: int = 24_576
    # Every sampled_every-th chunk is sampled at temperature 1, the others are greedy.
    sampled_every: int = 4
    time_budget_s: float = 55.0


@dataclass
class DrafterTrainConfig:
    batch_size: int = 128
    anchors_per_sequence: int = 64
    time_budget_s: float = 165.0
    max_steps: int = 100_000
    loss: DSparkLossWeights = field(default_factory=DSparkLossWeights)
    # What the confidence head learns (see loss.dspark_loss). The paper's "soft_tv" is
    # the acceptance probability of sampled verification; our benchmarks verify greedily,
    # and with soft_tv the calibrated ECE stayed at 0.08-0.14 in CPU trials.
    confidence_label: str = "greedy_match"
    # Gradient scale of the confidence loss into the drafting features (see drafter.heads):
    # at full strength it cost the small drafter 20% of its acceptance length in CPU trials.
    confidence_grad_scale: float = 0.1
    # Anchors only where the benchmark has them: in the continuation, after the prompt.
    anchors_after_prompt: bool = True
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=2e-3, warmup_steps=100))


@dataclass
class PipelineConfig:
    seed: int = 0
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    target_train: TargetTrainConfig = field(default_factory=TargetTrainConfig)
    drafter_data: DrafterDataConfig = field(default_factory=DrafterDataConfig)
    # vocab_size, target_hidden_size and mask_token_id are filled from the target/tokenizer.
    drafter: DrafterConfig = field(
        default_factory=lambda: DrafterConfig(
            vocab_size=0, target_hidden_size=0, target_layer_ids=[1, 3, 5], mask_token_id=-1
        )
    )
    drafter_train: DrafterTrainConfig = field(default_factory=DrafterTrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint_every_s: float = 60.0

    def to_dict(self) -> dict:
        return asdict(self)


def full_config(seed: int = 0) -> PipelineConfig:
    """The shipped pair: ~9 minutes on one H200."""
    return PipelineConfig(seed=seed)


def smoke_config(seed: int = 0) -> PipelineConfig:
    """Tiny everything, for an end-to-end check in a few minutes on 2 CPU cores."""
    return PipelineConfig(
        seed=seed,
        corpus=CorpusConfig(
            vocab_size=1024,
            train_bytes=2 * 1024 * 1024,
            heldout_bytes=256 * 1024,
            tokenizer_train_bytes=1024 * 1024,
        ),
        target=TargetConfig(
            vocab_size=1024,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=512,
        ),
        target_train=TargetTrainConfig(
            batch_size=16,
            seq_len=96,
            time_budget_s=40.0,
            max_steps=300,
            heldout_batches=4,
            optim=OptimConfig(lr=3e-3, warmup_steps=30),
        ),
        drafter_data=DrafterDataConfig(
            prompt_len=16,
            seq_len=96,
            generation_batch=64,
            max_sequences=256,
            time_budget_s=20.0,
        ),
        drafter=DrafterConfig(
            vocab_size=0,
            target_hidden_size=0,
            target_layer_ids=[0, 2],
            mask_token_id=-1,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=512,
            markov_rank=8,
        ),
        drafter_train=DrafterTrainConfig(
            batch_size=16,
            anchors_per_sequence=16,
            time_budget_s=40.0,
            max_steps=300,
            optim=OptimConfig(lr=3e-3, warmup_steps=30),
        ),
        eval=EvalConfig(
            prompt_len=16,
            new_tokens=64,
            num_calibration_prompts=64,
            num_test_prompts=64,
            generation_batch=64,
            draft_batch=16,
        ),
        checkpoint_every_s=20.0,
    )


@dataclass
class Runtime:
    """Where and how the pipeline computes."""

    device: torch.device
    # bf16 autocast on GPU; plain float32 where bf16 matmuls are slow (CPU).
    autocast_dtype: torch.dtype | None

    def autocast(self):
        return torch.autocast(
            self.device.type,
            dtype=self.autocast_dtype or torch.bfloat16,
            enabled=self.autocast_dtype is not None,
        )

    @property
    def inference_dtype(self) -> torch.dtype:
        # The target runs from its bf16 export everywhere; on CPU its values are upcast.
        return torch.bfloat16 if self.autocast_dtype is not None else torch.float32


def log(message: str) -> None:
    print(f"[tiny_pair {time.strftime('%H:%M:%S')}] {message}", flush=True)


def without_budgets(config: dict) -> dict:
    """A config minus its time settings: a rerun with other budgets may resume a work dir."""
    return {
        key: without_budgets(value) if isinstance(value, dict) else value
        for key, value in config.items()
        if key not in ("time_budget_s", "checkpoint_every_s")
    }


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=2))
    tmp.replace(path)


def lr_at(optim: OptimConfig, step: int, progress: float) -> float:
    warmup = min(1.0, (step + 1) / max(1, optim.warmup_steps))
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return optim.lr * warmup * (optim.min_lr_ratio + (1.0 - optim.min_lr_ratio) * cosine)


def make_optimizer(model: torch.nn.Module, optim: OptimConfig, device: torch.device):
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": optim.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=optim.lr,
        betas=(optim.beta1, optim.beta2),
        fused=device.type == "cuda",
    )


class TimedTraining:
    """Step loop state that survives restarts: step, elapsed time, RNG, model, optimizer."""

    def __init__(
        self,
        checkpoint: Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        generator: torch.Generator,
        time_budget_s: float,
        max_steps: int,
        checkpoint_every_s: float,
        deadline: float | None = None,
    ) -> None:
        """``deadline`` (time.monotonic) shrinks the budget so the loop ends by then."""
        self.checkpoint = checkpoint
        self.model, self.optimizer, self.generator = model, optimizer, generator
        self.time_budget_s, self.max_steps = time_budget_s, max_steps
        self.checkpoint_every_s = checkpoint_every_s
        self.step, self.elapsed_before = 0, 0.0
        self.history: list[dict] = []
        if checkpoint.exists():
            state = torch.load(checkpoint, map_location="cpu", weights_only=False)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            generator.set_state(state["generator"])
            self.step, self.elapsed_before = state["step"], state["elapsed_s"]
            self.history = state["history"]
            log(
                f"resumed {checkpoint.parent.name} at step {self.step} ({self.elapsed_before:.0f}s)"
            )
        self.started = time.monotonic()
        self.last_save = self.started
        if deadline is not None and self.elapsed_before + deadline - self.started < time_budget_s:
            self.time_budget_s = max(1.0, self.elapsed_before + deadline - self.started)
            log(
                f"{checkpoint.parent.name}: budget cut to {self.time_budget_s:.0f}s by the deadline"
            )

    @property
    def elapsed(self) -> float:
        return self.elapsed_before + time.monotonic() - self.started

    @property
    def progress(self) -> float:
        return max(self.elapsed / self.time_budget_s, self.step / self.max_steps)

    def running(self) -> bool:
        return self.progress < 1.0

    def after_step(self, stats: dict[str, torch.Tensor | float], progress) -> None:
        """Count the step; every LOG_EVERY steps read the statistics (a GPU sync)."""
        self.step += 1
        progress.update()
        if self.step % LOG_EVERY == 0 or self.step == 1:
            values = {k: round(float(v), 5) for k, v in stats.items()}
            self.history.append({"step": self.step, "elapsed_s": round(self.elapsed, 1), **values})
            progress.set_postfix(loss=f"{values['loss']:.3f}")
        if time.monotonic() - self.last_save > self.checkpoint_every_s:
            self.save()

    def save(self) -> None:
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "generator": self.generator.get_state(),
            "step": self.step,
            "elapsed_s": self.elapsed,
            "history": self.history,
        }
        tmp = self.checkpoint.with_suffix(".tmp")
        torch.save(state, tmp)
        tmp.replace(self.checkpoint)
        self.last_save = time.monotonic()


def optimizer_step(model, optimizer, loss, optim: OptimConfig, lr: float) -> torch.Tensor:
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip)
    optimizer.step()
    return grad_norm


def sample_windows(
    tokens: torch.Tensor, batch: int, length: int, generator: torch.Generator
) -> torch.Tensor:
    starts = torch.randint(
        0, tokens.numel() - length, (batch,), generator=generator, device=tokens.device
    )
    return tokens[starts[:, None] + torch.arange(length, device=tokens.device)].long()


class Pipeline:
    def __init__(
        self,
        config: PipelineConfig,
        work_dir: Path,
        export_dir: Path,
        runtime: Runtime,
        deadline_s: float | None = None,
    ) -> None:
        """``deadline_s``: finish within this many seconds from now, shrinking the training
        and data budgets (later phases keep their planned share) when running late."""
        self.config, self.work_dir, self.export_dir, self.runtime = (
            config,
            work_dir,
            export_dir,
            runtime,
        )
        self.deadline = None if deadline_s is None else time.monotonic() + deadline_s
        self.corpus_paths = CorpusPaths(work_dir / "corpus")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        config_path = work_dir / "pipeline_config.json"
        if config_path.exists() and without_budgets(read_json(config_path)) != without_budgets(
            config.to_dict()
        ):
            raise ValueError(
                f"{work_dir} holds a run with another configuration; use a fresh --work-dir"
            )
        write_json(config_path, config.to_dict())

    def phase_dir(self, phase: str) -> Path:
        return self.work_dir / phase

    def is_done(self, phase: str) -> bool:
        return (self.phase_dir(phase) / "done.json").exists()

    def planned_seconds(self, phase: str) -> float:
        budgets = {
            "target": self.config.target_train.time_budget_s,
            "drafter_data": self.config.drafter_data.time_budget_s,
            "drafter": self.config.drafter_train.time_budget_s,
        }
        return budgets.get(phase, UNBUDGETED_PHASE_RESERVE_S.get(phase, 0.0))

    def phase_deadline(self, phase: str) -> float | None:
        """When ``phase`` must stop so the unfinished later phases still fit."""
        if self.deadline is None:
            return None
        later = PHASES[PHASES.index(phase) + 1 :]
        return self.deadline - sum(self.planned_seconds(p) for p in later if not self.is_done(p))

    def finish(self, phase: str, summary: dict) -> dict:
        write_json(self.phase_dir(phase) / "done.json", summary)
        return summary

    def run(self, phases: tuple[str, ...] = PHASES) -> dict:
        summaries = {}
        for phase in phases:
            done = self.phase_dir(phase) / "done.json"
            if done.exists():
                log(f"phase {phase}: already done, skipped")
                summaries[phase] = read_json(done)
                continue
            log(f"phase {phase}: start")
            started = time.monotonic()
            self.phase_dir(phase).mkdir(parents=True, exist_ok=True)
            torch.manual_seed(self.config.seed)
            summaries[phase] = getattr(self, f"run_{phase}")()
            log(f"phase {phase}: done in {time.monotonic() - started:.0f}s")
        return summaries

    def seed_from_export(self, export_dir: Path) -> None:
        """Take the target and drafter of an exported pair as the finished training phases,
        so that ``evaluate`` and ``export`` recalibrate a shipped pair without retraining.

        The corpus phase must have run here: its tokenizer must be the export's (the
        held-out split and the prompts depend on it), which holds where the export was made
        from the same interpreter's sources.
        """
        export_dir = Path(export_dir)
        ours = json.loads(self.corpus_paths.tokenizer.read_text())["model"]
        theirs = json.loads((export_dir / "target" / "tokenizer.json").read_text())["model"]
        if ours != theirs:
            raise ValueError(
                f"the corpus built here tokenizes differently from {export_dir}: the export was "
                "made from another interpreter's sources, so its held-out split cannot be rebuilt"
            )
        training = read_json(export_dir / "training.json")
        target_dir = self.phase_dir("target") / "model"
        target_dir.mkdir(parents=True, exist_ok=True)
        for name in ("config.json", "generation_config.json", "model.safetensors"):
            shutil.copyfile(export_dir / "target" / name, target_dir / name)
        drafter, _ = load_drafter_from_export(export_dir / "draft")
        self.phase_dir("drafter").mkdir(parents=True, exist_ok=True)
        torch.save(
            {"config": drafter.config.to_dict(), "model": drafter.state_dict()},
            self.phase_dir("drafter") / "drafter.pt",
        )
        seeded = {"seeded_from": str(export_dir)}
        for phase in ("target", "drafter_data", "drafter"):
            self.phase_dir(phase).mkdir(parents=True, exist_ok=True)
            self.finish(phase, training[phase] | seeded)

    # -- shared pieces -------------------------------------------------------------------

    def special_ids(self) -> dict[str, int]:
        return read_json(self.corpus_paths.manifest)["special_token_ids"]

    def load_tokens(self, path: Path) -> np.ndarray:
        return np.load(path).astype(np.int64)

    def load_target(self) -> Qwen3ForCausalLM:
        """The trained target as exported (bf16 weights), frozen, in the inference dtype."""
        target = Qwen3ForCausalLM.from_pretrained(
            self.phase_dir("target") / "model", dtype=torch.bfloat16
        )
        target = target.to(self.runtime.device, self.runtime.inference_dtype).eval()
        return target.requires_grad_(False)

    def drafter_config(self) -> DrafterConfig:
        target_cfg = self.config.target
        layer_ids = self.config.drafter.target_layer_ids
        assert layer_ids == sorted(set(layer_ids)) and layer_ids[-1] < target_cfg.num_hidden_layers
        return dataclasses.replace(
            self.config.drafter,
            vocab_size=target_cfg.vocab_size,
            target_hidden_size=target_cfg.hidden_size,
            mask_token_id=self.special_ids()[MASK_TOKEN],
            max_position_embeddings=target_cfg.max_position_embeddings,
            rope_theta=target_cfg.rope_theta,
        )

    def generator(self, offset: int) -> torch.Generator:
        generator = torch.Generator(device=self.runtime.device)
        generator.manual_seed(self.config.seed * 1000 + offset)
        return generator

    # -- phases --------------------------------------------------------------------------

    def run_corpus(self) -> dict:
        manifest = build_corpus(self.config.corpus, self.corpus_paths.root)
        log(
            f"corpus: {manifest['train_files']} train / {manifest['heldout_files']} held-out "
            f"files, {manifest['train_tokens']:,} / {manifest['heldout_tokens']:,} tokens, "
            f"seconds {manifest['seconds']}"
        )
        assert manifest["vocab_size"] == self.config.target.vocab_size, manifest["vocab_size"]
        return self.finish("corpus", manifest)

    def run_target(self) -> dict:
        cfg, rt = self.config.target_train, self.runtime
        phase_dir = self.phase_dir("target")
        target = build_target(self.config.target).to(rt.device).train()
        optimizer = make_optimizer(target, cfg.optim, rt.device)
        generator = self.generator(1)
        loop = TimedTraining(
            phase_dir / "checkpoint.pt",
            target,
            optimizer,
            generator,
            cfg.time_budget_s,
            cfg.max_steps,
            self.config.checkpoint_every_s,
            self.phase_deadline("target"),
        )
        train_tokens = torch.as_tensor(
            self.load_tokens(self.corpus_paths.train_tokens), dtype=torch.int32, device=rt.device
        )
        progress = progress_bar(desc="target", unit="step", initial=loop.step)
        while loop.running():
            batch = sample_windows(train_tokens, cfg.batch_size, cfg.seq_len + 1, generator)
            with rt.autocast():
                logits = target(input_ids=batch[:, :-1], use_cache=False).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
            lr = lr_at(cfg.optim, loop.step, loop.progress)
            grad_norm = optimizer_step(target, optimizer, loss, cfg.optim, lr)
            loop.after_step({"loss": loss.detach(), "lr": lr, "grad_norm": grad_norm}, progress)
        progress.close()
        loop.save()

        target.eval()
        heldout = torch.as_tensor(
            self.load_tokens(self.corpus_paths.heldout_tokens), dtype=torch.int32, device=rt.device
        )
        heldout_generator = self.generator(2)
        losses = []
        with torch.no_grad():
            for _ in range(cfg.heldout_batches):
                batch = sample_windows(heldout, cfg.batch_size, cfg.seq_len + 1, heldout_generator)
                with rt.autocast():
                    logits = target(input_ids=batch[:, :-1], use_cache=False).logits
                losses.append(
                    F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten()).item()
                )
        # Every later phase uses the bf16 weights that ship.
        target.to(torch.bfloat16).save_pretrained(phase_dir / "model")
        summary = {
            "steps": loop.step,
            "seconds": round(loop.elapsed, 1),
            "tokens_seen": loop.step * cfg.batch_size * cfg.seq_len,
            "final_train_loss": loop.history[-1]["loss"] if loop.history else None,
            "heldout_loss": float(np.mean(losses)),
            "heldout_perplexity": float(np.exp(np.mean(losses))),
            "parameters": sum(p.numel() for p in target.parameters()),
            "history": loop.history,
        }
        log(
            f"target: {summary['steps']} steps, held-out loss {summary['heldout_loss']:.3f} "
            f"(ppl {summary['heldout_perplexity']:.1f})"
        )
        return self.finish("target", summary)

    def run_drafter_data(self) -> dict:
        cfg, rt = self.config.drafter_data, self.runtime
        phase_dir = self.phase_dir("drafter_data")
        target = self.load_target()
        train_tokens = np.load(self.corpus_paths.train_tokens)
        new_tokens = cfg.seq_len - cfg.prompt_len
        chunk_paths = sorted(phase_dir.glob("chunk_*.npy"))
        num_sequences = sum(np.load(p, mmap_mode="r").shape[0] for p in chunk_paths)
        started = time.monotonic()
        stop_at = started + cfg.time_budget_s
        if (deadline := self.phase_deadline("drafter_data")) is not None:
            stop_at = min(stop_at, deadline)
        progress = progress_bar(desc="drafter data", unit="seq", initial=num_sequences)
        chunk_index = len(chunk_paths)
        # Always at least one chunk, then until the budget or the sequence cap.
        while num_sequences < cfg.max_sequences and (
            chunk_index == 0 or time.monotonic() < stop_at
        ):
            rng = np.random.default_rng([self.config.seed, chunk_index])
            count = min(cfg.generation_batch, cfg.max_sequences - num_sequences)
            prompts = torch.as_tensor(
                sample_prompts(train_tokens, count, cfg.prompt_len, rng), device=rt.device
            )
            greedy = (chunk_index + 1) % cfg.sampled_every != 0
            torch.manual_seed(self.config.seed * 1000 + chunk_index)
            sequences = generate_continuations(target, prompts, new_tokens, greedy=greedy)
            np.save(
                phase_dir / f"chunk_{chunk_index:04d}_{'greedy' if greedy else 'sampled'}.npy",
                sequences.cpu().numpy().astype(np.uint16),
            )
            num_sequences += count
            chunk_index += 1
            progress.update(count)
        progress.close()
        chunk_paths = sorted(phase_dir.glob("chunk_*.npy"))
        summary = {
            "sequences": num_sequences,
            "greedy_sequences": sum(
                np.load(p, mmap_mode="r").shape[0] for p in chunk_paths if "greedy" in p.name
            ),
            "seq_len": cfg.seq_len,
            "prompt_len": cfg.prompt_len,
            "seconds_this_run": round(time.monotonic() - started, 1),
        }
        log(f"drafter data: {summary}")
        return self.finish("drafter_data", summary)

    def run_drafter(self) -> dict:
        cfg, rt = self.config.drafter_train, self.runtime
        phase_dir = self.phase_dir("drafter")
        target = self.load_target()
        shared = SharedTargetWeights(target.model.embed_tokens.weight, target.lm_head.weight)
        drafter_cfg = self.drafter_config()
        drafter = DSparkDrafter(drafter_cfg).to(rt.device).train()
        optimizer = make_optimizer(drafter, cfg.optim, rt.device)
        generator = self.generator(3)
        loop = TimedTraining(
            phase_dir / "checkpoint.pt",
            drafter,
            optimizer,
            generator,
            cfg.time_budget_s,
            cfg.max_steps,
            self.config.checkpoint_every_s,
            self.phase_deadline("drafter"),
        )
        chunks = sorted(self.phase_dir("drafter_data").glob("chunk_*.npy"))
        data = torch.as_tensor(
            np.concatenate([np.load(p) for p in chunks]).astype(np.int32), device=rt.device
        )
        seq_len, block = data.shape[1], drafter_cfg.block_size
        first_anchor = self.config.drafter_data.prompt_len if cfg.anchors_after_prompt else 1
        offsets = torch.arange(block, device=rt.device)
        progress = progress_bar(desc="drafter", unit="step", initial=loop.step)
        while loop.running():
            rows = torch.randint(
                0, len(data), (cfg.batch_size,), generator=generator, device=rt.device
            )
            seqs = data[rows].long()
            # Anchor p needs the target's distributions at p..p+K-1: p <= seq_len-K.
            scores = torch.rand(
                cfg.batch_size,
                seq_len - block - first_anchor + 1,
                generator=generator,
                device=rt.device,
            )
            anchors = scores.argsort(dim=1)[:, : cfg.anchors_per_sequence] + first_anchor
            positions = anchors[:, :, None] + offsets  # output j predicts position+1
            batch_index = torch.arange(cfg.batch_size, device=rt.device)[:, None, None]
            with torch.no_grad(), rt.autocast():
                features = target_features(target, seqs, drafter_cfg.target_layer_ids)
                target_logits = F.linear(
                    features.final_hidden[batch_index, positions], shared.lm_head
                )
                target_probs = torch.softmax(target_logits.float(), dim=-1)
            previous_tokens = seqs[batch_index, positions]  # anchor, then the true tokens
            with rt.autocast():
                block_out = drafter.backbone(
                    features.aux_hidden, anchors, previous_tokens[:, :, 0], shared
                )
                logits, confidence_logits = drafter.heads(
                    block_out.hidden,
                    block_out.base_logits,
                    previous_tokens,
                    cfg.confidence_grad_scale,
                )
            loss, stats = dspark_loss(
                logits,
                confidence_logits,
                target_probs,
                cfg.loss,
                drafter_cfg.loss_decay_gamma,
                cfg.confidence_label,
            )
            lr = lr_at(cfg.optim, loop.step, loop.progress)
            stats["grad_norm"] = optimizer_step(drafter, optimizer, loss, cfg.optim, lr)
            stats["lr"] = lr
            loop.after_step(stats, progress)
        progress.close()
        loop.save()
        torch.save(
            {"config": drafter_cfg.to_dict(), "model": drafter.state_dict()},
            phase_dir / "drafter.pt",
        )
        summary = {
            "steps": loop.step,
            "seconds": round(loop.elapsed, 1),
            "parameters": sum(p.numel() for p in drafter.parameters()),
            "final": loop.history[-1] if loop.history else None,
            "history": loop.history,
        }
        log(f"drafter: {summary['steps']} steps, last {summary['final']}")
        return self.finish("drafter", summary)

    @property
    def refitted_head_path(self) -> Path:
        return self.phase_dir("evaluate") / "confidence_head.pt"

    def load_drafter(self, with_refitted_head: bool = False) -> DSparkDrafter:
        """The trained drafter with its weights rounded as they ship (see export), and the
        confidence head refitted by the evaluate phase if asked and present."""
        state = torch.load(self.phase_dir("drafter") / "drafter.pt", map_location="cpu")
        model_state = state["model"]
        config = DrafterConfig(**state["config"])
        if with_refitted_head and self.refitted_head_path.exists():
            head = torch.load(self.refitted_head_path, map_location="cpu")
            model_state = model_state | {f"confidence_head.{k}": v for k, v in head.items()}
            config = with_position_heads(config)
        drafter = DSparkDrafter(config)
        drafter.load_state_dict(export_lib.round_like_export(model_state))
        return drafter.to(self.runtime.device).eval().requires_grad_(False)

    def run_evaluate(self) -> dict:
        cfg, rt = self.config.eval, self.runtime
        target, drafter = self.load_target(), self.load_drafter()
        heldout = np.load(self.corpus_paths.heldout_tokens)
        rng = np.random.default_rng([self.config.seed, 99])
        prompts = sample_prompts(
            heldout, cfg.num_calibration_prompts + cfg.num_test_prompts, cfg.prompt_len, rng
        )
        sequences = greedy_sequences(
            target, prompts, cfg.new_tokens, cfg.generation_batch, rt.device
        )
        np.save(self.phase_dir("evaluate") / "heldout_sequences.npy", sequences.numpy())
        splits = {
            "calibration": sequences[: cfg.num_calibration_prompts],
            "test": sequences[cfg.num_calibration_prompts :],
        }
        records = {
            name: simulate_verify_steps(
                target,
                drafter,
                seqs,
                cfg.prompt_len,
                cfg.draft_batch,
                rt.device,
                rt.autocast_dtype,
                keep_confidence_inputs=cfg.refit_confidence_head,
            )
            for name, seqs in splits.items()
        }
        as_trained = calibration_report(
            records["test"].confidence_logits, records["test"].accepted, None
        )
        if cfg.refit_confidence_head:
            hidden_and_rank = drafter.config.hidden_size + drafter.config.markov_rank
            head = refit_position_heads(records["calibration"], hidden_and_rank)
            torch.save(head, self.refitted_head_path)
            for split in records.values():
                # In full precision: the plugin computes the head in float32.
                split.confidence_logits = head_logits(split, head, hidden_and_rank)
                split.confidence_inputs = None
        fit = fit_sequential_temperature_scaling(
            records["calibration"].confidence_logits, records["calibration"].accepted
        )
        test = records["test"]
        report = {
            **acceptance_report(test),
            **calibration_report(test.confidence_logits, test.accepted, fit.temperatures),
            "calibration_split": {
                **acceptance_report(records["calibration"]),
                "ece_raw": fit.ece_before,
                "ece_sts": fit.ece_after,
            },
            "temperatures": fit.temperatures,
            "confidence_head_as_trained": {
                "auroc": as_trained["auroc"],
                "ece_raw": as_trained["ece_raw"],
            },
            "setup": {
                "decoding": "greedy",
                "num_speculative_tokens": drafter.config.block_size,
                "prompt_len": cfg.prompt_len,
                "new_tokens": cfg.new_tokens,
                "calibration_prompts": cfg.num_calibration_prompts,
                "test_prompts": cfg.num_test_prompts,
                "prompts_from": "held-out files (5% of the corpus by path hash)",
                "precision": str(rt.inference_dtype).removeprefix("torch."),
                "confidence_head_refitted_on_calibration_split": cfg.refit_confidence_head,
            },
        }
        calibration = {
            "method": "sts",
            "temperatures": fit.temperatures,
            "applies_to": "confidence logit z_k; c_k = sigmoid(z_k / T_k), k = 1..K",
            "num_bins": 15,
            "fitted_on": f"{records['calibration'].num_steps} verify steps, "
            f"{cfg.num_calibration_prompts} held-out prompts, greedy",
            "ece_before": fit.ece_before,
            "ece_after_on_fit_split": fit.ece_after,
            "confidence_head_refitted": cfg.refit_confidence_head,
        }
        write_json(self.phase_dir("evaluate") / "dspark_calibration.json", calibration)
        write_json(self.work_dir / "eval.json", report)
        print_report(report)
        return self.finish("evaluate", {"eval_json": str(self.work_dir / "eval.json")})

    def run_export(self) -> dict:
        drafter = self.load_drafter(with_refitted_head=True)
        heldout = np.load(self.phase_dir("evaluate") / "heldout_sequences.npy")
        prompts = heldout[
            self.config.eval.num_calibration_prompts :, : self.config.eval.prompt_len
        ][:256]
        summary = export_lib.export_pair(
            export_dir=self.export_dir,
            target_model_dir=self.phase_dir("target") / "model",
            tokenizer_path=self.corpus_paths.tokenizer,
            special_ids=self.special_ids(),
            drafter=drafter,
            calibration=read_json(self.phase_dir("evaluate") / "dspark_calibration.json"),
            eval_report=read_json(self.work_dir / "eval.json"),
            training={
                "corpus": read_json(self.corpus_paths.manifest),
                "target": {
                    k: v
                    for k, v in read_json(self.phase_dir("target") / "done.json").items()
                    if k != "history"
                },
                "drafter_data": read_json(self.phase_dir("drafter_data") / "done.json"),
                "drafter": {
                    k: v
                    for k, v in read_json(self.phase_dir("drafter") / "done.json").items()
                    if k != "history"
                },
                "config": self.config.to_dict(),
            },
            heldout_prompts=prompts,
        )
        log(f"export: {summary}")
        return self.finish("export", summary)


def print_report(report: dict) -> None:
    def fmt(values):
        return "[" + ", ".join("-" if v is None else f"{v:.3f}" for v in values) + "]"

    log(
        f"eval (test split, {report['verify_steps']} verify steps): "
        f"mean acceptance length {report['mean_acceptance_length']:.3f}"
    )
    log(f"  acceptance | prefix accepted: {fmt(report['acceptance_rate_conditional'])}")
    log(f"  survival rate:                 {fmt(report['survival_rate'])}")
    log(f"  AUROC (survival):              {fmt(report['auroc'])}")
    log(f"  ECE raw:                       {fmt(report['ece_raw'])}")
    log(f"  ECE after STS:                 {fmt(report['ece_sts'])}")
    log(f"  STS temperatures:              {fmt(report['temperatures'])}")
