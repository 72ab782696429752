"""Where a decode step's time goes: no speculation against DSpark k=1, 3, 7, phase by phase.

    python benchmarks/step_breakdown.py --out benchmarks/results/step_breakdown.json
    python benchmarks/step_breakdown.py --arms nospec,dspark-k1 --out part1.json
    python benchmarks/step_breakdown.py --arms dspark-k3,dspark-k7 --merge part1.json \
        --out benchmarks/results/step_breakdown.json

The Qwen3-8B shape with dummy weights (``benchmarks/shapes.py``), or with ``--pair
embedded`` the trained pair (real verification on windows of its held-out text, its own
confidence head; arms of k=7 only: ``nospec``, ``dspark-k7``, ``sps-k7``, where the draft
gate's skipped proposals show what a closed gate still costs), one engine per arm in
its own process (as ``offline_sweep.py``: the same engine arguments, greedy, EOS ignored).
DSpark arms use vLLM's synthetic acceptance (``rejection_sample_method: "synthetic"``,
``synthetic_acceptance_rates`` = ``offline_sweep.DEFAULT_RATES`` truncated to k). The
``sps-k1`` / ``sps-k3`` / ``sps-k7`` arms run the plugin's answer to the fixed cost,
capacity control (``dspark_capacity: sps``, curve profiled at start-up, compact
verification), on drafts accepted with their own synthetic confidence around the same
profile; their steps verify any number of drafts (``verified_tokens_median``), and a
proposal the draft gate skips counts with its context-KV work only. ``conf-k1`` /
``conf-k3`` / ``conf-k7`` are their like-for-like baselines: fixed k on the same per-draft
acceptance, whose own host work the sps arms also pay; ``all-k7`` and ``compact-k7``
add capacity control that admits every draft or 0.99 of them (every step compacted), so
that their steps against ``conf-k7``'s are the controller's and the compaction's own
cost. ``plain-k3`` / ``plain-k7`` are ``sps`` with plain steps (``dspark_plain_steps``),
and ``closed-k3`` the same with a draft gate that never opens: its steps are the plain
decode steps of a speculative engine, which the gate weighs drafting against.
``fp8-k1`` / ``fp8-k3`` are ``dspark-k1`` / ``dspark-k3`` with the plugin's rowwise FP8
draft LM head (``dspark_fp8_draft_head``): that head's share of the drafter's cost.
``lean-k7`` is the capacity sweep's ``sps-depth-plain-lean`` (dynamic depth, whose steps
replay the graph of the depth drafted; plain and mixed steps; the drafting cuts). For
each concurrency c (default 1, 64, 256) the arm runs c prompts of 128 tokens, 128 output
tokens each, all submitted at once, once unrecorded (warm-up) and once recorded.

Block size. vLLM 0.26.0 refuses ``num_speculative_tokens`` below the block only when
the draft config has ``dspark_block_size`` (DeepSeek-V4 DSpark); Qwen3 DSpark configs
carry ``block_size``, which nothing in vLLM reads, so k=1 and k=3 with the block-7 draft
would start. vLLM's own comment on that check says a speculative length below a trained
block is an unsupported layout, so each arm writes its draft with ``block_size = k``
(``write_shape(..., block=k)``): the configuration a real block-k checkpoint has. The
timings are the same either way (the block size is not read).

How it is measured. After the warm-up a function sent with ``llm.collective_rpc``
(needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, set here before the engine starts)
replaces methods of the V2 runner instance and of its speculator instance with
wrappers (instance attributes; no class is patched). While recording, each real
``execute_model`` call opens a step record; the wrappers record CUDA events on the
current stream and ``time.perf_counter`` stamps:

- step start: ``GPUModelRunner.execute_model`` entry (runner);
- target forward start: ``runner.eplb.prepare_forward`` exit, the last call before the
  forward (FULL graph replay, piecewise or eager);
- target forward end / sample end: ``GPUModelRunner.sample`` entry / exit (runner);
- propose start / end: ``DSparkSpeculator.propose`` entry / exit (speculator);
- context-KV start / end: ``precompute_and_store_context_kv`` entry / exit (the draft
  model instance, ``speculator.model``);
- draft start: ``speculator.query_cudagraph_manager.run_fullgraph`` entry (graph) or
  ``speculator._run_model`` entry (eager); backbone end: ``_run_model`` exit (eager);
- draft end: ``run_fullgraph`` exit (graph) or ``speculator._sample_sequential`` exit;
- next step start: the next ``execute_model`` entry.

``GPUModelRunner.prepare_inputs`` is wrapped to read the batch (requests, tokens,
requests still prefilling, the target's CUDA-graph mode) and ``sample_tokens`` to wrap
the returned ``AsyncOutput.get_output`` (host wait on its ``copy_event`` and the list
conversion). The events partition the GPU timeline of a step exactly:

- ``host_sched_prep``: step start -> target forward start (input-preparation kernels,
  plus any time the GPU waits for the host to prepare the step);
- ``target_forward``: the target model (a FULL graph replay, or eager/compiled with
  any launch gaps);
- ``logits_rejection``: ``sample()``: LM head over the verified positions + sampler or
  (synthetic) rejection sampler;
- ``draft_context_kv``: propose start -> draft forward start: the target's tapped
  hidden states combined (``combine_hidden_states``), the draft input kernel, the
  context-KV precompute (eager in every mode) and the draft attention metadata;
- ``draft_backbone`` and ``markov_lm_head`` (``_run_model``, ``_sample_sequential``: the
  draft LM head, Markov bias and per-position argmax) when the draft runs eagerly;
  ``draft_graph`` when it replays one FULL CUDA graph, see below;
- ``host_sync_output``: sample end -> propose start, plus draft end -> next step start
  (without speculation: sample end -> next step start): output copy, ``postprocess``
  and draft-token hand-off kernels, and any time the GPU waits for the host to take the
  previous output, process it and schedule the next step.

vLLM runs these engines with asynchronous scheduling: the host schedules and prepares
step N+1 while the GPU computes step N, so host work is largely hidden. The phases
therefore add up on the GPU timeline, where host work appears only as far as the GPU
waits for it (the two ``host_*`` phases); the host's own busy times are timed with
``perf_counter`` and reported beside them in ``host_ms`` (``execute_model``,
``sample_tokens``, ``propose``, ``between_steps``, ``output_sync_wait``,
``output_conversion``, ``scheduler_and_rest``), never added to the phases (they overlap
them). The step itself, ``step_ms``, is measured independently of every phase timer:
host ``perf_counter`` time between consecutive ``execute_model`` entries.
``phases_sum_over_step`` is the sum of the phase medians over the median step (the
issue's target: within 5%); ``gpu_step_ms_median`` (events between step starts) is
a cross-check. ``batch_ms`` adds up the recorded batch's steps by kind (prefill, decode
steps of all c requests, the tail's decode steps with fewer left, shadowed steps): what
the batch spends beyond its steady-state median, which an end-to-end comparison pays.

Inside CUDA graphs. The draft's backbone and its sequential Markov sampling + LM head
run in ONE captured FULL graph (``_generate_draft``) whenever the batch fits a captured
size (c x k <= 512 tokens with these engine arguments); events cannot split a replay.
There the row reports ``draft_graph`` (the measured replay) and leaves
``draft_backbone`` / ``markov_lm_head`` null. The split is measured another way and
reported separately as ``within_graph_split``: on a few recorded steps
(``--shadow-steps``), right after the real propose, the same draft step is run again
from the step's own buffers and attention metadata, ``--shadow-repeats`` times: the
graph replay, then ``_run_model`` and ``_sample_sequential`` eagerly, each part behind
a GPU sleep long enough that the host has queued every kernel before the GPU reaches
them (``launch_hidden`` says whether it had), timed with events. The draft tokens are
restored afterwards; those steps and the three after them are left out of the step
statistics. The shares are eager shares: they are not scaled to the graph time and not
forced to add up to it (``eager_sum_over_graph`` shows how far they are).
The target's forward is one graph too but is reported whole, and rows at sizes above
the captured ones run eagerly; ``target_cudagraph`` and ``draft_cudagraph`` say which.

Only pure decode steps at the full concurrency count: no request prefilling, exactly c
requests, each with 1 + k tokens, and a following step (for the step time). The
wrappers add tens of microseconds of host time per step, hidden while the GPU is the
bottleneck; ``tok_s_recorded_run`` includes them and the shadow re-runs.

Device time: each engine starts in ~110-190 s on an H200, the timed part adds ~30 s, so
four arms take ~8-13 min; split them over calls with ``--arms`` and ``--merge`` (the
merged file's commands are kept in ``earlier_commands``). The JSON is rewritten after
each arm, so a run cut short keeps the arms it finished.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # vllm_dspark, from a checkout

from offline_sweep import ARMS as SWEEP_ARMS  # noqa: E402
from offline_sweep import (  # noqa: E402
    DEFAULT_RATES,
    DRAFT_VOCAB,
    conditional_rates,
    engine_kwargs,
    heldout_stream,
    seeded_params,
    sweep_prompts,
)
from shapes import shape_root, write_shape  # noqa: E402

SHAPE = "qwen3-8b"
# Arm name -> (number of speculative tokens (0: no speculation), acceptance). "rates":
# vLLM's synthetic acceptance. "sps": the plugin's sps mode (curve profiled at start-up)
# with compact verification, each draft accepted with its own synthetic confidence drawn
# around the same acceptance profile (offline_sweep's --acceptance confidence).
# "confidence": fixed k with that same acceptance and no capacity control, the sps arms'
# like-for-like baseline (the per-draft acceptance has host work of its own). The third
# field: further speculative-config keys (fp8-k*: DSpark k with the plugin's rowwise FP8
# draft LM head, on the dspark-k* arms' acceptance).
FP8_HEAD = {"dspark_fp8_draft_head": True}
# vocab-k*: DSpark k drafting over the sweep's -vocab arms' first token ids only.
VOCAB_HEAD = {"dspark_draft_vocab": DRAFT_VOCAB}
# Capacity control that admits every draft (all-k7; such a step runs vLLM's uniform step)
# or all but a few (compact-k7: 0.99 of R*K, every step compacted at 64 and 256 requests),
# on conf-k7's acceptance: their steps against conf-k7's are the controller's and the
# compaction's own cost (the capacity issue's "overhead at most 3%" at 64 requests).
BUDGET = {"dspark_capacity": "budget", "dspark_varlen_verify": True}
# A draft gate that never opens: on this SPS curve a step's time grows as T^4 (tokens per
# step), so a step of R requests verifying j drafts each takes (1 + j)^4 >= 16 times one
# without, for at most 1 + j times the tokens; the step overhead is given, so the gate
# decides from the first step on.
NEVER_DRAFT = {
    "dspark_sps_curve": [[2**i, 1e4 * 2.0 ** (-4 * i)] for i in range(13)],
    "dspark_step_overhead_ms": 1.0,
}
ARMS = {
    "nospec": (0, "rates", {}),
    "dspark-k1": (1, "rates", {}),
    "dspark-k3": (3, "rates", {}),
    "dspark-k7": (7, "rates", {}),
    "fp8-k1": (1, "rates", FP8_HEAD),
    "fp8-k3": (3, "rates", FP8_HEAD),
    "vocab-k3": (3, "rates", VOCAB_HEAD),
    "vocab-k7": (7, "rates", VOCAB_HEAD),
    # The drafter's own layers in rowwise FP8 (vllm_dspark.draft_fp8).
    "fp8bb-k3": (3, "rates", {"dspark_fp8_draft_backbone": True}),
    "conf-k1": (1, "confidence", {}),
    "conf-k3": (3, "confidence", {}),
    "conf-k7": (7, "confidence", {}),
    "all-k7": (7, "confidence", BUDGET | {"dspark_budget_frac": 1.0}),
    "compact-k7": (7, "confidence", BUDGET | {"dspark_budget_frac": 0.99}),
    "sps-k1": (1, "sps", {}),
    "sps-k3": (3, "sps", {}),
    "sps-k7": (7, "sps", {}),
    # sps whose closed draft gate schedules plain decode steps (dspark_plain_steps).
    "plain-k3": (3, "sps", {"dspark_plain_steps": True}),
    "plain-k7": (7, "sps", {"dspark_plain_steps": True}),
    # The same with a draft gate that stays closed: plain decode steps of a speculative
    # engine, but for a probe every 64 proposals; against nospec's, what the gate weighs as
    # a plain step's cost.
    "closed-k3": (3, "sps", {"dspark_plain_steps": True} | NEVER_DRAFT),
    # The capacity sweep's sps-depth-plain-lean (dynamic depth, plain steps, mixed steps,
    # the drafting cuts), the arm that runs 1.03x no speculation at 256 requests: its
    # steps against nospec's say where a full speculative step's time goes beyond the
    # target's forward.
    "lean-k7": (7, "sps", SWEEP_ARMS["sps-depth-plain-lean"]),
}

# Reported phases, in stacking order; each adds up on the GPU timeline (module docstring).
PHASES = {
    "host_sched_prep": "host scheduling + input preparation",
    "target_forward": "target forward",
    "logits_rejection": "logits + rejection sampling",
    "draft_context_kv": "draft context-KV precompute",
    "draft_backbone": "draft backbone",
    "markov_lm_head": "sequential Markov sampling + draft LM head",
    "draft_graph": "draft backbone + Markov/LM head (one CUDA graph)",
    "host_sync_output": "host synchronisation + output processing",
}
# Finer GPU-timeline segments behind the phases, reported for transparency.
SEGMENTS = (
    "input_prep",
    "target_forward",
    "logits_rejection",
    "output_handoff",
    "draft_prologue",
    "context_kv",
    "draft_attn_metadata",
    "draft_backbone",
    "markov_lm_head",
    "draft_graph",
    "draft_tail",
    "step_tail",
)
# Steps from a shadow-timed step on that are left out of the step statistics.
SHADOW_WINDOW = 4


# --------------------------------------------------------------------------------------
# In the worker process (sent by value through collective_rpc).


class CudaClock:
    """CUDA events on the current stream, and a GPU sleep to hide kernel launches."""

    def __init__(self) -> None:
        self.cycles_per_ms: float | None = None

    def mark(self):
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def elapsed_ms(self, start, end) -> float:
        return start.elapsed_time(end)

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize()

    def calibrate(self) -> None:
        import torch

        cycles = 20_000_000
        for _ in range(2):  # the second, once clocks have ramped up
            start = self.mark()
            torch.cuda._sleep(cycles)
            end = self.mark()
            self.synchronize()
            self.cycles_per_ms = cycles / max(self.elapsed_ms(start, end), 1e-3)

    def sleep(self, ms: float) -> None:
        import torch

        if self.cycles_per_ms is None:
            self.calibrate()
        torch.cuda._sleep(int(ms * self.cycles_per_ms))


def draft_graph_managers(spec) -> dict:
    """The drafter's CUDA-graph managers: one per depth with the plugin's dynamic depth
    (each depth replays its own graph), else the speculator's one (none when eager)."""
    if hasattr(spec, "draft_graph_managers"):
        return spec.draft_graph_managers()
    manager = spec.query_cudagraph_manager
    return {} if manager is None else {"full": manager}


