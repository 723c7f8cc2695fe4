"""Checks every peer of a (case, mode), then times the checked ones together; serves the
grid, the block sweep (a kernel's tile candidates) and the masks.

Modes: "fwd" (the output), "fwd+bwd" (gradients of sum(out * dout) w.r.t. q, k, v, as in
training) and "bwd" (the pullback alone, on one fixed set of residuals; the sweep's
backward passes). Every result is compared with the reference's (the first peer of the
reference chain that runs the case) before it is timed; a wrong one is not timed.
JAX peers are compiled ahead of time, so each row records the compile seconds, the
first call (compile included) and the compiled temporaries.
"""
from __future__ import annotations

import math
import time
import uuid

import jax
import jax.numpy as jnp

from experiments import common
from experiments.bench import specs
from experiments.bench.peers import (Peer, PeerError, Unavailable, err_text, make_sets,
                                     peer_inputs, sync, to_jax, torch_module)
from experiments.bench.specs import Case


def fwd_bwd(attn):
  """Gradient of sum(out * dout) w.r.t. q, k, v: forward and backward, as in training."""
  def f(q, k, v, do):
    _, pull = jax.vjp(attn, q, k, v)
    return pull(do)
  return f


def _torch_fn(attn, mode):
  torch = torch_module()
  if mode == "fwd":
    def fwd(q, k, v, do):
      with torch.no_grad():
        return attn(q, k, v)
    return fwd
  if mode == "bwd":
    raise Unavailable("the pullback alone is timed for JAX peers only")

  def fwd_bwd_torch(q, k, v, do):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    return torch.autograd.grad(attn(q, k, v), (q, k, v), do)
  return fwd_bwd_torch


def build(peer: Peer, attn, mode: str, sets):
  """(fn, call_sets, compile_s, memory): fn(*call_sets[i]) is one call of this mode."""
  if peer.framework == "torch":
    return _torch_fn(attn, mode), sets, None, {}
  if mode == "fwd":
    f, call_sets = (lambda q, k, v, do: attn(q, k, v)), sets
  elif mode == "fwd+bwd":
    f, call_sets = fwd_bwd(attn), sets
  else:
    # The pullback is a pytree (residuals as leaves): compiling it times the backward
    # kernels alone, on one fixed set of residuals.
    q, k, v, do = sets[0]
    _, pull = jax.vjp(jax.jit(attn), q, k, v)
    f, call_sets = (lambda pull, do: pull(do)), [(pull, do)]
  t = time.perf_counter()
  compiled, mem = common.compile_with_memory(jax.jit(f), *call_sets[0])
  return compiled, call_sets, time.perf_counter() - t, mem


@jax.jit
def _rel(a, b):
  return jnp.linalg.norm((a - b).ravel()) / jnp.linalg.norm(b.ravel())


def rel_err(parts, ref_parts) -> float:
  """Largest relative Frobenius error over the output (or dq, dk, dv)."""
  return max(float(_rel(a, b)) for a, b in zip(parts, ref_parts))


def reference_mode(mode: str) -> str:
  return "fwd+bwd" if mode == "bwd" else mode


