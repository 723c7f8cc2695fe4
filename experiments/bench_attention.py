"""Speed of jflash against every attention peer on the machine, in one process (issue 4).

FlashAttention-2 paper grid: batch = 16384 / seq, hidden 2048 as 16 heads x 128 or
32 heads x 64, seq 1K-16K, causal and not, forward and forward + backward, bf16 (the
JAX Mosaic GPU kernel in fp16: its shared-memory buffers are fp16). FLOPs are
4*B*S^2*N*H, halved when causal; forward + backward counts 3.5x the forward
(FA-2 convention: the backward does 2.5 forward's worth of matmuls).

Peers, each tried on its own and recorded with its error when it cannot run:
  jflash            jflash.attention(implementation="pallas")
  cudnn, xla        jax.nn.dot_product_attention(implementation=...)
  jax_pallas_mha    jax.experimental.pallas.ops.gpu.attention.mha (Pallas Triton)
  jax_mgpu          jax.experimental.pallas.ops.gpu.attention_mgpu (Mosaic GPU, fp16)
  tokamax_mosaic, tokamax_triton   tokamax.dot_product_attention, when importable
  torch_flash, torch_cudnn         PyTorch SDPA backends, when torch sees a GPU

Every output (forward) or gradient triple (forward + backward) is checked against
cuDNN's (else XLA's, else jflash's "xla_chunked") before it is timed; a wrong one is
not timed. Timing: compile and a warm-up call, then ROUNDS rounds of back-to-back
calls over rotated input sets, completion awaited on the device once per round;
the median round gives ms per call.

  python experiments/bench_attention.py --quick        # issue 4's table + memory
  python experiments/bench_attention.py --full         # the whole grid + memory
  python experiments/bench_attention.py --block-sweep  # jflash tile sizes per (d, causal, pass)
  python experiments/bench_attention.py --quick --cpu-smoke   # tiny, CPU only, for tests

Results: <out-dir>/bench_attention_<device>.json (rows {impl, s, d, causal, mode,
tflops, ms, rel_err, ...}, "memory", environment and config) and, for the sweep,
<out-dir>/bench_attention_block_sweep_<device>.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import statistics
import sys
import time
import types
import warnings
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))  # run as a script: `experiments` and `jflash` come from this checkout
if "--cpu-smoke" in sys.argv:
  os.environ["JAX_PLATFORMS"] = "cpu"  # must precede `import jax`; the smoke run never touches a GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jflash  # noqa: E402
from experiments import common  # noqa: E402
from pallas_kernels import common as kernel_common, tuning  # noqa: E402
from pallas_kernels.tuning import default_block_sizes  # noqa: E402

# -- the grid -----------------------------------------------------------------------
TOKENS = 16384          # FA-2 grid: batch * seq held constant
HIDDEN = 2048           # heads * head_dim held constant
SEQS = (1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)
QUICK = (  # (seq, head_dim, causal): the cells of issue 4's table
    (16384, 128, False), (16384, 128, True),
    (4096, 64, False), (4096, 64, True),
    (1024, 128, False),
)
MODES = ("fwd", "fwd+bwd")
BWD_FACTOR = 3.5        # forward + backward FLOPs / forward FLOPs (FA-2 paper)
# A sanity gate, not an accuracy test: two bf16 implementations differ by ~4e-3
# (bf16 rounding of the output), a wrong kernel by O(1) or NaN.
REL_TOL = {"fwd": 2e-2, "fwd+bwd": 5e-2, "bwd": 5e-2}
XLA_MAX_SEQ = 8192      # the materialising baseline: 16K fwd+bwd needs 40 GiB and is ~10x slower
MEMORY_SEQS = {"quick": (1024, 4096, 16384, 32768),
               "full": (1024, 2048, 4096, 8192, 16384, 32768)}
MEMORY_IMPLS = ("jflash", "jax_pallas_mha", "cudnn", "xla")
ROUNDS = 5              # median over rounds
ROUND_S = 0.025         # each round long enough (>= 25 ms) that launch gaps do not count
TIME_LIMIT_S = 540       # grid: stay inside a 10-minute device command, JSON written
N_INPUT_SETS = 3        # rotated so no call reuses the previous call's inputs in cache

# JAX's Pallas Triton `mha` (chosen, not tuned here): forward 128 x 64 tiles; its
# fused backward walks dQ and dK/dV blocks with one grid, so block_q_dq == block_kv_dkv.
# Its own default backward tiles (32) are far slower; edit here to retune the peer.
MHA_BLOCKS = {
    64: dict(block_q=128, block_k=64, block_q_dkv=64, block_kv_dkv=128,
             block_q_dq=128, block_kv_dq=64),
    128: dict(block_q=128, block_k=64, block_q_dkv=64, block_kv_dkv=128,
              block_q_dq=128, block_kv_dq=64),
}
# JAX's Mosaic GPU kernel, in the order tried: its test suite's blocks with two
# compute warpgroups in the backward; the second only if the first overflows
# shared memory. Its forward has no scale argument, so q is scaled outside.
MGPU_CONFIGS = (
    dict(block_q=64, block_kv=128, max_concurrent_steps=2, compute_wgs_bwd=2,
         block_q_dq=64, block_kv_dq=128, block_q_dkv=128, block_kv_dkv=64),
    dict(block_q=64, block_kv=64, max_concurrent_steps=2, compute_wgs_bwd=1,
         block_q_dq=64, block_kv_dq=64, block_q_dkv=64, block_kv_dkv=64),
)

# -- block sweep ----------------------------------------------------------------------
SWEEP_SHAPES = {128: 16384, 64: 4096}   # head_dim -> seq: issue 4's long cells
SWEEP_BUDGET_S = 160                    # split evenly over (d, causal, pass); later candidates skipped
# Candidates per kernel (rows of Q, rows of K/V, num_warps, num_stages), most promising
# first. The dK/dV and dQ passes each time the whole backward with the other kernel at
# jflash's table, so the best of each combine (the kernels run one after the other).
SWEEP_FWD = {
    64: ((64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3), (128, 64, 4, 3), (64, 32, 4, 3),
         (128, 128, 8, 3), (128, 64, 4, 4), (256, 64, 8, 3)),
    128: ((128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (128, 64, 8, 2),
          (128, 64, 8, 4), (64, 64, 4, 3), (128, 32, 8, 3), (64, 128, 4, 3)),
}
SWEEP_DKV = {
    64: ((32, 128, 4, 3), (64, 128, 4, 3), (64, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 3),
         (64, 128, 8, 2), (128, 128, 8, 2), (32, 128, 4, 4), (128, 64, 4, 2)),
    128: ((32, 128, 4, 3), (64, 128, 8, 3), (64, 128, 4, 2), (64, 64, 4, 3), (32, 64, 4, 3),
          (64, 128, 8, 2), (128, 128, 8, 2)),
}
SWEEP_DQ = {
    64: ((128, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 64, 4, 2), (64, 32, 4, 3),
         (128, 64, 8, 2), (64, 128, 4, 2), (128, 128, 8, 2)),
    128: ((128, 32, 4, 3), (128, 64, 8, 2), (64, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 3),
          (128, 64, 4, 2)),
}
SWEEP_PASSES = ("fwd", "dkv", "dq")

# -- CPU smoke: tiny shapes, jflash "xla_chunked" against "xla" ------------------------
SMOKE_CASES = ((128, 32, True),)   # compile time is the cost here, so one config
SMOKE_BATCH, SMOKE_HEADS = 2, 2
SMOKE_MEMORY_SEQS = (128,)
SMOKE_SWEEP = {32: 256}
SMOKE_SWEEP_CANDS = ((64, 64, 4, 3),)   # "xla_chunked" reads only block_k

_T0 = time.perf_counter()


def log(msg: str):
  print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", flush=True)


class PeerError(Exception):
  """A peer could not run a call; the message already names the causes."""


def _err_text(e: BaseException, limit: int = 600) -> str:
  """Type and message, long compiler errors cut in the middle."""
  text = str(e) if isinstance(e, PeerError) else f"{type(e).__name__}: {e}".strip()
  if len(text) > limit:
    text = text[: limit // 2] + " ... " + text[-limit // 2:]
  return text


@dataclasses.dataclass(frozen=True)
class Case:
  s: int
  d: int
  causal: bool
  batch: int
  heads: int

  @property
  def scale(self) -> float:
    return 1.0 / math.sqrt(self.d)

  def flops(self, mode: str) -> float:
    f = 4.0 * self.batch * self.s * self.s * self.heads * self.d
    if self.causal:
      f /= 2
    return f * {"fwd": 1.0, "fwd+bwd": BWD_FACTOR, "bwd": BWD_FACTOR - 1.0}[mode]

  def key(self) -> str:
    return f"s={self.s} d={self.d} causal={self.causal}"


def grid_case(s: int, d: int, causal: bool, smoke: bool) -> Case:
  if smoke:
    return Case(s, d, causal, SMOKE_BATCH, SMOKE_HEADS)
  return Case(s, d, causal, TOKENS // s, HIDDEN // d)


# -- peers ----------------------------------------------------------------------------

@dataclasses.dataclass
class Peer:
  """One implementation. `variants(case)` returns [(label, attn)], tried in order until
  one runs; `attn(q, k, v) -> out` on BSNH JAX arrays (torch peers: BNSH tensors)."""

  name: str
  variants: Callable[[Case], list]
  framework: str = "jax"
  dtype: str | None = None         # input dtype when not the grid's (Mosaic GPU: fp16)
  prescale_q: bool = False         # kernel lacks a scale argument: q * 1/sqrt(H) outside the timed call
  max_seq: int | None = None
  skip_reason: str = ""


def _jax_nn(implementation):
  def variants(case):
    return [(implementation, lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=case.causal, implementation=implementation))]
  return variants


def _jflash(implementation):
  def variants(case):
    return [(implementation, lambda q, k, v: jflash.attention(
        q, k, v, is_causal=case.causal, implementation=implementation))]
  return variants


def _mha_variants(case):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # JAX 0.11 points users to tokamax
    from jax.experimental.pallas.ops.gpu import attention as mha_lib
  blocks = mha_lib.BlockSizes(**MHA_BLOCKS[case.d])
  return [(str(MHA_BLOCKS[case.d]), lambda q, k, v: mha_lib.mha(
      q, k, v, None, sm_scale=case.scale, causal=case.causal, block_sizes=blocks))]


def _dataclass_from(cls, fields: dict):
  """`cls(**fields)` keeping only the fields this JAX version's class has."""
  names = {f.name for f in dataclasses.fields(cls)}
  return cls(**{k: v for k, v in fields.items() if k in names})


