"""Error of half-precision attention against float32 and float64 references, as the
sequence grows: jflash's flash path side by side with standard attention in the same
dtype.

Inputs (B=1, --heads heads, head_dim --head-dim):
  normal     q, k, v ~ N(0, 1): the ordinary case.
  all-equal  every logit equal (q and k constant rows), v ~ N(0, 1): softmax is uniform,
             so the output is a mean over S values; tests summation over long rows.
  logit1e4   q, k ~ N(0, 1) with the scale set so logits have std 1e4: a near one-hot
             softmax that overflows anything not subtracting the running max.

Every output is compared, in float64, with (a) standard attention in float32 and (b)
attention in float64 (jflash xla_chunked with x64 enabled), on the same half-precision
inputs upcast, so only the computation's error is measured, not the input rounding.
Writes <out-dir>/numerics_<backend>.json and .png (see common.DEFAULT_OUT).
"""
from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jflash
from experiments import common
from experiments.scaling_common import load_average, seq_axis, setup_matplotlib

PRESETS = {
    # 2 CPU cores: half-precision matmuls are emulated on CPU, so stop at 4K.
    "cpu": dict(seqs="256,1024,4096", heads=2, head_dim=64, dtypes="float16,bfloat16"),
    # GPU: to 32K (the float64 reference is the slow part: ~2 s at 32K on an H200).
    "gpu": dict(seqs="1024,2048,4096,8192,16384,32768", heads=4, head_dim=128,
                dtypes="float16,bfloat16"),
    "tiny": dict(seqs="48", heads=2, head_dim=16, dtypes="float16"),
}
INPUTS = ("normal", "all-equal", "logit1e4")
# Attention paths compared: jflash's platform default (flash), jflash's standard
# materialising "xla" path, and jax.nn.dot_product_attention's XLA path (Flax's default).
IMPLS = {"jflash": None, "standard": "xla", "jax.nn": "jax.nn"}


def parse_args(argv=None):
  p = common.preset_parser(__doc__, PRESETS, "auto = cpu on a CPU, gpu otherwise")
  common.add_preset_options(p, [
      ("seqs", str, "comma-separated lengths"), ("heads", int, "heads"),
      ("head_dim", int, "head dim"), ("dtypes", str, "precisions under test")])
  p.add_argument("--inputs", default=",".join(INPUTS), help=f"input kinds from {INPUTS}")
  p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=False,
                 help="full attention by default: every row then sums S terms, the worst case")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out-dir", type=Path, default=common.DEFAULT_OUT,
                 help="where the JSON and PNG go (tests pass a tmp dir)")
  args = p.parse_args(argv)
  common.apply_preset(args, PRESETS, "gpu")
  return args


def make_inputs(kind, T, N, H, rng):
  """float64 NumPy q, k, v and the logits scale for one input kind."""
  v = rng.standard_normal((1, T, N, H))
  if kind == "normal":
    return rng.standard_normal((1, T, N, H)), rng.standard_normal((1, T, N, H)), v, None
  if kind == "all-equal":
    q = np.full((1, T, N, H), 0.5)
    return q, q.copy(), v, None
  if kind == "logit1e4":
    # q.k ~ N(0, H); this scale makes the logits' std 1e4.
    return rng.standard_normal((1, T, N, H)), rng.standard_normal((1, T, N, H)), v, 1e4 / np.sqrt(H)
  raise ValueError(f"unknown input kind {kind!r}; choose from {INPUTS}")


@functools.cache
def attend_fn(impl, scale, causal):
  """One jitted function per (implementation, scale, causal): jit's own cache then
  compiles once per shape and dtype instead of once per call."""
  def f(q, k, v):
    if impl == "jax.nn":
      return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                          implementation="xla")
    return jflash.attention(q, k, v, scale=scale, is_causal=causal, implementation=impl)
  return jax.jit(f)


def errors(out, ref):
  d = np.asarray(out, np.float64) - np.asarray(ref, np.float64)
  return {"max_abs": float(np.max(np.abs(d))), "rms": float(np.sqrt(np.mean(d * d)))}


