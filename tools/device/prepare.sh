#!/usr/bin/env bash
# Build, here, the parts a device session carries, once per checkout: the ignored folders
# that hold them (.parts/, .moe-bundle/) do not come with a new checkout.
#   bash tools/device/prepare.sh [qwen3] [dsv4]
# Always: the stock vLLM bundle with the wheels `vllm serve` needs, split into
# .parts/partNN (tools/device/bundle.sh); each named MoE set into .moe-bundle/SET/partNN
# (tools/device/build_moe_bundle.sh). What is already there is kept. About 2 minutes for
# the stock parts; the dsv4 set downloads about 210 MB.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exclude=$(git rev-parse --git-common-dir)/info/exclude
mkdir -p "$(dirname "$exclude")"
for folder in .vllm-bundle .serve-whl; do
  grep -qx "/$folder/" "$exclude" 2>/dev/null || echo "/$folder/" >> "$exclude"
done
if [ ! -d .parts/part00 ]; then
  [ -d .vllm-bundle/p2 ] || bash ../shared/device/build_vllm_bundle.sh .vllm-bundle
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    -d .serve-whl -r tools/device/serve-wheels.txt
  bash tools/device/bundle.sh split .vllm-bundle .parts .serve-whl
fi
for set_name in "$@"; do
  [ -d ".moe-bundle/$set_name/part00" ] || bash tools/device/build_moe_bundle.sh "$set_name"
done
ls -d .parts/part* .moe-bundle/*/part* 2>/dev/null || true
