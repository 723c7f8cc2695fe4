"""Effective bandwidth and achieved TF/s of attention against the device's own ceilings.

Ceilings are measured here, not quoted from a datasheet:
  copy    y = x + 1 over a large array (reads and writes every byte once) -> GB/s
  matmul  a square matmul in the attention dtype -> TF/s
For each sequence length and implementation, forward and forward+backward:
  effective bandwidth = bytes of the op's inputs and outputs (fwd: Q, K, V, O;
                        bwd adds dO, dQ, dK, dV) / time: the least traffic any
                        implementation must move, so a flash kernel near the copy
                        ceiling would be memory-bound, one far below it is not;
  achieved TF/s       = attention FLOPs (4 B N T S H, halved when causal; x3.5 for
                        fwd+bwd) / time, as a fraction of the matmul ceiling.
Writes <out-dir>/bandwidth_<backend>.json (see common.DEFAULT_OUT).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from experiments import common
from experiments.scaling_common import (attention_callable, failure, labels_for_backend,
                                        load_average, random_arrays, shape_struct,
                                        IMPLEMENTATIONS)

PRESETS = {
    "cpu": dict(seqs="512,1024,2048", batch=1, heads=4, head_dim=64, dtype="float32",
                copy_mb=256, matmul_n=1024, iters=3),
    "gpu": dict(seqs="1024,2048,4096,8192,16384", batch=4, heads=16, head_dim=128,
                dtype="bfloat16", copy_mb=2048, matmul_n=8192, iters=20),
    "tiny": dict(seqs="64", batch=1, heads=2, head_dim=16, dtype="float32",
                 copy_mb=8, matmul_n=128, iters=1),
}


def parse_args(argv=None):
  p = common.preset_parser(__doc__, PRESETS, "auto = cpu on a CPU, gpu otherwise")
  p.add_argument("--impls", default=None, help=f"labels from {list(IMPLEMENTATIONS)}")
  p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True,
                 help="causal, as in decoder training")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out-dir", type=Path, default=common.DEFAULT_OUT,
                 help="where the JSON goes (tests pass a tmp dir)")
  common.add_preset_options(p, [
      ("seqs", str, "comma-separated sequence lengths"), ("batch", int, "batch"),
      ("heads", int, "heads"), ("head_dim", int, "head dim"),
      ("dtype", str, "input dtype (bf16 on GPU: the tensor-core path)"),
      ("copy_mb", int, "copy-ceiling array size; far above the last-level cache"),
      ("matmul_n", int, "matmul-ceiling size n (n x n @ n x n); large enough to saturate"),
      ("iters", int, "timed repetitions after warm-up (median reported)")])
  args = p.parse_args(argv)
  common.apply_preset(args, PRESETS, "gpu")
  return args


def measure_ceilings(args):
  n_elem = args.copy_mb * 2**20 // 4
  x = jnp.ones((n_elem,), jnp.float32)
  copy = jax.jit(lambda a: a + 1)
  t = common.time_fn(copy, x, warmup=2, iters=max(3, args.iters))
  copy_gbs = 2 * x.nbytes / t["median_s"] / 1e9   # one read + one write per element
  del x
  n = args.matmul_n
  a = jnp.ones((n, n), args.dtype)
  mm = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
  t2 = common.time_fn(mm, a, a, warmup=2, iters=max(3, args.iters))
  return {"copy_GBps": copy_gbs, "copy_bytes": 2 * n_elem * 4, "copy_median_s": t["median_s"],
          "matmul_TFps": 2 * n**3 / t2["median_s"] / 1e12, "matmul_n": n,
          "matmul_dtype": args.dtype, "matmul_median_s": t2["median_s"]}


def main(argv=None):
  args = parse_args(argv)
  t0 = time.perf_counter()
  labels = labels_for_backend(args.impls.split(",") if args.impls else None)
  ceil = measure_ceilings(args)
  print(f"ceilings: copy {ceil['copy_GBps']:.1f} GB/s, matmul {ceil['matmul_TFps']:.2f} TF/s "
        f"({args.dtype})")
  rows = []
  seqs = [int(s) for s in args.seqs.split(",")]
  itemsize = jnp.dtype(args.dtype).itemsize
  for T in common.progress(seqs, "bandwidth", "seq"):
    shape = (args.batch, T, args.heads, args.head_dim)
    q, k, v, do = random_arrays(args.seed + T, [shape_struct(shape, args.dtype)] * 4)
    one = q.size * itemsize
    for label in labels:
      f = attention_callable(label, args.causal)
      for mode, fn, fargs, nbytes in (
          ("fwd", jax.jit(f), (q, k, v), 4 * one),
          ("fwd+bwd", jax.jit(lambda q, k, v, do, f=f: jax.vjp(f, q, k, v)[1](do)),
           (q, k, v, do), 8 * one)):
        row = dict(seq=T, impl=label, mode=mode, batch=args.batch, heads=args.heads,
                   head_dim=args.head_dim, dtype=args.dtype, causal=args.causal,
                   io_bytes=nbytes)
        try:
          t = common.time_fn(fn, *fargs, warmup=1, iters=args.iters)
          flops = common.attention_flops(args.batch, args.heads, args.head_dim,
                                         common.dense_pairs(T, T, args.causal), mode)
          gbs = nbytes / t["median_s"] / 1e9
          tfs = flops / t["median_s"] / 1e12
          row.update(status="ok", median_s=t["median_s"], effective_GBps=gbs, TFps=tfs,
                     frac_copy_ceiling=gbs / ceil["copy_GBps"],
                     frac_matmul_ceiling=tfs / ceil["matmul_TFps"])
        except Exception as e:  # recorded (OOM or an implementation that cannot run)
          row.update(failure(e))
        rows.append(row)
    del q, k, v, do
  elapsed = time.perf_counter() - t0
  name = f"bandwidth_{jax.default_backend()}" + (
      "" if args.preset in ("cpu", "gpu") else f"_{args.preset}")
  config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
  config["load_average_at_end"] = load_average()  # a busy host slows CPU timings
  config["impls"] = labels
  path = common.write_result(name, config, rows, extra={"ceilings": ceil, "elapsed_s": elapsed},
                             out_dir=args.out_dir)
  print(f"{'impl':9s} {'mode':8s} {'seq':>6s} {'GB/s':>8s} {'TF/s':>7s} {'%copy':>6s} {'%mm':>6s}")
  for r in rows:
    if r["status"] == "ok":
      print(f"{r['impl']:9s} {r['mode']:8s} {r['seq']:6d} {r['effective_GBps']:8.2f} "
            f"{r['TFps']:7.3f} {100 * r['frac_copy_ceiling']:6.1f} "
            f"{100 * r['frac_matmul_ceiling']:6.1f}")
    else:
      print(f"{r['impl']:9s} {r['mode']:8s} {r['seq']:6d} {r['status']}")
  print(f"wrote {path} in {elapsed:.0f} s")
  return path


if __name__ == "__main__":
  main()