class StepProbe:
    """Per-step CUDA events and host stamps from wrappers on the runner's instances."""

    def __init__(self, runner, clock, now=time.perf_counter, shadow: dict | None = None):
        self.runner = runner
        self.clock = clock
        self.now = now
        self.shadow_cfg = {"steps": 0, "start": 6, "every": 8, "repeats": 6, "sleep_ms": 30.0}
        self.shadow_cfg.update(shadow or {})
        self.original: dict[str, object] = {}
        self.hooked: list[str] = []
        self.recording = False
        self.label = None
        self.current: dict | None = None
        self._next_id = 0
        self._clear()

    def _clear(self) -> None:
        self._records: list[dict] = []
        self._outputs: list[dict] = []
        self._shadow: list[dict] = []
        self._eligible = 0
        self._shadows_done = 0
        self._draft_desc = None
        self._draft_replay = None  # the graph manager's replay that drew _draft_desc
        self._draft_metadata = None

    # -- installation ------------------------------------------------------------------

    def install(self) -> list[str]:
        runner = self.runner
        self._wrap(runner, "execute_model", self._execute_model)
        self._wrap(runner, "prepare_inputs", self._prepare_inputs)
        self._wrap(runner.eplb, "prepare_forward", self._prepare_forward, "eplb.prepare_forward")
        self._wrap(runner, "sample", self._sample)
        self._wrap(runner, "sample_tokens", self._sample_tokens)
        spec = runner.speculator
        if spec is not None:
            self._wrap(spec, "propose", self._propose)
            self._wrap(spec.model, "precompute_and_store_context_kv", self._context_kv)
            self._wrap(spec, "_build_draft_attn_metadata", self._draft_metadata_hook)
            self._wrap(spec, "_run_model", self._run_model)
            if hasattr(spec, "_sample_sequential"):  # DSpark's Markov stage
                self._wrap(spec, "_sample_sequential", self._sample_sequential)
            for depth, manager in draft_graph_managers(spec).items():
                self._wrap(manager, "run_fullgraph", self._run_fullgraph, f"draft_graph_{depth}")
        return list(self.hooked)

    def _wrap(self, owner, name: str, hook, key: str | None = None) -> None:
        original = getattr(owner, name)  # the bound method the instance resolves today
        if not callable(original):
            raise TypeError(f"{type(owner).__name__}.{name} is not callable")

        def wrapper(*args, **kwargs):
            return hook(original, *args, **kwargs)

        wrapper.__wrapped__ = original
        setattr(owner, name, wrapper)  # an instance attribute: shadows the class's method
        self.original[key or name] = original
        self.hooked.append(f"{type(owner).__name__}.{name}")

    # -- recording control -------------------------------------------------------------

    def start(self, label) -> None:
        self._clear()
        self.label = label
        self.current = None
        self.recording = True

    def collect(self) -> dict:
        """Stop recording; resolve the events (one synchronize) into plain numbers (ms for
        GPU offsets from the step's start, seconds for host stamps)."""
        self.recording = False
        self.current = None
        self.clock.synchronize()
        elapsed = self.clock.elapsed_ms
        records = []
        for i, rec in enumerate(self._records):
            start = rec["events"]["start"]
            gpu = {
                name: elapsed(start, ev) for name, ev in rec["events"].items() if name != "start"
            }
            host = dict(rec["host"])
            following = self._records[i + 1] if i + 1 < len(self._records) else None
            if following is not None and following["id"] == rec["id"] + 1:
                gpu["next_start"] = elapsed(start, following["events"]["start"])
                host["next_exec_start"] = following["host"]["exec_start"]
            plain = {k: v for k, v in rec.items() if k not in ("events", "host")}
            records.append({**plain, "gpu": gpu, "host": host})
        shadow = []
        for sample in self._shadow:
            ev = sample.pop("events")
            shadow.append(
                {
                    **sample,
                    "sleep_graph_ms": elapsed(ev["graph_sleep"], ev["graph_start"]),
                    "graph_ms": elapsed(ev["graph_start"], ev["graph_end"]),
                    "sleep_eager_ms": elapsed(ev["eager_sleep"], ev["eager_start"]),
                    "backbone_ms": elapsed(ev["eager_start"], ev["backbone_end"]),
                    "markov_ms": elapsed(ev["backbone_end"], ev["eager_end"]),
                }
            )
        data = {"records": records, "outputs": list(self._outputs), "shadow": shadow}
        self._clear()
        return data

    # -- hooks -------------------------------------------------------------------------

    def _mark(self, name: str) -> None:
        rec = self.current
        if rec is not None and name not in rec["events"]:
            rec["events"][name] = self.clock.mark()

    def _execute_model(self, original, *args, **kwargs):
        dummy = kwargs.get("dummy_run", len(args) > 2 and bool(args[2]))
        if not self.recording or dummy:
            return original(*args, **kwargs)
        rec = {"id": self._next_id, "label": self.label, "host": {"exec_start": self.now()}}
        rec["events"] = {"start": self.clock.mark()}
        self._next_id += 1
        self._records.append(rec)
        self.current = rec
        try:
            return original(*args, **kwargs)
        finally:
            rec["host"]["exec_end"] = self.now()

    def _prepare_inputs(self, original, *args, **kwargs):
        batch = original(*args, **kwargs)
        rec = self.current
        if rec is not None and "num_reqs" not in rec:
            desc = args[1] if len(args) > 1 else kwargs.get("batch_desc")
            rec["num_reqs"] = int(batch.num_reqs)
            rec["num_tokens"] = int(batch.num_tokens)
            rec["num_prefill"] = int(batch.is_prefilling_np[: batch.num_reqs].sum())
            rec["num_draft_tokens"] = int(batch.num_draft_tokens)
            rec["target_cudagraph"] = getattr(getattr(desc, "cg_mode", None), "name", None)
        return batch

    def _prepare_forward(self, original, *args, **kwargs):
        out = original(*args, **kwargs)
        self._mark("fwd_start")
        return out

    def _sample(self, original, *args, **kwargs):
        self._mark("fwd_end")
        out = original(*args, **kwargs)
        self._mark("sample_end")
        return out

    def _sample_tokens(self, original, *args, **kwargs):
        rec = self.current
        if rec is None:
            return original(*args, **kwargs)
        rec["host"]["sample_start"] = self.now()
        try:
            out = original(*args, **kwargs)
        finally:
            rec["host"]["sample_end"] = self.now()
            self.current = None
        if hasattr(out, "copy_event") and hasattr(out, "get_output"):
            self._wrap_output(out, rec["id"])
        return out

    def _wrap_output(self, out, step_id: int) -> None:
        original = out.get_output

        def get_output():
            start = self.now()
            out.copy_event.synchronize()  # get_output's own wait then returns at once
            synced = self.now()
            result = original()
            self._outputs.append(
                {"id": step_id, "start": start, "synced": synced, "end": self.now()}
            )
            return result

        out.get_output = get_output

    def _propose(self, original, *args, **kwargs):
        rec = self.current
        if rec is None or kwargs.get("dummy_run", False):
            return original(*args, **kwargs)
        rec["host"]["propose_start"] = self.now()
        self._mark("propose_start")
        out = original(*args, **kwargs)
        self._mark("propose_end")
        rec["host"]["propose_end"] = self.now()
        if self._shadow_due(rec):
            self._shadow_time(rec)
        return out

    def _context_kv(self, original, *args, **kwargs):
        self._mark("ctx_start")
        out = original(*args, **kwargs)
        self._mark("ctx_end")
        return out

    def _draft_metadata_hook(self, original, *args, **kwargs):
        metadata = original(*args, **kwargs)
        if self.current is not None:
            self._draft_metadata = metadata
        return metadata

    def _run_fullgraph(self, original, desc):
        if self.current is not None:
            self.current["draft_cudagraph"] = getattr(desc.cg_mode, "name", "FULL")
            self._draft_desc, self._draft_replay = desc, original
        self._mark("draft_start")
        out = original(desc)
        self._mark("draft_end")
        return out

    def _run_model(self, original, *args, **kwargs):
        if self.current is not None:
            self.current.setdefault("draft_cudagraph", "NONE")
        self._mark("draft_start")
        out = original(*args, **kwargs)
        self._mark("backbone_end")
        return out

    def _sample_sequential(self, original, *args, **kwargs):
        out = original(*args, **kwargs)
        self._mark("draft_end")
        return out

    # -- the split inside the draft graph ------------------------------------------------

    def _shadow_due(self, rec: dict) -> bool:
        cfg = self.shadow_cfg
        if (
            not cfg["steps"]
            or rec.get("draft_cudagraph") != "FULL"
            or rec.get("num_prefill") != 0
            or rec.get("num_reqs") != self.label
        ):
            return False
        self._eligible += 1
        if self._shadows_done >= cfg["steps"] or self._eligible < cfg["start"]:
            return False
        return (self._eligible - cfg["start"]) % cfg["every"] == 0

    def _shadow_time(self, rec: dict) -> None:
        """Re-run this step's draft: the graph replay, then backbone and Markov stage
        eagerly, each behind a GPU sleep so that launches are hidden; restore drafts."""
        from vllm.config.compilation import CUDAGraphMode
        from vllm.v1.worker.gpu.attn_utils import build_slot_mappings_by_layer

        spec = self.runner.speculator
        desc, metadata = self._draft_desc, self._draft_metadata
        if desc is None or metadata is None or "_sample_sequential" not in self.original:
            return
        num_reqs, num_tokens = desc.num_reqs, desc.num_tokens  # as the graph was captured
        slot_mappings = build_slot_mappings_by_layer(
            spec.block_tables.slot_mappings[:, :num_tokens], spec.kv_cache_config
        )
        saved = spec.draft_tokens[:num_reqs].clone()
        clock, sleep_ms = self.clock, self.shadow_cfg["sleep_ms"]
        for _ in range(self.shadow_cfg["repeats"]):
            ev = {"graph_sleep": clock.mark()}
            clock.sleep(sleep_ms)
            ev["graph_start"] = clock.mark()
            launch = self.now()
            self._draft_replay(desc)
            ev["graph_end"] = clock.mark()
            launch_graph_ms = (self.now() - launch) * 1e3
            ev["eager_sleep"] = clock.mark()
            clock.sleep(sleep_ms)
            ev["eager_start"] = clock.mark()
            launch = self.now()
            hidden = self.original["_run_model"](
                num_tokens, metadata, slot_mappings, None, CUDAGraphMode.NONE
            )
            ev["backbone_end"] = clock.mark()
            self.original["_sample_sequential"](num_reqs, hidden)
            ev["eager_end"] = clock.mark()
            self._shadow.append(
                {
                    "step": rec["id"],
                    "launch_graph_ms": launch_graph_ms,
                    "launch_eager_ms": (self.now() - launch) * 1e3,
                    "events": ev,
                }
            )
        spec.draft_tokens[:num_reqs].copy_(saved)
        rec["shadow"] = True
        self._shadows_done += 1