def main(argv=None):
  args = parse_args(argv)
  t0 = time.perf_counter()
  seqs = [int(s) for s in args.seqs.split(",")]
  dtypes = args.dtypes.split(",")
  kinds = args.inputs.split(",")
  rng = np.random.default_rng(args.seed)
  rows = []
  jobs = [(T, kind) for T in seqs for kind in kinds]
  for T, kind in common.progress(jobs, "numerics", "case"):
    q64, k64, v64, scale = make_inputs(kind, T, args.heads, args.head_dim, rng)
    for dt in dtypes:
      # Round the inputs to the dtype under test once; every reference sees the same
      # rounded values, so the errors below are the computation's alone.
      q, k, v = (jnp.asarray(x, dt) for x in (q64, k64, v64))
      with jax.enable_x64(True):
        ref64 = np.asarray(attend_fn("xla_chunked", scale, args.causal)(
            *(x.astype(jnp.float64) for x in (q, k, v))))
      ref32 = np.asarray(attend_fn("xla", scale, args.causal)(
          *(x.astype(jnp.float32) for x in (q, k, v))))
      # The float32 reference's own error: the yardstick for "as good as float32".
      rows.append(dict(seq=T, input=kind, dtype=dt, impl="float32 standard", heads=args.heads,
                       head_dim=args.head_dim, causal=args.causal, status="ok",
                       vs_float64=errors(ref32, ref64), vs_float32=errors(ref32, ref32),
                       nonfinite=int(np.sum(~np.isfinite(ref32)))))
      for label, impl in IMPLS.items():
        row = dict(seq=T, input=kind, dtype=dt, impl=label, heads=args.heads,
                   head_dim=args.head_dim, causal=args.causal)
        try:
          out = np.asarray(attend_fn(impl, scale, args.causal)(q, k, v).astype(jnp.float32))
          row.update(status="ok", vs_float64=errors(out, ref64), vs_float32=errors(out, ref32),
                     nonfinite=int(np.sum(~np.isfinite(out))))
        except Exception as e:  # recorded: e.g. an implementation without this dtype
          row.update(status="error", error=f"{type(e).__name__}: {e}"[:400])
        rows.append(row)
  elapsed = time.perf_counter() - t0
  backend = jax.default_backend()
  name = f"numerics_{backend}" + ("" if args.preset in ("cpu", "gpu") else f"_{args.preset}")
  config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
  config["load_average_at_end"] = load_average()  # a busy host slows CPU timings
  config["impls"] = {k: (v or f"default {jflash.default_implementation()}") for k, v in IMPLS.items()}
  path = common.write_result(name, config, rows, extra={"elapsed_s": elapsed},
                             out_dir=args.out_dir)
  plot(rows, Path(args.out_dir) / f"{name}.png", dtypes, kinds,
       f"attention error vs float64 on {common.environment()['device']}: B=1, "
       f"N={args.heads}, H={args.head_dim}, {'causal' if args.causal else 'full'}; "
       "solid: max |err|, dashed: RMS")
  worst = {}
  for r in rows:
    if r["status"] == "ok":
      key = (r["dtype"], r["impl"])
      worst[key] = max(worst.get(key, 0.0), r["vs_float64"]["max_abs"])
  for (dt, impl), e in sorted(worst.items()):
    print(f"  {dt:9s} {impl:9s} worst max|err| vs float64: {e:.3g}")
  print(f"wrote {path} and .png in {elapsed:.0f} s")
  return path


COLORS = {"jflash": "tab:blue", "standard": "tab:red", "jax.nn": "tab:orange",
          "float32 standard": "tab:gray"}


def plot(rows, path, dtypes, kinds, title):
  plt = setup_matplotlib()
  fig, axes = plt.subplots(len(kinds), len(dtypes), figsize=(5.5 * len(dtypes), 3.4 * len(kinds)),
                           squeeze=False)
  for i, kind in enumerate(kinds):
    for j, dt in enumerate(dtypes):
      ax = axes[i, j]
      for impl in COLORS:
        rs = sorted((r for r in rows if r["input"] == kind and r["dtype"] == dt
                     and r["impl"] == impl and r["status"] == "ok"), key=lambda r: r["seq"])
        if not rs:
          continue
        xs = [r["seq"] for r in rs]
        # Exact zeros cannot sit on a log axis; show them at a floor and say so.
        floor = 1e-10
        ax.plot(xs, [max(r["vs_float64"]["max_abs"], floor) for r in rs], "-o", ms=3,
                color=COLORS[impl], label=f"{impl} max")
        ax.plot(xs, [max(r["vs_float64"]["rms"], floor) for r in rs], "--", color=COLORS[impl],
                label=f"{impl} rms")
      ax.set(yscale="log", title=f"{dt}, {kind} inputs", ylabel="error vs float64 (floor 1e-10)")
      seq_axis(ax, [r["seq"] for r in rows])
      ax.grid(True, which="both", alpha=0.3)
  # One legend for all panels: an implementation missing from one panel (e.g. jax.nn's
  # float16 path, which XLA:CPU lacks) still appears.
  handles = {}
  for ax in axes.flat:
    for h, l in zip(*ax.get_legend_handles_labels()):
      handles.setdefault(l, h)
  fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=4, fontsize=8)
  fig.suptitle(title + "\n(lines on top of each other: equal error; a missing line: see "
               "the JSON's error rows)", fontsize=10)
  fig.tight_layout(rect=(0, 0.05, 1, 1))
  fig.savefig(path, dpi=110)
  plt.close(fig)


if __name__ == "__main__":
  main()
