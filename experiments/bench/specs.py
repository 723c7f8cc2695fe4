"""What the benchmarks measure, as data: cases, grids, peers' settings, targets.

A `Case` is one attention shape; a grid is a tuple of cases; a target is a rule a
measured row must meet, evaluated by `experiments.bench.report.evaluate_targets`.
"""
from __future__ import annotations

import dataclasses
import math

from experiments.common import attention_flops, dense_pairs


@dataclasses.dataclass(frozen=True)
class Case:
  """B x T x N x d queries against B x S x K x d keys and values (T = S = s here)."""

  s: int
  d: int
  causal: bool
  batch: int
  heads: int
  kv_heads: int | None = None      # None: as many as query heads (MHA)
  name: str = ""                   # a short label for tables and targets

  @property
  def k_heads(self) -> int:
    return self.kv_heads or self.heads

  @property
  def scale(self) -> float:
    return 1.0 / math.sqrt(self.d)

  def pairs(self) -> float:
    return dense_pairs(self.s, self.s, self.causal)

  def flops(self, mode: str) -> float:
    return attention_flops(self.batch, self.heads, self.d, self.pairs(), mode)

  def key(self) -> str:
    gqa = f" {self.heads}/{self.k_heads}" if self.k_heads != self.heads else ""
    return f"s={self.s} d={self.d}{gqa} b={self.batch} causal={self.causal}"


MODES = ("fwd", "fwd+bwd")

# -- FlashAttention-2 paper grid: batch * seq and heads * head_dim held constant ------
TOKENS = 16384
HIDDEN = 2048
SEQS = (1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)


def fa2_case(s: int, d: int, causal: bool) -> Case:
  return Case(s, d, causal, TOKENS // s, HIDDEN // d, name=f"fa2 {s // 1024}K d{d}"
              + (" causal" if causal else ""))


FA2_QUICK = tuple(fa2_case(s, d, c) for s, d, c in (
    (16384, 128, False), (16384, 128, True), (4096, 64, False), (4096, 64, True),
    (1024, 128, False)))
FA2_FULL = tuple(fa2_case(s, d, c) for d in HEAD_DIMS for s in SEQS for c in (False, True))

# d = 256 beside the grid: 8 heads x 256 (hidden 2048), batch 4, 4K.
D256 = tuple(Case(4096, 256, c, 4, 8, name="d256 4K" + (" causal" if c else ""))
             for c in (False, True))

# Shapes real models use. MQA/GQA exercise the grouped backward, d 80/96/192 head dims
# that are not powers of two, 3000 tails that are not whole tiles (3072 beside it with
# the same kernels), d=128 4K the aligned case the others' temporaries compare with.
D96 = Case(4096, 96, False, 4, 16, name="d96 4K")
D80 = Case(4096, 80, False, 4, 16, name="d80 4K")
D192 = Case(4096, 192, False, 4, 16, name="d192 4K")
D128_4K = Case(4096, 128, False, 4, 16, name="d128 4K")
T3000 = Case(3000, 128, True, 4, 16, name="T3000 causal")
T3072 = Case(3072, 128, True, 4, 16, name="T3072 causal")
GQA = Case(8192, 128, True, 2, 32, 8, name="GQA 32/8 8K causal")
MQA = Case(16384, 128, True, 1, 16, 1, name="MQA 16/1 16K causal")
# Longest compiles last: a run cut by its time limit loses them, not the rest.
MODEL = (D96, D80, D192, D128_4K, T3000, T3072) + D256 + (GQA, MQA)

# The short regime (T up to about 1K): vision and encoder models' shapes, with the
# aligned twin of 577 (ViT-L/14 at 336 px: 24 x 24 patches and a class token) that its
# temporaries compare with, and the FA-2 grid's 1K causal cell.
VIT_B = Case(197, 64, False, 64, 12, name="ViT-B/16 197")
VIT_L = Case(577, 64, False, 32, 16, name="ViT-L/14 577")
VIT_L_ALIGNED = Case(576, 64, False, 32, 16, name="ViT-L/14 576")
BERT = Case(512, 64, False, 32, 12, name="BERT 512")
SHORT = (VIT_B, VIT_L, VIT_L_ALIGNED, BERT, fa2_case(1024, 128, True))

# The FA-2 cells of the Hopper targets: 1K, 4K and 16K at d = 128 and 4K at d = 64, causal
# and not (d = 256 is its own grid).
FA2_HOPPER = tuple(fa2_case(s, d, c) for s, d in ((1024, 128), (4096, 128), (16384, 128),
                                                   (4096, 64)) for c in (False, True))