def _mgpu_variants(case):
  from jax.experimental.pallas.ops.gpu import attention_mgpu as mgpu
  out = []
  for cfg in MGPU_CONFIGS:
    config = _dataclass_from(mgpu.TuningConfig, dict(cfg, causal=case.causal))
    out.append((str(cfg), functools.partial(mgpu.attention, config=config)))
  return out


@functools.cache
def _tokamax():
  try:
    import tokamax
  except ModuleNotFoundError as e:
    if not (e.name or "").startswith("xprof"):
      raise
    # tokamax imports xprof (a 100 MiB profiler UI) only for its own benchmark
    # helper, which is not used here; an empty stand-in lets the kernels import.
    for name in ("xprof", "xprof.cli", "xprof.cli.tools"):
      sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["xprof.cli.tools"].get_kernel_stats_tool = None
    import tokamax
  return tokamax


def _tokamax_variants(implementation):
  def variants(case):
    tokamax = _tokamax()
    return [(implementation, lambda q, k, v: tokamax.dot_product_attention(
        q, k, v, is_causal=case.causal, implementation=implementation))]
  return variants


@functools.cache
def _torch():
  import torch
  if not torch.cuda.is_available():
    raise RuntimeError("torch sees no CUDA device")
  return torch


def _torch_variants(backend):
  def variants(case):
    torch = _torch()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    chosen = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]

    def attn(q, k, v):  # BNSH, PyTorch's own layout (inputs transposed outside the timed call)
      with sdpa_kernel([chosen]):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=case.causal, scale=case.scale)
    return [(backend, attn)]
  return variants


