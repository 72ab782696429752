#!/usr/bin/env bash
# Build, here (PyPI reachable), what vLLM 0.26.0's MoE paths need beyond the stock bundle
# (shared/device/build_vllm_bundle.sh leaves these out), as parts of PART_MIB (default 34)
# MiB that travel one per device call beside the tree (tools/device/moe_bundle.sh stashes and
# installs them there):
#   qwen3  vllm/_moe_C_stable_libtorch.abi3.so (xz): the fused MoE path's routing and
#          alignment ops, all a bf16 Qwen3MoeForCausalLM target needs beyond the bundle
#   dsv4   qwen3's, plus vllm/third_party/deep_gemm (cp312 extension, headers for its JIT)
#          and the wheels DeepSeek-V4's NVIDIA path imports on Hopper: tilelang (mHC) with
#          z3-solver (its libtvm links libz3) and torch-c-dlpack-ext; nvidia-cutlass-dsl
#          with its base, core and cu13 libraries (the compressor's head-512 kernels, the
#          indexer's and the K-cache gather's; cu12 left out: the image's driver is CUDA 13)
#          and quack-kernels (those kernels import it); compressed-tensors with loguru (a
#          quantized model's config imports them). tokenspeed-mla is left out: its
#          backends take compute capability 10 only.
# Usage, from the checkout root: bash tools/device/build_moe_bundle.sh SET [OUTDIR]
# OUTDIR (default .moe-bundle; git-ignored through .git/info/exclude) gets SET/partNN/.
set -euo pipefail
set_name=${1:?usage: build_moe_bundle.sh qwen3|dsv4 [OUTDIR]}
out=${2:-.moe-bundle}
case "$set_name" in qwen3|dsv4) ;; *) echo "unknown set $set_name" >&2; exit 2 ;; esac
exclude=$(git rev-parse --git-common-dir)/info/exclude
grep -qx "/$out/" "$exclude" 2>/dev/null || echo "/$out/" >> "$exclude"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
stage=$tmp/stage/moe
mkdir -p "$stage" "$tmp/w"
python3 -m pip download -q --no-deps vllm==0.26.0 -d "$tmp/w"
(cd "$tmp" && python3 -m zipfile -e w/vllm-0.26.0-*.whl x)
xz -T2 -6 -c "$tmp/x/vllm/_moe_C_stable_libtorch.abi3.so" > "$stage/moe_C.so.xz"
if [ "$set_name" = dsv4 ]; then
  # DeepGEMM's extension for the machine's Python (3.12) only.
  find "$tmp/x/vllm/third_party/deep_gemm" -name "_C.cpython-*.so" ! -name "*cpython-312*" -delete
  tar -C "$tmp/x" -cf - vllm/third_party/deep_gemm | xz -T2 -6 > "$stage/deep_gemm.tar.xz"
  plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
  for req in tilelang==0.1.9 z3-solver==4.15.4.0 torch-c-dlpack-ext==0.1.5 \
             nvidia-cutlass-dsl==4.6.0 nvidia-cutlass-dsl-libs-base==4.6.0 \
             nvidia-cutlass-dsl-libs-core==4.6.0 nvidia-cutlass-dsl-libs-cu13==4.6.0 \
             quack-kernels==0.6.3 compressed-tensors==0.17.0 loguru==0.7.3; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp "${plat[@]}" -d "$stage/whl" "$req"
  done
fi
parts=$out/$set_name
rm -rf "$parts" && mkdir -p "$parts/stream"
tar -C "$tmp/stage" -cf - moe | split -b "${PART_MIB:-34}M" -d -a 2 - "$parts/stream/chunk"
for chunk in "$parts"/stream/chunk*; do
  n=${chunk##*chunk}; mkdir -p "$parts/part$n"; mv "$chunk" "$parts/part$n/"
done
rmdir "$parts/stream"
ls -lR "$stage"
du -b "$parts"/part* | sort -k2