GRIDS = {
    "quick": FA2_QUICK,
    "hopper": FA2_HOPPER,
    "short": SHORT,
    "full": FA2_FULL,
    "d256": D256,
    "model": MODEL,
    "tails": (T3000, T3072),   # the model preset's ragged pair alone
    # CPU smoke: compile time is the cost there, so two tiny cases (MHA, GQA).
    "smoke": (Case(128, 32, True, 2, 2, name="smoke"),
              Case(128, 32, False, 1, 4, 2, name="smoke GQA 4/2")),
}

# -- compiled memory of fwd+bwd against the sequence (batch 1, 16 x 128) -------------
MEMORY_SEQS = {"quick": (1024, 4096, 16384, 32768),
               "full": (1024, 2048, 4096, 8192, 16384, 32768), "smoke": (128,)}
MEMORY_HEADS = {"gpu": (16, 128), "smoke": (2, 32)}
MEMORY_PEERS = ("jflash", "jax_pallas_mha", "cudnn", "xla")

# -- checking and timing ---------------------------------------------------------------
# A sanity gate, not an accuracy test: two bf16 implementations differ by ~4e-3 (bf16
# rounding of the output), a wrong kernel by O(1) or NaN.
REL_TOL = {"fwd": 2e-2, "fwd+bwd": 5e-2, "bwd": 5e-2}
# Peers compared in one cell are timed together (`experiments.common.time_alternating`):
# WARM_S of sustained calls through all of them, then ROUNDS rounds, each peer's calls
# back to back for ROUND_S per round, in a balanced order (`common.round_order`).
ROUNDS = 7              # median over rounds
ROUND_S = 0.05          # each round long enough (>= 50 ms) that launch gaps do not count
WARM_S = 1.0            # the card brought to the clock it holds under sustained load
N_INPUT_SETS = 3        # rotated so no call reuses the previous call's inputs in cache
XLA_MAX_SEQ = 8192      # the materialising baseline: 16K fwd+bwd needs 40 GiB and is ~10x slower

# -- peers' settings -------------------------------------------------------------------
# jflash implementations timed by default; one not registered, or raising
# NotImplementedError for a case, is recorded with its reason.
JFLASH_IMPLS = ("pallas", "mosaic_gpu")
# JAX's Pallas Triton `mha` (chosen, not tuned here): forward 128 x 64 tiles; its fused
# backward walks dQ and dK/dV blocks with one grid, so block_q_dq == block_kv_dkv. Its own
# default backward tiles (32) are far slower.
MHA_BLOCKS = dict(block_q=128, block_k=64, block_q_dkv=64, block_kv_dkv=128,
                  block_q_dq=128, block_kv_dq=64)
# JAX's Mosaic GPU kernel, in the order tried: its test suite's blocks with two compute
# warpgroups in the backward; the second only if the first overflows shared memory. Its
# forward has no scale argument, so q is scaled outside; its buffers are fp16.
MGPU_CONFIGS = (
    dict(block_q=64, block_kv=128, max_concurrent_steps=2, compute_wgs_bwd=2,
         block_q_dq=64, block_kv_dq=128, block_q_dkv=128, block_kv_dkv=64),
    dict(block_q=64, block_kv=64, max_concurrent_steps=2, compute_wgs_bwd=1,
         block_q_dq=64, block_kv_dq=64, block_q_dkv=64, block_kv_dkv=64),
)
# Peers other than jflash, in table order. The reference of a check is the first of
# REFERENCE_CHAIN that runs the case.
PEERS = ("cudnn", "xla", "jax_pallas_mha", "jax_mgpu", "tokamax_mosaic", "tokamax_triton",
         "torch_flash", "torch_cudnn")
REFERENCE_CHAIN = ("cudnn", "xla", "jflash:xla_chunked")

# -- targets ---------------------------------------------------------------------------
# kind: "tflops"     jflash TF/s >= value
#       "vs_peer"    jflash TF/s >= value x the peer's in the same cell
#       "vs_case"    jflash TF/s >= value x jflash's own on the case `other`
#       "compile_s"  first call of fwd+bwd (compile included) <= value seconds
#       "temp_vs"    compiled temporaries of fwd+bwd <= value x those of case `other`
#       "resolves"   implementation=None resolves to `impl` for the case
#       "vs_baseline" jflash TF/s >= value x the same cell in a baseline JSON
@dataclasses.dataclass(frozen=True)
class Target:
  group: str
  kind: str
  cases: tuple
  impl: str                      # the jflash implementation judged
  mode: str = "fwd+bwd"
  value: float = 1.0
  peer: str | None = None
  other: Case | None = None


def _fa2(*cells):
  return tuple(fa2_case(s, d, c) for s, d in cells for c in (False, True))


