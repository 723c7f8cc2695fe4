"""Builds the jflash HIP kernels for the local GPU, checks them against float64, times them.

  python -m experiments.hip_check               # correctness (forward and gradients),
                                                #   then timing -> results/hip_<target>_<device>.json
  python -m experiments.hip_check --timing      # timing only (MI50 owners: `make mi50`)
  python -m experiments.hip_check --quick       # a smaller grid, smaller timing shapes
  python -m experiments.hip_check --tiny        # smoke run on the CPU emulation

The kernel source is one file for hipcc (gfx906, the product) and nvcc (sm_90, how its
logic is run on NVIDIA hardware). Correctness goes through `jflash.attention(...,
implementation="hip")` and `jax.vjp`: the forward kernel, then the delta, dQ and dK/dV
kernels. The rule is the tests' rule: the max error of out, lse, dq, dk, dv against
`jflash.attention_numpy` (float64) is at most 2x the error of the plain same-dtype
`implementation="xla"` against the same truth, plus a floor of two roundings to the
dtype and a few float32 roundings of a length-H dot product (times the largest value).

Timing: 10 warm-up calls, 50 measured, median and p95 of the wall
time of the jitted call (forward; forward + backward), completion awaited. TF/s counts
4*H flops per visible (query, key) pair for the forward and 10*H for the backward
(five matmuls: S, dP, dV, dK, dQ; S is recomputed). The process exits non-zero on a
compile error (printing the compiler's output), a missing device, or a failed case.
"""
from __future__ import annotations

import math
import shlex
import statistics
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import hip_ffi
import jflash
from experiments import common
from experiments.common import attention_flops, block, device_tag, is_oom, write_result
from hip_ffi import build
from jflash.reference import error_floor

# (B, T, S, N, K, H) of the correctness grid: awkward lengths, T != S both ways, GQA/MQA.
SHAPES = [
    (2, 97, 97, 4, 2, 64),
    (1, 113, 203, 4, 2, 64),
    (1, 203, 113, 4, 1, 128),
    (1, 257, 257, 2, 1, 128),
    (1, 1, 257, 2, 2, 64),
    (1, 257, 1, 2, 2, 128),
    (1, 203, 113, 4, 2, 96),
    (1, 113, 203, 4, 1, 80),
]
MASKS = {  # B = 2, T = S = 300
    "lengths": dict(query_seq_lengths=np.array([250, 7], np.int32),
                    key_value_seq_lengths=np.array([300, 130], np.int32)),
    "causal_window": dict(is_causal=True, local_window_size=(100, 0)),
    "window": dict(local_window_size=(40, 70)),
    "segments": dict(segment_ids=np.array([[0] * 90 + [1] * 150 + [2] * 60, [4] * 300], np.int32)),
    "causal_len_seg": dict(is_causal=True, key_value_seq_lengths=np.array([200, 300], np.int32),
                           segment_ids=np.array([[0] * 130 + [1] * 170, [3] * 300], np.int32)),
    "soft_cap": dict(logits_soft_cap=2.0),
    "causal_window_soft_cap": dict(is_causal=True, local_window_size=(100, 0),
                                   logits_soft_cap=5.0),
}
# (B, T, N, K, H) for the timing table: MHA and GQA, both head dims.
BENCH = [
    (4, 4096, 16, 16, 64),
    (4, 4096, 16, 16, 128),
    (8, 2048, 32, 8, 128),
    (1, 16384, 16, 16, 64),
]


def parse_args():
  ap = common.parser(__doc__, whole=True)
  ap.add_argument("--timing", "--bandwidth", dest="timing", action="store_true",
                  help="skip the correctness grid: build, then timing only")
  ap.add_argument("--no-timing", action="store_true", help="correctness only")
  ap.add_argument("--timing-quick", action="store_true", help="time the first shape only")
  ap.add_argument("--target", choices=("auto", "cuda", "rocm"), default="auto",
                  help="compiler: auto follows the GPU jax sees (cuda: nvcc, rocm: hipcc)")
  ap.add_argument("--warmup", type=int, default=10, help="untimed calls (compile, caches)")
  ap.add_argument("--iters", type=int, default=50, help="timed calls: median and p95")
  ap.add_argument("--quick", action="store_true", help="smaller grid and timing shapes")
  common.add_tiny(ap, "a few correctness cases on the kernels' CPU emulation (no GPU, "
                      "no handler or timing rows)")
  ap.add_argument("--out", default=None, help="result name under experiments/results/ "
                  "(default: hip_<target>_<device> or hip_timing_<target>_<device>)")
  return ap.parse_args()


# -- correctness -------------------------------------------------------------------------