def install_probe(worker, shadow: dict) -> dict:
    """collective_rpc: wrap the runner's and speculator's methods (once)."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    runner = worker.model_runner
    if not isinstance(runner, GPUModelRunner):
        raise RuntimeError(f"needs vLLM's V2 model runner, got {type(runner).__name__}")
    probe = getattr(runner, "_step_breakdown_probe", None)
    if probe is None:
        clock = CudaClock()
        if shadow.get("steps"):
            clock.calibrate()
        probe = StepProbe(runner, clock, shadow=shadow)
        probe.install()
        runner._step_breakdown_probe = probe
    spec = runner.speculator
    return {
        "runner": type(runner).__name__,
        "speculator": None if spec is None else type(spec).__name__,
        "hooks": probe.hooked,
        "sleep_cycles_per_ms": probe.clock.cycles_per_ms,
    }


def start_recording(worker, label) -> None:
    worker.model_runner._step_breakdown_probe.start(label)


def fetch_records(worker) -> dict:
    return worker.model_runner._step_breakdown_probe.collect()


def start_host_profile(worker) -> None:
    """cProfile the engine core's thread (it runs the scheduler and this worker's steps)."""
    import cProfile

    worker._host_profile = cProfile.Profile()
    worker._host_profile.enable()


def stop_host_profile(worker, top: int) -> dict:
    """Microseconds per step of the ``top`` functions by own time and by cumulative time,
    per real ``execute_model`` call of the profiled run; and of every function of this
    package and the benchmark's acceptance (``plugin_by_cumulative_time``), so that the
    host time the plugin adds to a step can be told from vLLM's own."""
    import pstats

    profile = worker._host_profile
    profile.disable()
    stats = pstats.Stats(profile).stats
    steps = max(
        (calls for (_, _, name), (_, calls, *_rest) in stats.items() if name == "execute_model"),
        default=0,
    )

    def table(column: int, items, limit: int | None = top) -> list[dict]:
        ranked = sorted(items, key=lambda item: item[1][column], reverse=True)[:limit]
        return [
            {
                "function": f"{Path(file).name}:{line}:{name}",
                "calls_per_step": round(calls / max(steps, 1), 2),
                "own_us_per_step": round(own * 1e6 / max(steps, 1), 1),
                "cumulative_us_per_step": round(cumulative * 1e6 / max(steps, 1), 1),
            }
            for (file, line, name), (_, calls, own, cumulative, _callers) in ranked
        ]

    plugin = [item for item in stats.items() if f"{os.sep}vllm_dspark{os.sep}" in item[0][0]]
    return {
        "steps": steps,
        "by_own_time": table(2, stats.items()),
        "by_cumulative_time": table(3, stats.items()),
        "plugin_by_cumulative_time": table(3, plugin, limit=None),
    }


