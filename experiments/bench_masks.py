"""Speed of jflash's structured masks against cuDNN and XLA.

Three kinds of self-attention, all causal, bf16, 16 heads x d=128, batch * seq = 16K
tokens (FA-2 grid convention), forward and forward + backward:
  causal   plain causal attention
  window   causal sliding window of W keys to the left: (W, 0) in jax.nn semantics
  docs     packed documents: causal within each of n documents of random lengths

Peers (each checked against the reference before it is timed, a wrong one is not timed):
  jflash   jflash.attention(implementation=--jflash-impl): is_causal, local_window_size,
           segment_ids; masked tiles are skipped
  cudnn    jax.nn implementation="cudnn": is_causal, local_window_size=(W, 0) (cuDNN's
           sliding_window_length = W + 1); jax.nn has no segment ids, so "docs" passes
           the [B, 1, T, S] bool mask built in the call from the ids (cuDNN then adds it
           as a bias and skips nothing)
  xla      jax.nn implementation="xla", the materialising baseline, seq <= --xla-max-seq
Reference: cudnn, else xla, else jflash "xla_chunked" (experiments/bench/specs.py).

FLOPs count only the visible (query, key) pairs (experiments.common.attention_flops), so
TF/s compare the useful work; the skipped fraction of each case is in the JSON
("visible_fraction", "jflash_tile_fraction"). Checking and timing: experiments/bench/runner.py.

  python -m experiments.bench_masks               # H200: < 3 minutes
  python -m experiments.bench_masks --tiny   # smoke run on the CPU (the tests)

Results: <out-dir>/bench_masks_<device>.json: rows {impl, kind, s, window, docs, mode,
ms, tflops, rel_err, status, ...}, "ratios" (peer ms / jflash ms: > 1 means jflash
is faster), "cases", environment and config.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import sys

if "--tiny" in sys.argv:
  os.environ["JAX_PLATFORMS"] = "cpu"  # must precede `import jax`; the smoke run never touches a GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments import common  # noqa: E402
from experiments.bench import report, specs  # noqa: E402
from experiments.bench.peers import Peer, jflash_call, jflash_peer, select  # noqa: E402
from experiments.bench.runner import (Runner, add_timing_args, smoke_timing,  # noqa: E402
                                      timing_options, timing_text)
from experiments.bench.specs import Case  # noqa: E402

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
class MaskCase(Case):
  """A causal case with its mask kind; FLOPs count the pairs the mask leaves visible."""

  kind: str = "causal"
  window: int | None = None     # left window W: keys i - W <= j <= i
  docs: int | None = None       # packed documents per sequence

  def key(self) -> str:
    extra = {"causal": "", "window": f" W={self.window}", "docs": f" docs={self.docs}"}[self.kind]
    return f"{self.kind}{extra} s={self.s}"

  def pairs(self) -> float:
    return visible_pairs(self) / self.batch


def make_case(kind, s, param, smoke) -> MaskCase:
  batch, heads, d = (SMOKE_BATCH, SMOKE_HEADS, SMOKE_HEAD_DIM) if smoke else (
      TOKENS // s, HEADS, HEAD_DIM)
  return MaskCase(s, d, True, batch, heads, name=f"{kind} {s}", kind=kind,
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


def jflash_tile_fraction(case: MaskCase) -> float | str:
  """Key tiles jflash's forward visits over all tiles, with the default tile sizes (read
  from the kernels' schedule; the reason instead, where that schedule has moved)."""
  try:
    return _tile_fraction(case)
  except Exception as e:  # informative only: the benchmark runs without it
    return f"unavailable: {type(e).__name__}: {e}"[:300]


def _tile_fraction(case: MaskCase) -> float:
  from jflash.masks import Masks, tile_classes, visited_tiles
  from pallas_kernels.tuning import default_block_sizes
  bs = default_block_sizes(case.d)
  window = (case.window, 0) if case.window else None

  def fraction(ids):
    masks = Masks(is_causal=True, window=window, q_segment_ids=ids, kv_segment_ids=ids)
    classes = tile_classes(B=case.batch, T=case.s, S=case.s, block_q=bs.block_q,
                           block_k=bs.block_k, masks=masks)
    return visited_tiles(classes) / classes.size
  if case.kind == "docs":  # one program instead of dozens of eager ops
    return float(jax.jit(fraction)(jnp.asarray(segment_ids(case))))
  return float(fraction(None))


# -- peers ----------------------------------------------------------------------------------

def mask_options(case: MaskCase) -> dict:
  kw = {}
  if case.kind == "window":
    kw["local_window_size"] = (case.window, 0)
  if case.kind == "docs":
    kw["segment_ids"] = jnp.asarray(segment_ids(case))
  return kw


