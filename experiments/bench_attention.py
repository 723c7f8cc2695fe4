"""Speed of jflash against every attention peer on the machine, in one process.

Grids (experiments/bench/specs.py): "quick" (five FlashAttention-2 cells), "full" (the
whole FA-2 grid: batch = 16384 / seq, 16 heads x 128 or 32 x 64, seq 1K-16K, causal and
not), "hopper" (its 1K, 4K and 16K cells at d = 128 and 4K at d = 64), "d256" (4K, 8
heads x 256, batch 4), "short" (ViT 197 and 577 beside 576, BERT 512, 1K d = 128 causal)
and "model" (MQA 16/1 16K causal, GQA 32/8 8K causal, d 96/80/192 4K, T = S = 3000 beside
3072, d=256), forward and forward +
backward, bf16 (JAX's Mosaic GPU kernel in fp16). FLOPs: experiments.common.

Peers (experiments/bench/peers.py), each tried on its own and recorded with its error
when it cannot run: jflash per implementation (--jflash-impls; one not registered, or
raising NotImplementedError, is recorded as "unavailable"), cuDNN and XLA through
jax.nn, JAX's Pallas `mha` and Mosaic GPU `attention_mgpu`, tokamax mosaic and triton,
PyTorch SDPA flash and cuDNN. Each result is checked against cuDNN's (else XLA's, else
jflash "xla_chunked") before it is timed. Per row: TF/s, ms, rel_err, compile and
first-call seconds, compiled temporaries; per case, what implementation=None resolves
to. Targets (specs.TARGETS) are evaluated in the JSON and printed.

  python -m experiments.bench_attention --quick               # FA-2 cells + memory
  python -m experiments.bench_attention --grids quick,d256,model --impls jflash,cudnn
  python -m experiments.bench_attention --block-sweep         # jflash tiles per kernel
  python -m experiments.bench_attention --report a.json b.json --name merged
  python -m experiments.bench_attention --quick --tiny   # smoke run on the CPU (the tests)

Results: <out-dir>/bench_attention_<device>.json (rows, "memory", "resolved", "targets",
environment and config); the sweep: bench_attention_block_sweep_<device>.json.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

if "--tiny" in sys.argv:
  os.environ["JAX_PLATFORMS"] = "cpu"  # must precede `import jax`; the smoke run never touches a GPU

import jax  # noqa: E402

from experiments import common  # noqa: E402
from experiments.bench import peers as peers_mod, report, specs, sweep  # noqa: E402
from experiments.bench.runner import (Runner, add_timing_args, memory_rows,  # noqa: E402
                                      smoke_timing, timing_options, timing_text)

BASELINE = common.RESULTS / "bench_attention_h200.json"  # the committed run "not slower" compares with
TIME_LIMIT_S = 540      # grid: stay inside a 10-minute device command, JSON written


def make_runner(args, peers) -> Runner:
  return Runner(peers, dtype=args.dtype, time_limit_s=args.time_limit_s,
                **timing_options(args))


def jflash_impls(args) -> list[str]:
  names = args.jflash_impls or ("xla_chunked" if args.tiny else ",".join(specs.JFLASH_IMPLS))
  return [n.strip() for n in names.split(",") if n.strip()]


def config_record(args, **extra) -> dict:
  cfg = dict(vars(args))
  cfg.update(
      rel_tol=specs.REL_TOL, reference_chain=list(specs.REFERENCE_CHAIN),
      mha_blocks=specs.MHA_BLOCKS, mgpu_configs=list(specs.MGPU_CONFIGS),
      flops="4*B*N*H per (query, key) pair, S^2/2 pairs when causal, x3.5 for fwd+bwd",
      timing=timing_text(args),
      **report.jflash_build_info(), **extra)
  return cfg


def grid_cases(args) -> list:
  if args.tiny:
    return list(specs.GRIDS["smoke"])
  names = args.grids.split(",") if args.grids else ["full" if args.full else "quick"]
  cases = []
  for n in names:
    grid = specs.GRIDS[n]
    if n == "full":
      grid = [c for c in grid if (not args.seqs or c.s in args.seqs)
              and (not args.head_dims or c.d in args.head_dims)]
    cases += [c for c in grid if c not in cases]
  return cases


def run_grid(args):
  impls = jflash_impls(args)
  peers = peers_mod.make_peers(impls, args.xla_max_seq, smoke=args.tiny)
  # jflash "xla_chunked" is the reference of last resort, timed only when asked for.
  timed = [p.label for p in peers.values() if p.name != "jflash" or p.implementation in impls]
  if args.no_torch:
    timed = [n for n in timed if peers[n].framework != "torch"]
  labels = peers_mod.select(peers, args.impls, timed)
  cases = grid_cases(args)
  modes = [m for m in specs.MODES if m in args.modes.split(",")]
  memory = "smoke" if args.tiny else ("full" if args.full else "quick")
  common.log(f"{len(cases)} cases x {modes} x {labels} on "
             f"{jax.devices()[0].device_kind} (jax {jax.__version__})")
  name = args.name or f"bench_attention_{'cpu_tiny' if args.tiny else common.device_tag()}"
  resolved = {c.key(): peers_mod.resolved_implementation(c, args.dtype) for c in cases}
  baseline = (report.load_rows([args.baseline])[0]
              if args.baseline and Path(args.baseline).exists() else None)
  extra = {"cases": [dict(dataclasses.asdict(c), key=c.key()) for c in cases],
           "resolved": resolved, "timed_peers": labels}

  def save(rows, mem=None):
    if mem is not None:
      extra.update(memory=mem, memory_summary=report.memory_summary(mem))
    extra["targets"] = report.evaluate_targets(rows, resolved, extra.get("memory_summary"),
                                               baseline)
    return report.save(name, config_record(args), rows, args.out_dir, extra, args.merge)

  runner = make_runner(args, peers)
  rows = []
  for case in cases:
    rows += runner.run_case(case, labels, modes)
    runner.forget(case)
    save(rows)
  mem = None
  if not args.skip_memory:
    mem_labels = [f"jflash:{impls[0]}"] + [
        n for n in specs.MEMORY_PEERS[1:] if n in peers]
    heads, d = specs.MEMORY_HEADS["smoke" if args.tiny else "gpu"]
    mem = memory_rows(peers, mem_labels, specs.MEMORY_SEQS[memory], heads, d, args.dtype,
                      args.time_limit_s)
  path = save(rows, mem)
  report.print_tables(rows, labels)
  if mem:
    report.print_memory(mem)
  report.print_targets(extra["targets"])
  report.print_summary(rows, labels, resolved)
  common.log(f"wrote {path}")


def run_block_sweep(args):
  impl = jflash_impls(args)[0]
  peers = peers_mod.make_peers([impl], args.xla_max_seq, smoke=args.tiny)
  if args.tiny:   # the machinery only
    shapes = specs.SMOKE_SWEEP_SHAPES
    cases = [specs.Case(s, d, False, 2, 2, name="sweep smoke") for d, s in shapes.items()]
  else:
    head_dims = args.head_dims or specs.HEAD_DIMS
    unknown = [d for d in head_dims if d not in specs.SWEEP_SHAPES]
    if unknown:
      raise ValueError(f"--head-dims {unknown}: the sweep has shapes for "
                       f"{sorted(specs.SWEEP_SHAPES)}")
    shapes = {d: specs.SWEEP_SHAPES[d] for d in head_dims}
    cases = [specs.sweep_case(s, d, c) for d, s in shapes.items()
             for c in specs.SWEEP_CAUSALS.get(d, (False, True))]
  rows, best = sweep.run_sweep(make_runner(args, peers), impl, cases, args.sweep_passes,
                               args.sweep_budget_s, smoke=args.tiny)
  sweep.print_best(best)
  name = args.name or ("bench_attention_block_sweep_"
                       + ("cpu_tiny" if args.tiny else common.device_tag()))
  extra = {"best": best, "shapes": {str(d): s for d, s in shapes.items()}}
  path = report.save(name, config_record(args, jflash_sweep_impl=impl), rows, args.out_dir, extra)
  common.log(f"wrote {path}")


def run_report(args):
  """Joins result JSONs of split runs, evaluates the targets over all rows, prints."""
  rows, resolved, mem = report.load_rows(args.report)
  baseline = report.load_rows([args.baseline])[0] if Path(args.baseline).exists() else None
  labels = list(dict.fromkeys(r.get("peer", r["impl"]) for r in rows))
  mem_summary = report.memory_summary(mem) if mem else None
  targets = report.evaluate_targets(rows, resolved, mem_summary, baseline)
  report.print_tables(rows, labels)
  if mem:
    report.print_memory(mem)
  report.print_targets(targets)
  report.print_summary(rows, [n for n in labels if n.startswith("jflash:")] + ["cudnn"], resolved)
  if args.name:
    extra = {"resolved": resolved, "targets": targets, "joined": args.report}
    if mem:
      extra.update(memory=mem, memory_summary=mem_summary)
    path = report.save(args.name, config_record(args), rows, args.out_dir, extra)
    common.log(f"wrote {path}")


def parse_args(argv=None):
  p = common.parser(__doc__)
  what = p.add_mutually_exclusive_group()
  what.add_argument("--quick", action="store_true", help="the five FA-2 cells and memory (default)")
  what.add_argument("--full", action="store_true", help="the whole FA-2 grid and memory")
  what.add_argument("--grids", default=None, help=f"comma-separated from {sorted(specs.GRIDS)}")
  what.add_argument("--block-sweep", action="store_true",
                    help="time jflash over tile candidates; best per (d, causal, pass)")
  what.add_argument("--report", nargs="+", default=None,
                    help="result JSONs to join: targets and tables over all their rows")
  common.add_tiny(p, "tiny shapes, jflash 'xla_chunked' against 'xla'")
  p.add_argument("--out-dir", default=str(common.DEFAULT_OUT),
                 help="where the JSON goes (experiments/results: the committed results)")
  p.add_argument("--name", default=None, help="JSON file stem (default bench_attention_<device>"
                 " / bench_attention_block_sweep_<device>; --report: none, print only)")
  p.add_argument("--merge", action="store_true",
                 help="keep rows of an earlier JSON of the same name that this run does not redo")
  p.add_argument("--impls", default=None,
                 help="comma-separated peer labels (jflash = every --jflash-impls)")
  p.add_argument("--no-torch", action="store_true", help="leave out the PyTorch SDPA peers")
  p.add_argument("--jflash-impls", default=None,
                 help="jflash implementations timed, comma-separated (default "
                      f"{','.join(specs.JFLASH_IMPLS)}; --tiny: xla_chunked); the sweep: the first")
  p.add_argument("--seqs", type=int, nargs="+", default=None, help="--full: these seqs only")
  p.add_argument("--head-dims", type=int, nargs="+", default=None,
                 help="--full / --block-sweep: these head dims only")
  p.add_argument("--modes", default="fwd,fwd+bwd", help="comma-separated: fwd, fwd+bwd")
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--xla-max-seq", type=int, default=specs.XLA_MAX_SEQ,
                 help="longest seq timed for the materialising XLA baseline")
  p.add_argument("--skip-memory", action="store_true", help="no compiled-memory table")
  p.add_argument("--baseline", default=str(BASELINE),
                 help="earlier result JSON that the 'not slower' targets compare with")
  add_timing_args(p)
  p.add_argument("--sweep-passes", type=lambda x: tuple(x.split(",")), default=specs.SWEEP_PASSES,
                 help="block sweep: which kernels, comma-separated from fwd,dkv,dq")
  p.add_argument("--sweep-budget-s", type=float, default=specs.SWEEP_BUDGET_S,
                 help="block sweep: candidates past this many seconds are skipped")
  p.add_argument("--time-limit-s", type=float, default=TIME_LIMIT_S,
                 help="calls not started this many seconds after start are skipped "
                      "(the JSON is still written)")
  args = p.parse_args(argv)
  if args.tiny:
    smoke_timing(args)
    args.sweep_budget_s = min(args.sweep_budget_s, 60)
  return args


def main(argv=None):
  args = parse_args(argv)
  if args.block_sweep:
    run_block_sweep(args)
  elif args.report:
    run_report(args)
  else:
    run_grid(args)


if __name__ == "__main__":
  main()
