#!/usr/bin/env bash
# One device-tool call of bench/gpu_vs_diffusers.py: the environment, then each measure in its own process
# (a crash or an out-of-memory leaves the others), each started only while BUDGET_S seconds allow, every
# result under $OUT. The diffusers wheel travels in gpu/whl (bench/README.md, "GPU").
#
#   bash bench/gpu_device.sh BUDGET_S NAME[:extra gpu_vs_diffusers args] ...
#   bash bench/gpu_device.sh 530 sdxl flux wan                        # each family's step (2026-11-26 run)
#   bash bench/gpu_device.sh 370 "flux_fp8:--quantize fp8 --no-compile" "sdxl_vae:--measures vae --no-compile"
#
# NAME's part before "_" is the family; the defaults (--measures step --rounds 3 --per-round 3) come before the
# extra arguments, which override them.
set -u
BUDGET=$1
shift
OUT=${OUT:-/tmp/gpu-bench}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site gpu/whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site
{
    date -u
    nvidia-smi -L
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
    nproc
    free -g | head -2
    python3 -c "import jax, torch; print(jax.__version__, jax.devices(), torch.__version__, torch.version.cuda)"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
for spec in "$@"; do
    name=${spec%%:*}
    extra=""
    [ "$spec" != "$name" ] && extra=${spec#*:}
    left=$((BUDGET - SECONDS - 5))
    if [ $left -lt 40 ]; then
        echo "SKIP $name: ${left}s left"
        continue
    fi
    echo "=== $name ($extra) at ${SECONDS}s, ${left}s left"
    # shellcheck disable=SC2086  # extra holds several arguments
    timeout $left python3 bench/gpu_vs_diffusers.py --stages "${name%%_*}" --measures step --rounds 3 \
        --per-round 3 --out "$OUT/$name.json" $extra >"$OUT/$name.log" 2>&1
    echo "rc=$? at ${SECONDS}s"
    grep -E "^\||ERROR|Error|loaded|fp8|GEMM|temporaries" "$OUT/$name.log" | cut -c1-400 | tail -25
done