# --------------------------------------------------------------------------------------
# Pure logic: from per-step records to the reported row.


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def segment_values(rec: dict) -> dict[str, float] | None:
    """The step's GPU-timeline segments (ms), or None if an event is missing."""
    g = rec["gpu"]
    if any(name not in g for name in ("fwd_start", "fwd_end", "sample_end", "next_start")):
        return None
    seg = {
        "input_prep": g["fwd_start"],
        "target_forward": g["fwd_end"] - g["fwd_start"],
        "logits_rejection": g["sample_end"] - g["fwd_end"],
    }
    if "propose_start" not in g:
        seg["step_tail"] = g["next_start"] - g["sample_end"]
        return seg
    if any(n not in g for n in ("ctx_start", "ctx_end", "propose_end")):
        return None
    if "draft_start" not in g and "draft_end" not in g:
        # A proposal the plugin's draft gate skipped: context K/V stored, nothing drafted.
        return seg | {
            "output_handoff": g["propose_start"] - g["sample_end"],
            "draft_prologue": g["ctx_start"] - g["propose_start"],
            "context_kv": g["ctx_end"] - g["ctx_start"],
            "draft_attn_metadata": g["propose_end"] - g["ctx_end"],
            "draft_tail": 0.0,
            "step_tail": g["next_start"] - g["propose_end"],
        }
    if "draft_start" not in g or "draft_end" not in g:
        return None
    seg |= {
        "output_handoff": g["propose_start"] - g["sample_end"],
        "draft_prologue": g["ctx_start"] - g["propose_start"],
        "context_kv": g["ctx_end"] - g["ctx_start"],
        "draft_attn_metadata": g["draft_start"] - g["ctx_end"],
        "draft_tail": g["propose_end"] - g["draft_end"],
        "step_tail": g["next_start"] - g["propose_end"],
    }
    if rec.get("draft_cudagraph") == "FULL":
        seg["draft_graph"] = g["draft_end"] - g["draft_start"]
    elif "backbone_end" in g:
        seg["draft_backbone"] = g["backbone_end"] - g["draft_start"]
        seg["markov_lm_head"] = g["draft_end"] - g["backbone_end"]
    else:
        return None
    return seg