class Runner:
  def __init__(self, peers: dict[str, Peer], *, dtype="bfloat16", rounds=specs.ROUNDS,
               round_s=specs.ROUND_S, warm_s=specs.WARM_S, input_sets=specs.N_INPUT_SETS,
               time_limit_s=math.inf):
    self.peers = peers
    self.dtype = dtype
    self.rounds, self.round_s, self.warm_s = rounds, round_s, warm_s
    self.input_sets = input_sets
    self.time_limit_s = time_limit_s
    self.chain = [n for n in specs.REFERENCE_CHAIN if n in peers]
    self._fns = {}    # (peer label, case, mode) -> compiled call and what its first run said
    self._refs = {}   # (case, mode) -> (ref name, parts) or (None, reason)
    self._sets = {}   # (case, peer form) -> input sets

  def over_time(self) -> bool:
    return common.elapsed() > self.time_limit_s

  def inputs(self, peer: Peer, case: Case):
    if (case, "base") not in self._sets:
      self._sets[case, "base"] = make_sets(case, jnp.dtype(self.dtype), self.input_sets)
    form = (peer.framework, peer.dtype, peer.prescale_q)
    if (case, form) not in self._sets:
      self._sets[case, form] = peer_inputs(peer, case, self._sets[case, "base"])
    return self._sets[case, form]

  def fn(self, peer: Peer, case: Case, mode: str) -> dict:
    """The first variant of `peer` that compiles and runs on the first input set:
    {label, fn, sets, first (its result), first_call_s, compile_s, memory, notes}.
    Kept per (peer, case, mode), so the reference peer is compiled once."""
    key = (peer.label, case, mode)
    if key in self._fns:
      got = dict(self._fns[key])  # first_call_s stays the compiling call's
      got["first"] = sync(peer)(got["fn"](*got["sets"][0]))
      return got
    try:
      variants = peer.variants(case)
    except PeerError:
      raise
    except NotImplementedError as e:  # a peer that says it lacks something
      raise Unavailable(err_text(e)) from e
    except Exception as e:  # import errors, missing packages: recorded, never fatal
      raise PeerError(err_text(e)) from e
    notes, unsupported = [], True
    for label, attn in variants:
      t = time.perf_counter()
      try:
        fn, sets, compile_s, mem = build(peer, attn, mode, self.inputs(peer, case))
        first = sync(peer)(fn(*sets[0]))
      except Exception as e:
        unsupported &= isinstance(e, (NotImplementedError, Unavailable))
        notes.append(f"{label}: {err_text(e)}")
        continue
      got = dict(label=label, fn=fn, sets=sets, compile_s=compile_s, memory=mem, notes=notes,
                 first_call_s=time.perf_counter() - t)
      self._fns[key] = got
      return dict(got, first=first)
    raise (Unavailable if unsupported and notes else PeerError)(" | ".join(notes) or "no variant")

  def forget(self, case: Case):
    """Drops the compiled functions and inputs of a finished case (and the arrays they hold)."""
    self._fns = {k: v for k, v in self._fns.items() if k[1] != case}
    self._refs = {k: v for k, v in self._refs.items() if k[0] != case}
    self._sets = {k: v for k, v in self._sets.items() if k[0] != case}

  def reference(self, case: Case, mode: str):
    mode = reference_mode(mode)
    key = (case, mode)
    if key in self._refs:
      return self._refs[key]
    if self.over_time():  # every call of this case will be skipped
      return None, "time limit"
    reasons = []
    for name in self.chain:
      peer = self.peers[name]
      if peer.max_seq and case.s > peer.max_seq:
        reasons.append(f"{name}: {peer.skip_reason}")
        continue
      try:
        first = self.fn(peer, case, mode)["first"]
        self._refs[key] = (name, to_jax(peer, case, first, mode))
        return self._refs[key]
      except Exception as e:
        reasons.append(f"{name}: {err_text(e, 200)}")
    self._refs[key] = (None, "; ".join(reasons))
    return self._refs[key]

  def run_case(self, case: Case, labels, modes) -> list[dict]:
    """Every peer's row of each mode: each checked first, then the checked ones timed
    together (`common.time_alternating`), so their ratios compare the same card state."""
    rows = []
    for mode in modes:
      ref = self.reference(case, mode)
      checked = [self.check_one(self.peers[n], case, mode, ref) for n in labels]
      self.time_rows(case, [c for c in checked if c[1] is not None])
      rows += [row for row, _ in checked]
      self._refs.pop((case, mode), None)
    return rows

  def check_one(self, peer: Peer, case: Case, mode: str, ref=None) -> tuple[dict, dict | None]:
    """(row, compiled call) of one peer, the call None where the row is final: skipped,
    unavailable, failed, or wrong against `ref` (a wrong result is not timed)."""
    ref_name, ref_parts = ref if ref is not None else self.reference(case, mode)
    row = dict(impl=peer.name, peer=peer.label, case=case.name, key=case.key(), s=case.s,
               d=case.d, causal=case.causal, batch=case.batch, heads=case.heads,
               kv_heads=case.k_heads, mode=mode, dtype=peer.dtype or self.dtype,
               tflops=None, ms=None, rel_err=None, ref=ref_name, status="ok")
    if peer.implementation:
      row["implementation"] = peer.implementation
    tag = _tag(row)
    if peer.max_seq and case.s > peer.max_seq:
      row.update(status="skipped", error=peer.skip_reason)
      common.log(f"{tag} skipped: {peer.skip_reason}")
      return row, None
    if self.over_time():
      row.update(status="skipped", error=f"time limit of {self.time_limit_s:.0f} s spent")
      common.log(f"{tag} skipped: time limit")
      return row, None
    try:
      got = self.fn(peer, case, mode)
      row.update(variant=got["label"], first_call_s=round(got["first_call_s"], 3))
      if got["compile_s"] is not None:
        row["compile_s"] = round(got["compile_s"], 3)
      temp = got["memory"].get("temp_size_in_bytes")
      if temp is not None:
        row["temp_mib"] = temp / 2**20
      if got["notes"]:
        row["notes"] = got["notes"]
      if ref_name is None:
        row.update(status="unchecked", error=f"no reference: {ref_parts}")
      else:
        err = rel_err(to_jax(peer, case, got.pop("first"), mode), ref_parts)
        row["rel_err"] = err
        tol = specs.REL_TOL[mode]
        if not err <= tol:  # NaN fails too
          row.update(status="wrong", error=f"rel_err={err:.3g} > {tol} against {ref_name}: not timed")
          common.log(f"{tag} WRONG rel_err={err:.3g} against {ref_name}")
          return row, None
      got.pop("first", None)
      return row, dict(got, sync=sync(peer))
    except Unavailable as e:
      row.update(status="unavailable", error=err_text(e))
      common.log(f"{tag} unavailable: {row['error'][:160]}")
    except Exception as e:
      row.update(status="error", error=err_text(e))
      common.log(f"{tag} ERROR {row['error'][:160]}")
    return row, None

  def time_rows(self, case: Case, checked):
    """Times the compiled calls of `checked` [(row, call)] of `case` together
    (`common.time_alternating`) and fills in their rows; a call that raises while
    timed fails its own row only."""
    if not checked:
      return
    programs = {i: (got["fn"], got["sets"], got["sync"]) for i, (_, got) in enumerate(checked)}
    times = common.time_alternating(programs, rounds=self.rounds, round_s=self.round_s,
                                    warm_s=self.warm_s)
    group = uuid.uuid4().hex[:12]   # which rows' rounds were timed together
    for i, (row, _) in enumerate(checked):
      t = times[i]
      if "error" in t:
        row.update(status="error", error=f"timing: {t['error']}")
        common.log(f"{_tag(row)} ERROR timing: {row['error'][:160]}")
        continue
      sec = t["median_s"]
      row.update(ms=sec * 1e3, tflops=case.flops(row["mode"]) / sec / 1e12,
                 calls_per_round=t["calls_per_round"],
                 ms_by_round=[round(x * 1e3, 4) for x in t["s_by_round"]], timing_group=group)
      err_txt = "unchecked" if row["rel_err"] is None else f"rel_err={row['rel_err']:.1e}"
      common.log(f"{_tag(row)} {row['tflops']:7.2f} TF/s {row['ms']:9.3f} ms  {err_txt}"
                 f" (first call {row['first_call_s']:.1f}s)")