def make_peers(args) -> dict[str, Peer]:
  if args.cpu_smoke:
    return {
        "jflash": Peer("jflash", _jflash("xla_chunked")),
        "xla": Peer("xla", _jax_nn("xla")),
    }
  peers = [
      Peer("jflash", _jflash(args.jflash_impl)),
      Peer("cudnn", _jax_nn("cudnn")),
      Peer("xla", _jax_nn("xla"), max_seq=args.xla_max_seq,
           skip_reason=f"seq > --xla-max-seq={args.xla_max_seq}: T x S logits"),
      Peer("jax_pallas_mha", _mha_variants),
      Peer("jax_mgpu", _mgpu_variants, dtype="float16", prescale_q=True),
      Peer("tokamax_mosaic", _tokamax_variants("mosaic")),
      Peer("tokamax_triton", _tokamax_variants("triton")),
      Peer("torch_flash", _torch_variants("flash"), framework="torch"),
      Peer("torch_cudnn", _torch_variants("cudnn"), framework="torch"),
      # Not timed by default; the reference of last resort when cuDNN and XLA cannot run.
      Peer("jflash_xla_chunked", _jflash("xla_chunked")),
  ]
  return {p.name: p for p in peers}


def default_impls(args, peers) -> list[str]:
  if args.impls:
    names = [n.strip() for n in args.impls.split(",") if n.strip()]
    unknown = [n for n in names if n not in peers]
    if unknown:
      raise SystemExit(f"--impls: unknown {unknown}; choose from {sorted(peers)}")
    return names
  names = [n for n in peers if n != "jflash_xla_chunked"]
  if args.no_torch:
    names = [n for n in names if peers[n].framework != "torch"]
  return names


def reference_chain(args) -> tuple[str, ...]:
  return ("xla",) if args.cpu_smoke else ("cudnn", "xla", "jflash_xla_chunked")


# -- inputs, functions, checks ----------------------------------------------------------

def make_sets(case: Case, dtype, n: int, seed: int = 0):
  """n input sets (q, k, v, dout), BSNH, normal(0, 1)."""
  shape = (case.batch, case.s, case.heads, case.d)
  sets = []
  for i in range(n):
    ks = jax.random.split(jax.random.key(seed * 1000 + i), 4)
    sets.append(tuple(jax.random.normal(kk, shape, jnp.float32).astype(dtype) for kk in ks))
  return sets


def _fwd_bwd(attn):
  """Gradient of sum(out * dout) w.r.t. q, k, v: forward and backward, as in training."""
  def f(q, k, v, do):
    _, pull = jax.vjp(attn, q, k, v)
    return pull(do)
  return f


def jax_fn(attn, mode):
  if mode == "fwd":
    return jax.jit(lambda q, k, v, do: attn(q, k, v))
  return jax.jit(_fwd_bwd(attn))


def torch_fn(attn, mode):
  torch = _torch()
  if mode == "fwd":
    def fwd(q, k, v, do):
      with torch.no_grad():
        return attn(q, k, v)
    return fwd

  def fwd_bwd(q, k, v, do):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    return torch.autograd.grad(attn(q, k, v), (q, k, v), do)
  return fwd_bwd


def peer_inputs(peer: Peer, case: Case, sets):
  """The grid's input sets in the form and dtype this peer takes."""
  out = []
  for q, k, v, do in sets:
    if peer.prescale_q:
      q = q.astype(jnp.float32) * case.scale
    if peer.dtype:
      q, k, v, do = (x.astype(peer.dtype) for x in (q, k, v, do))
    if peer.framework == "torch":
      torch = _torch()
      dtype = getattr(torch, str(q.dtype))  # same name in both: bfloat16, float16, float32
      q, k, v, do = (torch.from_numpy(np.asarray(x, np.float32)).to("cuda", dtype)
                     .permute(0, 2, 1, 3).contiguous() for x in (q, k, v, do))  # BSNH -> BNSH
    out.append((q, k, v, do))
  return out


def to_jax(peer: Peer, case: Case, result, mode):
  """A peer's result as float32 JAX arrays comparable to the reference's."""
  parts = (result,) if mode == "fwd" else tuple(result)
  if peer.framework == "torch":  # BNSH -> BSNH
    parts = tuple(jnp.asarray(p.float().permute(0, 2, 1, 3).cpu().numpy()) for p in parts)
  parts = tuple(p.astype(jnp.float32) for p in parts)
  if peer.prescale_q and mode != "fwd":
    parts = (parts[0] * case.scale,) + parts[1:]  # d/dq = scale * d/d(scale q)
  return parts


@jax.jit
def _rel(a, b):
  return jnp.linalg.norm((a - b).ravel()) / jnp.linalg.norm(b.ravel())


