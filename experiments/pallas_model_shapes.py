"""Model shapes on the Pallas kernels, in one GPU call: correctness, cost, speed, tiles.

Phases, each inside one time budget (a phase that would start past it is skipped and
recorded as such; the JSON is rewritten after every step, so a cut-off run still
leaves what it measured):
  check    experiments/pallas_check.py's "model" preset against the float64 reference
  measure  jflash (pallas) and cuDNN (jax.nn) fwd+bwd on the model shapes: compile
           seconds (lower + compile, first call), compiled temp MiB, median ms, TF/s
  sweep    tiles/warps/stages per kernel for d = 256 and d = 96 (each candidate checked
           against a float32 reference under the 2x rule before it is timed)
  retime   the sweep's best tiles, fwd+bwd, on the d = 80/96/192/256 shapes
  measure  (again) the extra shapes: d = 96 causal, d = 192, MQA at 2K split and not

  python experiments/pallas_model_shapes.py --out-dir $OUT --budget 270
  python experiments/pallas_model_shapes.py --tiny   # CPU: tiny shapes, interpret mode
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

import jflash
from experiments import pallas_check
from experiments.common import environment, write_result
from pallas_kernels.backward import flash_backward
from pallas_kernels.forward import flash_forward
from pallas_kernels.tuning import BlockSizes, _row

BWD_FACTOR = 3.5   # forward + backward FLOPs / forward FLOPs (FA-2 paper)
T0 = time.perf_counter()


@dataclasses.dataclass(frozen=True)
class Shape:
  name: str
  B: int
  T: int
  N: int
  K: int
  H: int
  causal: bool
  dkv_splits: str = ""   # JFLASH_DKV_SPLITS while jflash compiles ("" = the heuristic)

  def flops(self, mode="fwd+bwd"):
    f = 4.0 * self.B * self.T * self.T * self.N * self.H / (2 if self.causal else 1)
    return f * (BWD_FACTOR if mode == "fwd+bwd" else 1.0)


# The issue's shapes; 16K d=128 causal (MHA) is an FA-2 grid cell (measured before at
# 413.7 TF/s fwd+bwd) and the MHA point of the compile-time comparison.
GPU_SHAPES = [
    Shape("mqa16_16k_causal", 1, 16384, 16, 1, 128, True),
    Shape("mqa16_16k_causal_nosplit", 1, 16384, 16, 1, 128, True, "1"),
    Shape("mha16_16k_causal", 1, 16384, 16, 16, 128, True),
    Shape("gqa32_8_8k_causal", 1, 8192, 32, 8, 128, True),
    Shape("d128_4k", 4, 4096, 16, 16, 128, False),
    Shape("d96_4k", 4, 4096, 16, 16, 96, False),
    Shape("d80_4k", 4, 4096, 16, 16, 80, False),
    Shape("d256_4k_causal", 4, 4096, 8, 8, 256, True),
    Shape("d256_4k", 4, 4096, 8, 8, 256, False),
    Shape("t3072_causal", 4, 3072, 16, 16, 128, True),
    Shape("t3000_causal", 4, 3000, 16, 16, 128, True),
]
EXTRA_SHAPES = [   # measured last, as the budget allows
    Shape("d96_4k_causal", 4, 4096, 16, 16, 96, True),
    Shape("d192_4k_causal", 4, 4096, 8, 8, 192, True),
    Shape("mqa16_2k_causal", 1, 2048, 16, 1, 128, True),
    Shape("mqa16_2k_causal_nosplit", 1, 2048, 16, 1, 128, True, "1"),
]
TINY_SHAPES = [
    Shape("mqa4_tiny", 1, 100, 4, 1, 64, True),
    Shape("mqa4_tiny_split2", 1, 100, 4, 1, 64, True, "2"),
    Shape("d96_tiny", 1, 97, 2, 2, 96, False),
]

# (block_q, block_k, num_warps, num_stages) per kernel; the first is the table's row.
CANDIDATES = {
    256: dict(
        fwd=[(64, 64, 8, 2), (64, 32, 4, 2), (64, 64, 4, 2), (128, 64, 8, 2), (128, 32, 8, 2),
             (64, 64, 8, 3)],
        dkv=[(32, 32, 4, 2), (32, 64, 4, 2), (64, 32, 4, 2), (64, 64, 8, 2), (32, 32, 4, 1),
             (64, 64, 8, 1)],
        dq=[(32, 32, 4, 2), (64, 32, 4, 2), (64, 64, 8, 2), (32, 64, 4, 2), (128, 32, 8, 2),
            (64, 32, 8, 2)]),
    128: dict(
        fwd=[(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3),
             (128, 128, 8, 2), (64, 128, 4, 3)],
        dkv=[(64, 64, 4, 2), (64, 64, 4, 3), (32, 64, 4, 2), (64, 128, 8, 2), (128, 64, 8, 2),
             (64, 64, 8, 2)],
        dq=[(128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 8, 3), (128, 128, 8, 2), (64, 64, 4, 2),
            (128, 64, 4, 3)]),
}
SWEEP = {256: "d256_4k_causal", 128: "d96_4k"}     # padded head dim -> the shape timed
TINY_SWEEP = {128: "d96_tiny"}


def log(msg):
  print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


class Run:
  """Results, written whole after every step."""

  def __init__(self, args):
    self.args, self.path = args, os.path.join(args.out_dir, args.name + ".json")
    self.data = {"environment": environment(), "config": vars(args), "argv": sys.argv,
                 "check": [], "measure": [], "sweep": [], "retime": [], "skipped": []}

  def left(self):
    return self.args.budget - (time.perf_counter() - T0)

  def save(self):
    os.makedirs(self.args.out_dir, exist_ok=True)
    with open(self.path, "w") as f:
      json.dump(self.data, f, indent=1, default=str)


def inputs(s: Shape, seed=0, dtype=jnp.bfloat16):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(ks[0], (s.B, s.T, s.N, s.H), dtype)
  k = jax.random.normal(ks[1], (s.B, s.T, s.K, s.H), dtype)
  v = jax.random.normal(ks[2], (s.B, s.T, s.K, s.H), dtype)
  do = jax.random.normal(ks[3], (s.B, s.T, s.N, s.H), dtype)
  return q, k, v, do


def fwd_bwd(attn):
  def run(q, k, v, do):
    out, vjp = jax.vjp(attn, q, k, v)
    return (out, *vjp(do))
  return run


def jflash_attn(s: Shape, blocks=None):
  return lambda q, k, v: jflash.attention(q, k, v, is_causal=s.causal, implementation="pallas",
                                          block_sizes=blocks)


def cudnn_attn(s: Shape):
  return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=s.causal,
                                                      implementation="cudnn")


def compile_fn(fn, args):
  """(compiled, seconds of lower + compile, temp MiB)."""
  t = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  sec = time.perf_counter() - t
  mem = compiled.memory_analysis()
  temp = None if mem is None else mem.temp_size_in_bytes / 2**20
  return compiled, sec, temp


def median_ms(compiled, arg_sets, reps):
  """Median per call over `reps` synchronised calls, rotating input sets (warm-up first)."""
  for a in arg_sets:
    jax.block_until_ready(compiled(*a))
  times = []
  for i in range(reps):
    a = arg_sets[i % len(arg_sets)]
    t = time.perf_counter()
    jax.block_until_ready(compiled(*a))
    times.append(time.perf_counter() - t)
  return 1e3 * statistics.median(times)


def rel_err(x, ref):
  x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
  return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


# -- phases -----------------------------------------------------------------------------

def phase_check(run: Run):
  a = run.args
  seq, gqa_seq, heads = (70, 33, 2) if a.tiny else (3000, 1000, 2)
  for case in pallas_check.model_cases(seq, gqa_seq, heads):
    if run.left() < a.reserve:
      run.data["skipped"].append(f"check {case[:6]}")
      continue
    seq_, d, dtype, causal, n, kh, extra = case
    row = pallas_check.check(seq_, d, dtype, causal, n, extra, kh)
    pallas_check.report(row)
    run.data["check"].append(row)
    run.save()
  # Also in pallas_check's own format, as that script would write it.
  config = {"preset": "model", "seq": seq, "gqa_seq": gqa_seq, "heads": heads,
            "out_dir": a.out_dir, "name": a.check_name}
  write_result(a.check_name, config, run.data["check"], out_dir=a.out_dir)


def phase_measure(run: Run, shapes):
  a = run.args
  for s in shapes:
    if run.left() < a.reserve:
      run.data["skipped"].append(f"measure {s.name}")
      continue
    row = {"shape": dataclasses.asdict(s)}
    arg_sets = [inputs(s, seed) for seed in range(2)]
    outs = {}
    for impl, attn in (("jflash", jflash_attn(s)), ("cudnn", cudnn_attn(s))):
      try:
        os.environ["JFLASH_DKV_SPLITS"] = s.dkv_splits if impl == "jflash" else ""
        compiled, sec, temp = compile_fn(fwd_bwd(attn), arg_sets[0])
        os.environ["JFLASH_DKV_SPLITS"] = ""
        ms = median_ms(compiled, arg_sets, a.reps)
        outs[impl] = compiled(*arg_sets[0])
        row[impl] = {"compile_s": round(sec, 2), "temp_mib": temp, "ms": ms,
                     "tflops": s.flops() / ms / 1e9}
      except Exception as e:  # recorded: cuDNN may not take a shape
        row[impl] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    if len(outs) == 2:   # same inputs, two implementations: a check for gross errors
      row["rel_diff_vs_cudnn"] = {n: rel_err(x, y) for n, x, y in
                                  zip(("out", "dq", "dk", "dv"), outs["jflash"], outs["cudnn"])}
    if "tflops" in row.get("jflash", {}) and "tflops" in row.get("cudnn", {}):
      row["ratio"] = row["jflash"]["tflops"] / row["cudnn"]["tflops"]
    log(f"measure {s.name}: {json.dumps(row, default=str)[:600]}")
    run.data["measure"].append(row)
    run.save()


def _blocks(hp, kernel, cand):
  """BlockSizes with `cand` for one kernel and the table's row for the other two."""
  row = dict(_row(hp))
  row[kernel] = cand
  f, kv, dq = row["fwd"], row["dkv"], row["dq"]
  return BlockSizes(block_q=f[0], block_k=f[1], block_q_dkv=kv[0], block_k_dkv=kv[1],
                    block_q_dq=dq[0], block_k_dq=dq[1], num_warps=f[2], num_stages=f[3],
                    num_warps_dkv=kv[2], num_stages_dkv=kv[3], num_warps_dq=dq[2],
                    num_stages_dq=dq[3])