def fwd_bwd(impl, kw):
  def run(q, k, v, do):
    f = lambda q, k, v: jflash.attention(q, k, v, implementation=impl, return_residuals=True,
                                         **kw)
    (out, lse), vjp = jax.vjp(f, q, k, v)
    return (out, lse, *vjp((do, jnp.zeros_like(lse))))
  return jax.jit(run)


def rand(shape, dtype, seed, scale=1.0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, dtype)


def check_case(name, shape, dtype, seed, config=None, **kw):
  B, T, S, N, K, H = shape
  q, do = rand((B, T, N, H), dtype, seed), rand((B, T, N, H), dtype, seed + 1)
  k, v = rand((B, S, K, H), dtype, seed + 2), rand((B, S, K, H), dtype, seed + 3)
  row = {"case": name, "shape": list(shape), "dtype": jnp.dtype(dtype).name,
         "options": {k_: (v_.tolist() if hasattr(v_, "tolist") else v_) for k_, v_ in kw.items()}}
  try:
    got = [np.asarray(x, np.float64) for x in block(
        fwd_bwd("hip", dict(kw, config=config))(q, k, v, do))]
    plain = [np.asarray(x, np.float64) for x in block(fwd_bwd("xla", kw)(q, k, v, do))]
    ref = jflash.attention_numpy(q, k, v, dout=do, **kw)
    ok = True
    for what, g, p, r in zip(("out", "lse", "dq", "dk", "dv"), got, plain, ref):
      if what == "lse":
        hidden = np.isneginf(r)
        ok &= bool(np.array_equal(np.isneginf(g), hidden))
        g, p, r = g[~hidden], p[~hidden], r[~hidden]
      e, ep = float(np.abs(g - r).max(initial=0)), float(np.abs(p - r).max(initial=0))
      fl = error_floor(jnp.float32 if what == "lse" else dtype, r, H)
      row[f"err_{what}"], row[f"err_{what}_plain"] = e, ep
      ok &= bool(np.isfinite(g).all() and e <= 2 * ep + fl)
    row["ok"] = ok
  except Exception as e:  # recorded, the run goes on; the exit code reports it
    row.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
    traceback.print_exc()
  ratios = [row[f"err_{w}"] / max(row[f"err_{w}_plain"], 1e-30)
            for w in ("out", "dq", "dk", "dv") if f"err_{w}" in row]
  row["max_ratio_over_plain"] = max(ratios, default=None)
  flags = "c" if kw.get("is_causal") else " "
  print(f"{'ok  ' if row['ok'] else 'FAIL'} {name:<19} {flags} {row['dtype']:<8} {tuple(shape)} "
        + " ".join(f"{w}={row.get('err_' + w, float('nan')):.1e}"
                   f"({row.get('err_' + w + '_plain', float('nan')):.1e})"
                   for w in ("out", "dq", "dk", "dv")), flush=True)
  return row


def correctness_rows(quick: bool, tiny: bool = False):
  """The correctness grid; `tiny` (the smoke run): its first shape, float16, and one
  mask at the smallest head dim."""
  rows, seed = [], 0
  head_dims = hip_ffi.head_dims()[:1] if tiny else hip_ffi.head_dims()
  masks = {"causal_len_seg": MASKS["causal_len_seg"]} if tiny else MASKS
  for dtype in (jnp.float16,) if tiny else (jnp.float16, jnp.bfloat16):
    for shape in SHAPES[:1] if tiny else SHAPES[: 3 if quick else None]:
      for is_causal in (False, True):
        seed += 4
        rows.append(check_case("grid", shape, dtype, seed, is_causal=is_causal))
    for H in head_dims:
      for mask, kw in masks.items():
        seed += 4
        rows.append(check_case(f"mask_{mask}", (2, 300, 300, 4, 2 if H == 64 else 1, H),
                               dtype, seed, **kw))
  for H in head_dims:
    bq, bk, _ = hip_ffi.tile_table()[H][1]
    rows.append(check_case("tile1", (1, 203, 113, 4, 2, H), jnp.float16, 90 + H, is_causal=True,
                           config=jflash.HipConfig(bq, bk)))
    if not quick:
      rows.append(check_case("long_rows", (1, 64, 8192, 2, 1, H), jnp.float16, 95 + H))
      rows.append(check_case("long_causal", (1, 2048, 2048, 2, 1, H), jnp.bfloat16, 97 + H,
                             is_causal=True))
  rows.append(nan_row())
  rows.append(vmap_row())
  if not hip_ffi.emulating():
    rows.extend(handler_error_rows())
  return rows