def phase_values(rec: dict) -> dict[str, float] | None:
    """The reported phases (ms) of one step; they add up to its GPU step exactly."""
    seg = segment_values(rec)
    if seg is None:
        return None
    phases = {
        "host_sched_prep": seg["input_prep"],
        "target_forward": seg["target_forward"],
        "logits_rejection": seg["logits_rejection"],
    }
    if "draft_prologue" in seg:
        phases["draft_context_kv"] = (
            seg["draft_prologue"] + seg["context_kv"] + seg["draft_attn_metadata"]
        )
        for key in ("draft_backbone", "markov_lm_head", "draft_graph"):
            if key in seg:
                phases[key] = seg[key]
        phases["host_sync_output"] = seg["output_handoff"] + seg["draft_tail"] + seg["step_tail"]
    else:
        phases["host_sync_output"] = seg["step_tail"]
    return phases


def step_exclusion(
    rec: dict, concurrency: int, k: int, shadowed: set[int], compacted: bool = False
) -> str | None:
    """Why a step is left out of the statistics (None: a pure decode step at c; with
    ``compacted``, one that verified any number of the k drafts per request)."""
    if rec.get("num_reqs") is None:
        return "no_batch"  # execute_model returned before preparing inputs
    if rec["num_prefill"] > 0:
        return "prefill"
    if rec["num_reqs"] != concurrency:
        return "partial_batch"
    uniform = rec["num_reqs"] * (1 + k)
    if not (
        rec["num_reqs"] <= rec["num_tokens"] <= uniform
        if compacted
        else rec["num_tokens"] == uniform
    ):
        return "non_uniform"
    if rec["id"] in shadowed:
        return "shadow_window"
    if "next_exec_start" not in rec["host"] or phase_values(rec) is None:
        return "incomplete"
    return None


def shadowed_ids(records: list[dict], window: int) -> set[int]:
    """Steps a within-graph shadow re-run lengthens: its own and the ``window`` - 1 after."""
    return {r["id"] + j for r in records if r.get("shadow") for j in range(window)}


def decode_steps(
    records: list[dict],
    concurrency: int,
    k: int,
    window: int = SHADOW_WINDOW,
    compacted: bool = False,
) -> tuple[list[dict], dict[str, int]]:
    """Pure decode steps with c requests of 1 + k tokens each (with ``compacted``, of
    1 to 1 + k), and the excluded counts."""
    shadowed = shadowed_ids(records, window)
    kept, excluded = [], {}
    for rec in records:
        reason = step_exclusion(rec, concurrency, k, shadowed, compacted)
        if reason is None:
            kept.append(rec)
        else:
            excluded[reason] = excluded.get(reason, 0) + 1
    return kept, excluded