FA2_LONG = _fa2((16384, 128), (4096, 64))
HOPPER_CELLS = FA2_LONG + D256   # 16K d=128, 4K d=64, 4K d=256, causal and not
TARGETS = (
    # FlashAttention-2 floors of the Triton kernels on the H200.
    Target("fa2_floors", "tflops", FA2_LONG[:2], "pallas", "fwd", 430.0),
    Target("fa2_floors", "tflops", FA2_LONG[:2], "pallas", "fwd+bwd", 330.0),
    Target("fa2_floors", "tflops", FA2_LONG[2:], "pallas", "fwd", 330.0),
    Target("fa2_floors", "tflops", FA2_LONG[2:], "pallas", "fwd+bwd", 280.0),
    Target("fa2_floors", "vs_peer", (fa2_case(1024, 128, False),), "pallas", "fwd", 0.9,
           "jax_pallas_mha"),
    Target("fa2_floors", "vs_peer", (fa2_case(1024, 128, False),), "pallas", "fwd+bwd", 1.5,
           "jax_pallas_mha"),
    # Model shapes on the Triton kernels, against cuDNN in the same run.
    Target("model_shapes", "compile_s", (MQA, GQA, T3072), "pallas", value=10.0),
    Target("model_shapes", "vs_peer", (MQA,), "pallas", value=0.75, peer="cudnn"),
    Target("model_shapes", "vs_peer", (GQA,), "pallas", value=0.8, peer="cudnn"),
    Target("model_shapes", "vs_peer", (D96, D80), "pallas", value=0.75, peer="cudnn"),
    Target("model_shapes", "temp_vs", (D96, D80), "pallas", value=1.1, other=D128_4K),
    Target("model_shapes", "vs_case", (T3000,), "pallas", value=0.95, other=T3072),
    Target("model_shapes", "temp_vs", (T3000,), "pallas", value=1.1, other=T3072),
    Target("model_shapes", "vs_peer", D256, "pallas", value=0.7, peer="cudnn"),
    # Timing noise of a median over rounds is ~2%: "not slower" allows 3%.
    Target("model_shapes", "vs_baseline", FA2_QUICK, "pallas", "fwd", 0.97),
    Target("model_shapes", "vs_baseline", FA2_QUICK, "pallas", "fwd+bwd", 0.97),
    # Hopper forward (Mosaic GPU) against cuDNN; 1.05 is FlashAttention-3's margin on an H100.
    Target("hopper_fwd", "vs_peer", HOPPER_CELLS, "mosaic_gpu", "fwd", 1.0, "cudnn"),
    Target("hopper_fwd_stretch", "vs_peer", HOPPER_CELLS, "mosaic_gpu", "fwd", 1.05, "cudnn"),
    Target("hopper_fwd", "resolves", HOPPER_CELLS, "mosaic_gpu", "fwd"),
    # Hopper backward (Mosaic GPU) against cuDNN.
    Target("hopper_bwd", "vs_peer", HOPPER_CELLS + (GQA,), "mosaic_gpu", value=1.0, peer="cudnn"),
    Target("hopper_bwd", "vs_peer", (MQA,), "mosaic_gpu", value=0.9, peer="cudnn"),
    Target("hopper_bwd", "compile_s", HOPPER_CELLS + (GQA, MQA), "mosaic_gpu", value=15.0),
    # The whole Hopper grid, forward and fwd+bwd, on the H100 and the H200 alike.
    *(Target("hopper_grid", "vs_peer", FA2_HOPPER + D256, "mosaic_gpu", m, 1.0, "cudnn")
      for m in MODES),
    # The short regime: cuDNN where it runs (not at 577), tokamax's Mosaic GPU kernel,
    # and 577 rows without padded copies.
    *(Target("short", "vs_peer", SHORT, "mosaic_gpu", m, 1.0, p)
      for m in MODES for p in ("cudnn", "tokamax_mosaic")),
    Target("short", "temp_vs", (VIT_L,), "mosaic_gpu", value=1.1, other=VIT_L_ALIGNED),
)
# jflash temp bytes of fwd+bwd <= 1.1x JAX Pallas mha's at 32K (the memory table).
MEMORY_TARGET = (32768, 1.1)

# -- block sweep -------------------------------------------------------------------------
# head_dim -> seq: the FA-2 grid's long cells at 64 and 128, the model shapes' cells
# (MODEL, D256) at 80/96/192/256, and at 160 (no model cell) a FA-2-style one of 12
# heads; `sweep_case` picks the case.
SWEEP_SHAPES = {128: 16384, 64: 4096, 256: 4096, 96: 4096, 80: 4096, 192: 4096, 160: 4096}
# Masks swept per head_dim where not both: the model cells of d 80/96/192 are not causal,
# and d = 160 follows them.
SWEEP_CAUSALS = {80: (False,), 96: (False,), 192: (False,), 160: (False,)}
SWEEP_BUDGET_S = 160                    # split evenly over (d, causal, pass)
SWEEP_PASSES = ("fwd", "dkv", "dq")
# Which Pallas tile fields each pass sets: (rows of Q, rows of K/V, warps, stages).
SWEPT_FIELDS = {"fwd": ("block_q", "block_k", "num_warps", "num_stages"),
                "dkv": ("block_q_dkv", "block_k_dkv", "num_warps_dkv", "num_stages_dkv"),
                "dq": ("block_q_dq", "block_k_dq", "num_warps_dq", "num_stages_dq")}