def nan_row():
  """A NaN in query row 3 reaches out row 3 and its gradients; the other rows stay finite."""
  q = np.array(rand((1, 200, 2, 64), jnp.float16, 7))
  k, v, do = (rand((1, 200, 2, 64), jnp.float16, s) for s in (8, 9, 10))
  q[0, 3, 0, 0] = np.nan
  out, lse, dq, dk, dv = (np.asarray(x, np.float32) for x in block(
      fwd_bwd("hip", dict(is_causal=True))(jnp.asarray(q), k, v, do)))
  rest = np.ones(200, bool)
  rest[3] = False
  ok = bool(np.isnan(out[0, 3, 0]).all() and np.isfinite(out[0, rest]).all()
            and np.isfinite(out[0, :, 1]).all() and np.isnan(dq[0, 3, 0]).all()
            and np.isfinite(dq[0, rest]).all() and np.isnan(dk[0, :4, 0]).all())
  print(f"{'ok  ' if ok else 'FAIL'} nan_propagation", flush=True)
  return {"case": "nan_propagation", "ok": ok}


def vmap_row():
  """jax.vmap over implementation="hip" (one launch with a leading batch dim) equals the
  unmapped call, forward and dq."""
  q, k, v = (rand((3, 100, 2, 64), jnp.float16, s) for s in (11, 12, 13))
  f = lambda q, k, v: jflash.attention(q, k, v, is_causal=True, implementation="hip")
  loss = lambda f_: lambda q: jnp.sum(f_(q).astype(jnp.float32) ** 2)
  mapped = jax.jit(jax.vmap(f))(q[:, None], k[:, None], v[:, None])[:, 0]
  dq_m = jax.jit(jax.grad(loss(lambda q: jax.vmap(f)(q, k[:, None], v[:, None]))))(q[:, None])
  ok = bool(np.array_equal(np.asarray(mapped), np.asarray(jax.jit(f)(q, k, v))) and
            np.array_equal(np.asarray(dq_m[:, 0]),
                           np.asarray(jax.jit(jax.grad(loss(lambda q: f(q, k, v))))(q))))
  print(f"{'ok  ' if ok else 'FAIL'} vmap", flush=True)
  return {"case": "vmap", "ok": ok}


def handler_error_rows():
  """The C++ handlers answer a bad call with an ffi::Error (Python checks bypassed)."""
  rows = []
  q = jnp.zeros((1, 8, 2, 64), jnp.float16)
  q72 = jnp.zeros((1, 8, 2, 72), jnp.float16)      # no kernel compiled for head_dim 72
  r, seg = jnp.zeros((1, 1, 8), jnp.int32), jnp.zeros((1, 1), jnp.int32)
  attrs = dict(scale=np.float32(0.125), is_causal=np.bool_(False), window_left=np.int32(-1),
               window_right=np.int32(-1), has_segments=np.bool_(False),
               soft_cap=np.float32(0.0))
  out = jax.ShapeDtypeStruct(q.shape, q.dtype)
  lse = lambda t, dt=jnp.float32: jax.ShapeDtypeStruct((1, 2, t), dt)
  fwd = hip_ffi.TARGETS["forward"][0]
  bad = {
      "lse_shape": (fwd, (out, lse(9)), (q, q, q, r, seg, seg), {"tile": np.int32(0)}, "lse"),
      "lse_dtype": (fwd, (out, lse(8, jnp.float16)), (q, q, q, r, seg, seg),
                    {"tile": np.int32(0)}, ""),
      "tile": (fwd, (out, lse(8)), (q, q, q, r, seg, seg), {"tile": np.int32(9)}, "tile"),
      "soft_cap": (fwd, (out, lse(8)), (q, q, q, r, seg, seg),
                   {"tile": np.int32(0), "soft_cap": np.float32(-1.0)}, "soft_cap"),
      "head_dim": (fwd, (jax.ShapeDtypeStruct(q72.shape, q72.dtype), lse(8)),
                   (q72, q72, q72, r, seg, seg), {"tile": np.int32(0)}, "got 72"),
      "dq_ranges": (hip_ffi.TARGETS["dq"][0], jax.ShapeDtypeStruct(q.shape, jnp.float32),
                    (q, q, q, q, jnp.zeros((1, 2, 8)), jnp.zeros((1, 2, 8)),
                     jnp.zeros((1, 5, 8), jnp.int32), seg, seg), {}, "ranges"),
  }
  for name, (target, results, args, extra, word) in bad.items():
    row = {"case": f"handler_error_{name}"}
    try:
      block(jax.ffi.ffi_call(target, results)(*args, **{**attrs, **extra}))
      row.update(ok=False, error="no error raised")
    except Exception as e:  # expected: the handler's (or XLA's dtype) message
      msg = str(e)
      row.update(ok=word in msg, message=msg[:500])
    print(f"{'ok  ' if row['ok'] else 'FAIL'} {row['case']}: "
          f"{row.get('message', row.get('error', ''))[:100]}", flush=True)
    rows.append(row)
  return rows


# -- timing --------------------------------------------------------------------------------