def phase_sweep(run: Run, shapes_by_name, sweep):
  a = run.args
  for hp, shape_name in sweep.items():
    s = shapes_by_name[shape_name]
    if run.left() < a.reserve + 20:
      run.data["skipped"].append(f"sweep d={hp}")
      continue
    scale = s.H ** -0.5
    q, k, v, do = inputs(s, seed=5)
    # float32 truth on the same bf16 values, full-precision products
    with jax.default_matmul_precision("highest"):
      up = lambda x: x.astype(jnp.float32)
      ref = jax.jit(fwd_bwd(lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=s.causal, implementation="xla")))(up(q), up(k), up(v), up(do))
      ref = [np.asarray(x, np.float32) for x in ref]
    base = flash_forward(q, k, v, scale=scale, is_causal=s.causal)
    eps_out, eps_acc = float(jnp.finfo(jnp.bfloat16).eps), float(jnp.finfo(jnp.float32).eps)

    def err(x, r):
      return float(np.max(np.abs(np.asarray(x, np.float32) - r)))

    def floor(r):
      return (2 * eps_out + 4 * eps_acc * np.sqrt(s.H)) * max(1.0, float(np.abs(r).max()))

    def build(kernel, cand):
      blocks = _blocks(hp, kernel, cand)
      if kernel == "fwd":
        fn = lambda q, k, v: flash_forward(q, k, v, scale=scale, is_causal=s.causal,
                                           block_sizes=blocks)
        args = (q, k, v)
      else:
        fn = lambda q, k, v, o, lse, do: flash_backward(q, k, v, o, lse, do, scale=scale,
                                                        is_causal=s.causal, block_sizes=blocks)
        args = (q, k, v, base[0], base[1], do)
      return jax.jit(fn).lower(*args).compile(), args

    jobs = [(kernel, cand) for kernel, cands in CANDIDATES[hp].items() for cand in cands]
    # Compiles are independent: run them side by side (compile time is not measured here).
    with concurrent.futures.ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as pool:
      futures = {job: pool.submit(build, *job) for job in jobs}
    results = {"fwd": {}, "dkv": {}, "dq": {}}
    for (kernel, cand), fut in futures.items():
      row = {"head_dim": s.H, "padded": hp, "shape": shape_name, "kernel": kernel,
             "cand": cand, "table": cand == CANDIDATES[hp][kernel][0]}
      try:
        compiled, args = fut.result()
        got = compiled(*args)
        names = ("out",) if kernel == "fwd" else ("dq", "dk", "dv")
        got = got[:1] if kernel == "fwd" else got
        refs = ref[:1] if kernel == "fwd" else ref[1:]
        row["err"] = {n: err(g, r) for n, g, r in zip(names, got, refs)}
        results[kernel][cand] = (compiled, args, row)
      except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"[:1500]
        run.data["sweep"].append(row)
    # The 2x rule against the table's own tiles: a candidate may not be less accurate.
    for kernel, by_cand in results.items():
      table = CANDIDATES[hp][kernel][0]
      if table not in by_cand:   # nothing to hold the others to: recorded, not timed
        run.data["sweep"].extend(row for _, _, row in by_cand.values())
        continue
      base_err = by_cand[table][2]["err"]
      names = list(base_err)
      refs = dict(zip(("out", "dq", "dk", "dv"), ref))
      for cand, (compiled, args, row) in by_cand.items():
        row["ok"] = all(row["err"][n] <= 2 * base_err[n] + floor(refs[n]) for n in names)
        if row["ok"] and run.left() > a.reserve:
          row["ms"] = median_ms(compiled, [args], a.reps)
          flops = s.flops("fwd") * (BWD_FACTOR - 1 if kernel != "fwd" else 1)
          row["tflops_pass"] = flops / row["ms"] / 1e9
        run.data["sweep"].append(row)
        log(f"sweep d={hp} {kernel} {cand}: ok={row['ok']} ms={row.get('ms')}")
    run.save()


