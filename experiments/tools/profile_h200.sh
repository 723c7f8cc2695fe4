#!/usr/bin/env bash
# Hardware-counter profiles of the kernels behind the open misses, one ncu run per case,
# each non-fatal and inside its own timeout. Every step of a case runs the same kernels;
# the summary (experiments/tools/ncu_summary.py) keeps each kernel's last launch, a warm one.
#
#   bash experiments/tools/profile_h200.sh OUT [CASE ...]     # on the H200; default: every case
#   PROFILE_TOOL=sass bash experiments/tools/profile_h200.sh OUT [CASE ...]
#     instead of ncu: each case compiled once with Mosaic GPU's dump of PTX, ptxas log and
#     SASS (through the toolkit's ptxas and cuobjdump where nvdisasm is not on the path),
#     summarised by experiments/tools/sass_summary.py (register reallocation, spills).
set -uo pipefail
out=${1:?usage: profile_h200.sh OUT [CASE ...]}; shift
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
# One allocation per buffer: ncu's replay then saves only the buffers a kernel touches,
# not JAX's preallocated pool (most of the card's memory) on every pass.
export XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_ALLOCATOR=platform
declare -A CASES=(
  [fwd_d64]="--seq 4096 --head-dim 64 --implementation mosaic_gpu --forward-only"
  [fwd_d64_causal]="--seq 4096 --head-dim 64 --implementation mosaic_gpu --forward-only --causal"
  [fwd_d256]="--seq 4096 --head-dim 256 --heads 8 --batch 4 --implementation mosaic_gpu --forward-only"
  [bwd_d64]="--seq 4096 --head-dim 64 --implementation mosaic_gpu --backward mosaic_gpu"
  [bwd_d128_triton]="--seq 16384 --head-dim 128 --heads 16 --batch 1 --implementation mosaic_gpu --backward pallas"
  [bwd_d128_mosaic]="--seq 16384 --head-dim 128 --heads 16 --batch 1 --implementation mosaic_gpu --backward mosaic_gpu"
  [bwd_d128_causal_mosaic]="--seq 16384 --head-dim 128 --heads 16 --batch 1 --causal --implementation mosaic_gpu --backward mosaic_gpu"
  [fwd_d128]="--seq 16384 --head-dim 128 --heads 16 --batch 1 --implementation mosaic_gpu --forward-only"
  [fwd_1k_causal]="--seq 1024 --head-dim 128 --heads 16 --batch 16 --causal --implementation mosaic_gpu --forward-only"
  [fwd_1k_causal_two]="--seq 1024 --head-dim 128 --heads 16 --batch 16 --causal --implementation mosaic_gpu --forward-only --config {\"consumers\":2}"
)
names=("$@"); [ ${#names[@]} -eq 0 ] && names=(fwd_d64 fwd_d256 bwd_d128_triton bwd_d128_mosaic)
sections=(--section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats
          --section LaunchStats --section Occupancy --section InstructionStats
          --section MemoryWorkloadAnalysis)
if [ "${PROFILE_TOOL:-ncu}" = sass ]; then
  ptxas=$(command -v ptxas || ls /usr/local/cuda*/bin/ptxas 2>/dev/null | head -1)
  cuobjdump=$(command -v cuobjdump || ls /usr/local/cuda*/bin/cuobjdump 2>/dev/null | head -1)
  "$ptxas" --version >"$out/ptxas_version.txt" 2>&1
  for name in "${names[@]}"; do
    t=$SECONDS
    mkdir -p "$out/sass_$name"
    MOSAIC_GPU_DUMP_TO="$out/sass_$name" timeout --kill-after=10 "${PROFILE_TIMEOUT_S:-150}" \
      $py -m experiments.tools.profile_kernels --steps 1 ${CASES[$name]} >"$out/sass_$name.log" 2>&1
    echo "== $name: rc=$? in $(( SECONDS - t )) s"
    # Mosaic GPU writes the SASS only where nvdisasm is on PATH; otherwise the dumped PTX
    # goes through the toolkit's ptxas (its version in ptxas_version.txt; the register
    # count it reports should match the dumped .ptxas log's) and cuobjdump here.
    for ptx in "$out/sass_$name"/*.ptx; do
      [ -f "$ptx" ] && [ ! -s "${ptx%.ptx}.sass" ] || continue
      "$ptxas" -arch=sm_90a -v "$ptx" -o "${ptx%.ptx}.cubin" 2>"${ptx%.ptx}.toolkit_ptxas" &&
        "$cuobjdump" -sass "${ptx%.ptx}.cubin" >"${ptx%.ptx}.sass"
    done
    $py -m experiments.tools.sass_summary "$out/sass_$name" | tee "$out/sass_${name}_summary.txt"
    # keep ptxas's logs (a few hundred bytes each) and the SASS and PTX (compressed, after
    # the summary above read them); the MLIR dumps are large
    find "$out/sass_$name" -type f ! -name '*ptxas' ! -name '*.sass' ! -name '*.ptx' -delete
    gzip -f "$out/sass_$name"/*.sass "$out/sass_$name"/*.ptx 2>/dev/null
  done
  exit 0
fi
for name in "${names[@]}"; do
  t=$SECONDS
  timeout --kill-after=10 "${PROFILE_TIMEOUT_S:-150}" ncu --clock-control none --csv --page raw \
    "${sections[@]}" -o "$out/ncu_$name" -f $py -m experiments.tools.profile_kernels --steps 2 \
    ${CASES[$name]} >"$out/ncu_$name.log" 2>&1
  echo "== $name: rc=$? in $(( SECONDS - t )) s"
  if [ -f "$out/ncu_$name.ncu-rep" ]; then
    ncu --import "$out/ncu_$name.ncu-rep" --csv --page raw >"$out/ncu_${name}_raw.csv" 2>/dev/null
    ncu --import "$out/ncu_$name.ncu-rep" --csv --page details >"$out/ncu_${name}_details.csv" 2>/dev/null
    $py -m experiments.tools.ncu_summary "$out/ncu_${name}_raw.csv" | tee "$out/ncu_${name}_summary.txt"
  else
    tail -5 "$out/ncu_$name.log"
  fi
done
