"""Where one decoder-LM training step's time goes, per HLO op, from JAX's own profiler.

The step of `seq_scaling --parts lm` (same presets and model), or with `--cell` one
attention forward + backward of a benchmark cell (`experiments.tools.ab_kernels.CELLS`;
`--impl` cudnn, jflash (implementation=None) or a jflash implementation's name, with
`--config` MosaicGPUConfig fields), compiled once, timed as seq_scaling times it
(`--warmup` calls, `--steps` rounds), then `--steps` steps under
`jax.profiler.trace`. The trace's device events (the GPU's
kernels; on a CPU, the host's XLA ops) of the step's module are summed per HLO op
(the `hlo_op` stat XLA attaches, else the event's name) and kernel, divided by the
steps. Times are the events' own durations: ops that run concurrently on different
streams add up, so the total can exceed the step's wall time; an event that spans
others of its line (a host while loop over its body's ops) is left out for them. With
`--hlo` the optimized HLO is written beside (gzipped) to read what an op is.

  python -m experiments.tools.profile_step --preset h200 --impl jflash --seq 4096 --hlo
  python -m experiments.tools.profile_step --cell "fa2 16K d128" --impl cudnn
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import json
import tempfile
from pathlib import Path

import jax
import numpy as np

from experiments import common, seq_scaling

DEVICE_PLANE = "/device:"


def leaves(events):
  """The events inside which no other event of the same line lies: an XLA op that runs
  others (a while loop on the host) spans their events, which would count twice."""
  events = sorted(events, key=lambda e: (e.start_ns, -e.duration_ns))
  parents, open_ = set(), []
  for i, e in enumerate(events):
    while open_ and events[open_[-1]].start_ns + events[open_[-1]].duration_ns <= e.start_ns:
      open_.pop()
    if open_:
      parents.add(open_[-1])
    open_.append(i)
  return [e for i, e in enumerate(events) if i not in parents]


def device_events(xspace: bytes, module: str):
  """(op, event name, start ns, duration ns) of the trace's events that name an HLO
  module containing `module`: the device planes' when they have any (every kernel:
  two on one line may overlap, XLA's command buffers running independent kernels
  at once), else the host's innermost (`leaves`)."""
  from jax.profiler import ProfileData
  planes = list(ProfileData.from_serialized_xspace(xspace).planes)

  def events(chosen, innermost):
    for plane in chosen:
      for line in plane.lines:
        ours = [e for e in line.events if module in str(dict(e.stats).get("hlo_module", ""))]
        for e in (leaves(ours) if innermost else ours):
          yield (str(dict(e.stats).get("hlo_op") or e.name), e.name, e.start_ns,
                 e.duration_ns)
  found = list(events([p for p in planes if p.name.startswith(DEVICE_PLANE)], False))
  return found or list(events(planes, True))


def timeline(events, steps: int):
  """The events in order of start, each (op, kernel, start and end in ms from the first
  event), and the device span per step (first start to last end, over `steps`): with
  the sum of the events' durations it shows the gaps between kernels."""
  events = sorted(events, key=lambda e: e[2])
  if not events:
    return [], 0.0
  t0 = events[0][2]
  end = max(start + duration for _, _, start, duration in events)
  rows = [dict(op=op, kernel=name[:80], start_ms=round((start - t0) / 1e6, 4),
               end_ms=round((start + duration - t0) / 1e6, 4))
          for op, name, start, duration in events]
  return rows, round((end - t0) / steps / 1e6, 4)


def per_op(events, steps: int, top: int):
  """Rows (op, kernel, ms per step, events per step) per op and kernel name (XLA's
  command buffers are one op of many kernels), longest first, and the total ms per step."""
  ns, calls = collections.Counter(), collections.Counter()
  for op, name, _, duration in events:
    ns[op, name] += duration
    calls[op, name] += 1
  rows = [dict(op=op, kernel=name[:160], ms=round(t / steps / 1e6, 4),
               calls=calls[op, name] / steps) for (op, name), t in ns.most_common(top)]
  return rows, round(sum(ns.values()) / steps / 1e6, 4)


def lm_training_step(args):
  """(one_step, compiled, tokens per step, record) of the decoder LM's training step."""
  lm = seq_scaling.parse_args(["--preset", args.preset])
  cfg = seq_scaling.lm_config(lm, args.impl, args.seq, remat=False)
  step, state = seq_scaling.lm_step(cfg, lm.lm_batch, np.random.default_rng(0), 0)
  compiled = step.lower(*state).compile()
  params, opt_state, *data = state

  def one_step():
    nonlocal params, opt_state
    params, opt_state, loss = compiled(params, opt_state, *data)
    return loss
  return one_step, compiled, lm.lm_batch * args.seq, dict(model=dataclasses.asdict(cfg))