def best_tiles(run: Run, hp):
  """The sweep's fastest checked candidate per kernel (the table's row where none)."""
  best = dict(_row(hp))
  for kernel in ("fwd", "dkv", "dq"):
    timed = [r for r in run.data["sweep"] if r["padded"] == hp and r["kernel"] == kernel
             and r.get("ok") and "ms" in r]
    if timed:
      best[kernel] = tuple(min(timed, key=lambda r: r["ms"])["cand"])
  return best


def phase_retime(run: Run, shapes, sweep):
  a = run.args
  for s in shapes:
    hp = max(16, 1 << (s.H - 1).bit_length())
    if hp not in sweep or s.H == 128 or run.left() < a.reserve:
      continue
    best = best_tiles(run, hp)
    if best == dict(_row(hp)):
      continue
    f, kv, dq = best["fwd"], best["dkv"], best["dq"]
    blocks = BlockSizes(block_q=f[0], block_k=f[1], block_q_dkv=kv[0], block_k_dkv=kv[1],
                        block_q_dq=dq[0], block_k_dq=dq[1], num_warps=f[2], num_stages=f[3],
                        num_warps_dkv=kv[2], num_stages_dkv=kv[3], num_warps_dq=dq[2],
                        num_stages_dq=dq[3])
    arg_sets = [inputs(s, seed) for seed in range(2)]
    try:
      compiled, sec, temp = compile_fn(fwd_bwd(jflash_attn(s, blocks)), arg_sets[0])
      ms = median_ms(compiled, arg_sets, a.reps)
      row = {"shape": dataclasses.asdict(s), "tiles": best, "compile_s": sec, "temp_mib": temp,
             "ms": ms, "tflops": s.flops() / ms / 1e9}
      cud = next((m for m in run.data["measure"] if m["shape"]["name"] == s.name), None)
      if cud and "tflops" in cud.get("cudnn", {}):
        row["ratio"] = row["tflops"] / cud["cudnn"]["tflops"]
    except Exception as e:
      row = {"shape": dataclasses.asdict(s), "tiles": best, "error": f"{type(e).__name__}: {e}"[:1500]}
    log(f"retime {s.name}: {json.dumps(row, default=str)[:400]}")
    run.data["retime"].append(row)
    run.save()