def _jflash(implementation):
  def variants(case: MaskCase):
    return [(implementation, functools.partial(
        jflash_call, implementation=implementation, is_causal=True, **mask_options(case)))]
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


def make_peers(args) -> dict[str, Peer]:
  impl = "xla_chunked" if args.tiny else args.jflash_impl
  peers = [jflash_peer(impl, _jflash(impl)), Peer("xla", _jax_nn("xla"), max_seq=args.xla_max_seq,
                                                  skip_reason=f"seq > --xla-max-seq={args.xla_max_seq}: T x S logits")]
  if not args.tiny:
    peers.insert(1, Peer("cudnn", _jax_nn("cudnn")))
  if impl != "xla_chunked":  # not timed; the reference of last resort
    peers.append(jflash_peer("xla_chunked", _jflash("xla_chunked")))
  return {p.label: p for p in peers}


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


def config_record(args) -> dict:
  cfg = dict(vars(args))
  cfg.update(
      tokens=TOKENS, heads=HEADS, head_dim=HEAD_DIM, min_doc=MIN_DOC,
      rel_tol=specs.REL_TOL, reference_chain=list(specs.REFERENCE_CHAIN),
      flops="4*B*N*d*(visible query-key pairs), x3.5 for fwd+bwd",
      window="causal, (W, 0) in jax.nn semantics: query i sees keys i-W..i",
      timing=timing_text(args),
  )
  return cfg


def parse_args(argv=None):
  p = common.parser(__doc__)
  common.add_tiny(p, "tiny shapes, jflash 'xla_chunked' against 'xla'")
  p.add_argument("--out-dir", default=str(common.DEFAULT_OUT),
                 help="where the JSON goes (experiments/results: the committed results)")
  p.add_argument("--name", default=None, help="JSON file stem (default bench_masks_<device>)")
  p.add_argument("--kinds", default="causal,window,docs", help="comma-separated subset")
  p.add_argument("--seqs", type=int, nargs="+", default=None, help="these seqs only")
  p.add_argument("--impls", default=None, help="comma-separated subset of jflash,cudnn,xla")
  p.add_argument("--jflash-impl", default="pallas", help="jflash implementation timed on the GPU")
  p.add_argument("--modes", default="fwd,fwd+bwd", help="comma-separated: fwd, fwd+bwd")
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--xla-max-seq", type=int, default=XLA_MAX_SEQ,
                 help="longest seq timed for the materialising XLA baseline")
  add_timing_args(p)
  p.add_argument("--time-limit-s", type=float, default=TIME_LIMIT_S,
                 help="calls not started by then are skipped (the JSON is still written)")
  args = p.parse_args(argv)
  if args.tiny:
    smoke_timing(args)
  return args


def main(argv=None):
  args = parse_args(argv)
  peers = make_peers(args)
  timed = [n for n in peers if n != "jflash:xla_chunked" or args.tiny]
  labels = select(peers, args.impls, timed)
  kinds = set(args.kinds.split(","))
  cases = [make_case(kind, s, param, args.tiny)
           for kind, s, param in (SMOKE_CASES if args.tiny else CASES)
           if kind in kinds and (args.seqs is None or s in args.seqs)]
  modes = [m for m in MODES if m in args.modes.split(",")]
  common.log(f"{len(cases)} mask cases x {modes} x {labels} on {jax.devices()[0].device_kind} "
             f"(jax {jax.__version__})")
  name = args.name or f"bench_masks_{'cpu_tiny' if args.tiny else common.device_tag()}"
  case_info = []
  for c in cases:
    info = dict(dataclasses.asdict(c), key=c.key(),
                visible_fraction=visible_pairs(c) / (c.batch * c.s * c.s),
                jflash_tile_fraction=jflash_tile_fraction(c))
    if c.kind == "docs":
      info["doc_lengths"] = [np.bincount(row).tolist() for row in segment_ids(c)]
    case_info.append(info)

  runner = Runner(peers, dtype=args.dtype, time_limit_s=args.time_limit_s,
                  **timing_options(args))
  rows = []
  for case in cases:
    for row in runner.run_case(case, labels, modes):
      rows.append(dict(row, kind=case.kind, window=case.window, docs=case.docs))
    runner.forget(case)
    path = report.save(name, config_record(args), rows, args.out_dir,
                       {"cases": case_info, "ratios": ratios(rows)})
  report.print_tables(rows, labels)
  common.log(f"wrote {path}")


if __name__ == "__main__":
  main()
