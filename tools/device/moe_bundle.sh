#!/usr/bin/env bash
# What vLLM's MoE paths need beyond the stock bundle, on the GPU machine: the parts
# tools/device/build_moe_bundle.sh made here (one set: qwen3 or dsv4), after bundle.sh's.
#   there:  bash tools/device/moe_bundle.sh stash PARTS/partNN   # one call per part (carry it)
#   there:  . tools/device/moe_bundle.sh install                 # after bundle.sh install
# `install` puts _moe_C beside the installed vLLM in /tmp/vsite, and for the dsv4 set
# DeepGEMM under vllm/third_party and the wheels beside vLLM; cutlass's DSL packages sit
# in a folder its .pth file names, which PYTHONPATH (not a site dir) does not read: it
# goes on PYTHONPATH itself. Parts stay in /opt/vb/moe_parts while the machine is warm.
# The kernels DeepSeek-V4's first engine compiles (DeepGEMM, tilelang; about 14 minutes)
# are saved and restored with everything else compiled: bundle.sh save-caches.
set -u
cmd=${1:?usage: moe_bundle.sh stash PART | install}
site=/tmp/vsite
case "$cmd" in
  stash)
    part=${2:?part dir}
    mkdir -p /opt/vb/moe_parts && cp "$part"/chunk* /opt/vb/moe_parts/ && ls /opt/vb/moe_parts
    ;;
  install)
    if [ ! -f "$site/.complete" ]; then
      echo "moe_bundle.sh: install vLLM first (. tools/device/bundle.sh install)" >&2
      return 1 2>/dev/null || exit 1
    fi
    if [ ! -f "$site/.moe-complete" ]; then
      rm -rf /opt/vb/moe && mkdir -p /opt/vb
      cat /opt/vb/moe_parts/chunk* | tar -C /opt/vb -xf - || return 1 2>/dev/null || exit 1
      m=/opt/vb/moe
      xz -dc "$m/moe_C.so.xz" > "$site/vllm/_moe_C_stable_libtorch.abi3.so"
      [ -f "$m/deep_gemm.tar.xz" ] && tar -xJf "$m/deep_gemm.tar.xz" -C "$site"
      if ls "$m"/whl/*.whl > /dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
          --target "$site" "$m"/whl/*.whl || return 1 2>/dev/null || exit 1
      fi
      touch "$site/.moe-complete"
    fi
    dsl=$site/nvidia_cutlass_dsl/dsl_packages
    [ -d "$dsl" ] && case ":${PYTHONPATH:-}:" in *":$dsl:"*) ;; *) export PYTHONPATH="$dsl:${PYTHONPATH:-}" ;; esac
    python3 -c "import torch, vllm._moe_C_stable_libtorch  # noqa: F401
from vllm.utils.import_utils import has_deep_gemm, has_tilelang, has_cutedsl
print('moe ready: deep_gemm', has_deep_gemm(), 'tilelang', has_tilelang(), 'cutedsl', has_cutedsl())"
    ;;
  *) echo "moe_bundle.sh: unknown command $cmd" >&2; exit 2 ;;
esac