def cell_fwd_bwd_step(args):
  """(one_step, compiled, tokens per step, record) of one attention forward + backward
  (a vjp with a fixed output cotangent) of the benchmark cell `args.cell`."""
  import jflash
  from experiments.tools.ab_kernels import cell_inputs, select_cases
  named = [c for c in select_cases(None if args.tiny else args.cell, tiny=args.tiny)
           if c.name == args.cell]
  if not named:
    raise ValueError(f"--cell {args.cell!r} is not a cell's whole name")
  (case,) = named
  q, k, v, do = cell_inputs(case)
  config = None
  if args.impl == "cudnn" and args.config:
    raise ValueError(f"--config {args.config!r} is jflash's: --impl cudnn takes none")
  if args.impl == "cudnn":
    attend = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=case.causal,
                                                          implementation="cudnn")
  else:
    if args.config:
      config = jflash.MosaicGPUConfig(**json.loads(args.config))
    implementation = None if args.impl == "jflash" else args.impl
    attend = lambda q, k, v: jflash.attention(q, k, v, is_causal=case.causal,
                                              implementation=implementation, config=config)

  def step(q, k, v, do):       # the module "jit_step", as the LM's
    return jax.vjp(attend, q, k, v)[1](do)
  compiled = jax.jit(step).lower(q, k, v, do).compile()
  return (lambda: compiled(q, k, v, do)), compiled, case.batch * case.s, dict(
      cell=dataclasses.asdict(case), **ran_by(args.impl, case, q, k, v, config))


def ran_by(impl, case, q, k, v, config):
  """{"implementation": what ran, "backward": which backward "mosaic_gpu" runs}: a
  config's backward fields off the timed defaults can make "auto" take the Triton
  backward, which the profile's kernel names would show only to a reader who knows them."""
  if impl == "cudnn":
    return dict(implementation="cudnn", backward=None)
  import jflash
  from experiments.bench.peers import resolved_implementation
  from jflash import mosaic_impl
  ran = resolved_implementation(case, q.dtype) if impl == "jflash" else impl
  backward = (mosaic_impl.backward_kind(q, k, *jflash.prepare(
      q, k, v, is_causal=case.causal, config=config)) if ran == "mosaic_gpu" else None)
  return dict(implementation=ran, backward=backward)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--preset", default="h200", help="seq_scaling's preset (the model)")
  p.add_argument("--impl", default="jflash", help="attention label, as seq_scaling's")
  p.add_argument("--seq", type=int, default=4096)
  p.add_argument("--steps", type=int, default=3, help="profiled steps")
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--top", type=int, default=200, help="ops kept, longest first")
  p.add_argument("--hlo", action="store_true", help="also write the optimized HLO")
  p.add_argument("--out-dir", type=Path, default=common.DEFAULT_OUT)
  p.add_argument("--name", default=None)
  p.add_argument("--cell", default=None,
                 help="profile one attention fwd+bwd of this benchmark cell, not the LM")
  p.add_argument("--config", default=None,
                 help="with --cell: jflash MosaicGPUConfig fields as JSON")
  p.add_argument("--tiny", action="store_true",
                 help="test-suite size: preset tiny, T = 64 (with --cell: the cell \"tiny causal\")")
  args = p.parse_args(argv)
  if args.tiny:
    args.preset, args.seq, args.steps, args.warmup = "tiny", 64, 1, 1
  if args.config and not args.cell:
    raise ValueError("--config is for --cell (the LM takes seq_scaling's preset)")
  what = args.cell.replace(" ", "_").replace("/", "-") if args.cell else args.seq
  name = args.name or f"profile_step_{args.impl}_{what}_{common.device_tag()}"
  one_step, compiled, tokens, record = (cell_fwd_bwd_step if args.cell else lm_training_step)(args)
  # The step timed as seq_scaling times it (median of rounds), then traced.
  wall_ms = common.time_calls(one_step, rounds=args.steps, warmup=args.warmup)["median_s"] * 1e3
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      for _ in range(args.steps):
        out = one_step()
      jax.block_until_ready(out)
    (trace,) = Path(d).glob("**/*.xplane.pb")
    events = device_events(trace.read_bytes(), "step")
  rows, total_ms = per_op(events, args.steps, args.top)
  order, span_ms = timeline(events, args.steps)
  extra = dict(total_ms_per_step=total_ms, span_ms_per_step=span_ms,
               wall_ms_per_step=round(wall_ms, 3), tokens_per_s=round(tokens / wall_ms * 1e3, 1),
               timeline=order if args.cell else None)
  if args.hlo:
    hlo = Path(args.out_dir) / f"{name}.hlo.txt.gz"
    hlo.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(hlo, "wt") as f:
      f.write(compiled.as_text())
    extra["hlo"] = hlo.name
  path = common.write_result(name, vars(args) | record, rows, extra=extra,
                             out_dir=args.out_dir)
  if args.cell:
    common.log(f"implementation {record['implementation']}, backward {record['backward']}")
  common.log(f"{total_ms} ms of ops per step, {span_ms} ms from the first to the last "
             f"({wall_ms:.2f} ms wall); wrote {path}")
  for r in rows[:15]:
    common.log(f"  {r['ms']:9.3f} ms  x{r['calls']:g}  {r['op']}  {r['kernel'][:60]}")
  for r in (order if args.cell else [])[:40]:
    common.log(f"  {r['start_ms']:9.3f} - {r['end_ms']:9.3f} ms  {r['op']}  {r['kernel'][:50]}")


if __name__ == "__main__":
  main()
