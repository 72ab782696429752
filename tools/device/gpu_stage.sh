#!/usr/bin/env bash
# One stage of the project's GPU work on the device machine, results under $OUT.
#   bash tools/device/gpu_stage.sh STAGE [COMMIT]
# Stages:
#   kernels  FP8 head and capacity kernel tests + FP8 head benchmark (no vLLM needed);
#            third argument "tests": the tests alone (about a minute)
#   sharded-heads  the FP8 heads split over two tensor-parallel ranks (threads on one GPU)
#            against one unsharded rank (vLLM installed, no engine)
#   smoke    the capacity kernel tests and one bf16 engine of the embedded pair with every
#            capacity option (~2 min; queue it as "smoke!" so a failure stops the queue)
#   recal    recalibrate the embedded pair's confidence head (tools/train_tiny_pair.py
#            --from-export; no vLLM needed) into /tmp/recal_pair, packed into $OUT; later
#            stages on the same machine run on it; plus the FP8 head's agreement on the
#            pair's real hidden states
#   demo     `vllm-dspark demo` as a user runs it (three engines of the embedded pair: no
#            speculation, fixed k=7, adaptive sps; 1 and 64 requests, bfloat16): its report
#            in demo.log, demo.json (benchmarks/results/demo.json) and demo.png; extra
#            arguments go to the demo (tests/gpu/test_demo_gpu.py runs it with small settings)
#   pair     reference check: vLLM's drafts and confidences against the PyTorch reference's
#   arms     capacity modes (one engine, switched), FP8 heads and FP8 drafter on the pair,
#            against no speculation, and the FP8 drafter's GEMM (vLLM; 4 engines of ~60-90 s);
#            DFlash's controller with mixed steps on the tiny shape (two small engines); a
#            pytest -k expression as the third argument selects; whole log in arms.log
#   fp8e2e   Qwen3-8B shape, FP8 head on/off at concurrency 1 and 16 (vLLM)
#   sps      SPS curve of the Qwen3-8B shape (vLLM), kept in /tmp for the capacity stages;
#            third argument embedded: the embedded pair's target (real weights) instead
#   capacity-qwen3
#            the capacity sweep on the Qwen3-8B shape with calibrated synthetic confidence,
#            one run, in this order: no speculation; sps with dynamic depth and plain
#            steps, sps with plain steps (what depth adds), sps (curve profiled at
#            start-up), budget, threshold (one shared engine); fixed k=7; Dynamic SD.
#            Graphs to 2,048 tokens. On an H100 the three stock engines took 13.6 min
#            (e38413b); the whole stage, ~22 min by estimate (the shared engine has not yet
#            run to its end there), is longer than one call: run it from
#            tools/device/queue.sh, first in a session. Every row is kept as it comes, so
#            a cut run keeps what ran. Third and fourth arguments: other arms (e.g.
#            sps-depth; sps-depth-plain-fp8, an engine of its own), other concurrencies;
#            a fifth, max_num_batched_tokens for every arm (as dflash)
#   refill   steady load (offline_sweep --refill: 4 x c requests into engines of c
#            sequences, most steps carrying a prompt), Qwen3-8B shape, calibrated synthetic
#            confidence: no speculation, sps-depth-plain-lean without mixed steps and with
#            them (its default; one engine); third to fifth arguments: arms, c (64), refill
#   fixed-k  no speculation against stock DSpark with K drafts (third argument, default 3),
#            CUDA graphs to the fourth argument's tokens (default 1024), Qwen3-8B shape,
#            end to end (vLLM; two engines, ~8 min: from the queue); a fifth argument
#            names other arms, e.g. nospec,dspark,dspark-fp8 (an engine each); a sixth, the
#            concurrencies
#   depth    draft step time per physical depth, Qwen3-8B shape (vLLM; one engine)
#   serve    a real `vllm serve` per arm driven by vLLM's own client (`vllm bench serve`) at
#            Poisson request rates and at saturation (benchmarks/serve_bench.py): TPOT and
#            TTFT against output throughput; third argument the setup: embedded (servers of
#            ~60 s) or qwen3-8b (~110-190 s each, 7 arms: from the queue, or name a few);
#            fourth, the arms (default: every one the setup runs); fifth, the request rates.
#            Rows go to serving.json beside the earlier ones: a later call on the same
#            warm machine merges that machine's record (kept in /tmp), a call on a fresh
#            one the committed benchmarks/results/serving.json, so a table grows part by
#            part (each part running nospec and k7 again); each call's per-point client
#            JSON and logs come back as one archive
#   sampling  sampled outputs (temperature 1, top-k / top-p) with every capacity mode
#            against no speculation, as distributions (chi-square), on the embedded pair,
#            and a deliberately biased verifier the test must catch (vLLM; two engines)
#   breakdown  step-time breakdown, Qwen3-8B shape; third argument the arms (each an
#            engine of ~3 min on an H100: from the queue; a later call merges the earlier
#            rows, kept in /tmp on the warm machine); optional: a fourth, graphs up to
#            that many tokens per step (--graphs-to); a fifth, the concurrencies (default
#            1,64,256); a sixth, the steps re-run for the within-graph split (default 2;
#            0: none, every step of the batch as it ran)
#   breakdown-embedded  the same on the embedded pair: nospec, dspark-k7, sps-k7, plain-k7
#            (or the arms given as third argument), graphs to 2048 tokens (~7 min)
#   tp       tensor parallelism 2 (and 4) with every capacity option, against TP 1 without
#            speculation, then setup (b)'s capacity sweep at TP 2 with every rank's
#            admissions compared (vLLM; run on kind nvidia-h200-x2 or -x4, from the queue;
#            a third argument names the sweep's arms)
#   soak     2,000 requests, preemption, aborts, every capacity option, against no
#            speculation (vLLM; two engines, float32)
#   prefix   prefix caching on/off with shared prefixes, stock and plugin (vLLM; 4 engines)
#   dflash   DFlash fixed k=7 against its acceptance-length controller (without and with
#            dynamic depth and plain steps, one shared engine) and no speculation, Qwen3-8B
#            shape, vLLM's synthetic acceptance, graphs to 2,048 tokens (vLLM; three
#            engines, ~10 min); third and fourth arguments: other arms, other concurrencies;
#            a fifth, max_num_batched_tokens for every arm (e.g. 20480: see offline_sweep.py)
#   sts      online STS from temperature 1 on the embedded pair, then the held-out
#            prompts against no speculation (vLLM; two engines, float32)
#   hardening  the GPU tests that time nothing, at once on one GPU (each engine gets a
#            fixed 2 GiB KV cache, so concurrent starts cannot disturb vLLM's memory
#            profiling; the freed-memory test poisons 16 GiB): test_pair_arms_gpu (its
#            float32, bf16-graph and FP8 thirds), test_prefix_cache_gpu, test_freed_memory_gpu,
#            test_soak_gpu, test_draft_slots_gpu; one log, each JSON in its own folder
#   capacity-embedded
#            the same arms on the embedded pair (real verification; 4 engines of ~60 s)
#   capacity-lockstep
#            the embedded pair's arms in engines alive at once, their timed repeats taken
#            in turn (offline_sweep --lockstep); by default four: no speculation, stock k=7
#            twice (two engines of one arm: the noise floor) and sps. Stock k=7's two
#            engines ran 0.997-1.025x apart with four engines (55bf4da) and 0.90-1.08x
#            with eight (155bc4a: every arm, too noisy to rank within 5%), so name other
#            arms (dynamic-sd, budget, threshold, sps-plain, ...) in runs of their own
#            beside nospec and dspark. The engines start at once: four were ready 2.1-2.3
#            min after (3.4-3.7 min on a slow host, b768281), eight 2.4-2.6 min; then
#            ~1.5 s per engine and repeat (eight engines, 9 repeats: ~2.5 min at 1 and 256
#            requests, 1.5 min at 16 and 64); third to fifth arguments: arms,
#            concurrencies, repeats (9)
#   sanitizer  compute-sanitizer memcheck over a short run of the embedded pair with every
#            capacity option (tests/gpu/test_sanitizer_gpu.py; skipped without the tool)
#   moe-lossless  the tiny-moe shape (Qwen3 MoE target, dense DSpark drafter, float32,
#            dummy weights): greedy outputs of fixed k=7 and every capacity mode against
#            no speculation (tests/gpu/test_moe_lossless_gpu.py; three small engines, the
#            capacity modes switched in one; five engines ran past 8 minutes on an H100)
#   moe-qwen3  throughput on the Qwen3-30B-A3B shape with its DSpark drafter, calibrated
#            synthetic confidence: no speculation, fixed k=7, every capacity mode (one
#            shared engine), graphs to 2,048 tokens, at 1, 16, 64, 256 requests; rows
#            {shape, arm, concurrency, tok_s, ...} in moe_qwen3.json (offline_sweep's
#            record: setup names the shape). Third and fourth arguments: other arms, other
#            concurrencies; fifth, "interleave": the shared engine's arms take their
#            repeats in turn, rows with paired ratios (offline_sweep --interleave; e.g.
#            dspark-fixed,sps: sps against its own engine's k=7, repeat by repeat)
#   dsv4-lossless  the tiny-dsv4 shape (DeepSeek-V4, its own DSpark module, bf16 with FP8
#            linears, dummy weights): greedy outputs of stock DSpark k=7 and of every
#            capacity mode verified masked (one engine, switched), then compacted with FULL
#            compact graphs (another engine), against no speculation
#            (tests/gpu/test_dsv4_lossless_gpu.py; four engines); queue it as
#            "dsv4-lossless!" so that a failure stops the queue before the timed stage.
#            Third argument: a CUDA-graph mode for every engine (e.g. FULL_DECODE_ONLY),
#            or "breakable" (VLLM_USE_BREAKABLE_CUDAGRAPH=1 set before vLLM starts);
#            fourth: a pytest -k filter (e.g. "compact": no speculation and the compact
#            engine only)
#   dsv4-probe  stock DSpark k=7 on the tiny-dsv4 shape, eager, with vLLM's default
#            graphs (each PIECEWISE segment synchronised, to name the one that faults; also
#            with no draft graphs, and with breakable graphs on before vLLM starts) and with
#            FULL decode graphs only; and the plugin's sps, masked, with default graphs;
#            every kernel launch synchronous and workspace resizes logged (six engines, 1
#            to 6.5 minutes each). Third argument: a pytest -k filter (e.g. "not eager and
#            not draft")
#   dsv4     throughput on the dsv4-flash-reduced shape (48.7 GB of dummy weights, one
#            80 GB GPU), vLLM's uniform random routing, calibrated synthetic confidence:
#            no speculation, sps verified masked and compacted (one shared engine, second:
#            #59's ratios need no third start), then stock DSpark k=7, graphs to 2,048
#            tokens, at 1, 16, 64, 256 requests, each arm's
#            greedy outputs checked against no speculation's (--greedy-check); rows
#            {shape, arm, verify, concurrency, tok_s, greedy_identical, ...} in
#            deepseek_v4.json. Untimed so far: run it from the queue. Third, fourth and
#            fifth arguments: other arms, other concurrencies, a CUDA-graph mode (e.g.
#            FULL_DECODE_ONLY) or "breakable" (as dsv4-lossless's); sixth: another shape
#            (tiny-dsv4: a first check of the sweep's DeepSeek-V4 path); seventh,
#            "interleave": the shared engine's masked and compact sps take their repeats in
#            turn, rows with paired ratios (as moe-qwen3's fifth; greedy checks at the end)
# MoE stages also need the MoE bundle's parts stashed (tools/device/moe_bundle.sh; set
# qwen3 for the Qwen3 MoE stages, dsv4 for the DeepSeek-V4 ones).
# vLLM stages expect the bundle parts stashed (tools/device/bundle.sh). COMMIT names the
# tested commit in the JSON results.
set -u
stage=${1:?stage}
export PYTHONUNBUFFERED=1 DSPARK_COMMIT=${2:-unknown} DSPARK_RESULTS_DIR=$OUT
RECAL=/tmp/recal_pair
vllm_env() {
  . tools/device/bundle.sh install >/dev/null || exit 1
  . tools/device/register_plugin.sh /tmp/vsite >/dev/null
  # Multi-GPU kinds must keep NVLink multicast off (what and why: the file's comments).
  set -a; . tools/device/no_multicast.env; set +a
}
vllm_moe_env() {
  vllm_env
  . tools/device/moe_bundle.sh install || exit 1
}
vllm_dsv4_env() {
  vllm_moe_env
  watch_compiles
  # DeepGEMM's warmup kernels compiled by 8 processes side by side, in every engine with
  # dummy weights (vllm_dspark/bench/parallel_warmup.py); 0 compiles them one at a time.
  export DSPARK_DEEP_GEMM_WARMUP_WORKERS=${DSPARK_DEEP_GEMM_WARMUP_WORKERS:-8}
  python3 -c "from vllm.utils.import_utils import has_deep_gemm, has_tilelang
import sys; sys.exit(not (has_deep_gemm() and has_tilelang()))" \
    || { echo "$stage: no DeepGEMM or tilelang: stash the MoE bundle's dsv4 set" >&2; exit 1; }
}
watch_compiles() {
  # Every 15 s while the stage runs: the kernels in each JIT cache and the compiler
  # processes, so that a first engine's start-up splits into what it compiled and when.
  while sleep 15; do
    echo "$(date +%T) deep_gemm=$(ls ~/.cache/vllm/deep_gemm/cache 2>/dev/null | wc -l)" \
      "tilelang=$(ls ~/.tilelang/cache 2>/dev/null | wc -l)" \
      "triton=$(ls ~/.triton/cache 2>/dev/null | wc -l) compilers=$(pgrep -c 'nvcc|cicc|ptxas')"
  done >> "$OUT/compile_watch.log" 2>&1 &  # nothing of the stage's pipes is held
  trap "kill $! 2>/dev/null" EXIT
}
dsv4_graphs() {
  # How DeepSeek-V4 engines capture graphs: "breakable" turns vLLM's breakable CUDA graphs
  # on before vLLM is imported (it would only once the model's modules are, see
  # docs/design/deepseek-v4.md); any other value is a cudagraph_mode (graph_mode).
  graph_mode=""
  if [ "$1" = breakable ]; then export VLLM_USE_BREAKABLE_CUDAGRAPH=1; else graph_mode=$1; fi
}
use_recalibrated() {
  # Each call brings a fresh copy of the tree: put the recalibrated pair back in place.
  if [ -d "$RECAL/draft" ]; then
    cp -r "$RECAL"/. vllm_dspark/data/tiny_pair/ && echo "using the recalibrated pair"
  fi
}
# Line-buffered, so that a stage's log under $OUT shows how far it got when it is cut.
# The engine core's own INFO/WARNING/DEBUG lines go too; its errors and tracebacks stay,
# and so do the plugin's own lines ("vllm-dspark: ...").
quiet() {
  # vLLM's log lines dropped, but the plugin's and those that time a start-up phase (the
  # lines offline_sweep.py's START_UP_LINES passes on).
  grep --line-buffered -v -P '^(?!.*(vllm-dspark:|\btook\b|\btakes\b|finished in|compiled \d+ units|Warming up|bytecode transform))(INFO|WARNING|\(EngineCore[^)]*\) (INFO|WARNING|DEBUG)|\[)'
}
case "$stage" in
  kernels)
    vllm_env  # the confidence kernel's test builds the plugin's head (pydantic, vLLM)
    PYTHONPATH=.:$PYTHONPATH timeout 200 python3 -m pytest tests/gpu/test_fp8_head_kernel.py tests/gpu/test_capacity_kernels_gpu.py -q -p no:cacheprovider 2>&1 | tee "$OUT/kernel_gpu_tests.log" | tail -8
    tests_rc=${PIPESTATUS[0]}  # the stage's status: a queue gate ("kernels!") reads it
    [ "${3:-}" = tests ] || PYTHONPATH=.:$PYTHONPATH timeout 200 python3 benchmarks/bench_fp8_draft_head.py --out "$OUT/fp8_head.json" 2>&1 | tail -30
    exit "$tests_rc"
    ;;
  sharded-heads)
    vllm_env
    timeout 300 python3 -m pytest tests/gpu/test_sharded_heads_gpu.py -q -p no:cacheprovider -rA 2>&1 | tee "$OUT/sharded_heads.log" | tail -8
    ;;
  smoke)
    vllm_env; use_recalibrated
    # A fixed KV cache: the smoke can run beside the sanitizer ("smoke+sanitizer").
    export DSPARK_PROBE_KV_CACHE_BYTES=$((2 << 30))
    timeout 500 python3 -m pytest tests/gpu/test_capacity_kernels_gpu.py tests/gpu/test_context_kv_gpu.py tests/gpu/test_smoke_gpu.py \
      -q -p no:cacheprovider -x 2>&1 | tee "$OUT/smoke.log" | tail -15
    exit "${PIPESTATUS[0]}"  # pytest's status, so that "smoke!" gates the queue
    ;;
  recal)
    rm -rf "$RECAL"
    PYTHONPATH=. timeout 400 python3 tools/train_tiny_pair.py --work-dir /tmp/recal_work \
      --from-export vllm_dspark/data/tiny_pair --export-dir "$RECAL" --pack "$OUT" \
      > "$OUT/recalibration.log" 2>&1
    echo "recal rc=$?"; grep "eval\|AUROC\|ECE\|acceptance\|temperatures\|done" "$OUT/recalibration.log" | tail -12
    use_recalibrated
    PYTHONPATH=. timeout 200 python3 -m pytest tests/gpu/test_pair_arms_gpu.py -k agrees -q -p no:cacheprovider -rA 2>&1 | tail -4
    ;;
  demo)
    vllm_env; use_recalibrated
    # The demo's own progress and report lines (vLLM's log is at WARNING unless
    # VLLM_LOGGING_LEVEL says otherwise); each engine start prints a line every 15 s.
    timeout 480 python3 -m vllm_dspark.cli demo --device gpu --json "$OUT/demo.json" \
      --plot "$OUT/demo.png" "${@:3}" > "$OUT/demo.log" 2>&1
    echo "demo rc=$?"; tr '\r' '\n' < "$OUT/demo.log" | grep -v "it/s\]" | tail -40
    ;;
  pair)
    vllm_env; use_recalibrated
    timeout 280 python3 -m pytest tests/gpu/test_tiny_pair_gpu.py -q -p no:cacheprovider -rA 2>&1 | tail -8
    ;;
  arms)
    vllm_env; use_recalibrated
    # A fixed KV cache (no memory profiling), so that it can run beside another stage
    # (queue.sh's "sanitizer+arms:lossless").
    export DSPARK_PROBE_KV_CACHE_BYTES=$((2 << 30))
    timeout 560 python3 -m pytest tests/gpu/test_pair_arms_gpu.py tests/gpu/test_draft_fp8_gpu.py tests/gpu/test_dflash_mixed_gpu.py -q -p no:cacheprovider -rA ${3:+-k "$3"} 2>&1 | tee "$OUT/arms.log" | tail -12
    ;;
  fp8e2e)
    vllm_env
    timeout 560 python3 benchmarks/offline_sweep.py --pair qwen3-8b --arms dspark,dspark-fp8 --concurrency 1,16 --out "$OUT/fp8_e2e.json" 2>&1 | quiet | tail -10
    ;;
  sps)
    vllm_env
    if [ "${3:-qwen3-8b}" = embedded ]; then
      timeout 300 python3 benchmarks/profile_dspark_sps_curve.py --real-weights \
        --target vllm_dspark/data/tiny_pair/target --out "$OUT/sps_curve_embedded.json" 2>&1 \
        | quiet | tail -40
    else
      timeout 300 python3 benchmarks/profile_dspark_sps_curve.py --shape qwen3-8b \
        --out "$OUT/sps_curve_qwen3_8b.json" 2>&1 | quiet | tail -40
      cp "$OUT/sps_curve_qwen3_8b.json" /tmp/sps_curve_qwen3_8b.json
    fi
    ;;
  capacity-qwen3)
    vllm_env
    # 32 requests per repeat at least: at one request, 16 requests' synthetic acceptance
    # draws moved an arm's throughput by +-7% between repeats (06f3fff). CUDA graphs to
    # 2,048 tokens for every arm, as setup (a): with vLLM's 512, a speculative step at 256
    # requests runs the target and the drafter without graphs (README, graph sizes).
    timeout 1500 python3 benchmarks/offline_sweep.py --pair qwen3-8b --acceptance confidence \
      --arms "${3:-nospec,sps-depth-plain,sps-plain,sps,budget,threshold,dspark,dynamic-sd}" \
      --shared-engine \
      --min-requests 32 --graphs-to 2048 --concurrency "${4:-1,16,64,256}" --out "$OUT/$stage.json" \
      ${5:+--max-num-batched-tokens "$5"} \
      2>&1 | quiet \
      | tee "$OUT/$stage.log" | tail -30
    ;;
  refill)
    vllm_env
    # Steady load: each wave submits 4 x c requests into engines of max_num_seqs c, so most
    # steps carry a prompt (mixed steps compact those; the -unmixed arm verifies all K
    # there). Third argument: arms; fourth: the one concurrency; fifth: the refill.
    timeout 1100 python3 benchmarks/offline_sweep.py --pair qwen3-8b --acceptance confidence \
      --arms "${3:-nospec,sps-depth-plain-lean-unmixed,sps-depth-plain-lean}" --shared-engine \
      --graphs-to 2048 --concurrency "${4:-64}" --refill "${5:-4}" --min-requests 256 \
      --out "$OUT/refill.json" 2>&1 | quiet | tee "$OUT/refill.log" | tail -14
    ;;
  fixed-k)
    vllm_env
    # End to end: no speculation against stock DSpark with K drafts (third argument, 3),
    # CUDA graphs to the fourth argument's tokens (1024), vLLM's synthetic acceptance.
    k=${3:-3}; graphs=${4:-1024}
    timeout 900 python3 benchmarks/offline_sweep.py --pair qwen3-8b --arms "${5:-nospec,dspark}" \
      --num-drafts "$k" --graphs-to "$graphs" --min-requests 32 --concurrency "${6:-1,16,64,256}" \
      --out "$OUT/fixed_k${k}_graphs$graphs.json" 2>&1 | quiet | tee "$OUT/$stage.log" | tail -12
    ;;
  depth)
    vllm_env
    timeout 400 python3 benchmarks/draft_depth_time.py --out "$OUT/depth_time.json" 2>&1 | quiet | tail -30
    ;;
  serve)
    vllm_env; use_recalibrated
    # One record for every setup and part (serving.json): this machine's latest, else the
    # committed table, so that each part adds its rows beside the earlier parts'.
    setup=${3:?setup}; name=serving; merge=()
    for earlier in "/tmp/$name.json" "benchmarks/results/$name.json"; do
      [ -f "$earlier" ] && { merge=(--merge "$earlier"); break; }
    done
    # The JSON and plot are rewritten after every point, so a cut run keeps what ran.
    timeout 1500 python3 benchmarks/serve_bench.py --setup "$setup" ${4:+--arms "$4"} \
      ${5:+--rates "$5"} "${merge[@]}" --out "$OUT/$name.json" 2>&1 \
      | grep --line-buffered "^{\|Error\|error\|failed" | tee "$OUT/$name.log" | tail -40
    [ -f "$OUT/$name.json" ] && cp "$OUT/$name.json" "/tmp/$name.json"
    # One archive for the points' client results and the server logs (the device returns
    # at most 8 files).
    tar czf "$OUT/${name}_points.tar.gz" -C "$OUT" "${name}_points" && rm -rf "$OUT/${name}_points"
    ;;
  sampling)
    vllm_env; use_recalibrated
    # Fixed KV caches: the test runs its engines side by side.
    timeout 560 python3 -m pytest tests/gpu/test_sampling_lossless_gpu.py -q -p no:cacheprovider -rA \
      2>&1 | tee "$OUT/sampling.log" | tail -15
    ;;
  breakdown)
    vllm_env
    # Rows merge only with earlier rows of the same engine arguments (graphs or not).
    name=step_breakdown${4:+_graphs$4}
    merge=(); [ -f "/tmp/$name.json" ] && merge=(--merge "/tmp/$name.json")
    timeout 900 python3 benchmarks/step_breakdown.py --arms "${3:?arms}" "${merge[@]}" \
      ${4:+--graphs-to "$4"} ${5:+--concurrency "$5"} ${6:+--shadow-steps "$6"} \
      --host-profile 40 --out "$OUT/$name.json" \
      2>&1 | quiet | tail -20
    cp "$OUT/$name.json" "/tmp/$name.json"
    ;;
  breakdown-embedded)
    vllm_env; use_recalibrated
    # Setup (a)'s step: no speculation, fixed k=7, sps (whose closed draft gate's steps
    # show what skipping still costs) and sps with plain steps, graphs to 2048 tokens as
    # capacity-embedded.
    timeout 900 python3 benchmarks/step_breakdown.py --pair embedded --graphs-to 2048 \
      --arms "${3:-nospec,dspark-k7,sps-k7,plain-k7}" --host-profile 40 --out "$OUT/step_breakdown_embedded.json" \
      2>&1 | quiet | tee "$OUT/$stage.log" | tail -20
    ;;
  tp)
    vllm_env; use_recalibrated
    timeout 1500 python3 -m pytest tests/gpu/test_tp_gpu.py -q -p no:cacheprovider -rA 2>&1 \
      | tee "$OUT/tp_test.log" | tail -8
    # capacity-qwen3's sweep at TP 2; its log keeps each row should the stage be cut.
    timeout 1500 python3 benchmarks/offline_sweep.py --pair qwen3-8b --acceptance confidence \
      --arms "${3:-nospec,dspark,dynamic-sd,budget,threshold,sps,sps-depth,sps-plain}" --shared-engine \
      --min-requests 32 --tensor-parallel-size 2 --concurrency 1,16,64,256 \
      --out "$OUT/capacity_tp2.json" 2>&1 | quiet | tee "$OUT/capacity_tp2.log" | tail -30
    ;;
  soak)
    vllm_env; use_recalibrated
    timeout 580 python3 -m pytest tests/gpu/test_soak_gpu.py -q -p no:cacheprovider -rA 2>&1 | tail -8
    ;;
  prefix)
    vllm_env; use_recalibrated
    timeout 560 python3 -m pytest tests/gpu/test_prefix_cache_gpu.py -q -p no:cacheprovider -rA 2>&1 | tail -8
    ;;
  dflash)
    vllm_env
    # The acceptance arms share one engine (started with depth graphs and plain steps).
    # Graphs to 2,048 tokens for every arm, as capacity-qwen3: at 94a15b3 (vLLM's 512), 103
    # of dflash-depth's 193 steps at 256 requests (depth 2-3: 768-1,024 tokens) ran eager.
    # 32 requests a repeat at least, as capacity-qwen3: at 16 (one request, 16 waves) the
    # repeats of one arm spread 5% (47bc5ae, H200), more than the arms differed.
    timeout 1100 python3 benchmarks/offline_sweep.py --pair qwen3-8b --shared-engine --graphs-to 2048 \
      --min-requests 32 \
      --arms "${3:-nospec,dflash,dflash-acceptance,dflash-depth,dflash-plain,dflash-depth-plain}" \
      --concurrency "${4:-1,16,64,256}" ${5:+--max-num-batched-tokens "$5"} \
      --out "$OUT/dflash_acceptance.json" 2>&1 | quiet \
      | tee "$OUT/dflash.log" | tail -14
    ;;
  sts)
    vllm_env; use_recalibrated
    timeout 500 python3 benchmarks/online_sts_convergence.py --out "$OUT/online_sts.json" 2>&1 | quiet | tail -20
    ;;
  hardening)
    vllm_env; use_recalibrated
    export DSPARK_PROBE_KV_CACHE_BYTES=$((2 << 30)) DSPARK_PROBE_POISON_GIB=16
    # name:test file:-k expression; each writes its JSON under $OUT/name.
    runs="arms32:pair_arms:lossless arms16:pair_arms:compacted fp8:pair_arms:fp8
      prefix:prefix_cache: freed:freed_memory: soak:soak: slots:draft_slots:"
    for run in $runs; do
      IFS=: read -r name test expr <<< "$run"; mkdir -p "$OUT/$name"
      # Own compile caches: concurrent writers of one cache entry could read it half-written.
      DSPARK_RESULTS_DIR=$OUT/$name VLLM_CACHE_ROOT=/tmp/vcache_$name \
        TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_$name timeout 570 python3 -m pytest \
        "tests/gpu/test_${test}_gpu.py" ${expr:+-k "${expr//_/ }"} -q -p no:cacheprovider -rA \
        > "/tmp/hardening_$name.log" 2>&1 &
    done
    wait
    for run in $runs; do
      # The probes' own error output (vLLM's root cause) is in the assertion text.
      name=${run%%:*}; echo "== $name"
      grep -v "^INFO\|^WARNING\|^DEBUG\|it/s\]" "/tmp/hardening_$name.log" | tail -150
    done > "$OUT/hardening.log"
    grep "^==\|passed\|failed\|Error" "$OUT/hardening.log" | head -60
    python3 tools/hardening_summary.py "$OUT" --out "$OUT/hardening.json"
    ;;
  sanitizer)
    vllm_env; use_recalibrated
    # memcheck slows every kernel down by an order of magnitude: one short run. A fixed KV
    # cache, so that it can run beside another stage (queue.sh's "sts+sanitizer").
    export DSPARK_PROBE_KV_CACHE_BYTES=$((2 << 30))
    # It took more than 580 s at 2e9fa62 (Firecracker runtime); the test ends its probe
    # within 1,100 s, memcheck's log in $OUT either way.
    timeout 1200 python3 -m pytest tests/gpu/test_sanitizer_gpu.py -q -p no:cacheprovider -rA \
      2>&1 | tail -20
    ;;
  capacity-embedded)
    vllm_env
    # Graphs to 2048 tokens (every arm): the tiny pair is host-bound, and vLLM's default
    # 512 leaves speculative steps past 64 requests (and their drafter) eager. The first
    # engine (no speculation) took 2 min at 2e9fa62: 1,200 s for the four.
    # Optional: arms ($3) and concurrencies ($4) instead of the full table, timed repeats
    # ($5; 3: one row's repeats spread up to 20% at 9da6cdd), and "mirror" ($6: the shared
    # engine's arms run again in reverse order; at 9da6cdd the later an arm ran in it,
    # the faster it ran at one request). --bracket: the
    # first engine (no speculation) runs again last: in both step_breakdown_embedded runs
    # at 54f3c3a and 9c5cbbb the engine started first had the slower steps.
    timeout 1200 python3 benchmarks/offline_sweep.py --pair embedded --graphs-to 2048 \
      --arms "${3:-nospec,dspark,dynamic-sd,budget,threshold,sps,sps-depth,sps-plain,sps-batch,dspark-fixed}" --shared-engine \
      --concurrency "${4:-1,16,64,256}" --repeats "${5:-3}" ${6:+--$6} --bracket \
      --out "$OUT/$stage.json" 2>&1 | quiet \
      | tee "$OUT/$stage.log" \
      | tail -30
    ;;
  capacity-lockstep)
    vllm_env
    # At 78ed08b (H100) one row's repeats of 0.1-2 s spread 1.2x at the median and stock
    # k=7's own engine ran 66,289 and 43,358 tok/s at 256 ten minutes apart, while every
    # speculating arm made the same decisions: only arms measured in the same seconds
    # compare. 8 requests a repeat at one request (1 s).
    timeout 1500 python3 benchmarks/offline_sweep.py --pair embedded --graphs-to 2048 \
      --arms "${3:-nospec,dspark,dspark,sps}" \
      --lockstep --concurrency "${4:-1,16,64,256}" --repeats "${5:-9}" --min-requests 8 \
      --out "$OUT/$stage.json" 2>&1 | quiet \
      | tee "$OUT/$stage.log" \
      | tail -30
    ;;
  moe-lossless)
    vllm_moe_env
    timeout 900 python3 -m pytest tests/gpu/test_moe_lossless_gpu.py -q -p no:cacheprovider -rA \
      2>&1 | tee "$OUT/moe_lossless.log" | tail -12
    exit "${PIPESTATUS[0]}"  # pytest's status, so that "moe-lossless!" gates the queue
    ;;
  moe-qwen3)
    case ${5:-} in ""|interleave) ;; *) echo "moe-qwen3: fifth argument: interleave" >&2; exit 2 ;; esac
    vllm_moe_env
    # The capacity-qwen3 sweep on the MoE target: no speculation, stock fixed k=7, then
    # the capacity modes in one shared engine.
    timeout 1500 python3 benchmarks/offline_sweep.py --pair qwen3-30b-a3b --acceptance confidence \
      --arms "${3:-nospec,dspark,sps-depth-plain,sps,budget,threshold}" --shared-engine \
      --min-requests 32 --graphs-to 2048 --concurrency "${4:-1,16,64,256}" \
      ${5:+--interleave} --out "$OUT/moe_qwen3.json" 2>&1 | quiet | tee "$OUT/moe_qwen3.log" | tail -30
    ;;
  dsv4-probe)
    vllm_dsv4_env
    # Synchronous launches, and a log line for every workspace resize (a graph captured
    # before one would replay into freed memory).
    CUDA_LAUNCH_BLOCKING=1 VLLM_DEBUG_WORKSPACE=1 timeout 900 python3 -m pytest \
      tests/gpu/test_dsv4_lossless_gpu.py -k "starts_and_generates${3:+ and $3}" -q \
      -p no:cacheprovider -rA 2>&1 | tee "$OUT/dsv4_probe.log" | tail -60
    exit "${PIPESTATUS[0]}"
    ;;
  dsv4-lossless)
    vllm_dsv4_env
    # An optional CUDA-graph mode for every engine (e.g. FULL_DECODE_ONLY), or "breakable";
    # then an optional pytest -k filter (e.g. compact).
    dsv4_graphs "${3:-}"
    DSV4_CUDAGRAPH_MODE=${graph_mode:-} timeout 2400 python3 -m pytest \
      tests/gpu/test_dsv4_lossless_gpu.py -k "not starts_and_generates${4:+ and $4}" \
      -q -p no:cacheprovider -rA 2>&1 | tee "$OUT/dsv4_lossless.log" | tail -12
    exit "${PIPESTATUS[0]}"  # pytest's status, so that "dsv4-lossless!" gates the queue
    ;;
  dsv4)
    case ${7:-} in ""|interleave) ;; *) echo "dsv4: seventh argument: interleave" >&2; exit 2 ;; esac
    vllm_dsv4_env
    dsv4_graphs "${5:-}"
    # Dummy routers send every token to the same few experts (docs/design/deepseek-v4.md):
    # balanced random routing instead, which changes no output (the experts are zero).
    export VLLM_MOE_ROUTING_SIMULATION_STRATEGY=uniform_random
    timeout 3600 python3 benchmarks/offline_sweep.py --pair "${6:-dsv4-flash-reduced}" --acceptance confidence \
      --arms "${3:-nospec,sps-masked,sps,dspark}" --shared-engine \
      --greedy-check --min-requests 32 --graphs-to 2048 --concurrency "${4:-1,16,64,256}" \
      ${graph_mode:+--cudagraph-mode "$graph_mode"} ${7:+--interleave} --out "$OUT/deepseek_v4.json" 2>&1 \
      | quiet | tee "$OUT/deepseek_v4.log" | tail -30
    ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