def rel_err(parts, ref_parts) -> float:
  """Largest relative Frobenius error over the output (or dq, dk, dv)."""
  return max(float(_rel(a, b)) for a, b in zip(parts, ref_parts))


def sync(peer: Peer, x):
  if peer.framework == "torch":
    _torch().cuda.synchronize()
  else:
    common.block(x)
  return x


def time_calls(peer: Peer, fn, sets, rounds: int, round_s: float) -> tuple[float, int]:
  """Median seconds per call over `rounds` rounds of back-to-back calls."""
  sync(peer, fn(*sets[1 % len(sets)]))  # warm-up (plan caches, clocks)
  t = time.perf_counter()
  sync(peer, fn(*sets[2 % len(sets)]))  # a first estimate of one call
  one = time.perf_counter() - t
  calls = int(min(max(1, round_s / max(one, 1e-6)), 500))
  times = []
  for _ in range(rounds):
    t = time.perf_counter()
    for i in range(calls):
      out = fn(*sets[i % len(sets)])
    sync(peer, out)  # one stream, in order: the last call done means all are
    times.append((time.perf_counter() - t) / calls)
    del out
  return statistics.median(times), calls


# -- the grid --------------------------------------------------------------------------

class Runner:
  def __init__(self, args, peers):
    self.args = args
    self.peers = peers
    self._fns = {}    # (peer, case, mode) -> (label, fn, notes)
    self._refs = {}   # (case, mode) -> (ref name, parts) or (None, reason)
    self.deadline = _T0 + args.time_limit_s

  def fn(self, peer: Peer, case: Case, mode: str, sets):
    """The first variant of `peer` that compiles and runs on sets[0]:
    (label, fn, its result, seconds of that first call, errors of earlier variants).
    Kept per (peer, case, mode), so the reference peer is compiled once."""
    key = (peer.name, case, mode)
    if key in self._fns:
      label, fn, notes = self._fns[key]
      t = time.perf_counter()
      first = sync(peer, fn(*sets[0]))
      return label, fn, first, time.perf_counter() - t, notes
    notes = []
    try:
      variants = peer.variants(case)
    except Exception as e:  # import errors, missing packages: recorded, never fatal
      raise PeerError(_err_text(e)) from e
    for label, attn in variants:
      fn = torch_fn(attn, mode) if peer.framework == "torch" else jax_fn(attn, mode)
      try:
        t = time.perf_counter()
        first = sync(peer, fn(*sets[0]))
      except Exception as e:
        notes.append(f"{label}: {_err_text(e)}")
        continue
      self._fns[key] = (label, fn, notes)
      return label, fn, first, time.perf_counter() - t, notes
    raise PeerError(" | ".join(notes) or "no variant")

  def forget(self, case: Case):
    """Drops the compiled functions of a finished config (and the arrays they hold)."""
    self._fns = {k: v for k, v in self._fns.items() if k[1] != case}
    self._refs = {k: v for k, v in self._refs.items() if k[0] != case}

  def reference(self, case: Case, mode: str, sets_by_peer):
    key = (case, mode)
    if key in self._refs:
      return self._refs[key]
    if time.perf_counter() > self.deadline:  # every call of this config will be skipped
      return None, "time limit"
    reasons = []
    for name in reference_chain(self.args):
      peer = self.peers[name]
      if peer.max_seq and case.s > peer.max_seq:
        reasons.append(f"{name}: {peer.skip_reason}")
        continue
      try:
        sets = sets_by_peer(peer)
        _, _, first, _, _ = self.fn(peer, case, mode, sets)
        self._refs[key] = (name, to_jax(peer, case, first, mode))
        return self._refs[key]
      except Exception as e:
        reasons.append(f"{name}: {_err_text(e, 200)}")
    self._refs[key] = (None, "; ".join(reasons))
    return self._refs[key]

  def run_case(self, case: Case, impls, modes) -> list[dict]:
    rows = []
    base = make_sets(case, jnp.dtype(self.args.dtype), self.args.input_sets)
    cache = {}

    def sets_by_peer(peer):
      k = (peer.framework, peer.dtype, peer.prescale_q)
      if k not in cache:
        cache[k] = peer_inputs(peer, case, base)
      return cache[k]

    for mode in modes:
      ref_name, ref = self.reference(case, mode, sets_by_peer)
      for name in impls:
        rows.append(self.run_one(self.peers[name], case, mode, sets_by_peer, ref_name, ref))
      self._refs.pop((case, mode), None)
    return rows

  def run_one(self, peer, case, mode, sets_by_peer, ref_name, ref) -> dict:
    row = dict(impl=peer.name, s=case.s, d=case.d, causal=case.causal, mode=mode,
               batch=case.batch, heads=case.heads,
               dtype=peer.dtype or self.args.dtype, tflops=None, ms=None, rel_err=None,
               ref=ref_name, status="ok")
    tag = f"{case.key():28s} {mode:8s} {peer.name:18s}"
    if peer.max_seq and case.s > peer.max_seq:
      row.update(status="skipped", error=peer.skip_reason)
      log(f"{tag} skipped: {peer.skip_reason}")
      return row
    if time.perf_counter() > self.deadline:
      row.update(status="skipped", error=f"--time-limit-s={self.args.time_limit_s} spent")
      log(f"{tag} skipped: time limit")
      return row
    try:
      sets = sets_by_peer(peer)
      label, fn, first, compile_s, notes = self.fn(peer, case, mode, sets)
      row.update(variant=label, first_call_s=round(compile_s, 3))
      if notes:
        row["notes"] = notes
      if ref_name is None:
        row["status"] = "unchecked"
        row["error"] = f"no reference: {ref}"
      else:
        err = rel_err(to_jax(peer, case, first, mode), ref)
        row["rel_err"] = err
        if not err <= REL_TOL[mode]:  # NaN fails too
          row.update(status="wrong",
                     error=f"rel_err={err:.3g} > {REL_TOL[mode]} against {ref_name}: not timed")
          log(f"{tag} WRONG rel_err={err:.3g} against {ref_name}")
          return row
      del first
      sec, calls = time_calls(peer, fn, sets, self.args.rounds, self.args.round_ms / 1e3)
      row.update(ms=sec * 1e3, tflops=case.flops(mode) / sec / 1e12, calls_per_round=calls)
      err_txt = "unchecked" if row["rel_err"] is None else f"rel_err={row['rel_err']:.1e}"
      log(f"{tag} {row['tflops']:7.2f} TF/s {row['ms']:9.3f} ms  {err_txt}"
          f" (first call {compile_s:.1f}s)")
    except Exception as e:
      row.update(status="error", error=_err_text(e))
      log(f"{tag} ERROR {row['error'][:160]}")
    return row