# Candidates per kernel, most promising first. The dK/dV and dQ passes each time the
# whole backward with the other kernel at jflash's table, so the best of each combine
# (the kernels run one after the other).
SWEEP_CANDIDATES = {
    "fwd": {
        64: ((64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3), (128, 64, 4, 3), (64, 32, 4, 3),
             (128, 128, 8, 3), (128, 64, 4, 4), (256, 64, 8, 3)),
        128: ((128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (128, 64, 8, 2),
              (128, 64, 8, 4), (64, 64, 4, 3), (128, 32, 8, 3), (64, 128, 4, 3))},
    "dkv": {
        64: ((32, 128, 4, 3), (64, 128, 4, 3), (64, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 3),
             (64, 128, 8, 2), (128, 128, 8, 2), (32, 128, 4, 4), (128, 64, 4, 2)),
        128: ((32, 128, 4, 3), (64, 128, 8, 3), (64, 128, 4, 2), (64, 64, 4, 3), (32, 64, 4, 3),
              (64, 128, 8, 2), (128, 128, 8, 2))},
    "dq": {
        64: ((128, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 64, 4, 2), (64, 32, 4, 3),
             (128, 64, 8, 2), (64, 128, 4, 2), (128, 128, 8, 2)),
        128: ((128, 32, 4, 3), (128, 64, 8, 2), (64, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 3),
              (128, 64, 4, 2))},
}
SWEEP_CANDIDATES["fwd"][256] = ((128, 32, 8, 2), (64, 64, 4, 2), (128, 64, 8, 3), (64, 64, 8, 2),
                                (64, 32, 4, 3), (128, 64, 8, 1))
# dK/dV: the last five ran slower than 64 x 32 / 4 warps / 2 stages
# (block_sweep_d256_h200.json).
SWEEP_CANDIDATES["dkv"][256] = ((128, 32, 8, 2), (64, 32, 4, 1), (32, 64, 8, 2), (64, 64, 8, 1),
                                (64, 64, 8, 2), (32, 64, 4, 2), (64, 32, 8, 2), (64, 32, 4, 3),
                                (32, 32, 4, 2))
SWEEP_CANDIDATES["dq"][256] = ((128, 64, 8, 2), (64, 64, 4, 2), (64, 32, 4, 2), (128, 32, 8, 3),
                               (64, 64, 8, 2), (128, 32, 8, 1), (64, 32, 4, 3))
# Head dims that run as pieces (80 = 64 + 16, 96 = 64 + 32) start from d = 128's
# candidates, with 128 x 64 and 64 x 64 tiles first.
for _pass, _extra in (("fwd", ((128, 64, 4, 3), (64, 64, 4, 3))), ("dkv", ((64, 64, 4, 3),)),
                      ("dq", ((64, 64, 4, 3),))):
  for _d in (80, 96):
    SWEEP_CANDIDATES[_pass][_d] = _extra + tuple(
        c for c in SWEEP_CANDIDATES[_pass][128] if c not in _extra)


# d = 160 and 192 (pieces 128 + 32 and 128 + 64): candidates around the d = 256 row, which
# they took before their own.
for _d in (160, 192):
  SWEEP_CANDIDATES["fwd"][_d] = ((128, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 8, 2),
                                 (64, 32, 4, 3), (128, 64, 8, 1))
  SWEEP_CANDIDATES["dkv"][_d] = ((64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 3), (64, 64, 8, 2),
                                 (32, 64, 4, 2), (64, 32, 8, 2))
  SWEEP_CANDIDATES["dq"][_d] = ((128, 64, 8, 2), (128, 32, 4, 3), (64, 64, 4, 2), (128, 32, 8, 2),
                                (64, 32, 4, 3), (128, 64, 8, 3))
del _pass, _extra, _d


def sweep_case(s: int, d: int, causal: bool) -> Case:
  """The case a block sweep times at (s, d, causal): the model preset's, else the FA-2
  grid's."""
  for case in MODEL + D256:
    if (case.s, case.d, case.causal, case.k_heads) == (s, d, causal, case.heads):
      return case
  return fa2_case(s, d, causal)


SMOKE_SWEEP_SHAPES = {32: 256}
SMOKE_SWEEP_CANDIDATES = ((64, 64, 4, 3),)   # "xla_chunked" reads only block_k
