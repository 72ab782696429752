#!/usr/bin/env bash
# What vLLM's MoE paths need beyond the stock bundle, on the GPU machine: the parts
# tools/device/build_moe_bundle.sh made here (one set: qwen3 or dsv4), after bundle.sh's.
#   there:  bash tools/device/moe_bundle.sh stash PARTS/partNN   # one call per part (carry it)
#   there:  . tools/device/moe_bundle.sh install                 # after bundle.sh install
# `install` puts _moe_C beside the installed vLLM in /tmp/vsite, and for the dsv4 set
# DeepGEMM under vllm/third_party and the wheels beside vLLM; cutlass's DSL packages sit
# in a folder its .pth file names, which PYTHONPATH (not a site dir) does not read: it
# goes on PYTHONPATH itself. Parts stay in /opt/vb/moe_parts while the machine is warm.
#   there:  bash tools/device/moe_bundle.sh save-caches   # into $OUT: jit_caches.tar.gz
# DeepSeek-V4's first engine compiles its DeepGEMM, tilelang and Triton kernels for about
# 14 minutes (H100), and a fresh machine has none of them: save them once, keep the file
# here in .moe-bundle/dsv4-jit/ and stash that folder like a part; `install` then unpacks
# it into $HOME (kernels are compiled for SM90: an H100 or H200 alike).
set -u
cmd=${1:?usage: moe_bundle.sh stash PART | install | save-caches}
site=/tmp/vsite
caches=(.cache/vllm/deep_gemm/cache .tilelang .triton)  # under $HOME
case "$cmd" in
  stash)
    part=${2:?part dir}
    files=$(find "$part" -maxdepth 1 \( -name 'chunk*' -o -name jit_caches.tar.gz \))
    [ -n "$files" ] || { echo "moe_bundle.sh: no chunks or caches in $part" >&2; exit 1; }
    # shellcheck disable=SC2086  # paths without spaces, one a line
    mkdir -p /opt/vb/moe_parts && cp $files /opt/vb/moe_parts/ && ls /opt/vb/moe_parts
    ;;
  save-caches)
    (cd "$HOME" && ls -d "${caches[@]}" 2>/dev/null | tar -czf "$OUT/jit_caches.tar.gz" -T -) \
      && ls -la "$OUT/jit_caches.tar.gz"
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
      if [ -f /opt/vb/moe_parts/jit_caches.tar.gz ]; then
        tar -C "$HOME" -xzf /opt/vb/moe_parts/jit_caches.tar.gz && echo "JIT caches restored"
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
