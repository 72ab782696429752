#!/usr/bin/env bash
# Bring stock vLLM 0.26.0 to a registry-less GPU machine in pieces small enough to travel
# beside this repository (which carries the ~15 MB embedded model pair).
#
#   here:   bash tools/device/bundle.sh split BUNDLE PARTS [XWHL]  # after shared/device/build_vllm_bundle.sh
#   there:  bash tools/device/bundle.sh stash PARTS/partNN    # one call per part (carry it)
#   there:  . tools/device/bundle.sh install                  # once all parts are stashed
#   there:  bash tools/device/bundle.sh save-caches NAME [CACHE...]  # into $OUT: NAME_caches.tar.gz.N
# A part travels as one carried folder of PART_MIB (default 34) MiB: a call carries 64 MiB,
# the tree (~24 MiB) included; the machine keeps stashed parts
# in /opt/vb/parts while it stays warm. `install` rebuilds the bundle's two archives and
# the wheel folder from them and installs vLLM under /tmp/vsite, then sets PYTHONPATH.
# XWHL, optional, is a folder of extra wheels (e.g. .serve-whl, fetched as
# tools/device/serve-wheels.txt says: what `vllm serve` needs beyond the bundle); they
# travel in the same stream as xwhl/ and install beside vLLM.
# A fresh machine compiles every kernel again: Triton's, torch.compile's per engine
# configuration (about 40 s an engine) and, for DeepSeek-V4, DeepGEMM's and tilelang's
# (about 14 minutes). `save-caches` packs what this machine compiled (finished kernels
# only; CACHE names some of triton, torch_compile, deep_gemm, tilelang: by default all,
# `deep_gemm tilelang` for an archive small enough to commit) as pieces under 16 MiB;
# keep them here and stash them like parts, at most 34 MiB a call (`stash` takes chunks
# and caches alike); `install` unpacks each archive whose pieces are all stashed into
# $HOME once. Kernels are compiled for SM90: an H100 or H200 alike.
set -u
cmd=${1:?usage: bundle.sh split|stash|install|save-caches|restore-caches ...}
declare -A cache_dirs=([triton]=.triton/cache [torch_compile]=.cache/vllm/torch_compile_cache
  [deep_gemm]=.cache/vllm/deep_gemm/cache [tilelang]=.tilelang)  # under $HOME
stashed=${VB_PARTS:-/opt/vb/parts}

# A cache archive committed here travels with the tree (only committed files outlive a
# checkout): keep the small ones a later session needs, such as DeepGEMM's kernels.
committed=${BASH_SOURCE[0]%/*}/caches

# Unpack into $HOME each cache archive, stashed or committed, whose pieces are all here, once.
restore_caches() {
  local archive
  for archive in $(ls "$stashed"/*_caches.tar.gz* "$committed"/*_caches.tar.gz* 2>/dev/null \
      | grep -v '\.restored$' | sed 's/\.gz\..*$/.gz/' | sort -u); do
    [ ! -f "$stashed/${archive##*/}.restored" ] || continue
    if cat "$archive"* | gzip -t 2>/dev/null; then  # reads the whole archive: a piece missing fails
      mkdir -p "$stashed" && cat "$archive"* | tar -C "$HOME" -xzf - \
        && touch "$stashed/${archive##*/}.restored" && echo "restored ${archive##*/}"
    else
      echo "bundle.sh: ${archive##*/} is not whole yet (stash its other pieces); not restored" >&2
    fi
  done
}

case "$cmd" in
  split)
    bundle=${2:?bundle dir}; parts=${3:?parts dir}; xwhl=${4:-}; xw=()
    if [ -n "$xwhl" ]; then
      xw=($(cd "$xwhl" && ls *.whl)) || exit 1
      xw=(-C "$(cd "$xwhl" && pwd)" --transform 's,^[^/]*\.whl$,xwhl/&,' "${xw[@]}")
    fi
    rm -rf "$parts"/part* "$parts/stream" && mkdir -p "$parts/stream"
    tar -C "$bundle" -cf - p1/vllm_C.so.xz p2 "${xw[@]}" | split -b "${PART_MIB:-34}M" -d -a 2 - "$parts/stream/chunk"
    for chunk in "$parts"/stream/chunk*; do
      n=${chunk##*chunk}; mkdir -p "$parts/part$n"; mv "$chunk" "$parts/part$n/"
    done
    rmdir "$parts/stream"; ls -la "$parts"/part*
    ;;
  stash)
    part=${2:?part dir}
    files=$(find "$part" -maxdepth 1 \( -name 'chunk*' -o -name '*_caches.tar.gz*' \))
    [ -n "$files" ] || { echo "bundle.sh: no chunks or caches in $part" >&2; exit 1; }
    # shellcheck disable=SC2086  # paths without spaces, one a line
    mkdir -p "$stashed" && cp $files "$stashed"/ && ls "$stashed"
    ;;
  save-caches)
    name=${2:?name, e.g. dense or dsv4}; shift 2
    [ $# -gt 0 ] || set -- "${!cache_dirs[@]}"
    dirs=()
    for cache in "$@"; do
      [ -n "${cache_dirs[$cache]:-}" ] || { echo "bundle.sh: no cache $cache (${!cache_dirs[*]})" >&2; exit 2; }
      dirs+=("${cache_dirs[$cache]}")
    done
    # pieces of 15 MiB: a file comes back from $OUT only under 16 MiB
    (cd "$HOME" && ls -d "${dirs[@]}" 2>/dev/null | tar -czf - -T -) \
      | split -b 15M -d -a 1 - "$OUT/${name}_caches.tar.gz." && ls -la "$OUT"
    ;;
  restore-caches) restore_caches ;;
  install)
    site=/tmp/vsite
    if [ ! -f "$site/.complete" ]; then
      rm -rf /opt/vb/bundle "$site" && mkdir -p /opt/vb/bundle "$site"
      cat "$stashed"/chunk* | tar -C /opt/vb/bundle -xf - || return 1 2>/dev/null || exit 1
      b=/opt/vb/bundle
      xw=("$b"/xwhl/*.whl); [ -e "${xw[0]}" ] || xw=()
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
        "$b"/p2/whl/*.whl "${xw[@]}"
      tar -xJf "$b/p2/vllm_rest.tar.xz" -C "$site"
      xz -dc "$b/p1/vllm_C.so.xz" > "$site/vllm/_C_stable_libtorch.abi3.so"
      touch "$site/.complete"
    fi
    restore_caches
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    python3 -c "import vllm; print('vllm', vllm.__version__, 'ready')"
    ;;
  *) echo "bundle.sh: unknown command $cmd" >&2; exit 2 ;;
esac
