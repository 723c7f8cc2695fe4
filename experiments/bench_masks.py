"""Speed of jflash's structured masks on the H200 against cuDNN and XLA (issue 3).

Three kinds of self-attention, all causal, bf16, 16 heads x d=128, batch * seq = 16K
tokens (FA-2 grid convention), forward and forward + backward:
  causal   plain causal attention
  window   causal sliding window of W keys to the left: (W, 0) in jax.nn semantics
  docs     packed documents: causal within each of n documents of random lengths

Peers (jax.nn.dot_product_attention; each checked against the reference before it
is timed, a wrong one is not timed):
  jflash   jflash.attention(implementation="pallas"): is_causal, local_window_size,
           segment_ids; masked tiles are skipped
  cudnn    implementation="cudnn": is_causal, local_window_size=(W, 0) (cuDNN's
           sliding_window_length = W + 1); jax.nn has no segment ids, so "docs" passes
           the [B, 1, T, S] bool mask built in the call from the ids (cuDNN then adds it
           as a bias and skips nothing)
  xla      implementation="xla", the materialising baseline, seq <= --xla-max-seq
Reference: cudnn, else xla, else jflash "xla_chunked" (bench_attention's chain).

FLOPs count only the visible (query, key) pairs, 4 * B * N * d * pairs, x3.5 for
forward + backward (FA-2 convention), so TF/s compare the useful work; the skipped
fraction of each case is in the JSON ("visible_fraction", "jflash_tile_fraction").
Timing, correctness gate and peers' machinery come from experiments/bench_attention.py.

  python experiments/bench_masks.py               # H200: < 3 minutes, JSON in experiments/results/
  python experiments/bench_masks.py --cpu-smoke   # tiny, CPU, "xla_chunked" against "xla" (tests)

Results: <out-dir>/bench_masks_<device>.json: rows {impl, kind, s, window, docs, mode,
ms, tflops, rel_err, status, ...}, "ratios" (peer ms / jflash ms: > 1 means jflash
is faster), "cases", environment and config.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))  # run as a script: `experiments` and `jflash` from this checkout
if "--cpu-smoke" in sys.argv:
  os.environ["JAX_PLATFORMS"] = "cpu"  # must precede `import jax`; the smoke run never touches a GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jflash  # noqa: E402
from experiments import bench_attention as ba  # noqa: E402
from experiments import common  # noqa: E402
from jflash.masks import MaskArrays, tile_classes, visited_tiles  # noqa: E402
from pallas_kernels.masking import MaskOptions  # noqa: E402
from pallas_kernels.tuning import default_block_sizes  # noqa: E402

TOKENS = 16384          # batch * seq held constant, as bench_attention's grid
HEADS, HEAD_DIM = 16, 128
# (kind, seq, W or number of documents), most wanted first: past --time-limit-s the
# rest are skipped, and the JSON is written after every case.
CASES = (
    ("causal", 16384, None), ("window", 16384, 256), ("window", 16384, 1024),
    ("docs", 16384, 8), ("causal", 4096, None), ("window", 4096, 256), ("docs", 4096, 4),
)
MODES = ("fwd", "fwd+bwd")
XLA_MAX_SEQ = 4096      # the T x S baseline: at 16K one fp32 logits tensor is 16 GiB
TIME_LIMIT_S = 140      # calls not started by then are skipped: < 3 minutes with compiles
MIN_DOC = 64            # shortest packed document (random cut points, fixed seed)

SMOKE_CASES = (("causal", 128, None), ("window", 128, 16), ("docs", 128, 4))
SMOKE_BATCH, SMOKE_HEADS, SMOKE_HEAD_DIM = 2, 2, 32


@dataclasses.dataclass(frozen=True)
class MaskCase(ba.Case):
  """A bench_attention Case (always causal here) with its mask kind."""

  kind: str = "causal"
  window: int | None = None     # left window W: keys i - W <= j <= i
  docs: int | None = None       # packed documents per sequence

  def key(self) -> str:
    extra = {"causal": "", "window": f" W={self.window}", "docs": f" docs={self.docs}"}[self.kind]
    return f"{self.kind}{extra} s={self.s}"

  def flops(self, mode: str) -> float:
    f = 4.0 * self.heads * self.d * visible_pairs(self)
    return f * {"fwd": 1.0, "fwd+bwd": ba.BWD_FACTOR}[mode]


def make_case(kind, s, param, smoke) -> MaskCase:
  batch, heads, d = (SMOKE_BATCH, SMOKE_HEADS, SMOKE_HEAD_DIM) if smoke else (
      TOKENS // s, HEADS, HEAD_DIM)
  return MaskCase(s, d, True, batch, heads, kind=kind,
                  window=param if kind == "window" else None,
                  docs=param if kind == "docs" else None)


@functools.cache
def segment_ids(case: MaskCase) -> np.ndarray:
  """[B, s] int32: `docs` contiguous documents per row, random lengths >= MIN_DOC."""
  r = np.random.default_rng(case.s * 100 + case.docs)
  min_doc = min(MIN_DOC, case.s // (2 * case.docs))
  ids = np.zeros((case.batch, case.s), np.int32)
  for b in range(case.batch):
    # docs - 1 cut points with every document at least min_doc long.
    free = case.s - case.docs * min_doc
    cuts = np.sort(r.choice(free + 1, case.docs - 1, replace=True))
    cuts = cuts + min_doc * np.arange(1, case.docs)
    ids[b] = np.searchsorted(cuts, np.arange(case.s), side="right")
  return ids


@functools.cache
def visible_pairs(case: MaskCase) -> int:
  """Visible (query, key) pairs summed over the batch."""
  s = case.s
  if case.kind == "causal":
    return case.batch * s * (s + 1) // 2
  if case.kind == "window":
    w = min(case.window, s - 1)
    return case.batch * (w * (w + 1) // 2 + (s - w) * (w + 1))  # row i sees min(i, W) + 1 keys
  lengths = [np.bincount(row) for row in segment_ids(case)]
  return int(sum((n * (n + 1) // 2).sum() for n in lengths))


def jflash_tile_fraction(case: MaskCase) -> float:
  """Key tiles jflash's forward visits over all tiles, with the default tile sizes."""
  bs = default_block_sizes(case.d)
  opts = MaskOptions(is_causal=True, window=(case.window, 0) if case.window else None)

  def fraction(ids):
    masks = None if ids is None else MaskArrays(q_segment_ids=ids, kv_segment_ids=ids)
    classes = tile_classes(B=case.batch, T=case.s, S=case.s, block_q=bs.block_q,
                           block_k=bs.block_k, opts=opts, masks=masks)
    return visited_tiles(classes) / classes.size
  if case.kind == "docs":  # one program instead of dozens of eager ops
    return float(jax.jit(fraction)(jnp.asarray(segment_ids(case))))
  return float(fraction(None))