# -- memory -----------------------------------------------------------------------------

def memory_rows(args, peers, seqs, impls, deadline=math.inf) -> list[dict]:
  """Compiled temp bytes of forward + backward (no arrays are allocated)."""
  heads, d = (SMOKE_HEADS, 32) if args.cpu_smoke else (16, 128)
  rows = []
  for s in seqs:
    case = Case(s, d, False, 1, heads)
    spec = jax.ShapeDtypeStruct((1, s, heads, d), jnp.dtype(args.dtype))
    for name in impls:
      row = dict(impl=name, s=s, d=d, heads=heads, batch=1, dtype=args.dtype)
      if time.perf_counter() > deadline:
        row["error"] = f"skipped: --time-limit-s={args.time_limit_s} spent"
        rows.append(row)
        continue
      try:
        _, attn = peers[name].variants(case)[0]
        m = common.compiled_memory(_fwd_bwd(attn), spec, spec, spec, spec)
        row.update(m)
        temp = m.get("temp_size_in_bytes")
        row["temp_mib"] = None if temp is None else temp / 2**20
        log(f"memory s={s:6d} {name:18s} temp {row['temp_mib']:10.1f} MiB")
      except Exception as e:
        row["error"] = _err_text(e)
        log(f"memory s={s:6d} {name:18s} ERROR {row['error'][:160]}")
      rows.append(row)
  return rows


def memory_summary(mem_rows) -> dict:
  """jflash temp bytes over JAX Pallas mha's per seq (issue 4: <= 1.1 at 32K)."""
  by = {(r["impl"], r["s"]): r.get("temp_size_in_bytes") for r in mem_rows}
  out = {}
  for (impl, s), b in by.items():
    m = by.get(("jax_pallas_mha", s))
    if impl == "jflash" and b is not None and m:
      out[str(s)] = b / m
  return {"jflash_over_jax_pallas_mha": out}


# -- issue 4's table ----------------------------------------------------------------------
# (seq, head_dim, causal or None for both, mode) -> TF/s floor, or ("jax_pallas_mha", x): x times mha's
TARGETS = {
    (16384, 128, None, "fwd"): 430.0,
    (16384, 128, None, "fwd+bwd"): 330.0,
    (4096, 64, None, "fwd"): 330.0,
    (4096, 64, None, "fwd+bwd"): 280.0,
    (1024, 128, None, "fwd"): ("jax_pallas_mha", 0.9),
    (1024, 128, None, "fwd+bwd"): ("jax_pallas_mha", 1.5),
}
MEMORY_TARGET = (32768, 1.1)   # jflash temp bytes <= 1.1x JAX Pallas mha's at 32K


def check_targets(rows, mem_summary) -> list[dict]:
  """Issue 4's table against this run's jflash rows: one entry per measured cell."""
  by = {(r["impl"], r["s"], r["d"], r["causal"], r["mode"]): r for r in rows}
  out = []
  for (s, d, causal, mode), target in TARGETS.items():
    for c in ((False, True) if causal is None else (causal,)):
      j = by.get(("jflash", s, d, c, mode))
      if j is None:
        continue
      if isinstance(target, tuple):
        peer = by.get((target[0], s, d, c, mode))
        need = peer["tflops"] * target[1] if peer and peer["tflops"] else None
        what = f">= {target[1]}x {target[0]}"
      else:
        need, what = target, f">= {target:.0f} TF/s"
      have = j["tflops"]
      out.append(dict(s=s, d=d, causal=c, mode=mode, target=what, need_tflops=need,
                      tflops=have, met=None if need is None or have is None else have >= need))
  ratio = (mem_summary or {}).get("jflash_over_jax_pallas_mha", {}).get(str(MEMORY_TARGET[0]))
  if ratio is not None:
    out.append(dict(s=MEMORY_TARGET[0], target=f"temp bytes <= {MEMORY_TARGET[1]}x jax_pallas_mha",
                    ratio=ratio, met=ratio <= MEMORY_TARGET[1]))
  return out


def print_targets(targets):
  if not targets:
    return
  print("\nIssue 4 targets (jflash)", flush=True)
  for t in targets:
    met = {True: "met", False: "MISSED", None: "n/a"}[t["met"]]
    if "ratio" in t:
      print(f"  memory s={t['s']}: {t['target']}: {t['ratio']:.2f}x  {met}")
      continue
    have = "-" if t["tflops"] is None else f"{t['tflops']:.1f}"
    need = "-" if t["need_tflops"] is None else f"{t['need_tflops']:.1f}"
    print(f"  s={t['s']:>5} d={t['d']:>3} causal={str(t['causal']):5} {t['mode']:7}: "
          f"{have:>7} TF/s, need {need:>7} ({t['target']})  {met}")


