"""Mosaic GPU configs of jflash timed against its default and cuDNN, in one process.

A candidate is a JSON object of `jflash.MosaicGPUConfig` fields, set over the
heuristics' choice for each call as a user would set them (a field set runs as set or
the call raises: such a candidate is recorded with its error). Every candidate of a cell
is checked against cuDNN (else XLA) and then timed in the same rounds as the default and
the peers (`Runner.run_case`), so their ratios compare one card state. This is how a
heuristics rule is decided: the rule in pallas_kernels/mosaic_gpu/heuristics.py changes
with the figures, the note in docs/notes/mosaic.md records them.

  python -m experiments.tools.config_candidates --cells "fa2 1K d128 causal" \\
      --candidates '{"persistent": true}' '{"consumers": 3}' --modes fwd --out-dir $OUT
"""
from __future__ import annotations

import json

import jax

import jflash
from experiments import common
from experiments.bench import peers as peers_mod
from experiments.bench import report, runner, specs

CELLS = {c.name: c for grid in specs.GRIDS.values() for c in grid}


def candidate_peer(fields: dict) -> peers_mod.Peer:
  config = jflash.MosaicGPUConfig(**fields)   # a field name it lacks raises here
  tag = ",".join(f"{k}={v}" for k, v in sorted(fields.items()))
  return peers_mod.jflash_peer("mosaic_gpu", tag=tag, config=config)


def main(argv=None):
  p = common.parser(__doc__)
  p.add_argument("--cells", required=True,
                 help=f"comma-separated case names from the grids ({len(CELLS)} known)")
  p.add_argument("--candidates", nargs="+", required=True, type=json.loads,
                 help="JSON objects of MosaicGPUConfig fields")
  p.add_argument("--peers", default="cudnn", help="comma-separated peers timed beside them")
  p.add_argument("--modes", default="fwd,fwd+bwd")
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--out-dir", default=str(common.DEFAULT_OUT))
  p.add_argument("--name", default=None)
  runner.add_timing_args(p)
  common.add_tiny(p, "the machinery at the timing of a smoke run, not numbers")
  args = p.parse_args(argv)
  if args.tiny:
    runner.smoke_timing(args)
  unknown = [c for c in args.cells.split(",") if c not in CELLS]
  if unknown:
    raise ValueError(f"--cells {unknown}: known cells are {sorted(CELLS)}")
  cases = [CELLS[c] for c in args.cells.split(",")]
  peers = peers_mod.make_peers(["mosaic_gpu"])
  candidates = [candidate_peer(f) for f in args.candidates]
  peers.update({c.label: c for c in candidates})
  labels = (peers_mod.select(peers, args.peers, []) + ["jflash:mosaic_gpu"]
            + [c.label for c in candidates])
  modes = [m for m in specs.MODES if m in args.modes.split(",")]
  run = runner.Runner(peers, dtype=args.dtype, **runner.timing_options(args))
  common.log(f"{[c.name for c in cases]} x {modes} x {labels} on "
             f"{jax.devices()[0].device_kind} (jax {jax.__version__})")
  name = args.name or f"config_candidates_{common.device_tag()}"
  config = dict(vars(args), timing=runner.timing_text(args), **report.jflash_build_info())
  rows = []
  for case in cases:
    rows += run.run_case(case, labels, modes)
    run.forget(case)
    report.save(name, config, rows, args.out_dir)
  report.print_tables(rows, labels)
  common.log(f"wrote {args.out_dir}/{name}.json")


if __name__ == "__main__":
  main()
