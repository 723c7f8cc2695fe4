#!/usr/bin/env bash
# One device call for the H200: correctness, an A/B of the exp2 instruction, and the
# issue-4 benchmark. Usage (on the device machine, repo root, tokamax wheels in .whl):
#   bash experiments/run_h200.sh "$OUT"
set -uo pipefail
out=${1:?output dir}
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
python3 -c "import jax; d = jax.devices()[0]; print(jax.__version__, d, repr(d.client.platform_version))"
# 1. SASS of one exp2: libdevice's non-FTZ path against the bare instruction.
nvcc -arch=sm_90 -cubin -o /tmp/ex2.cubin experiments/ex2_sass.cu &&
  cuobjdump -sass /tmp/ex2.cubin | grep -E "Function|MUFU|FSETP|FMUL" | tee "$out/ex2_sass.txt"
# 2. Compiled kernels against the float64 reference.
timeout 150 python3 experiments/pallas_check.py --out-dir "$out" 2>&1 | tee "$out/pallas_check.log" || exit 1
# 3. A/B: jflash's table, d=64 s=4K, forward and backward, libdevice exp2 vs the bare one.
for lib in 1 0; do
  JFLASH_LIBDEVICE_EXP2=$lib timeout 120 python3 experiments/bench_attention.py --block-sweep \
    --head-dims 64 --sweep-passes fwd,dq --sweep-budget-s 1 --out-dir "$out" \
    --name "exp2_ab_libdevice$lib" 2>&1 | grep "default" | tee -a "$out/exp2_ab.log"
done
# 4. Issue 4's table with every peer, one process.
timeout 330 python3 experiments/bench_attention.py --quick --time-limit-s 240 --out-dir "$out" \
  2>&1 | tee "$out/bench_attention_h200.log" | grep -v "^\[" | grep -v "WARNING\|W1129\|^W"