# -- printing -----------------------------------------------------------------------------

def print_tables(rows, impls):
  cells = {}
  for r in rows:
    cells.setdefault((r["s"], r["d"], r["causal"], r["mode"]), {})[r["impl"]] = r
  w = {n: max(7, len(n)) + 2 for n in impls}
  head = f"{'s':>6} {'d':>4} {'causal':>6} {'mode':>8} " + "".join(f"{n:>{w[n]}}" for n in impls)

  def fmt(r):
    if r is None:
      return "-"
    if r["tflops"] is not None:
      return f"{r['tflops']:.1f}"
    return {"wrong": "WRONG", "skipped": "skip", "error": "err"}.get(r["status"], "?")

  print("\nTF/s (bf16; jax_mgpu fp16). err/WRONG/skip: see the JSON rows' 'error'.", flush=True)
  print(head)
  for key in sorted(cells):
    s, d, c, mode = key
    print(f"{s:>6} {d:>4} {str(c):>6} {mode:>8} "
          + "".join(f"{fmt(cells[key].get(n)):>{w[n]}}" for n in impls))
  others = [n for n in impls if n != "jflash"]
  if "jflash" not in impls or not others:
    return
  print("\njflash / peer (TF/s ratio; > 1 means jflash is faster)")
  print(f"{'s':>6} {'d':>4} {'causal':>6} {'mode':>8} " + "".join(f"{n:>{w[n]}}" for n in others))
  for key in sorted(cells):
    s, d, c, mode = key
    j = cells[key].get("jflash")
    line = f"{s:>6} {d:>4} {str(c):>6} {mode:>8} "
    for n in others:
      p = cells[key].get(n)
      ok = j and p and j["tflops"] and p["tflops"]
      line += f"{j['tflops'] / p['tflops']:>{w[n]}.2f}" if ok else f"{'-':>{w[n]}}"
    print(line, flush=True)


def print_memory(mem_rows, impls):
  seqs = sorted({r["s"] for r in mem_rows})
  by = {(r["impl"], r["s"]): r for r in mem_rows}
  print("\nCompiled temp memory of fwd+bwd, MiB (batch 1)", flush=True)
  print(f"{'s':>6} " + "".join(f"{n:>18}" for n in impls))
  for s in seqs:
    line = f"{s:>6} "
    for n in impls:
      r = by.get((n, s))
      v = r.get("temp_mib") if r else None
      line += f"{(f'{v:.1f}' if v is not None else 'err'):>18}"
    print(line, flush=True)


# -- output ----------------------------------------------------------------------------------

def device_tag(args) -> str:
  if args.cpu_smoke:
    return "cpu_smoke"
  kind = getattr(jax.devices()[0], "device_kind", jax.default_backend())
  if "H200" in kind:
    return "h200"
  return "".join(c if c.isalnum() else "_" for c in kind.lower()).strip("_") or "unknown"


def _merge(path: Path, rows, mem, row_key, mem_key):
  """Rows of an earlier run that this run did not redo, kept (for a grid split over runs)."""
  if not path.exists():
    return rows, mem
  old = json.loads(path.read_text())
  new_keys = {row_key(r) for r in rows}
  rows = [r for r in old.get("rows", []) if row_key(r) not in new_keys] + rows
  if mem is not None:
    new_mem = {mem_key(r) for r in mem}
    mem = [r for r in old.get("memory", []) if mem_key(r) not in new_mem] + mem
  return rows, mem


def config_record(args, extra=None) -> dict:
  cfg = dict(vars(args))
  cfg.update(
      tokens=TOKENS, hidden=HIDDEN, bwd_flop_factor=BWD_FACTOR, rel_tol=REL_TOL,
      reference_chain=list(reference_chain(args)), mha_blocks=MHA_BLOCKS,
      mgpu_configs=list(MGPU_CONFIGS),
      jflash_tile_table={str(d): row for d, row in tuning._TABLE.items()},
      jflash_fast_exp2=kernel_common.fast_exp2_enabled(kernel_common.use_interpret(None)),
      flops="4*B*S^2*N*H, /2 when causal, x3.5 for fwd+bwd",
      timing=f"median of {args.rounds} rounds of back-to-back calls (>= {args.round_ms} ms each),"
             f" {args.input_sets} rotated input sets, block_until_ready / cuda.synchronize per round",
  )
  cfg.update(extra or {})
  return cfg


# -- modes --------------------------------------------------------------------------------------