def add_timing_args(p):
  """The timing options of the benchmarks that time peers through `Runner`."""
  p.add_argument("--rounds", type=int, default=specs.ROUNDS)
  p.add_argument("--round-ms", type=float, default=specs.ROUND_S * 1e3)
  p.add_argument("--warm-ms", type=float, default=specs.WARM_S * 1e3,
                 help="sustained calls through a cell's peers before its timed rounds")
  p.add_argument("--input-sets", type=int, default=specs.N_INPUT_SETS)


def smoke_timing(args):
  """--tiny: the machinery, not numbers."""
  args.rounds, args.round_ms, args.warm_ms, args.input_sets = 2, 1.0, 0.0, 2


def timing_options(args) -> dict:
  """Runner's timing keywords from `add_timing_args`' options."""
  return dict(rounds=args.rounds, round_s=args.round_ms / 1e3, warm_s=args.warm_ms / 1e3,
              input_sets=args.input_sets)


def timing_text(args) -> str:
  """How the rows' times were taken, for the JSON's config."""
  return (f"peers of a cell timed together: {args.warm_ms:g} ms of sustained calls through "
          f"all, then the median of {args.rounds} rounds, each peer's calls back to back for "
          f">= {args.round_ms:g} ms per round in a balanced order (common.round_order), "
          f"{args.input_sets} rotated "
          f"input sets, completion awaited once per round")


def _tag(row) -> str:
  return f"{row['key']:36s} {row['mode']:8s} {row['peer']:20s}"


def memory_rows(peers: dict[str, Peer], labels, seqs, heads: int, d: int, dtype,
                time_limit_s=math.inf) -> list[dict]:
  """Compiled temp bytes of forward + backward at batch 1 (no arrays are allocated)."""
  rows = []
  for s in seqs:
    case = Case(s, d, False, 1, heads)
    spec = jax.ShapeDtypeStruct((1, s, heads, d), jnp.dtype(dtype))
    for label in labels:
      peer = peers[label]
      row = dict(impl=peer.name, peer=label, s=s, d=d, heads=heads, batch=1, dtype=dtype)
      if common.elapsed() > time_limit_s:
        row["error"] = f"skipped: time limit of {time_limit_s:.0f} s spent"
        rows.append(row)
        continue
      try:
        _, attn = peer.variants(case)[0]
        row.update(common.compiled_memory(fwd_bwd(attn), spec, spec, spec, spec))
        temp = row.get("temp_size_in_bytes")
        row["temp_mib"] = None if temp is None else temp / 2**20
        common.log(f"memory s={s:6d} {label:20s} temp {row['temp_mib']:10.1f} MiB")
      except Exception as e:
        row["error"] = err_text(e)
        common.log(f"memory s={s:6d} {label:20s} ERROR {row['error'][:160]}")
      rows.append(row)
  return rows