def batch_time(records: list[dict], concurrency: int, window: int = SHADOW_WINDOW) -> dict:
    """The recorded batch's wall time by kind of step, each step from its execute_model
    entry to the next one's: ``prefill`` (a prefill in the batch), ``decode`` (all c
    requests decoding), ``tail`` (fewer left: the batch waits for its slowest requests),
    ``shadow_window`` (steps the within-graph re-runs lengthen; kept apart), with the
    requests a step of each kind ran on average (in the tail, requests that finished a step
    before may still be scheduled: async scheduling plans a step before the last one's
    accepted tokens are known). The steady state's median leaves out what the batch
    spends in its prefill and its tail. ``ms`` adds up host periods (execute_model entry to
    the next), ``gpu_ms`` the GPU's (a step's start event to the next's): the host runs a
    step ahead, so a host period can hold the GPU's step before it, and a kind's ``ms``
    the step after its last (at 256 requests on an H100, no speculation's decode steps
    averaged 14.9 ms on the host, median 12.0, the last prefill's period among them;
    ``step_breakdown_prefill_4961536_h100.json``)."""
    shadowed = shadowed_ids(records, window)
    kinds: dict[str, list[float]] = {}
    gpu: dict[str, float] = {}
    requests: dict[str, int] = {}
    for rec in records:
        host = rec["host"]
        if rec.get("num_reqs") is None or "next_exec_start" not in host:
            continue
        if rec["id"] in shadowed:
            kind = "shadow_window"
        elif rec["num_prefill"] > 0:
            kind = "prefill"
        else:
            kind = "decode" if rec["num_reqs"] == concurrency else "tail"
        kinds.setdefault(kind, []).append(host_period_ms(rec))
        gpu[kind] = gpu.get(kind, 0.0) + rec["gpu"].get("next_start", float("nan"))
        requests[kind] = requests.get(kind, 0) + rec["num_reqs"]
    return {
        kind: {
            "steps": len(ms),
            "ms": round(sum(ms), 3),
            "gpu_ms": round(gpu[kind], 3),
            "ms_median": round(_median(ms), 4),
            "requests_per_step": round(requests[kind] / len(ms), 2),
        }
        for kind, ms in sorted(kinds.items())
    }


def prefill_steps(records: list[dict]) -> list[dict]:
    """Each step with a prefill in it, and the step after the last (the host runs a step
    ahead, so a step's period can hold the one before it), one by one: its requests,
    requests prefilling and tokens, its period on the host, its GPU step and that step's
    segments. At 256 requests on an H100 the prefill steps' host periods added up to 756 ms
    with DSpark k=3 and 419 ms without speculation
    (``step_breakdown_prefill_4961536_h100.json``), though the sweep's mean time to a first
    token was no longer with it: which steps the periods held is what this shows."""
    batch = [rec for rec in records if rec.get("num_reqs") is not None]
    last = max((i for i, rec in enumerate(batch) if rec["num_prefill"] > 0), default=None)
    if last is None:
        return []
    steps = []
    for i, rec in enumerate(batch[: last + 2]):
        if rec["num_prefill"] == 0 and i != last + 1:
            continue
        host, segments = rec["host"], segment_values(rec)
        steps.append(
            {
                "requests": rec["num_reqs"],
                "prefilling": rec["num_prefill"],
                "tokens": rec["num_tokens"],
                "ms": round(host_period_ms(rec), 3) if "next_exec_start" in host else None,
                "gpu_ms": round(rec["gpu"]["next_start"], 3)
                if "next_start" in rec["gpu"]
                else None,
                "segments_ms": None if segments is None else _rounded(segments),
            }
        )
    return steps


def host_period_ms(rec: dict) -> float:
    """A step's period on the host: from its execute_model entry to the next's."""
    return (rec["host"]["next_exec_start"] - rec["host"]["exec_start"]) * 1e3


def host_values(rec: dict, outputs: list[dict]) -> dict[str, float]:
    """Host busy times (ms) of one step; overlapping the GPU phases, so never added."""
    h = rec["host"]
    ms = {
        "execute_model": (h["exec_end"] - h["exec_start"]) * 1e3,
        "sample_tokens": (h["sample_end"] - h["sample_start"]) * 1e3,
        "between_steps": (h["next_exec_start"] - h["sample_end"]) * 1e3,
    }
    if "propose_start" in h:
        ms["propose"] = (h["propose_end"] - h["propose_start"]) * 1e3
    # The output collected between this step's sample_tokens and the next step.
    taken = [o for o in outputs if h["sample_end"] <= o["start"] < h["next_exec_start"]]
    if len(taken) == 1:
        out = taken[0]
        ms["output_sync_wait"] = (out["synced"] - out["start"]) * 1e3
        ms["output_conversion"] = (out["end"] - out["synced"]) * 1e3
        ms["scheduler_and_rest"] = ms["between_steps"] - (out["end"] - out["start"]) * 1e3
    return ms


def within_graph_split(samples: list[dict], graph_in_step_ms: float | None) -> dict | None:
    """Eager shares of the draft graph's two stages; not scaled to the graph time."""
    if not samples:
        return None
    backbone = _median(s["backbone_ms"] for s in samples)
    markov = _median(s["markov_ms"] for s in samples)
    graph = _median(s["graph_ms"] for s in samples)
    eager = backbone + markov
    return {
        "method": "shadow re-run of the step's draft: graph replay, then eager stages, "
        "each behind a GPU sleep (launches hidden)",
        "samples": len(samples),
        "draft_backbone_eager_ms": round(backbone, 4),
        "markov_lm_head_eager_ms": round(markov, 4),
        "graph_replay_ms": round(graph, 4),
        "graph_replay_in_step_ms": None if graph_in_step_ms is None else round(graph_in_step_ms, 4),
        "backbone_share": round(backbone / eager, 4) if eager > 0 else None,
        "markov_lm_head_share": round(markov / eager, 4) if eager > 0 else None,
        "eager_sum_over_graph": round(eager / graph, 4) if graph > 0 else None,
        "launch_hidden": all(
            s["launch_graph_ms"] < 0.9 * s["sleep_graph_ms"]
            and s["launch_eager_ms"] < 0.9 * s["sleep_eager_ms"]
            for s in samples
        ),
    }


def _mode(values) -> str | None:
    values = [v for v in values if v is not None]
    return max(set(values), key=values.count) if values else None


def _rounded(values: dict) -> dict:
    return {key: None if v is None else round(v, 4) for key, v in values.items()}