def run_grid(args):
  peers = make_peers(args)
  impls = default_impls(args, peers)
  grid = "full" if args.full else "quick"
  if args.cpu_smoke:
    cases = [grid_case(s, d, c, True) for s, d, c in SMOKE_CASES]
  elif grid == "quick":
    cases = [grid_case(s, d, c, False) for s, d, c in QUICK]
  else:
    seqs = args.seqs or SEQS
    dims = args.head_dims or HEAD_DIMS
    cases = [grid_case(s, d, c, False) for d in dims for s in seqs for c in (False, True)]
  modes = [m for m in MODES if m in args.modes.split(",")]
  if args.cpu_smoke:
    mem_impls, mem_seqs = [n for n in ("jflash", "xla") if n in peers], SMOKE_MEMORY_SEQS
  else:
    mem_impls, mem_seqs = [n for n in MEMORY_IMPLS if n in peers], MEMORY_SEQS[grid]
  log(f"{grid} grid: {len(cases)} configs x {modes} x {impls} on "
      f"{jax.devices()[0].device_kind} (jax {jax.__version__})")
  out_dir = Path(args.out_dir)
  name = args.name or f"bench_attention_{device_tag(args)}"

  def save(rows, mem):
    """Written after every config, so a run stopped early still leaves its rows."""
    if args.merge:
      rows, mem = _merge(out_dir / f"{name}.json", rows, mem,
                         lambda r: (r["impl"], r["s"], r["d"], r["causal"], r["mode"]),
                         lambda r: (r["impl"], r["s"]))
    extra = {"grid": grid, "cases": [dataclasses.asdict(c) for c in cases],
             "elapsed_s": round(time.perf_counter() - _T0, 1)}
    if mem is not None:
      extra["memory"] = mem
      extra["memory_summary"] = memory_summary(mem)
    if not args.cpu_smoke:
      extra["targets"] = check_targets(rows, extra.get("memory_summary"))
    return common.write_result(name, config_record(args), rows, extra=extra, out_dir=out_dir)

  runner = Runner(args, peers)
  rows, mem = [], None
  for case in cases:
    rows += runner.run_case(case, impls, modes)
    runner.forget(case)
    save(rows, mem)
  if not args.skip_memory:
    mem = memory_rows(args, peers, mem_seqs, mem_impls, runner.deadline)

  print_tables(rows, impls)
  mem_sum = memory_summary(mem) if mem else None
  if mem:
    print_memory(mem, mem_impls)
  if not args.cpu_smoke:
    print_targets(check_targets(rows, mem_sum))
  log(f"wrote {save(rows, mem)}")


_SWEPT = {"fwd": ("block_q", "block_k", "num_warps", "num_stages"),
          "dkv": ("block_q_dkv", "block_k_dkv", "num_warps_dkv", "num_stages_dkv"),
          "dq": ("block_q_dq", "block_k_dq", "num_warps_dq", "num_stages_dq")}


def _sweep_blocks(pass_, cand, head_dim):
  """All jflash.BlockSizes fields for one candidate: the swept kernel's from `cand`,
  the others at jflash's table."""
  fields = dataclasses.asdict(default_block_sizes(head_dim))
  fields.update(zip(_SWEPT[pass_], cand))
  return fields


def run_block_sweep(args):
  """Times jflash over BlockSizes candidates, forward and backward apart."""
  peers = make_peers(args)
  impl = "xla_chunked" if args.cpu_smoke else args.jflash_impl
  shapes = SMOKE_SWEEP if args.cpu_smoke else {d: SWEEP_SHAPES[d] for d in (args.head_dims or HEAD_DIMS)}
  runner = Runner(args, peers)
  jflash_peer = Peer("jflash", None)
  rows, best = [], {}
  budget = args.sweep_budget_s
  causals = (False,) if args.cpu_smoke else (False, True)  # smoke: machinery only
  passes = args.sweep_passes
  slots_left = len(shapes) * len(causals) * len(passes)
  end = time.perf_counter() + budget
  log(f"block sweep of jflash '{impl}' over {shapes} (budget {budget}s)")
  for d, s in shapes.items():
    for causal in causals:
      case = grid_case(s, d, causal, args.cpu_smoke)
      base = make_sets(case, jnp.dtype(args.dtype), 1)
      q, k, v, do = base[0]
      sets_by_peer = lambda peer: peer_inputs(peer, case, base)  # noqa: E731
      table = {"fwd": SWEEP_FWD, "dkv": SWEEP_DKV, "dq": SWEEP_DQ}
      for pass_ in passes:
        cands = SMOKE_SWEEP_CANDS if args.cpu_smoke else table[pass_][d]
        mode = "fwd" if pass_ == "fwd" else "bwd"
        ref_name, ref = runner.reference(case, "fwd" if pass_ == "fwd" else "fwd+bwd", sets_by_peer)
        # Each (d, causal, pass) gets an even share of what is left, so a slow slot
        # cuts its own least promising candidates rather than the later slots.
        slot_end = time.perf_counter() + max(0.0, end - time.perf_counter()) / slots_left
        slots_left -= 1
        for cand in (None,) + tuple(cands):  # None: jflash's own table, the baseline
          fields = None if cand is None else _sweep_blocks(pass_, cand, d)
          swept = "default" if cand is None else dict(zip(_SWEPT[pass_], cand))
          row = dict(impl="jflash", implementation=impl, s=s, d=d, causal=causal, mode=mode,
                     pass_=pass_,
                     batch=case.batch, heads=case.heads, dtype=args.dtype, swept=swept,
                     block_sizes=fields or "default", tflops=None, ms=None, rel_err=None,
                     ref=ref_name, status="ok")
          tag = f"sweep {case.key():28s} {pass_:3s} {_fmt_swept(swept):58s}"
          if cand is not None and time.perf_counter() > slot_end:
            row.update(status="skipped", error=f"share of --sweep-budget-s={budget} spent")
            rows.append(row)
            continue
          try:
            bs = None if fields is None else jflash.BlockSizes(**fields)
            attn = functools.partial(_sweep_attn, causal=causal, impl=impl, bs=bs)
            if pass_ == "fwd":
              fn, sets = jax.jit(attn), [(q, k, v)]
            else:
              # The pullback is a pytree (residuals as leaves): jitting it times the
              # backward kernels alone, on one fixed set of residuals.
              _, pull = jax.vjp(jax.jit(attn), q, k, v)
              fn, sets = jax.jit(lambda pull, do: pull(do)), [(pull, do)]
            t = time.perf_counter()
            first = common.block(fn(*sets[0]))
            row["first_call_s"] = round(time.perf_counter() - t, 3)
            if ref_name is not None:
              err = rel_err(to_jax(jflash_peer, case, first, "fwd" if pass_ == "fwd" else "fwd+bwd"), ref)
              row["rel_err"] = err
              if not err <= REL_TOL[mode]:
                row.update(status="wrong", error=f"rel_err={err:.3g} against {ref_name}")
                log(f"{tag} WRONG rel_err={err:.3g}")
                rows.append(row)
                continue
            del first
            sec, calls = time_calls(jflash_peer, fn, sets, args.rounds, args.round_ms / 1e3)
            row.update(ms=sec * 1e3, tflops=case.flops(mode) / sec / 1e12, calls_per_round=calls)
            log(f"{tag} {row['tflops']:7.1f} TF/s {row['ms']:8.3f} ms")
          except Exception as e:
            row.update(status="error", error=_err_text(e))
            log(f"{tag} ERROR {row['error'][:140]}")
          rows.append(row)
        ok = [r for r in rows if r["d"] == d and r["causal"] == causal and r["pass_"] == pass_
              and r["ms"] is not None]
        if ok:
          b = min(ok, key=lambda r: r["ms"])
          default = next((r for r in ok if r["block_sizes"] == "default"), None)
          best[f"d={d} causal={causal} {pass_}"] = dict(
              d=d, causal=causal, pass_=pass_, swept=b["swept"], block_sizes=b["block_sizes"],
              ms=b["ms"],
              tflops=b["tflops"], default_ms=default and default["ms"],
              speedup_over_default=default and default["ms"] / b["ms"])
      runner.forget(case)

  print("\nBest jflash BlockSizes per (head_dim, causal, pass); paste into pallas_kernels/tuning.py:")
  for v in best.values():
    vs = "" if not v["default_ms"] else f", {v['speedup_over_default']:.2f}x the default"
    print(f"  ({v['d']}, {v['causal']}, {v['pass_']!r}): {_fmt_swept(v['swept'])},"
          f"  # {v['ms']:.3f} ms, {v['tflops']:.1f} TF/s{vs}", flush=True)
  out_dir = Path(args.out_dir)
  name = args.name or f"bench_attention_block_sweep_{device_tag(args)}"
  extra = {"best": best, "shapes": {str(d): s for d, s in shapes.items()},
           "elapsed_s": round(time.perf_counter() - _T0, 1)}
  path = common.write_result(name, config_record(args, {"jflash_sweep_impl": impl}), rows,
                             extra=extra, out_dir=out_dir)
  log(f"wrote {path}")


