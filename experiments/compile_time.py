"""Where the first call of a jflash fwd+bwd spends its time: tracing and lowering,
XLA's compile (with the Pallas kernels' own compile inside it) and the first run, each
measurement in a fresh process, so that no kernel is in a cache yet.

  python -m experiments.compile_time --shape 4,4096,8,256 --variants '[{}, {"persistent": false}]' \\
      --repeat 2 --out-dir experiments/results --name compile_time_h200

Each variant's MosaicGPUConfig fields (or, with another --implementation, nothing) go
to `jflash.attention` as its config; variants alternate within each repeat, so a
host's drift falls on all of them. --forward-first also compiles the training forward
alone before the fwd+bwd (its kernels then compiled twice unless a cache hits).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from experiments import common

REPO = Path(__file__).resolve().parent.parent


def measure(B: int, S: int, N: int, H: int, causal: bool, implementation: str,
            config: dict, forward_first: bool) -> dict:
  """The timings of one fresh process's first calls (run in that process)."""
  import jax
  import jax.numpy as jnp
  import jflash

  ks = jax.random.split(jax.random.key(0), 4)
  q, k, v, do = (jax.random.normal(key, (B, S, N, H), jnp.bfloat16) for key in ks)
  cfg = jflash.MosaicGPUConfig(**config) if config else None
  f = lambda q, k, v: jflash.attention(q, k, v, is_causal=causal,
                                       implementation=implementation, config=cfg)
  steps = [("fwd+bwd", lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do), (q, k, v, do))]
  if forward_first:
    steps.insert(0, ("fwd_train", lambda q, k, v: jax.vjp(f, q, k, v)[0], (q, k, v)))
  row = {"pid": os.getpid()}
  for name, fn, args in steps:
    t0 = time.perf_counter()
    lowered = jax.jit(fn).lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    t3 = time.perf_counter()
    row[name] = dict(lower_s=round(t1 - t0, 2), compile_s=round(t2 - t1, 2),
                     first_run_s=round(t3 - t2, 3), first_call_s=round(t3 - t0, 2))
  return row


def parse_args(argv=None):
  p = common.parser(__doc__)
  p.add_argument("--shape", default="4,4096,8,256", help="B,S,N,H (T = S, K = N)")
  p.add_argument("--causal", action="store_true")
  p.add_argument("--implementation", default="mosaic_gpu")
  p.add_argument("--variants", default="[{}]",
                 help="a JSON list of MosaicGPUConfig field dicts, one measurement each")
  p.add_argument("--repeat", type=int, default=2)
  p.add_argument("--forward-first", action="store_true")
  p.add_argument("--timeout-s", type=float, default=120.0, help="per process")
  p.add_argument("--out-dir", default=common.DEFAULT_OUT)
  p.add_argument("--name", default="compile_time")
  common.add_tiny(p, "--shape 1,64,2,32 on xla_chunked")
  p.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.tiny:
    args.shape, args.implementation = "1,64,2,32", "xla_chunked"
  try:
    args.shape = tuple(int(x) for x in args.shape.split(","))
  except ValueError:
    p.error(f"--shape={args.shape!r} must be four positive integers B,S,N,H")
  if len(args.shape) != 4 or min(args.shape) < 1:
    p.error(f"--shape={args.shape} must be four positive integers B,S,N,H")
  if args.repeat < 1:
    p.error(f"--repeat={args.repeat} must be at least 1")
  try:
    args.variants = json.loads(args.variants)
  except json.JSONDecodeError as e:
    p.error(f"--variants={args.variants!r} is not JSON: {e}")
  if not isinstance(args.variants, list) or not all(isinstance(v, dict) for v in args.variants):
    p.error(f"--variants={args.variants!r} must be a JSON list of dicts")
  if args.implementation != "mosaic_gpu" and any(args.variants):
    p.error("--variants' config fields are MosaicGPUConfig's: only with mosaic_gpu")
  return args


def main(argv=None):
  args = parse_args(argv)
  if args.child is not None:        # one measurement, printed for the parent
    print(json.dumps(measure(*args.shape, args.causal, args.implementation,
                             json.loads(args.child), args.forward_first)))
    return None
  # No persistent compilation cache: every process compiles from nothing.
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
  rows = []
  for r in range(args.repeat):
    for variant in args.variants:
      cmd = [sys.executable, "-m", "experiments.compile_time", "--child", json.dumps(variant),
             "--shape", ",".join(map(str, args.shape)), "--implementation", args.implementation]
      cmd += ["--causal"] * args.causal + ["--forward-first"] * args.forward_first
      row = dict(repeat=r, variant=variant)
      try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s,
                              cwd=REPO, env=env)
      except subprocess.TimeoutExpired as e:   # its output comes as bytes whatever `text`
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
        row.update(status="timeout", error=(err or "")[-2000:])
      else:
        try:
          if done.returncode:
            raise ValueError(f"exit status {done.returncode}")
          row.update(status="ok", **json.loads(done.stdout.strip().splitlines()[-1]))
        except (ValueError, IndexError) as e:   # a failed child, or no JSON line from it
          row.update(status="error", error=f"{e}: {(done.stderr or done.stdout)[-2000:]}")
      print(json.dumps(row), flush=True)
      rows.append(row)
  path = common.write_result(args.name, {k: v for k, v in vars(args).items() if k != "child"},
                             rows, out_dir=args.out_dir)
  print(f"wrote {path}")
  return path


if __name__ == "__main__":
  main()