def summarize(data: dict, concurrency: int, k: int, compacted: bool = False) -> dict:
    """One row: medians over the pure decode steps at this concurrency."""
    records = data["records"]
    steps, excluded = decode_steps(records, concurrency, k, compacted=compacted)
    row = {
        "concurrency": concurrency,
        "k": k,
        "steps_recorded": len(records),
        "steps_used": len(steps),
        "steps_excluded": excluded,
        "batch_ms": batch_time(records, concurrency),
        "prefill_steps": prefill_steps(records),
    }
    if not steps:
        return row | {"step_ms_median": None, "phases_ms": None, "phases_sum_over_step": None}
    step_ms = [host_period_ms(r) for r in steps]
    per_step = [phase_values(r) for r in steps]
    phases = {key: _median(p.get(key) for p in per_step) for key in PHASES}
    segments = [segment_values(r) for r in steps]
    hosts = [host_values(r, data["outputs"]) for r in steps]
    host_keys = sorted({key for h in hosts for key in h})
    step_median = statistics.median(step_ms)
    phases_sum = sum(v for v in phases.values() if v is not None)
    ratio = phases_sum / step_median
    return row | {
        "step_ms_median": round(step_median, 4),
        "verified_tokens_median": statistics.median(r["num_tokens"] for r in steps),
        "gpu_step_ms_median": round(statistics.median(r["gpu"]["next_start"] for r in steps), 4),
        "phases_ms": _rounded(phases),
        "phases_sum_ms": round(phases_sum, 4),
        "phases_sum_over_step": round(ratio, 4),
        "phases_add_up_within_5pct": abs(ratio - 1) <= 0.05,
        "segments_ms": _rounded({s: _median(x.get(s) for x in segments) for s in SEGMENTS}),
        "host_ms": _rounded({key: _median(h.get(key) for h in hosts) for key in host_keys}),
        "target_cudagraph": _mode(r.get("target_cudagraph") for r in steps),
        "draft_cudagraph": _mode(r.get("draft_cudagraph") for r in steps) if k else None,
        "within_graph_split": within_graph_split(data["shadow"], phases.get("draft_graph")),
    }


def merge_rows(previous: list[dict], new: list[dict]) -> list[dict]:
    """``previous`` rows, replaced by ``new`` ones of the same arm and concurrency."""
    keys = {(r["arm"], r["concurrency"]) for r in new}
    kept = [r for r in previous if (r["arm"], r["concurrency"]) not in keys]
    order = list(ARMS)
    rows = kept + new
    return sorted(
        rows,
        key=lambda r: (
            order.index(r["arm"]) if r["arm"] in order else len(order),
            r["concurrency"],
        ),
    )


