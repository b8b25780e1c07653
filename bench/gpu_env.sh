# The GPU machine's set-up, sourced from the repo root by each command there (bench/README.md):
#   . bench/gpu_env.sh && python3 bench/bench_engine.py --out "$OUT"
# It sets the environment and puts in place what the call carried (each optional, all ignored by git):
#   .whl/*.whl             bash ../shared/device/wheels.sh: Ray Serve, pydantic, gguf; plus llguidance's wheel
#                          (bench/README.md); into /tmp/site
#   .assets/$GGUF.part*    bash ../shared/device/stage.sh on the default model's GGUF: one part a call, back
#                          to back on the warm machine, the .sha256 with the last; joined into the cache
#   .assets/qwen3-tokenizer/   tests/assets.py's Qwen3 tokenizer, gzipped (the bench shapes' models use it)
#   .assets/triton_cache.txz   Triton's cache from an earlier call's $OUT (bench/gpu_tests.sh writes it)
# What it puts in place (/tmp/site, the cache) stays while the machine does.
# the four folders under the tileinfer namespace, as pyproject.toml installs them (nothing is installed here)
namespace=/tmp/tileinfer-$(echo "$PWD" | cksum | cut -d' ' -f1)
mkdir -p "$namespace/tileinfer"
for layer in kernels engine proposers deployments; do ln -sfn "$PWD/$layer" "$namespace/tileinfer/$layer"; done
export TILEINFER_CACHE=${TILEINFER_CACHE:-/tmp/tc} PYTHONPATH=/tmp/site:$namespace:$PWD RAY_USAGE_STATS_ENABLED=0
export NCCL_NVLS_ENABLE=0  # never NVLink multicast: the host's GPUs are shared
export OUT=${OUT:-/tmp/out}
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
models=$TILEINFER_CACHE/models assets=$TILEINFER_CACHE/test-assets
mkdir -p "$OUT" "$models" "$assets"

if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl > /dev/null 2>&1 || echo "gpu_env: the wheels in .whl did not install"
fi
if [ ! -e "$models/$GGUF" ] && ls .assets/"$GGUF".part* > /dev/null 2>&1; then
    joined=$(cat .assets/"$GGUF".part* | sha256sum | cut -d' ' -f1)
    if [ -e ".assets/$GGUF.sha256" ] && [ "$joined" = "$(cut -d' ' -f1 ".assets/$GGUF.sha256")" ]; then
        cat .assets/"$GGUF".part* > "$models/$GGUF.partial" && mv "$models/$GGUF.partial" "$models/$GGUF" &&
            echo "gpu_env: $GGUF joined"
    else
        echo "gpu_env: here: $(cd .assets && echo "$GGUF".part*); carry the next part (.sha256 with the last)"
    fi
fi
if [ -d .assets/qwen3-tokenizer ] && [ ! -d "$assets/qwen3-tokenizer" ]; then
    cp -r .assets/qwen3-tokenizer "$assets/" && gunzip -f "$assets"/qwen3-tokenizer/*.gz
fi
if [ -e .assets/triton_cache.txz ] && [ ! -d "$TILEINFER_CACHE/triton" ]; then
    tar -xJf .assets/triton_cache.txz -C "$TILEINFER_CACHE" && echo "gpu_env: Triton's cache carried in"
fi
