"""Builds the jflash HIP kernel for the local GPU, checks it against float64, measures it.

  python experiments/hip_check.py               # H200: nvcc sm_90 build, correctness grid,
                                                #   bandwidth -> results/hip_cuda_h200.json
  python experiments/hip_check.py --bandwidth   # MI50 owners: hipcc gfx906 build, effective
                                                #   bandwidth and TF/s only (one command)

The kernel source is one file for hipcc (gfx906, the product) and nvcc (sm_90, how its
logic is run on NVIDIA hardware). The correctness rule is the tests' rule: max error
against `jflash.attention_numpy` (float64) at most 2x the error of the plain fp16
`jflash.attention_xla` against the same truth, plus a floor of one fp16 ulp of the
largest output (lse: a few float32 roundings of a length-H dot product).

Effective bandwidth counts the bytes of Q, K, V and O once over the median wall time
of the jitted forward (the custom call alone; launch overhead included). TF/s counts
4*H flops per visible (query, key) pair. The process exits non-zero on a compile
error (printing the compiler's output), on a missing device, or on any failed case.
"""
from __future__ import annotations

import argparse
import math
import re
import shlex
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import hip_ffi
import jflash
from experiments.common import is_oom, time_fn, write_result
from hip_ffi import build

SIDES = (1, 97, 113, 203, 257)  # T and S: awkward lengths, every pair (T != S both ways)
LONG = 16384                    # long rows
# (B, T, N, K, H) for the speed table: MHA and GQA, both head dims, up to 16K.
BENCH = [
    (4, 4096, 16, 16, 64),
    (4, 4096, 16, 16, 128),
    (8, 2048, 32, 8, 128),
    (1, 16384, 16, 16, 64),
    (1, 16384, 16, 16, 128),
]


def parse_args():
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--bandwidth", action="store_true",
                  help="skip the correctness grid: build, then bandwidth and TF/s only")
  ap.add_argument("--target", choices=("auto", "cuda", "rocm"), default="auto",
                  help="compiler: auto follows the GPU jax sees (cuda: nvcc, rocm: hipcc)")
  ap.add_argument("--warmup", type=int, default=3, help="untimed calls (compile, caches)")
  ap.add_argument("--iters", type=int, default=20, help="timed calls; the median is kept")
  ap.add_argument("--quick", action="store_true",
                  help="smaller grid and no 16K cases (a smoke run, minutes less)")
  ap.add_argument("--out", default=None,
                  help="result name under experiments/results/ (default: "
                  "hip_<target>_<device> or hip_bandwidth_<target>_<device>)")
  return ap.parse_args()


def device_slug() -> str:
  kind = jax.devices()[0].device_kind.lower()
  kind = re.sub(r"\b(nvidia|amd|radeon|instinct)\b", "", kind)
  return re.sub(r"[^a-z0-9]+", "_", kind).strip("_") or "gpu"


# -- correctness -------------------------------------------------------------------------