def stack_of(row: dict) -> list[tuple[str, float]]:
    """(phase, ms) to stack for a row, in PHASES order, measured phases only."""
    phases = row.get("phases_ms") or {}
    return [(key, phases[key]) for key in PHASES if phases.get(key) is not None]


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    concurrencies = sorted({r["concurrency"] for r in rows})
    colors = dict(zip(PHASES, plt.get_cmap("tab10").colors, strict=False))
    fig, axes = plt.subplots(
        1, len(concurrencies), figsize=(3.6 * len(concurrencies) + 1.5, 4.2), squeeze=False
    )
    for ax, concurrency in zip(axes[0], concurrencies, strict=True):
        here = [r for r in rows if r["concurrency"] == concurrency and r.get("phases_ms")]
        for x, row in enumerate(here):
            bottom = 0.0
            for key, ms in stack_of(row):
                ax.bar(
                    x,
                    ms,
                    bottom=bottom,
                    color=colors[key],
                    hatch="//" if key == "draft_graph" else None,
                    edgecolor="white",
                    linewidth=0.4,
                )
                bottom += ms
            step = row["step_ms_median"]
            ax.hlines(step, x - 0.42, x + 0.42, colors="black", linewidth=1.6)
            ax.annotate(
                f"{row['phases_sum_over_step']:.2f}",
                (x, max(step, bottom)),
                textcoords="offset points",
                xytext=(0, 3),
                ha="center",
                fontsize=7,
            )
        ax.set_xticks(range(len(here)), [r["arm"] for r in here], rotation=30, fontsize=8)
        ax.set_title(f"concurrency {concurrency}", fontsize=9)
        ax.set_ylabel("ms per decode step (median)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[key]) for key in PHASES]
    handles[list(PHASES).index("draft_graph")].set_hatch("//")
    handles.append(plt.Line2D([0], [0], color="black", linewidth=1.6))
    labels = [*PHASES.values(), "measured step (host); number: phases sum / step"]
    fig.legend(handles, labels, loc="center right", fontsize=7, frameon=False)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0, 0.72, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------
# Arms and engines.


def speculative_config(
    k: int,
    draft: str,
    rates: str,
    acceptance: str = "rates",
    options: dict | None = None,
    real: bool = False,
) -> dict | None:
    """DSpark with k drafts and vLLM's synthetic acceptance (the first k rates); with
    ``acceptance`` "confidence", drafts accepted with their own synthetic confidence
    around the same rates; "sps", that and the plugin's sps mode. ``options``: further
    keys (the plugin's). ``real``: a trained pair, whose drafts are verified for real and
    whose confidence head is its own (no synthetic key)."""
    if k == 0:
        return None
    values = [float(r) for r in rates.split(",")]
    if len(values) < k:
        raise ValueError(f"--rates has {len(values)} values; k={k} needs {k}")
    config = {"method": "dspark", "model": draft, "num_speculative_tokens": k, **(options or {})}
    if acceptance == "sps":
        config |= {"dspark_capacity": "sps", "dspark_varlen_verify": True}
    if real:
        return config
    if acceptance != "rates":
        config["dspark_synthetic_confidence"] = conditional_rates(values[:k])
    if acceptance != "rates":
        return config
    return config | {
        "rejection_sample_method": "synthetic",
        "synthetic_acceptance_rates": values[:k],
    }


def run_arm_here(spec: dict) -> None:
    """In the arm's own process: one engine, every concurrency, one ROW line each."""
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # before the engine starts
    import torch
    from vllm import LLM, SamplingParams

    from vllm_dspark.metrics import SpecDecodeCounts

    k = spec["k"]
    started = time.perf_counter()
    real = spec["pair"] == "embedded"
    llm = LLM(
        **engine_kwargs(spec["target"], dummy=not real, graphs_to=spec.get("graphs_to")),
        speculative_config=speculative_config(
            k, spec["draft"], spec["rates"], spec["acceptance"], spec["options"], real
        ),
    )
    engine_s = time.perf_counter() - started
    params = SamplingParams(temperature=0.0, max_tokens=spec["output_len"], ignore_eos=True)

    stream = heldout_stream() if real else None  # text the trained drafter knows

    def prompts(count: int, offset: int):
        return sweep_prompts(count, offset, spec["prompt_len"], stream)

    llm.generate(prompts(8, 0), params, use_tqdm=False)
    probe = llm.collective_rpc(install_probe, args=(spec["shadow"],))[0]
    print("PROBE " + json.dumps(probe), file=sys.stderr, flush=True)
    for concurrency in spec["concurrency"]:
        llm.generate(prompts(concurrency, 10_000 + concurrency), params, use_tqdm=False)
        before = SpecDecodeCounts.from_metrics(llm.get_metrics())
        llm.collective_rpc(start_recording, args=(concurrency,))
        start = time.perf_counter()
        seeded = seeded_params(spec["output_len"], concurrency, concurrency)
        outputs = llm.generate(prompts(concurrency, concurrency), seeded, use_tqdm=False)
        seconds = time.perf_counter() - start
        data = llm.collective_rpc(fetch_records)[0]
        counts = SpecDecodeCounts.from_metrics(llm.get_metrics()) - before
        tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
        capacity = spec["acceptance"] == "sps" or "dspark_capacity" in spec["options"]
        row = summarize(data, concurrency, k, compacted=capacity)
        acceptance = counts.acceptance_length if counts.drafts else None
        step_ms = row["step_ms_median"]
        row |= {
            # Steady-state decode throughput: tokens per step over the median step.
            "decode_tok_s": (
                round(concurrency * (acceptance or 1.0) * 1e3 / step_ms, 1) if step_ms else None
            ),
            # The whole recorded run, prefill and the shadow re-runs of the split included.
            "tok_s_recorded_run": round(tokens / seconds, 1),
            "acceptance_length": round(acceptance, 4) if acceptance else None,
            "engine_start_s": round(engine_s, 1),
            "device": torch.cuda.get_device_name(0),
            "hooks": probe["hooks"],
        }
        if spec.get("host_profile"):
            # A separate, unrecorded run: cProfile slows the host several-fold.
            llm.collective_rpc(start_host_profile)
            llm.generate(prompts(concurrency, concurrency), params, use_tqdm=False)
            row["host_profile"] = llm.collective_rpc(
                stop_host_profile, args=(spec["host_profile"],)
            )[0]
        print("ROW " + json.dumps(row), flush=True)


def write_record(path: Path, rows: list[dict], setup: dict, earlier=()) -> None:
    title = setup["shape"] + ("" if "pair" in setup["shape"] else ", synthetic acceptance")
    record = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "earlier_commands": list(earlier),
        "commit": os.environ.get("DSPARK_COMMIT", "unknown"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": next((r["device"] for r in rows if r.get("device")), None),
        "setup": setup,
        "phases": PHASES,
        "rows": rows,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))
    plotted = [r for r in rows if r.get("phases_ms")]
    if not plotted:
        return
    try:
        plot(
            plotted,
            path.with_suffix(".png"),
            f"{title}, on {record['device']}",
        )
    except ImportError as error:  # the JSON is what matters; plot it later
        print(f"no plot: {error}", file=sys.stderr)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", default=",".join(ARMS), help=f"of {', '.join(ARMS)}")
    parser.add_argument(
        "--pair",
        choices=["qwen3-8b", "embedded"],
        default="qwen3-8b",
        help="qwen3-8b: the shape with dummy weights and synthetic acceptance; embedded: the "
        "trained pair, real verification on windows of its held-out text (k=7 arms only)",
    )
    parser.add_argument("--concurrency", default="1,64,256")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rates", default=DEFAULT_RATES)
    parser.add_argument("--shadow-steps", type=int, default=2, help="steps re-run for the split")
    parser.add_argument("--shadow-repeats", type=int, default=6)
    parser.add_argument("--merge", type=Path, help="earlier JSON whose other rows to keep")
    parser.add_argument(
        "--graphs-to", type=int, help="capture CUDA graphs up to this many tokens (every arm)"
    )
    parser.add_argument(
        "--host-profile",
        type=int,
        default=0,
        metavar="N",
        help="after each recorded run, one more under cProfile: the N costliest host functions",
    )
    parser.add_argument("--out", type=Path, required=True, help="JSON (PNG beside it)")
    parser.add_argument("--arm-spec", help=argparse.SUPPRESS)  # the per-arm subprocess
    args = parser.parse_args()
    if args.arm_spec:
        run_arm_here(json.loads(args.arm_spec))
        return 0

    arms = args.arms.split(",")
    unknown = [arm for arm in arms if arm not in ARMS]
    if unknown:
        parser.error(f"unknown arms {unknown}; choose from {list(ARMS)}")
    embedded = args.pair == "embedded"
    if embedded:
        from vllm_dspark.demo import EMBEDDED_PAIR

        # Its drafter was trained with blocks of 7 (see the Block size section).
        fits = [arm for arm in arms if ARMS[arm][0] in (0, 7)]
        if fits != arms:
            parser.error(f"--pair embedded runs k=7 arms only; not {sorted(set(arms) - set(fits))}")
        target, pair_draft = str(EMBEDDED_PAIR / "target"), str(EMBEDDED_PAIR / "draft")
    else:
        root = shape_root("step-breakdown") / SHAPE
        target = write_shape(SHAPE, root)["target"]
    rows, earlier = [], []
    if args.merge:
        merged = json.loads(args.merge.read_text())
        rows, earlier = merged["rows"], [*merged.get("earlier_commands", []), merged["command"]]
    setup = {
        "shape": "embedded pair" if embedded else f"{SHAPE}, dummy weights",
        "engine": {
            k: v for k, v in engine_kwargs("", graphs_to=args.graphs_to).items() if k != "model"
        },
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "rates": None if embedded else args.rates,
        "shadow": {"steps": args.shadow_steps, "repeats": args.shadow_repeats},
    }
    for arm in arms:
        k, acceptance, options = ARMS[arm]
        # Each DSpark arm's draft is written with block_size = k (module docstring).
        if embedded:
            draft = pair_draft if k else None
        else:
            draft = write_shape(SHAPE, root / f"block{k}", block=k)["draft"] if k else None
        spec = {
            "pair": args.pair,
            "target": target,
            "draft": draft,
            "k": k,
            "acceptance": acceptance,
            "options": options,
            "graphs_to": args.graphs_to,
            "host_profile": args.host_profile,
            "rates": args.rates,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "concurrency": [int(c) for c in args.concurrency.split(",")],
            "shadow": {"steps": args.shadow_steps, "repeats": args.shadow_repeats},
        }
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, __file__, "--out", str(args.out), "--arm-spec", json.dumps(spec)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            print(done.stderr[-4000:], file=sys.stderr)
            return done.returncode
        new = [
            {"arm": arm, **json.loads(line[4:])}
            for line in done.stdout.splitlines()
            if line.startswith("ROW ")
        ]
        rows = merge_rows(rows, new)
        write_record(args.out, rows, setup, earlier)
        for row in new:
            phases = row.get("phases_ms") or {}
            shown = ", ".join(f"{key} {v:.3f}" for key, v in phases.items() if v is not None)
            print(
                f"{arm} c={row['concurrency']}: step {row['step_ms_median']} ms, "
                f"sum/step {row['phases_sum_over_step']} ({row['steps_used']} steps) | {shown}",
                flush=True,
            )
        print(f"{arm}: {time.perf_counter() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