def visible_pairs(T, S, is_causal):
  if not is_causal:
    return T * S
  n = min(T, S)  # rows i < S see i + 1 keys; rows i >= S see all S
  return n * (n + 1) // 2 + max(0, T - S) * S


def time_stats(fn, args, warmup, iters):
  for _ in range(warmup):
    block(fn(*args))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    block(fn(*args))
    times.append(time.perf_counter() - t0)
  times.sort()
  return {"median_s": statistics.median(times),
          "p95_s": times[min(len(times) - 1, math.ceil(0.95 * len(times)) - 1)]}


def timing_rows(args):
  rows = []
  for B, T, N, K, H in BENCH[:1] if args.timing_quick else BENCH[:2] if args.quick else BENCH:
    for is_causal in (False, True):
      q, do = rand((B, T, N, H), jnp.float16, 0), rand((B, T, N, H), jnp.float16, 1)
      k, v = rand((B, T, K, H), jnp.float16, 2), rand((B, T, K, H), jnp.float16, 3)
      pairs = B * N * visible_pairs(T, T, is_causal)
      row = {"B": B, "T": T, "N": N, "K": K, "H": H, "is_causal": is_causal}
      for impl in ("hip", "xla"):
        f = lambda q, k, v: jflash.attention(q, k, v, is_causal=is_causal, implementation=impl)
        fb = lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do)
        for what, fn, a, flops in (("fwd", f, (q, k, v), attention_flops(1, 1, H, pairs)),
                                   ("fwd_bwd", fb, (q, k, v, do),
                                    attention_flops(1, 1, H, pairs, "fwd+bwd"))):
          try:
            st = time_stats(jax.jit(fn), a, args.warmup, args.iters)
            row[f"{impl}_{what}_median_s"], row[f"{impl}_{what}_p95_s"] = st["median_s"], st["p95_s"]
            row[f"{impl}_{what}_TFps"] = flops / st["median_s"] / 1e12
          except Exception as e:  # the materialising baseline may not fit
            row[f"{impl}_{what}_error"] = "OOM" if is_oom(e) else f"{type(e).__name__}: {e}"[:300]
      print(f"B={B} T={T} N={N} K={K} H={H} causal={is_causal:d}: " + " ".join(
          f"{i}_{w} {row[f'{i}_{w}_median_s'] * 1e3:.2f} ms (p95 {row[f'{i}_{w}_p95_s'] * 1e3:.2f},"
          f" {row[f'{i}_{w}_TFps']:.1f} TF/s)" for i in ("hip", "xla") for w in ("fwd", "fwd_bwd")
          if f"{i}_{w}_median_s" in row), flush=True)
      rows.append(row)
  return rows


def main():
  args = parse_args()
  if args.tiny:
    with hip_ffi.emulated():
      rows = correctness_rows(quick=True, tiny=True)
    failed = [r for r in rows if not r.get("ok")]
    print(f"emulated: {len(rows)} cases, {len(failed)} failed", flush=True)
    return 1 if failed else 0
  platform = next(iter(hip_ffi.device_platforms()), None)
  if platform is None:
    print(f"hip_check: no CUDA or ROCm device (jax backend: {jax.default_backend()})",
          file=sys.stderr)
    return 2
  target = platform if args.target == "auto" else args.target
  t0 = time.perf_counter()
  try:
    lib = build.build(target, verbose=True)
  except build.BuildError as e:
    print(f"hip_check: {e}", file=sys.stderr)
    return 3
  build_s = time.perf_counter() - t0
  if platform not in hip_ffi.register():
    print(f"hip_check: the {target} library does not serve {platform}: "
          f"{hip_ffi.load_errors()}", file=sys.stderr)
    return 4
  print(f"library {lib} ({build_s:.1f} s)", flush=True)

  rows = [] if args.timing else correctness_rows(args.quick)
  name = args.out or (f"hip_timing_{target}_{device_tag()}" if args.timing
                      else f"hip_{target}_{device_tag()}")
  cmd = " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])
  failed = [r for r in rows if not r.get("ok")]

  def write(timing):  # after the correctness grid, and again with the timing
    return write_result(name, vars(args), rows, extra={
        "timing": timing,
        "commands": {"build": (lib.parent / "command.txt").read_text().strip(), "run": cmd},
        "build_seconds": build_s,
        "tile_table": {str(h): t for h, t in hip_ffi.tile_table().items()},
        "bwd_tile_table": {str(h): t for h, t in hip_ffi.bwd_tile_table().items()},
        "summary": {"cases": len(rows), "failed": len(failed),
                    "max_ratio_over_plain": max((r["max_ratio_over_plain"] for r in rows
                                                 if r.get("max_ratio_over_plain")), default=None)},
    })

  write([])
  path = write([] if args.no_timing else timing_rows(args))
  print(f"wrote {path}: {len(rows)} cases, {len(failed)} failed", flush=True)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