# -- peers ----------------------------------------------------------------------------------

def _jflash(implementation):
  def variants(case: MaskCase):
    kw = {}
    if case.kind == "window":
      kw["local_window_size"] = (case.window, 0)
    if case.kind == "docs":
      kw["segment_ids"] = jnp.asarray(segment_ids(case))
    return [(implementation, lambda q, k, v: jflash.attention(
        q, k, v, is_causal=True, implementation=implementation, **kw))]
  return variants


def _jax_nn(implementation):
  def variants(case: MaskCase):
    kw, label = {}, implementation
    if case.kind == "window":
      kw["local_window_size"] = (case.window, 0)
    ids = jnp.asarray(segment_ids(case)) if case.kind == "docs" else None

    def attn(q, k, v):
      mask = None
      if ids is not None:  # jax.nn has no segment ids: the dense mask, built in the call
        mask = (ids[:, :, None] == ids[:, None, :])[:, None]
      return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True,
                                          implementation=implementation, **kw)
    if ids is not None:
      label += " (dense [B,1,T,S] mask from the segment ids)"
    return [(label, attn)]
  return variants


def make_peers(args) -> dict[str, ba.Peer]:
  if args.cpu_smoke:
    return {"jflash": ba.Peer("jflash", _jflash("xla_chunked")),
            "xla": ba.Peer("xla", _jax_nn("xla"))}
  return {
      "jflash": ba.Peer("jflash", _jflash(args.jflash_impl)),
      "cudnn": ba.Peer("cudnn", _jax_nn("cudnn")),
      "xla": ba.Peer("xla", _jax_nn("xla"), max_seq=args.xla_max_seq,
                     skip_reason=f"seq > --xla-max-seq={args.xla_max_seq}: T x S logits"),
      # Not timed; the reference of last resort when cuDNN and XLA cannot run.
      "jflash_xla_chunked": ba.Peer("jflash_xla_chunked", _jflash("xla_chunked")),
  }