def reference_f64(q, k, v, scale, is_causal, rows=1024):
  """float64 truth in query-row blocks with their absolute offsets (top-left causal),
  for T x S too large for `jflash.attention_numpy` in one piece."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  G = N // K
  out = np.zeros((B, T, N, H))
  lse = np.full((B, N, T), -np.inf)
  for b in range(B):
    for n in range(N):
      kh, vh = k[b, :, n // G], v[b, :, n // G]
      for i0 in range(0, T, rows):
        s = q[b, i0:i0 + rows, n] @ kh.T * scale
        if is_causal:
          s = np.where(np.arange(i0, i0 + len(s))[:, None] >= np.arange(S)[None], s, -np.inf)
        m = s.max(1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0)
        p = np.exp(s - m)
        l = p.sum(1, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
          out[b, i0:i0 + rows, n] = np.where(l > 0, (p @ vh) / l, 0)
          lse[b, n, i0:i0 + rows] = np.where(l[:, 0] > 0, m[:, 0] + np.log(l[:, 0]), -np.inf)
  return out, lse


_hip = jax.jit(
    lambda q, k, v, scale, is_causal, bq, bk: jflash.attention(
        q, k, v, scale=scale, is_causal=is_causal, implementation="hip",
        block_sizes=jflash.BlockSizes(bq, bk), return_residuals=True),
    static_argnums=(3, 4, 5, 6))
_plain = jax.jit(jflash.attention_xla, static_argnames=("scale", "is_causal"))


def check_case(name, q, k, v, scale, is_causal, tile=0):
  H = q.shape[-1]
  bq, bk, _ = hip_ffi.tile_table()[H][tile]
  row = {"case": name, "shape_q": list(q.shape), "shape_kv": list(k.shape),
         "is_causal": is_causal, "scale": float(scale), "tile": tile, "block_q": bq,
         "block_k": bk}
  try:
    qd, kd, vd = (jnp.asarray(x) for x in (q, k, v))
    out, lse = jax.block_until_ready(_hip(qd, kd, vd, float(scale), is_causal, bq, bk))
    xo, xl = jax.block_until_ready(_plain(qd, kd, vd, scale=float(scale), is_causal=is_causal))
    big = q.shape[1] * k.shape[1] > 2**24
    ref_o, ref_l = (reference_f64(q, k, v, scale, is_causal) if big else
                    jflash.attention_numpy(q, k, v, scale=scale, is_causal=is_causal))
    err = lambda x, ref: float(np.abs(np.asarray(x, np.float64) - ref).max())
    eps32 = float(np.finfo(np.float32).eps)
    o_floor = 2.0**-10 * max(1.0, float(np.abs(ref_o).max()))
    l_floor = 4 * eps32 * math.sqrt(H) * max(1.0, float(np.abs(ref_l).max()))
    row.update(
        err_out=err(out, ref_o), err_out_plain=err(xo, ref_o), floor_out=o_floor,
        err_lse=err(lse, ref_l), err_lse_plain=err(xl, ref_l), floor_lse=l_floor,
        finite=bool(np.isfinite(np.asarray(out, np.float32)).all()
                    and np.isfinite(np.asarray(lse)).all()))
    row["ok"] = bool(row["finite"]
                     and row["err_out"] <= 2 * row["err_out_plain"] + o_floor
                     and row["err_lse"] <= 2 * row["err_lse_plain"] + l_floor)
  except Exception as e:  # recorded, the run goes on; the exit code reports it
    row.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
    traceback.print_exc()
  status = "ok  " if row["ok"] else "FAIL"
  print(f"{status} {name:<14} q{tuple(q.shape)} kv{tuple(k.shape)} causal={is_causal:d} "
        f"tile={tile} out {row.get('err_out', float('nan')):.2e} "
        f"(plain {row.get('err_out_plain', float('nan')):.2e}) "
        f"lse {row.get('err_lse', float('nan')):.2e} "
        f"(plain {row.get('err_lse_plain', float('nan')):.2e})", flush=True)
  return row


def rand(shape, seed):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float16)


def correctness_rows(quick: bool):
  rows, seed = [], 0
  sides = (1, 113, 257) if quick else SIDES
  for H, (N, K) in ((64, (4, 2)), (128, (4, 1))):  # GQA for d=64, MQA for d=128
    for T in sides:
      for S in sides:
        for is_causal in (False, True):
          seed += 1
          q, k, v = rand((2, T, N, H), seed), rand((2, S, K, H), seed + 1), rand((2, S, K, H), seed + 2)
          rows.append(check_case("grid", q, k, v, 1 / math.sqrt(H), is_causal))
          if (T, S) in ((203, 113), (113, 203), (257, 257), (113, 257)):
            rows.append(check_case("grid", q, k, v, 1 / math.sqrt(H), is_causal, tile=1))
    for is_causal in (False, True):
      x = np.full((1, 203, 2, H), 0.5, np.float16)  # all-equal: out = v, lse = s + log(n)
      rows.append(check_case("all_equal", x, x[:, :, :1], x[:, :, :1], 1 / math.sqrt(H), is_causal))
      q, k, v = rand((1, 203, 4, H), 7), rand((1, 257, 2, H), 8), rand((1, 257, 2, H), 9)
      s = np.einsum("btnh,bskh->bnkts", q.astype(np.float64), k.astype(np.float64))
      rows.append(check_case("logits_1e4", q, k, v, 1e4 / np.abs(s).max(), is_causal))
    if not quick:
      q, k, v = rand((1, 64, 2, H), 10), rand((1, LONG, 1, H), 11), rand((1, LONG, 1, H), 12)
      rows.append(check_case("long_rows", q, k, v, 1 / math.sqrt(H), False))
      q, k, v = rand((1, LONG, 1, H), 13), rand((1, LONG, 1, H), 14), rand((1, LONG, 1, H), 15)
      rows.append(check_case("long_causal", q, k, v, 1 / math.sqrt(H), True))
  rows.extend(gradient_rows())
  rows.extend(handler_error_rows())
  return rows


def handler_error_rows():
  """The C++ handler answers a bad call with an ffi::Error (Python checks bypassed)."""
  rows = []
  q = jnp.zeros((1, 8, 2, 64), jnp.float16)
  good_out = jax.ShapeDtypeStruct(q.shape, q.dtype)
  bad = {
      "lse_shape": ((good_out, jax.ShapeDtypeStruct((1, 2, 9), jnp.float32)), 0, "lse"),
      "lse_dtype": ((good_out, jax.ShapeDtypeStruct((1, 2, 8), jnp.float16)), 0, "lse"),
      "tile": ((good_out, jax.ShapeDtypeStruct((1, 2, 8), jnp.float32)), 9, "tile"),
  }
  for name, (results, tile, word) in bad.items():
    row = {"case": f"handler_error_{name}"}
    try:
      jax.block_until_ready(jax.ffi.ffi_call(hip_ffi.TARGET_NAME, results)(
          q, q, q, scale=np.float32(0.125), is_causal=np.bool_(False), tile=np.int32(tile)))
      row.update(ok=False, error="no error raised")
    except Exception as e:  # expected: the handler's message, surfaced by XLA
      msg = str(e)
      row.update(ok="jflash_flash_fwd" in msg and word in msg, message=msg[:500])
    print(f"{'ok  ' if row['ok'] else 'FAIL'} {row['case']}: "
          f"{row.get('message', row.get('error', ''))[:120]}", flush=True)
    rows.append(row)
  return rows


def gradient_rows():
  """The custom_vjp around the kernel: hip forward + xla_chunked recompute backward."""
  rows = []
  for H, is_causal in ((64, True), (128, False)):
    q, k, v, do = (rand(s, 20 + i) for i, s in enumerate(
        ((1, 203, 4, H), (1, 113, 2, H), (1, 113, 2, H), (1, 203, 4, H))))
    row = {"case": "gradients", "shape_q": list(q.shape), "shape_kv": list(k.shape),
           "is_causal": is_causal}
    try:
      def grads(impl):
        f = lambda q, k, v: jflash.attention(q, k, v, is_causal=is_causal, implementation=impl)
        _, vjp = jax.vjp(f, *(jnp.asarray(x) for x in (q, k, v)))
        return [np.asarray(g, np.float64) for g in vjp(jnp.asarray(do))]
      ref = jflash.attention_numpy(q, k, v, is_causal=is_causal, dout=do)[2:]
      got, plain = grads("hip"), grads("xla")
      ok = True
      for name, g, p, r in zip(("dq", "dk", "dv"), got, plain, ref):
        e, ep = float(np.abs(g - r).max()), float(np.abs(p - r).max())
        fl = 4 * 2.0**-10 * math.sqrt(H) * max(1.0, float(np.abs(r).max()))  # tests' fp16 floor
        row[f"err_{name}"], row[f"err_{name}_plain"] = e, ep
        ok &= bool(np.isfinite(g).all() and e <= 2 * ep + fl)
      row["ok"] = ok
    except Exception as e:
      row.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
      traceback.print_exc()
    print(f"{'ok  ' if row['ok'] else 'FAIL'} gradients      H={H} causal={is_causal:d} "
          + " ".join(f"{k}={v:.2e}" for k, v in row.items() if k.startswith("err_")), flush=True)
    rows.append(row)
  return rows


# -- speed ---------------------------------------------------------------------------------

def visible_pairs(T, S, is_causal):
  if not is_causal:
    return T * S
  n = min(T, S)  # rows i < S see i + 1 keys; rows i >= S see all S
  return n * (n + 1) // 2 + max(0, T - S) * S


def bandwidth_rows(args):
  rows = []
  fwd = jax.jit(hip_ffi.flash_forward, static_argnames=("scale", "is_causal", "tile"))
  for B, T, N, K, H in BENCH:
    if args.quick and T > 4096:
      continue
    for is_causal in (False, True):
      r = np.random.default_rng(0)
      q = jnp.asarray(r.standard_normal((B, T, N, H)), jnp.float16)
      k = jnp.asarray(r.standard_normal((B, T, K, H)), jnp.float16)
      v = jnp.asarray(r.standard_normal((B, T, K, H)), jnp.float16)
      row = {"B": B, "T": T, "S": T, "N": N, "K": K, "H": H, "is_causal": is_causal}
      bytes_qkvo = 2 * (2 * q.size + k.size + v.size)
      flops = 4 * B * N * H * visible_pairs(T, T, is_causal)
      for tile in range(len(hip_ffi.tile_table()[H])):
        try:
          t = time_fn(lambda q, k, v: fwd(q, k, v, scale=1 / math.sqrt(H), is_causal=is_causal,
                                          tile=tile), q, k, v, warmup=args.warmup,
                      iters=args.iters)["median_s"]
          row[f"tile{tile}_s"] = t
          row[f"tile{tile}_GBps"] = bytes_qkvo / t / 1e9
          row[f"tile{tile}_TFps"] = flops / t / 1e12
        except Exception as e:
          row[f"tile{tile}_error"] = f"{type(e).__name__}: {e}"[:500]
      try:  # the materialising fp16 baseline, for context; may not fit at 16K
        plain = jax.jit(lambda q, k, v: jflash.attention_xla(
            q, k, v, scale=1 / math.sqrt(H), is_causal=is_causal))
        t = time_fn(plain, q, k, v, warmup=args.warmup, iters=args.iters)["median_s"]
        row["xla_s"], row["xla_TFps"] = t, flops / t / 1e12
      except Exception as e:
        row["xla_error"] = "OOM" if is_oom(e) else f"{type(e).__name__}: {e}"[:500]
      row.update(bytes_qkvo=bytes_qkvo, flops=flops)
      timed = [(row[f"tile{i}_s"], i) for i in range(2) if f"tile{i}_s" in row]
      if timed:
        best = min(timed)
        row["best_tile"] = best[1]
        print(f"B={B} T={T} N={N} K={K} H={H} causal={is_causal:d}: tile{best[1]} "
              f"{best[0] * 1e3:.3f} ms, {bytes_qkvo / best[0] / 1e9:.1f} GB/s effective, "
              f"{flops / best[0] / 1e12:.2f} TF/s" +
              (f" (xla {row['xla_TFps']:.2f} TF/s)" if "xla_TFps" in row else ""), flush=True)
      rows.append(row)
  return rows


def main():
  args = parse_args()
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

  rows = [] if args.bandwidth else correctness_rows(args.quick)
  speed = bandwidth_rows(args)
  failed = [r for r in rows if not r.get("ok")]
  name = args.out or (f"hip_bandwidth_{target}_{device_slug()}" if args.bandwidth
                      else f"hip_{target}_{device_slug()}")
  cmd = " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])
  path = write_result(name, vars(args), rows, extra={
      "speed": speed,
      "commands": {"build": (lib.parent / "command.txt").read_text().strip(), "run": cmd},
      "build_seconds": build_s,
      "tile_table": {str(h): t for h, t in hip_ffi.tile_table().items()},
      "summary": {"cases": len(rows), "failed": len(failed),
                  "max_err_out_over_plain": max(
                      (r["err_out"] / max(r["err_out_plain"], 1e-12) for r in rows
                       if "err_out" in r), default=None)},
  })
  print(f"wrote {path}: {len(rows)} cases, {len(failed)} failed", flush=True)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
