"""Correctness of the compiled Pallas kernels on a GPU against the float64 reference.

For each case, forward and gradients of `implementation="pallas"` are compared with the
float64 NumPy truth, under the test suite's rule: error <= 2x the error of the plain
same-dtype implementation (`implementation="xla"`) + a few roundings of the dtype.
On a CPU it runs the same cases at a small size (interpret mode).

  python experiments/pallas_check.py            # GPU: T = S = 4096, d in {64, 128}
  python experiments/pallas_check.py --seq 256  # any backend, smaller
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jflash
from experiments.common import write_result


def max_err(x, ref):
  return float(np.max(np.abs(np.asarray(x, np.float64) - ref)))


def check(seq, head_dim, dtype, causal, heads, extra):
  try:
    return _check(seq, head_dim, dtype, causal, heads, extra)
  except Exception as e:  # recorded, so one failing case does not hide the others
    return {"seq": seq, "head_dim": head_dim, "dtype": jnp.dtype(dtype).name, "causal": causal,
            "options": sorted(extra), "ok": False, "error": f"{type(e).__name__}: {e}"[:4000]}


def _check(seq, head_dim, dtype, causal, heads, extra):
  r = np.random.default_rng(seq + head_dim)
  shape = (1, seq, heads, head_dim)
  q, k, v, do = (r.standard_normal(shape) for _ in range(4))
  cast = lambda x: jnp.asarray(x, dtype)

  def fwd_bwd(impl):
    def run(q, k, v, do):
      out, vjp = jax.vjp(lambda q, k, v: jflash.attention(
          q, k, v, is_causal=causal, implementation=impl, **extra), q, k, v)
      return (out, *vjp(do))
    return jax.jit(run)(cast(q), cast(k), cast(v), cast(do))

  t0 = time.perf_counter()
  got = [np.asarray(x, np.float64) for x in fwd_bwd("pallas")]
  plain = [np.asarray(x, np.float64) for x in fwd_bwd("xla")]
  qc, kc, vc, doc = (np.asarray(cast(x), np.float64) for x in (q, k, v, do))
  ref_extra = {k_: (np.asarray(v_, np.float64 if k_ == "bias" else None)
                   if hasattr(v_, "shape") else v_)
               for k_, v_ in extra.items() if k_ != "dropout_rng"}
  if "dropout_rng" in extra:   # the reference takes the seed jflash derives from the key
    ref_extra["dropout_seed"] = int(jflash.masks.seed_from_key(extra["dropout_rng"]))
  ref = jflash.attention_numpy(qc, kc, vc, is_causal=causal, dout=doc, **ref_extra)
  ref = (ref[0], *ref[2:5])
  eps = float(jnp.finfo(dtype).eps)
  row = {"seq": seq, "head_dim": head_dim, "dtype": jnp.dtype(dtype).name, "causal": causal,
         "options": sorted(extra), "seconds": None, "ok": True}
  for name, g, p, t in zip(("out", "dq", "dk", "dv"), got, plain, ref):
    err, err_plain = max_err(g, t), max_err(p, t)
    bound = 2 * err_plain + 4 * eps * np.sqrt(head_dim) * max(1.0, float(np.abs(t).max()))
    ok = bool(np.all(np.isfinite(g)) and err <= bound)
    row[name] = {"err": err, "plain_err": err_plain, "bound": bound, "ok": ok}
    row["ok"] &= ok
  row["seconds"] = round(time.perf_counter() - t0, 2)
  return row


def report(row):
  if "error" in row:
    print({k: row[k] for k in ("head_dim", "dtype", "causal", "options", "ok")}, row["error"][:2000],
          flush=True)
    return
  print({k: row[k] for k in ("head_dim", "dtype", "causal", "options", "ok", "seconds")},
        {n: f"{row[n]['err']:.2e}/{row[n]['bound']:.2e}" for n in ("out", "dq", "dk", "dv")},
        flush=True)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  gpu = jax.default_backend() == "gpu"
  p.add_argument("--seq", type=int, default=4096 if gpu else 128,
                 help="T = S (the issue asks for 4096 on the GPU; small on CPU, interpret mode is slow)")
  p.add_argument("--heads", type=int, default=2, help="few heads keep the float64 reference cheap")
  p.add_argument("--out-dir", default=None, help="where the JSON goes (default experiments/results)")
  p.add_argument("--name", default=f"pallas_check_{'h200' if gpu else 'cpu'}")
  args = p.parse_args(argv)
  rows = []
  for head_dim, dtype, causal in itertools.product((64, 128), (jnp.bfloat16, jnp.float16),
                                                   (False, True)):
    rows.append(check(args.seq, head_dim, dtype, causal, args.heads, {}))
    report(rows[-1])
  # One masked case on the compiled kernels: window + segments + soft cap + GQA-free.
  seg = np.repeat(np.arange(4), args.seq // 4)[None]
  extra = {"local_window_size": (256, 0), "segment_ids": jnp.asarray(seg, jnp.int32),
           "logits_soft_cap": 30.0}
  rows.append(check(args.seq, 128, jnp.bfloat16, True, args.heads, extra))
  report(rows[-1])
  # And one with a bias and dropout (hashed per element, so the transposed dK/dV tile
  # must draw the same mask as the forward and dQ tiles).
  bias = np.random.default_rng(1).standard_normal((1, args.heads, args.seq, args.seq))
  extra = {"bias": jnp.asarray(bias, jnp.bfloat16), "dropout_rate": 0.1,
           "dropout_rng": jax.random.PRNGKey(3)}
  rows.append(check(args.seq, 64, jnp.bfloat16, True, args.heads, extra))
  report(rows[-1])
  path = write_result(args.name, vars(args), rows, out_dir=args.out_dir)
  bad = [r for r in rows if not r["ok"]]
  print(f"{len(rows) - len(bad)} passed, {len(bad)} failed -> {path}")
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