def table(run: Run):
  print("\nshape                 jflash TF/s  cuDNN TF/s  ratio  compile s (j/c)  temp MiB (j/c)")
  for m in run.data["measure"]:
    j, c = m.get("jflash", {}), m.get("cudnn", {})
    fmt = lambda d, k, f: (f % d[k]) if isinstance(d.get(k), (int, float)) else "-"
    print(f"{m['shape']['name']:22s}{fmt(j, 'tflops', '%8.1f'):>11s}{fmt(c, 'tflops', '%8.1f'):>12s}"
          f"{fmt(m, 'ratio', '%6.2f'):>7s}   {fmt(j, 'compile_s', '%5.1f')}/{fmt(c, 'compile_s', '%4.1f')}"
          f"        {fmt(j, 'temp_mib', '%7.1f')}/{fmt(c, 'temp_mib', '%7.1f')}"
          + ("" if "error" not in j else "  jflash ERR") + ("" if "error" not in c else "  cudnn ERR"))
  for r in run.data["retime"]:
    print(f"retimed {r['shape']['name']:14s} tiles {r.get('tiles')} "
          f"TF/s {r.get('tflops', float('nan')):.1f} ratio {r.get('ratio', float('nan')):.2f}")
  checks = run.data["check"]
  print(f"check: {sum(r['ok'] for r in checks)}/{len(checks)} within the rule; "
        f"sweep rows {len(run.data['sweep'])}; skipped {run.data['skipped']}")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out-dir", default="experiments/results")
  p.add_argument("--name", default="pallas_model_shapes_h200")
  p.add_argument("--check-name", default="pallas_check_h200")
  p.add_argument("--budget", type=float, default=270.0, help="seconds for the whole run")
  p.add_argument("--reserve", type=float, default=15.0,
                 help="no step starts with less than this left (a step takes up to ~10 s)")
  p.add_argument("--reps", type=int, default=10, help="timed calls per measurement")
  p.add_argument("--tiny", action="store_true", help="CPU smoke: tiny shapes, interpret mode")
  p.add_argument("--phases", default="check,measure,sweep,retime")
  args = p.parse_args(argv)
  shapes = TINY_SHAPES if args.tiny else GPU_SHAPES
  extra = [] if args.tiny else EXTRA_SHAPES
  sweep = TINY_SWEEP if args.tiny else SWEEP
  if args.tiny:
    args.reps = 2
    for kernels in CANDIDATES.values():   # interpret mode: two candidates per kernel
      for kernel in kernels:
        kernels[kernel] = kernels[kernel][:2]
  run = Run(args)
  phases = args.phases.split(",")
  if "check" in phases:
    phase_check(run)
  if "measure" in phases:
    phase_measure(run, shapes)
  if "sweep" in phases:
    phase_sweep(run, {s.name: s for s in shapes}, sweep)
  if "retime" in phases:
    phase_retime(run, shapes + extra, sweep)
  if "measure" in phases:
    phase_measure(run, extra)
  run.save()
  table(run)
  return 0


if __name__ == "__main__":
  sys.exit(main())
