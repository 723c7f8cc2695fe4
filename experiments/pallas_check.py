"""Correctness of the compiled Pallas kernels on a GPU against the float64 reference.

For each case, forward and gradients of `implementation="pallas"` are compared with the
float64 NumPy truth, under the test suite's rule: error <= 2x the error of the plain
same-dtype implementation (`implementation="xla"`) + the test suite's floor.
On a CPU it runs the same cases at a small size (interpret mode).

  python -m experiments.pallas_check                  # both presets (GPU sizes)
  python -m experiments.pallas_check --preset model   # GQA/MQA, d 72-256, T = S = 3000
  python -m experiments.pallas_check --seq 256        # any backend, smaller

Presets: "fa2" is the FlashAttention-2 grid (T = S = 4096, d 64/128, bf16/fp16, causal
and not, plus two masked cases); "model" is model shapes: GQA 32/8 and MQA 16/1 at
T = S = 1000 (32 heads of a float64 reference at 3000 would cost more than the kernels'
check is worth), and d = 72, 80, 96, 160, 192, 256 at T = S = 3000, none of them whole
tiles, causal and not.
"""
from __future__ import annotations

import itertools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jflash
from experiments import common
from experiments.common import write_result
from jflash.reference import error_floor, max_err


def check(seq, head_dim, dtype, causal, heads, extra, kv_heads=None):
  kv_heads = kv_heads or heads
  try:
    return _check(seq, head_dim, dtype, causal, heads, kv_heads, extra)
  except Exception as e:  # recorded, so one failing case does not hide the others
    return {"seq": seq, "head_dim": head_dim, "heads": heads, "kv_heads": kv_heads,
            "dtype": jnp.dtype(dtype).name, "causal": causal, "options": sorted(extra),
            "ok": False, "error": f"{type(e).__name__}: {e}"[:4000]}


def _check(seq, head_dim, dtype, causal, heads, kv_heads, extra):
  r = np.random.default_rng(seq + head_dim + heads + kv_heads)
  q, do = (r.standard_normal((1, seq, heads, head_dim)) for _ in range(2))
  k, v = (r.standard_normal((1, seq, kv_heads, head_dim)) for _ in range(2))
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
  row = {"seq": seq, "head_dim": head_dim, "heads": heads, "kv_heads": kv_heads,
         "dtype": jnp.dtype(dtype).name, "causal": causal, "options": sorted(extra),
         "seconds": None, "ok": True}
  for name, g, p, t in zip(("out", "dq", "dk", "dv"), got, plain, ref):
    err, err_plain = max_err(g, t), max_err(p, t)
    bound = 2 * err_plain + error_floor(dtype, t, head_dim)   # the stricter dot-product floor
    ok = bool(np.all(np.isfinite(g)) and err <= bound)
    row[name] = {"err": err, "plain_err": err_plain, "bound": bound, "ok": ok}
    row["ok"] &= ok
  row["seconds"] = round(time.perf_counter() - t0, 2)
  return row


def report(row):
  keys = ("seq", "heads", "kv_heads", "head_dim", "dtype", "causal", "options", "ok")
  if "error" in row:
    print({k: row[k] for k in keys}, row["error"][:2000], flush=True)
    return
  print({k: row[k] for k in (*keys, "seconds")},
        {n: f"{row[n]['err']:.2e}/{row[n]['bound']:.2e}" for n in ("out", "dq", "dk", "dv")},
        flush=True)


def fa2_cases(seq, heads):
  """(seq, head_dim, dtype, causal, heads, kv_heads, extra) of the FlashAttention-2 grid."""
  cases = [(seq, d, dt, c, heads, heads, {})
           for d, dt, c in itertools.product((64, 128), (jnp.bfloat16, jnp.float16), (False, True))]
  # One masked case on the compiled kernels: window + segments + soft cap.
  seg = np.repeat(np.arange(4), -(-seq // 4))[None, :seq]
  cases.append((seq, 128, jnp.bfloat16, True, heads, heads,
                {"local_window_size": (256, 0), "segment_ids": jnp.asarray(seg, jnp.int32),
                 "logits_soft_cap": 30.0}))
  # And one with a bias and dropout (hashed per element, so the transposed dK/dV tile
  # must draw the same mask as the forward and dQ tiles).
  bias = np.random.default_rng(1).standard_normal((1, heads, seq, seq))
  cases.append((seq, 64, jnp.bfloat16, True, heads, heads,
                {"bias": jnp.asarray(bias, jnp.bfloat16), "dropout_rate": 0.1,
                 "dropout_rng": jax.random.PRNGKey(3)}))
  return cases


def model_cases(seq, gqa_seq, heads):
  """Model shapes: GQA 32/8 and MQA 16/1 (d = 128), and head dims that are not powers
  of two (80, 96, 160, 192: two head-dim pieces each; 72: 64 + a 16-wide piece whose
  last 8 columns are masked) or are 256, at lengths that are not whole tiles; causal
  and not."""
  cases = []
  for causal in (False, True):
    cases.append((gqa_seq, 128, jnp.bfloat16, causal, 32, 8, {}))
    cases.append((gqa_seq, 128, jnp.bfloat16, causal, 16, 1, {}))
    for d in (72, 80, 96, 160, 192, 256):
      cases.append((seq, d, jnp.bfloat16, causal, heads, 1 if d == 96 else heads, {}))
  return cases


def main(argv=None):
  p = common.parser(__doc__, whole=True)
  gpu = jax.default_backend() == "gpu"
  p.add_argument("--preset", choices=("fa2", "model", "all"), default="all")
  p.add_argument("--seq", type=int, default=None,
                 help="T = S of every case (GPU default: 4096 for fa2, 3000 for model; "
                      "CPU default 128, interpret mode is slow)")
  p.add_argument("--gqa-seq", type=int, default=None,
                 help="T = S of the GQA/MQA cases (GPU default 1000; CPU: --seq)")
  p.add_argument("--heads", type=int, default=2, help="few heads keep the float64 reference cheap")
  p.add_argument("--head-dims", type=int, nargs="+", default=None,
                 help="only the cases of these head dims")
  p.add_argument("--out-dir", default=None, help="where the JSON goes (default experiments/results)")
  p.add_argument("--name", default=None,
                 help="JSON file stem (default pallas_check_h200 on a GPU, pallas_check_cpu, "
                      "pallas_check_cpu_tiny)")
  common.add_tiny(p, "the FlashAttention-2 grid's d = 64 cases at T = S = 32")
  args = p.parse_args(argv)
  if args.tiny:
    args.preset, args.seq, args.head_dims = "fa2", 32, [64]
  if args.name is None:
    args.name = f"pallas_check_{'h200' if gpu else 'cpu'}" + ("_tiny" if args.tiny else "")
  small = None if gpu else 128
  cases = []
  if args.preset in ("fa2", "all"):
    cases += fa2_cases(args.seq or small or 4096, args.heads)
  if args.preset in ("model", "all"):
    seq = args.seq or small or 3000
    cases += model_cases(seq, args.gqa_seq or (args.seq or small or 1000), args.heads)
  if args.head_dims:
    cases = [c for c in cases if c[1] in args.head_dims]
  rows = []
  for seq, head_dim, dtype, causal, heads, kv_heads, extra in cases:
    rows.append(check(seq, head_dim, dtype, causal, heads, extra, kv_heads))
    report(rows[-1])
  path = write_result(args.name, vars(args), rows, out_dir=args.out_dir)
  bad = [r for r in rows if not r["ok"]]
  print(f"{len(rows) - len(bad)} passed, {len(bad)} failed -> {path}")
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
