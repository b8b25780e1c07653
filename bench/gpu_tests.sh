#!/usr/bin/env bash
# The GPU test suite on the lent H200, in parallel pytest shards, within one device call (600 s at most):
# every test marked gpu, and every test of the files that run on CUDA when it is there
# (`DEVICE = "cuda" if torch.cuda.is_available() ...`: the kernels' whole grids, compiled). From the root:
#   bash bench/gpu_tests.sh                                  # the whole suite
#   bash bench/gpu_tests.sh tests/test_kernels_linear.py ... # the GPU tests of these files
#   SHARDS=8 LIMIT=300 bash bench/gpu_tests.sh ...           # shards (12), each one's limit in s (520)
#   TEST_TIMEOUT=120 bash bench/gpu_tests.sh                 # one test's limit in s (300)
#   SAVE_TRITON_CACHE=1 bash bench/gpu_tests.sh              # also write $OUT/triton_cache.txz
# Carry what bench/gpu_env.sh sets up: gguf's wheel (.whl/gguf-*.whl) and the default model's GGUF, which
# the engine's GPU tests load (.assets/$GGUF.part*, one a call). Compiling is most of the time (the whole
# suite: about 300 s on an H200 host with 16 cores, cold). A later call on a fresh machine, carrying the
# triton_cache.txz written on request as .assets/triton_cache.txz, starts warm (writing it takes minutes).
# Each shard's torch gets its share of the cores: the CPU reference runs beside the GPU in some tests,
# and 12 shards of 16 threads each on 16 cores left one of them past its limit.
# Prints the failures and each shard's summary; $OUT/gpu_tests.log holds every shard's log. Exits 1 when a
# shard failed or ran out of time.
set -u
. "$(dirname "$0")/gpu_env.sh"
shards=${SHARDS:-12} limit=${LIMIT:-520}
threads=$(($(nproc) / shards))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((threads > 0 ? threads : 1))}
# a test stuck in Python past this fails alone (pytest-timeout, in the GPU image), not its whole shard;
# on an empty Triton cache a test's compiles beside eleven shards' took over 200 s (test_graphs_cuda's
# [one-int8]; its file's four cases took 16 s warm)
per_test=()
python3 -c "import pytest_timeout" 2> /dev/null && per_test=(--timeout "${TEST_TIMEOUT:-300}")
[ $# -gt 0 ] || set -- tests/test_*.py
marked=$(grep -l "pytest.mark.gpu" "$@")
on_cuda=$(grep -l '^DEVICE = "cuda" if torch.cuda.is_available()' "$@")
# a file that does not import (a wheel not carried) is named, not dropped
collect() {
    python3 -m pytest -q --collect-only -p no:cacheprovider "$@" > /tmp/gpu_collect.log 2>&1
    grep -h -E "^ERROR " /tmp/gpu_collect.log | sed 's/^/collection: /' >&2
    grep "::" /tmp/gpu_collect.log
}
{ [ -z "$marked" ] || collect -m gpu $marked; [ -z "$on_cuda" ] || collect $on_cuda; } | sort -u \
    > /tmp/gpu_ids
echo "== $(wc -l < /tmp/gpu_ids) tests in $shards shards (limit ${limit}s each)"
rm -f /tmp/gpu_shard.*
split -n "r/$shards" -d /tmp/gpu_ids /tmp/gpu_shard.
pids=()
for ids in /tmp/gpu_shard.??; do  # one node id a line: ids may hold spaces
    [ -s "$ids" ] || continue
    xargs -r -d '\n' -a "$ids" timeout "$limit" python3 -m pytest -v -rfE --tb=short -p no:cacheprovider "${per_test[@]}" \
        > "$ids.log" 2>&1 &
    pids+=($!)
done
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
cat /tmp/gpu_shard.??.log > "$OUT/gpu_tests.log"
grep -h -E "^(FAILED|ERROR) " /tmp/gpu_shard.??.log
grep -h -E "^=+ .*(passed|failed|error|skipped).* in [0-9.]+s" /tmp/gpu_shard.??.log
for log in $(grep -L -E " in [0-9.]+s" /tmp/gpu_shard.??.log); do
    done=$(grep -c -E " (PASSED|FAILED|ERROR|SKIPPED)" "$log")
    echo "cut at ${limit}s: ${log%.log}, $done of its $(wc -l < "${log%.log}") tests done"
done
if [ "${SAVE_TRITON_CACHE:-0}" = 1 ]; then  # for a later call's .assets
    XZ_OPT="-1 -T0" tar -cJf "$OUT/triton_cache.txz" -C "$TILEINFER_CACHE" triton 2> /dev/null
fi
exit "$failed"