# -- output -----------------------------------------------------------------------------------

def ratios(rows) -> list[dict]:
  """peer ms / jflash ms per (case, mode): > 1 means jflash is faster."""
  by = {}
  for r in rows:
    by.setdefault((r["kind"], r["s"], r["window"], r["docs"], r["mode"]), {})[r["impl"]] = r
  out = []
  for (kind, s, window, docs, mode), cell in by.items():
    j = cell.get("jflash")
    for name, p in cell.items():
      if name != "jflash" and j and j["ms"] and p["ms"]:
        out.append(dict(kind=kind, s=s, window=window, docs=docs, mode=mode, peer=name,
                        peer_ms=p["ms"], jflash_ms=j["ms"], speedup=p["ms"] / j["ms"]))
  return out


def print_table(rows, impls):
  cells = {}
  for r in rows:
    key = (r["kind"], r["s"], r["window"] or r["docs"] or 0, r["mode"])
    cells.setdefault(key, {})[r["impl"]] = r

  def fmt(r):
    if r is None:
      return "-"
    if r["ms"] is not None:
      return f"{r['ms']:.3f}"
    return {"wrong": "WRONG", "skipped": "skip", "error": "err"}.get(r["status"], "?")

  others = [n for n in impls if n != "jflash"]
  print("\nms per call (bf16); ratio = peer ms / jflash ms (> 1: jflash faster). "
        "err/WRONG/skip: see the JSON rows' 'error'.", flush=True)
  print(f"{'kind':>7} {'s':>6} {'W/docs':>6} {'mode':>8} " + "".join(f"{n:>12}" for n in impls)
        + "".join(f"{'/' + n:>10}" for n in others))
  for key in sorted(cells):
    kind, s, p, mode = key
    c = cells[key]
    line = f"{kind:>7} {s:>6} {p:>6} {mode:>8} " + "".join(f"{fmt(c.get(n)):>12}" for n in impls)
    j = c.get("jflash")
    for n in others:
      o = c.get(n)
      line += (f"{o['ms'] / j['ms']:>10.2f}" if j and o and j["ms"] and o["ms"] else f"{'-':>10}")
    print(line, flush=True)


