#!/usr/bin/env bash
# The one device run on the H200: correctness of the compiled kernels, then the
# benchmark, inside BUDGET_S (default 540; a device call may run 600) seconds of wall time.
#
#   bash experiments/tools/run_h200.sh "$OUT"                  # repo root, tokamax wheels in .whl/
#   BENCH_SMOKE=1 bash experiments/tools/run_h200.sh /tmp/out  # the same steps, tiny, on a CPU
#
# Steps, each with its own timeout taken from what is left, each non-fatal:
#   1. python -m experiments.pallas_check and the Mosaic GPU tests compiled (pytest)
#   2. benchmark A: jflash (pallas, mosaic_gpu) against cuDNN on the FA-2 quick cells,
#      the d=256 cell and the model-shape preset
#   3. benchmark B: every other peer on the FA-2 quick cells, then the memory table
#   4. report: A and B joined into bench_attention_h200.json, targets evaluated, the
#      tables printed, the short summary last
# The benchmarks write their JSON after every case and stop starting calls at their
# --time-limit-s, so a step cut short keeps what it measured. Full logs: $OUT/*.log.
set -uo pipefail
out=${1:?usage: run_h200.sh OUT_DIR}
mkdir -p "$out"
budget=${BUDGET_S:-540}
start=$SECONDS
left() { echo $(( budget - (SECONDS - start) )); }
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
tag=h200
bench_flags=()
check_flags=()
if [ -n "${BENCH_SMOKE:-}" ]; then
  export JAX_PLATFORMS=cpu
  tag=cpu_tiny
  bench_flags=(--tiny --jflash-impls xla_chunked,mosaic_gpu)
  check_flags=(--seq 64)
fi

# step NAME TIMEOUT_S CMD...: runs CMD with its output in $OUT/NAME.log; prints one line.
step() {
  local name=$1 limit=$2; shift 2
  if [ "$limit" -le 5 ]; then
    echo "== $name: not run, $(left) s of the budget left"
    return
  fi
  local t=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $(( SECONDS - t )) s (limit $limit s)$([ $rc -eq 124 ] && echo ', TIMED OUT')"
  grep -E "passed|failed|wrote|Error|error:" "$out/$name.log" | tail -3 | cut -c1-200
}

