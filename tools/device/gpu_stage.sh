#!/usr/bin/env bash
# One stage of the project's GPU work on the device machine, results under $OUT.
#   bash tools/device/gpu_stage.sh STAGE [COMMIT]
# Stages: kernels (FP8 head tests + benchmark; no vLLM needed), foundation, pair (demo +
# reference check + capacity losslessness), fp8e2e (Qwen3-8B shape, FP8 head on/off),
# sps (SPS curve of the Qwen3-8B shape). vLLM stages expect the bundle parts stashed
# (tools/device/bundle.sh). COMMIT names the tested commit in the JSON results.
set -u
stage=${1:?stage}
export PYTHONUNBUFFERED=1 DSPARK_COMMIT=${2:-unknown} DSPARK_RESULTS_DIR=$OUT
vllm_env() {
  . tools/device/bundle.sh install >/dev/null || exit 1
  . tools/device/register_plugin.sh /tmp/vsite >/dev/null
}
case "$stage" in
  kernels)
    PYTHONPATH=. timeout 200 python3 -m pytest tests/gpu/test_fp8_head_kernel.py -q -p no:cacheprovider 2>&1 | tail -15
    PYTHONPATH=. timeout 330 python3 benchmarks/bench_fp8_draft_head.py --out "$OUT/fp8_head.json" 2>&1 | tail -30
    ;;
  foundation)
    vllm_env
    timeout 480 python3 -m pytest tests/gpu/test_foundation_gpu.py -q -p no:cacheprovider -rA 2>&1 | tail -15
    ;;
  pair)
    vllm_env
    timeout 200 python3 -m vllm_dspark.cli demo --json "$OUT/demo.json" --plot "$OUT/tiny_pair_acceptance.png" > "$OUT/demo.log" 2>&1
    echo "demo rc=$?"; grep -v "^INFO\|^WARNING\|^(EngineCore\|^\[" "$OUT/demo.log" | tail -15
    timeout 330 python3 -m pytest tests/gpu/test_tiny_pair_gpu.py tests/gpu/test_capacity_gpu.py -q -p no:cacheprovider -rA 2>&1 | tail -20
    ;;
  fp8e2e)
    vllm_env
    timeout 560 python3 benchmarks/offline_sweep.py --pair qwen3-8b --arms dspark,dspark-fp8 --concurrency 1,16 --out "$OUT/fp8_e2e.json" 2>&1 | grep -v "^INFO\|^WARNING" | tail -10
    ;;
  sps)
    vllm_env
    timeout 300 python3 benchmarks/profile_dspark_sps_curve.py --shape qwen3-8b --out "$OUT/sps_curve_qwen3_8b.json" 2>&1 | grep -v "^INFO\|^WARNING\|^(EngineCore" | tail -40
    ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