def config_record(args) -> dict:
  cfg = dict(vars(args))
  cfg.update(
      tokens=TOKENS, heads=HEADS, head_dim=HEAD_DIM, min_doc=MIN_DOC,
      bwd_flop_factor=ba.BWD_FACTOR, rel_tol=ba.REL_TOL,
      reference_chain=list(ba.reference_chain(args)),
      flops="4*B*N*d*(visible query-key pairs), x3.5 for fwd+bwd",
      window="causal, (W, 0) in jax.nn semantics: query i sees keys i-W..i",
      timing=f"median of {args.rounds} rounds of back-to-back calls (>= {args.round_ms} ms each),"
             f" {args.input_sets} rotated input sets, block_until_ready per round",
  )
  return cfg


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--cpu-smoke", action="store_true",
                 help="tiny shapes on the CPU, jflash 'xla_chunked' against 'xla' (for tests)")
  p.add_argument("--out-dir", default=str(common.RESULTS), help="where the JSON goes")
  p.add_argument("--name", default=None, help="JSON file stem (default bench_masks_<device>)")
  p.add_argument("--kinds", default="causal,window,docs", help="comma-separated subset")
  p.add_argument("--seqs", type=int, nargs="+", default=None, help="these seqs only")
  p.add_argument("--impls", default=None, help="comma-separated subset of jflash,cudnn,xla")
  p.add_argument("--jflash-impl", default="pallas", help="jflash implementation timed on the GPU")
  p.add_argument("--modes", default="fwd,fwd+bwd", help="comma-separated: fwd, fwd+bwd")
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--xla-max-seq", type=int, default=XLA_MAX_SEQ,
                 help="longest seq timed for the materialising XLA baseline")
  p.add_argument("--rounds", type=int, default=ba.ROUNDS)
  p.add_argument("--round-ms", type=float, default=ba.ROUND_S * 1e3)
  p.add_argument("--input-sets", type=int, default=ba.N_INPUT_SETS)
  p.add_argument("--time-limit-s", type=float, default=TIME_LIMIT_S,
                 help="calls not started by then are skipped (the JSON is still written)")
  args = p.parse_args(argv)
  if args.cpu_smoke:
    args.rounds, args.round_ms, args.input_sets = 2, 1.0, 2  # machinery, not numbers
  return args


def main(argv=None):
  args = parse_args(argv)
  peers = make_peers(args)
  impls = [n for n in peers if n != "jflash_xla_chunked"]
  if args.impls:
    impls = [n.strip() for n in args.impls.split(",") if n.strip()]
    unknown = [n for n in impls if n not in peers]
    if unknown:
      raise SystemExit(f"--impls: unknown {unknown}; choose from {sorted(peers)}")
  kinds = set(args.kinds.split(","))
  cases = [make_case(kind, s, param, args.cpu_smoke)
           for kind, s, param in (SMOKE_CASES if args.cpu_smoke else CASES)
           if kind in kinds and (args.seqs is None or s in args.seqs)]
  modes = [m for m in MODES if m in args.modes.split(",")]
  ba.log(f"{len(cases)} mask cases x {modes} x {impls} on {jax.devices()[0].device_kind} "
         f"(jax {jax.__version__})")
  name = args.name or f"bench_masks_{ba.device_tag(args)}"
  case_info = []
  for c in cases:
    info = dict(dataclasses.asdict(c), key=c.key(),
                visible_fraction=visible_pairs(c) / (c.batch * c.s * c.s),
                jflash_tile_fraction=jflash_tile_fraction(c))
    if c.kind == "docs":
      info["doc_lengths"] = [np.bincount(row).tolist() for row in segment_ids(c)]
    case_info.append(info)

  def save(rows):
    """Written after every case, so a run stopped early still leaves its rows."""
    extra = {"cases": case_info, "ratios": ratios(rows),
             "elapsed_s": round(time.perf_counter() - ba._T0, 1)}
    return common.write_result(name, config_record(args), rows, extra=extra,
                               out_dir=Path(args.out_dir))

  runner = ba.Runner(args, peers)  # its deadline: --time-limit-s after start
  rows = []
  for case in cases:
    for row in runner.run_case(case, impls, modes):
      row.update(kind=case.kind, window=case.window, docs=case.docs, key=case.key())
      rows.append(row)
    runner.forget(case)
    save(rows)
  print_table(rows, impls)
  ba.log(f"wrote {save(rows)}")


if __name__ == "__main__":
  main()