def _fmt_swept(swept) -> str:
  if swept == "default":
    return "default (jflash's table)"
  return "dict(" + ", ".join(f"{k}={v}" for k, v in swept.items()) + ")"


def _sweep_attn(q, k, v, *, causal, impl, bs):
  return jflash.attention(q, k, v, is_causal=causal, implementation=impl, block_sizes=bs)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  what = p.add_mutually_exclusive_group()
  what.add_argument("--quick", action="store_true",
                    help="issue 4's five cells, fwd and fwd+bwd, and memory (the default)")
  what.add_argument("--full", action="store_true", help="the whole FA-2 grid and memory")
  what.add_argument("--block-sweep", action="store_true",
                    help="time jflash over BlockSizes candidates; best per (d, causal, pass)")
  p.add_argument("--cpu-smoke", action="store_true",
                 help="tiny shapes on the CPU, jflash 'xla_chunked' against 'xla' (for tests)")
  p.add_argument("--out-dir", default=str(common.RESULTS), help="where the JSON goes")
  p.add_argument("--name", default=None,
                 help="JSON file stem (default bench_attention_<device> / "
                      "bench_attention_block_sweep_<device>)")
  p.add_argument("--merge", action="store_true",
                 help="keep rows of an earlier JSON of the same name that this run does not redo")
  p.add_argument("--impls", default=None, help="comma-separated subset of the peers")
  p.add_argument("--no-torch", action="store_true", help="leave out the PyTorch SDPA peers")
  p.add_argument("--jflash-impl", default="pallas", help="jflash implementation timed on the GPU")
  p.add_argument("--seqs", type=int, nargs="+", default=None, help="--full: these seqs only")
  p.add_argument("--head-dims", type=int, nargs="+", default=None,
                 help="--full / --block-sweep: these head dims only")
  p.add_argument("--modes", default="fwd,fwd+bwd", help="comma-separated: fwd, fwd+bwd")
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--xla-max-seq", type=int, default=XLA_MAX_SEQ,
                 help="longest seq timed for the materialising XLA baseline")
  p.add_argument("--skip-memory", action="store_true", help="no compiled-memory table")
  p.add_argument("--rounds", type=int, default=ROUNDS)
  p.add_argument("--round-ms", type=float, default=ROUND_S * 1e3)
  p.add_argument("--input-sets", type=int, default=N_INPUT_SETS)
  p.add_argument("--sweep-passes", type=lambda x: tuple(x.split(",")), default=SWEEP_PASSES,
                 help="block sweep: which kernels, comma-separated from fwd,dkv,dq")
  p.add_argument("--sweep-budget-s", type=float, default=SWEEP_BUDGET_S,
                 help="block sweep: candidates past this many seconds are skipped")
  p.add_argument("--time-limit-s", type=float, default=TIME_LIMIT_S,
                 help="grid: calls not started by then are skipped (the JSON is still written)")
  args = p.parse_args(argv)
  if args.cpu_smoke:
    args.rounds, args.round_ms, args.input_sets = 2, 1.0, 2  # machinery, not numbers
    args.sweep_budget_s = min(args.sweep_budget_s, 60)
  return args


def main(argv=None):
  args = parse_args(argv)
  if args.block_sweep:
    run_block_sweep(args)
  else:
    run_grid(args)


if __name__ == "__main__":
  main()
