#!/usr/bin/env bash
# Run several gpu_stage.sh stages one after another in the background of a warm device
# machine, so that the GPU never waits for the next call and no stage is cut at one call's
# 10-minute limit. Device time counts while the machine is held, busy or not: queue the
# session's work once, then keep calling `wait` back to back.
#
#   bash tools/device/queue.sh start COMMIT STAGE[:ARG...][+STAGE...][!] ...  # returns at once
#   bash tools/device/queue.sh wait SECONDS   # until the queue ends or SECONDS pass, then
#                                             # packs every result so far into $OUT
#   bash tools/device/queue.sh stop           # ends the running queue and its stages' processes
#
# `start` copies the tree to /tmp/queue/tree first (QUEUE_ROOT overrides /tmp/queue): each
# device call brings a fresh copy of the repository, which must not change under a running
# stage. Each stage writes into /tmp/queue/results/STAGE-N/ (its $OUT) and logs to
# /tmp/queue/log. A stage written with a trailing ! gates the rest: when it fails, the
# queue stops there (so a broken build does not spend the session's device time); give the
# machine back then. `wait` returns one archive, results.tar.gz (the device returns at most 8
# files), and prints the log's tail; on a machine where no queue ran (a fresh one: the
# earlier went back while idle) it says so and fails. The device copy has no .git: name
# the commit.
set -u
cmd=${1:?usage: queue.sh start COMMIT STAGE... | wait SECONDS | stop}
root=${QUEUE_ROOT:-/tmp/queue}
case "$cmd" in
  start)
    commit=${2:?commit}; shift 2
    [ -f "$root/running" ] && { echo "a queue is running: $(cat "$root/running")"; exit 1; }
    mkdir -p "$root/results" "$root/tree"
    cp -r . "$root/tree/" && echo "$*" > "$root/running"
    # A new session (setsid): the device machine ends a call's other processes.
    setsid bash "$root/tree/tools/device/queue.sh" run "$commit" "$@" \
      < /dev/null > /dev/null 2>&1 &
    echo $! > "$root/pid"  # the new session's leader: its process group holds every stage
    echo "queued: $*"
    ;;
  run)  # what `start` runs in the background, from the copied tree
    commit=${2:?commit}; shift 2
    cd "$root/tree" || exit 1
    n=$(ls "$root/results" | wc -l)  # a later queue adds to the earlier results
    for item in "$@"; do
      echo "== $(date +%T) $item" >> "$root/log"
      # Stages joined by + run side by side (only ones that time nothing), after a single
      # bundle install (concurrent installs into one folder would race), each with its own
      # compile caches (concurrent writers of one entry could read it half-written).
      IFS=+ read -ra group <<< "${item%!}"
      side_by_side=$(( ${#group[@]} > 1 ))
      [ "$side_by_side" = 1 ] && bash -c '. tools/device/bundle.sh install' >> "$root/log" 2>&1
      pids=()
      for member in "${group[@]}"; do
        n=$((n + 1)); IFS=: read -ra args <<< "$member"; stage=${args[0]}
        out="$root/results/$stage-$n"; mkdir -p "$out"; caches=()
        [ "$side_by_side" = 1 ] && caches=(VLLM_CACHE_ROOT=/tmp/vcache_$n TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_$n)
        env OUT="$out" "${caches[@]}" bash tools/device/gpu_stage.sh "$stage" "$commit" \
          "${args[@]:1}" > "$out.log" 2>&1 &
        pids+=($!)
      done
      rc=0
      for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
      cat "$root"/results/*.log >> "$root/log"; rm -f "$root"/results/*.log  # this item's
      echo "== $(date +%T) $item rc=$rc" >> "$root/log"
      if [ "$rc" != 0 ] && [ "$item" != "${item%!}" ]; then
        echo "== $(date +%T) queue stopped: $item failed" >> "$root/log"; break
      fi
    done
    rm -f "$root/running"
    ;;
  wait)
    seconds=${2:?seconds}; waited=0
    if [ ! -f "$root/running" ] && [ ! -f "$root/log" ]; then
      # No queue ever ran here: the machine is a fresh one (the earlier went back idle).
      echo "no queue on this machine: it is a fresh one, which has no stashed parts either"
      exit 3
    fi
    while [ -f "$root/running" ] && [ "$waited" -lt "$seconds" ]; do
      sleep 5; waited=$((waited + 5))
    done
    cp "$root/log" "$root/results/queue.log" 2>/dev/null
    tar -C "$root" -czf "$OUT/results.tar.gz" results
    [ -f "$root/running" ] && echo "still running: $(cat "$root/running")" || echo "queue done"
    grep "^== " "$root/log" | tail -20
    ;;
  stop)
    # By process group, not by name: `pkill -f NAME` in a call also matches the call's own
    # command line, and killing the call's shell ends the call.
    [ -f "$root/pid" ] || { echo "no queue has run here"; exit 3; }
    group=$(cat "$root/pid")
    kill -TERM -- "-$group" 2>/dev/null; sleep 5; kill -KILL -- "-$group" 2>/dev/null
    rm -f "$root/running"
    echo "== $(date +%T) queue stopped by queue.sh stop" >> "$root/log"
    grep "^== " "$root/log" | tail -5
    ;;
  *) echo "queue.sh: unknown command $cmd" >&2; exit 2 ;;
esac