if ls .whl/*.whl >/dev/null 2>&1; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
$py -c "import jax; d = jax.devices()[0]; print('jax', jax.__version__, d, d.device_kind)"

# The card's clocks, power and temperature every half second while the steps run
# (gpu_clocks.csv): the run-to-run spread of the timings is read against them. Only
# reads the card (METHOD.md: its settings are left alone).
clocks_pid=
if [ -z "${BENCH_SMOKE:-}" ] && command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active \
    --format=csv -lms 500 >"$out/gpu_clocks.csv" 2>&1 &
  clocks_pid=$!
  trap 'kill "$clocks_pid" 2>/dev/null' EXIT     # also when the call's time limit ends it
fi

# 1. Correctness against float64 (the checks write their own JSON; the benchmark times).
# PALLAS_CHECK_ARGS (e.g. "--preset fa2") narrows the Triton check; SKIP_PALLAS_CHECK=1 /
# SKIP_MOSAIC_CHECK=1 leave out a check whose kernels are unchanged since its committed
# run.
if [ "${SKIP_PALLAS_CHECK:-0}" != 1 ]; then
  step pallas_check $(( $(left) * 25 / 100 )) $py -m experiments.pallas_check --out-dir "$out" \
    ${check_flags[@]+"${check_flags[@]}"} ${PALLAS_CHECK_ARGS:-}
fi
if [ "${SKIP_MOSAIC_CHECK:-0}" != 1 ] && [ -z "${BENCH_SMOKE:-}" ]; then
  # The Mosaic GPU tests run compiled on a Hopper GPU (tests/mosaic_support.py; on a
  # CPU they run interpreted in the suite instead).
  step mosaic_tests $(( $(left) * 25 / 100 )) $py -m pytest -q -p no:cacheprovider \
    tests/test_mosaic.py tests/test_mosaic_backward.py --junitxml "$out/mosaic_tests.xml"
fi

# 2-3. The benchmark in two processes: A (what the targets need) before B (the peer table).
# Each stops starting calls at its --time-limit-s; the timeout leaves room for the call in
# flight (a compile) and the JSON.
grids=quick,d256,model
a_impls=jflash,cudnn
[ -n "${BENCH_SMOKE:-}" ] && grids=smoke && a_impls=jflash,xla
# A's share: with the alternating timing (experiments/common.py, time_alternating: a
# second of sustained calls, then 7 rounds of 50 ms per peer) A took 330 s and 307 s on
# the H200 (2026-12-01, bench_attention_h200_a_run7/8), so A alone wants
# BENCH_A_SHARE=100 of a 540 s budget. BENCH_A_REPEATS=2: A twice, one process after
# the other, each in its share of A's budget (bench_a_<tag>.json, then
# bench_a_<tag>_2.json): how far identical kernels move between two runs; the shares
# fit the whole grid only with a larger BUDGET_S than one call allows, so a repeat of
# the whole grid takes a call of its own. The report joins the first. A default run
# (the checks first, A at its 70%) leaves A about 200 s: the cells at the end of its
# grid (d = 256, GQA, MQA) are then cut; for the whole table run A in a call of its own
# (SKIP_PALLAS_CHECK=1 SKIP_MOSAIC_CHECK=1 SKIP_BENCH_B=1 BENCH_A_SHARE=100).
a=$(( ($(left) - 20) * ${BENCH_A_SHARE:-70} / 100 ))
reps=${BENCH_A_REPEATS:-1}
if [ "${SKIP_BENCH_A:-0}" != 1 ]; then
  share=$(( a / reps ))
  for rep in $(seq 1 "$reps"); do
    suffix=$([ "$rep" -gt 1 ] && echo "_$rep")
    step "bench_a$suffix" $share $py -m experiments.bench_attention --grids "$grids" \
      --impls "$a_impls" --skip-memory --time-limit-s $(( share - 40 > 10 ? share - 40 : 10 )) \
      --out-dir "$out" --name "bench_a_$tag$suffix" ${bench_flags[@]+"${bench_flags[@]}"}
  done
fi
# SKIP_BENCH_B=1: A only (B then runs in a later call: BENCH_A_JSON=<A's JSON> with
# SKIP_BENCH_A=1 joins the two).
b=$(( $(left) - 20 ))
others=jax_pallas_mha,jax_mgpu,tokamax_mosaic,tokamax_triton,torch_flash,torch_cudnn,xla
[ -n "${BENCH_SMOKE:-}" ] && others=xla
if [ "${SKIP_BENCH_B:-0}" != 1 ]; then
  step bench_b $b $py -m experiments.bench_attention --quick --impls "$others" \
    --time-limit-s $(( b - 40 > 10 ? b - 40 : 10 )) --out-dir "$out" --name bench_b_$tag \
    ${bench_flags[@]+"${bench_flags[@]}"}
fi

# 4. One JSON and the tables; the short summary is printed last.
parts=()
for f in "${BENCH_A_JSON:-$out/bench_a_$tag.json}" "$out/bench_b_$tag.json"; do
  [ -f "$f" ] && parts+=("$f")
done
if [ ${#parts[@]} -gt 0 ]; then
  timeout 60 $py -m experiments.bench_attention --report "${parts[@]}" --out-dir "$out" \
    --name "bench_attention_$tag" 2>&1 | tee "$out/report.log" | grep -v "^\[" | tail -70
else
  echo "no benchmark JSON was written: see $out/bench_a.log and $out/bench_b.log"
fi
# The samples under load (over 400 W; idle and compiling drew 78-130 W here): how many
# name the software power cap (bit 0x4 of clocks_event_reasons.active) as the clock's
# limiter, and the SM clock they ran at.
if [ -n "$clocks_pid" ]; then
  kill "$clocks_pid" 2>/dev/null
  awk -F', ' 'NR > 1 && $4 + 0 > 400 { n++; s += $2; if (!lo || $2 + 0 < lo) lo = $2 + 0
      if ($6 ~ /[4567cdefCDEF]$/) capped++ }
    END { if (n) printf "clocks: %d samples over 400 W, %d at the power cap; SM clock mean %.0f, min %d MHz (gpu_clocks.csv)\n", n, capped, s / n, lo
          else print "clocks: no sample over 400 W in gpu_clocks.csv (see its lines)" }' \
    "$out/gpu_clocks.csv"
fi
echo "== done in $(( SECONDS - start )) s of $budget"
