"""Ring attention on real GPUs: correctness, speed against one GPU, overlap, memory, LM.

One process on a machine with P >= 2 GPUs (`jflash.parallel`, sequence sharded over
all of them):

  check    forward and gradients of ring attention (causal zigzag and non-causal, GQA)
           against single-device `jflash.attention` with the same local implementation,
           both measured against a float64 reference on the host; the ring passes when
           its error is within 2x the single device's plus a floor of two bf16
           roundings (the ring merges partial outputs through their lse, which may
           round differently but must not lose accuracy).
  speed    fwd+bwd of the same global problem (B=1, 16 heads x 128, bf16) on one GPU and
           ring-sharded over P GPUs, 32K-128K tokens: scaling efficiency
           t(1 GPU) / (P * t(P GPUs)).
  overlap  the ring's transfers alone (the same ppermute hops and bytes, no compute),
           against the time the ring loses to perfect scaling,
           t(P GPUs) - t(1 GPU) / P. A transfer that runs under the block computation
           costs nothing; an exposed one shows up as that loss.
  memory   compiled per-device bytes (arguments + temporaries) of the sharded step
           against the single-device one.
  lm       the decoder LM (12 layers, hidden 1024, 8 x 128 heads, batch 4, bf16, no
           remat) at the shortest length whose single-GPU training step does not fit in
           one GPU's memory: it trains with `context_parallel_axis` over P GPUs;
           tokens/s and loss.

  python -m experiments.ring_gpu --out-dir experiments/results     # on the GPU machine
  python -m experiments.ring_gpu --tiny                        # 2 CPU devices, tiny
"""
from __future__ import annotations

import os
import sys

if "--tiny" in sys.argv:  # must precede the first jax import
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=2")

import dataclasses  # noqa: E402
import functools  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import jflash  # noqa: E402
from experiments import common  # noqa: E402
from jflash import parallel  # noqa: E402
from jflash.nn import DecoderLM, LMConfig  # noqa: E402

AXIS = "sp"
BF16_EPS = 2.0 ** -8


def parse_args(argv=None):
  p = common.parser(__doc__)
  common.add_tiny(p, "tiny sizes on 2 CPU devices")
  p.add_argument("--implementation", default=None,
                 help="local block implementation (default: GPU pallas, CPU xla_chunked)")
  p.add_argument("--check-seq", type=int, default=4096)
  p.add_argument("--seqs", default="32768,65536,131072", help="speed: global lengths")
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--lm-seqs", default="32768,65536",
                 help="LM: candidate lengths, the first that one GPU cannot hold is trained")
  p.add_argument("--lm-steps", type=int, default=3)
  p.add_argument("--time-limit-s", type=float, default=330.0,
                 help="stop starting new parts after this (JSON is always written)")
  p.add_argument("--parts", default="check,speed,lm", help="which parts to run")
  p.add_argument("--out-dir", default=None)
  p.add_argument("--name", default=None)
  args = p.parse_args(argv)
  if args.tiny:
    args.check_seq, args.seqs, args.heads, args.head_dim = 64, "64", 2, 16
    args.lm_seqs, args.lm_steps = "64", 1
  if args.implementation is None:
    args.implementation = "xla_chunked" if jax.default_backend() == "cpu" else "pallas"
  return args


def rel_err(x, ref):
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-300))


def fwd_bwd(attn):
  """(q, k, v, do) -> (out, dq, dk, dv): one forward and its VJP."""
  def f(q, k, v, do):
    out, vjp = jax.vjp(attn, q, k, v)
    return (out, *vjp(do))
  return f


def inputs(rng, B, T, N, K, H, dtype):
  mk = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32), dtype)
  return mk(B, T, N, H), mk(B, T, K, H), mk(B, T, K, H), mk(B, T, N, H)


def ring_fn(mesh, impl, causal):
  return parallel.sharded_ring_attention(mesh, AXIS, is_causal=causal, layout="zigzag",
                                         implementation=impl)


def check(args, mesh, P):
  """Ring vs single device, each against float64 on the host."""
  B, T, N, K, H = 1, args.check_seq, 8, 2, args.head_dim
  if args.tiny:
    N, K = 2, 1
  rng = np.random.default_rng(0)
  dtype = jnp.float32 if args.tiny else jnp.bfloat16
  q, k, v, do = inputs(rng, B, T, N, K, H, dtype)
  rows = []
  for causal in (True, False):
    single = jax.jit(fwd_bwd(functools.partial(jflash.attention, is_causal=causal,
                                               implementation=args.implementation)))
    got_1 = single(q, k, v, do)
    # The ring sees the sequence in zigzag order; its results are put back in order.
    zz = lambda x: parallel.zigzag_permute(x, P)
    unz = lambda x: parallel.zigzag_unpermute(x, P)
    ring = jax.jit(fwd_bwd(ring_fn(mesh, args.implementation, causal)))
    got_p = [unz(x) for x in ring(zz(q), zz(k), zz(v), zz(do))]
    out, _, dq, dk, dv = jflash.attention_numpy(
        *(np.asarray(x, np.float64) for x in (q, k, v)), is_causal=causal,
        dout=np.asarray(do, np.float64))
    ref = (out, dq, dk, dv)
    for name, a, b, r in zip(("out", "dq", "dk", "dv"), got_p, got_1, ref):
      e_ring, e_one = rel_err(a, r), rel_err(b, r)
      floor = 2 * BF16_EPS if dtype == jnp.bfloat16 else 1e-6
      rows.append(dict(causal=causal, tensor=name, ring_err=e_ring, single_err=e_one,
                       ring_vs_single=rel_err(a, b), bound=2 * e_one + floor,
                       ok=bool(e_ring <= 2 * e_one + floor)))
  return dict(shape=dict(B=B, T=T, N=N, K=K, H=H, dtype=str(jnp.dtype(dtype))), rows=rows)


def comm_only(mesh, P, B, T, K, H, dtype):
  """The ring's transfers with no compute: forward P-1 hops of (K, V); backward P-1
  hops of (K, V) and P hops of the float32 dK/dV accumulators (jflash.parallel)."""
  perm = [(i, (i + 1) % P) for i in range(P)]

  def local(k, v):
    kv = (k, v)
    for _ in range(2 * (P - 1)):
      kv = jax.lax.ppermute(kv, AXIS, perm)
    acc = (k.astype(jnp.float32), v.astype(jnp.float32))
    for _ in range(P):
      acc = jax.lax.ppermute(acc, AXIS, perm)
    return kv[0] + acc[0].astype(dtype), kv[1] + acc[1].astype(dtype)

  spec = PartitionSpec(None, AXIS)
  return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec, spec),
                                    out_specs=(spec, spec), check_vma=False))


def per_device_bytes(mem: dict) -> int:
  return int(mem.get("total_bytes", 0))


def speed(args, mesh, P, deadline):
  rows = []
  B, N, H = 1, args.heads, args.head_dim
  dtype = jnp.float32 if args.tiny else jnp.bfloat16
  shard = NamedSharding(mesh, PartitionSpec(None, AXIS))
  for T in [int(s) for s in args.seqs.split(",")]:
    for causal in (True, False):
      if time.monotonic() > deadline:
        rows.append(dict(seq=T, causal=causal, status="skipped: time limit"))
        continue
      row = dict(seq=T, causal=causal, heads=N, head_dim=H, batch=B)
      try:
        rng = np.random.default_rng(T)
        q, k, v, do = inputs(rng, B, T, N, N, H, dtype)
        single = fwd_bwd(functools.partial(jflash.attention, is_causal=causal,
                                           implementation=args.implementation))
        ring = fwd_bwd(ring_fn(mesh, args.implementation, causal))
        row["single"] = common.time_fn(jax.jit(single), q, k, v, do, warmup=1, iters=5)
        row["single_mem"] = common.compiled_memory(single, q, k, v, do)
        qs, ks, vs, dos = (jax.device_put(x, shard) for x in (q, k, v, do))
        row["ring"] = common.time_fn(jax.jit(ring), qs, ks, vs, dos, warmup=1, iters=5)
        row["ring_mem_per_device"] = common.compiled_memory(ring, qs, ks, vs, dos)
        comm = comm_only(mesh, P, B, T, N, H, dtype)
        row["comm_only"] = common.time_fn(comm, ks, vs, warmup=1, iters=10)
        t1, tp = row["single"]["median_s"], row["ring"]["median_s"]
        flops = common.attention_flops(B, N, H, common.dense_pairs(T, T, causal), "fwd+bwd")
        row.update(
            status="ok", tflops_single=flops / t1 / 1e12, tflops_ring_total=flops / tp / 1e12,
            scaling_efficiency=t1 / (P * tp),
            loss_to_perfect_s=tp - t1 / P, comm_s=row["comm_only"]["median_s"],
            transfer_hidden=bool(tp - t1 / P < 0.5 * row["comm_only"]["median_s"]),
            memory_ratio=per_device_bytes(row["ring_mem_per_device"]) /
            max(per_device_bytes(row["single_mem"]), 1))
      except Exception as e:  # recorded; the other cells still run
        row.update(status="error", error=f"{type(e).__name__}: {str(e)[:400]}")
        traceback.print_exc()
      print(f"speed T={T} causal={causal}: "
            + (f"1 GPU {row['single']['median_s'] * 1e3:.1f} ms, {P} GPUs "
               f"{row['ring']['median_s'] * 1e3:.1f} ms, eff {row['scaling_efficiency']:.3f}, "
               f"comm alone {row['comm_s'] * 1e3:.1f} ms, mem x{row['memory_ratio']:.2f}"
               if row.get("status") == "ok" else row.get("error", row.get("status"))),
            flush=True)
      rows.append(row)
  return rows


def lm(args, mesh, P, deadline):
  """The decoder LM at the first candidate length one device cannot hold."""
  dtype = "float32" if args.tiny else "bfloat16"
  size = (dict(num_layers=1, hidden=32, num_heads=2, head_dim=16, vocab_size=64)
          if args.tiny else
          dict(num_layers=12, hidden=1024, num_heads=8, head_dim=128, vocab_size=32768))
  batch = 1 if args.tiny else 4
  capacity = None
  stats = jax.devices()[0].memory_stats() or {}
  capacity = stats.get("bytes_limit")
  tx = optax.adamw(1e-4)
  rows = []
  for T in [int(s) for s in args.lm_seqs.split(",")]:
    if time.monotonic() > deadline:
      rows.append(dict(seq=T, status="skipped: time limit"))
      break
    cfg_1 = LMConfig(seq_len=T, attention_implementation=args.implementation, dtype=dtype,
                     remat=False, **size)
    cfg_p = dataclasses.replace(cfg_1, context_parallel_axis=AXIS)
    graphdef_1, params = nnx.split(DecoderLM(cfg_1, rngs=nnx.Rngs(0)), nnx.Param)
    graphdef_p, _ = nnx.split(DecoderLM(cfg_p, rngs=nnx.Rngs(0)), nnx.Param)
    rng = np.random.default_rng(T)
    stream = rng.integers(0, size["vocab_size"], size=(batch, T + 1)).astype(np.int32)
    tokens, targets = jnp.asarray(stream[:, :-1]), jnp.asarray(stream[:, 1:])

    def loss(params, graphdef, tokens, targets):
      logits = nnx.merge(graphdef, params)(tokens)
      return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
          logits.astype(jnp.float32), targets))

    def step_1(params, opt_state, tokens, targets):
      l, g = jax.value_and_grad(loss)(params, graphdef_1, tokens, targets)
      upd, opt_state = tx.update(g, opt_state, params)
      return optax.apply_updates(params, upd), opt_state, l

    opt_state = tx.init(params)
    mem_1 = common.compiled_memory(step_1, params, opt_state, tokens, targets)
    need_1 = per_device_bytes(mem_1)
    row = dict(seq=T, batch=batch, single_device_bytes=need_1, capacity_bytes=capacity, **size)
    fits = capacity is None or need_1 < capacity
    if fits and T != int(args.lm_seqs.split(",")[-1]) and not args.tiny:
      rows.append(dict(row, status="fits on one device: next length"))
      print(f"lm T={T}: one device needs {need_1 / 2**30:.1f} GiB, fits", flush=True)
      continue

    def local(params, opt_state, tokens, targets):
      l, g = jax.value_and_grad(loss)(params, graphdef_p, tokens, targets)
      # Parameters are replicated: the mean loss and its gradient average the shards.
      l, g = jax.lax.pmean((l, g), AXIS)
      upd, opt_state = tx.update(g, opt_state, params)
      return optax.apply_updates(params, upd), opt_state, l

    seq = PartitionSpec(None, AXIS)
    rep = PartitionSpec()
    step_p = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(rep, rep, seq, seq),
                                        out_specs=(rep, rep, rep), check_vma=False))
    tok_p = parallel.zigzag_permute(tokens, P)
    tgt_p = parallel.zigzag_permute(targets, P)
    try:
      row["sharded_per_device_bytes"] = per_device_bytes(
          common.compiled_memory(step_p, params, opt_state, tok_p, tgt_p))
      t0 = time.perf_counter()
      params, opt_state, l0 = step_p(params, opt_state, tok_p, tgt_p)
      l0 = float(l0)
      row["compile_and_first_step_s"] = time.perf_counter() - t0
      losses, times = [l0], []
      for _ in range(args.lm_steps):
        t0 = time.perf_counter()
        params, opt_state, l = step_p(params, opt_state, tok_p, tgt_p)
        losses.append(float(l))
        times.append(time.perf_counter() - t0)
      med = float(np.median(times))
      row.update(status="ok", single_device_fits=bool(fits), devices=P, losses=losses,
                 step_s=med, tokens_per_s=batch * T / med)
      print(f"lm T={T} over {P} devices: {batch * T / med:.0f} tokens/s, losses {losses}, "
            f"one device would need {need_1 / 2**30:.1f} GiB", flush=True)
    except Exception as e:  # recorded
      row.update(status="error", error=f"{type(e).__name__}: {str(e)[:400]}")
      traceback.print_exc()
    rows.append(row)
    break
  return rows


def main(argv=None):
  args = parse_args(argv)
  start = time.monotonic()
  deadline = start + args.time_limit_s
  P = jax.device_count()
  if P < 2:
    raise SystemExit(f"ring attention needs >= 2 devices, found {P}")
  mesh = parallel.make_mesh(P, AXIS)
  result = {"devices": [str(d) for d in jax.devices()], "ring_size": P}
  for part, fn in (("check", lambda: check(args, mesh, P)),
                   ("speed", lambda: speed(args, mesh, P, deadline)),
                   ("lm", lambda: lm(args, mesh, P, deadline))):
    if part not in args.parts.split(","):
      continue
    try:
      result[part] = fn()
    except Exception as e:  # one part failing must not lose the others
      traceback.print_exc()
      result[part] = {"error": f"{type(e).__name__}: {str(e)[:600]}"}
    print(f"[{time.monotonic() - start:.0f} s] {part} done", flush=True)
  name = args.name or f"ring_{common.device_tag()}_x{P}"
  path = common.write_result(name, vars(args), [], extra=result,
                             out_dir=args.out_dir or (common.RESULTS / "local"))
  print(f"wrote {path}")
  for r in result.get("check", {}).get("rows", []) if isinstance(result.get("check"), dict) else []:
    print(f"check causal={r['causal']!s:5} {r['tensor']:3}: ring {r['ring_err']:.2e} single "
          f"{r['single_err']:.2e} bound {r['bound']:.2e} {'ok' if r['ok'] else 'FAIL'}")
  for r in result.get("speed", []) if isinstance(result.get("speed"), list) else []:
    if r.get("status") == "ok":
      print(f"T={r['seq']:6} causal={r['causal']!s:5} eff {r['scaling_efficiency']:.3f} "
            f"loss-to-perfect {r['loss_to_perfect_s'] * 1e3:7.1f} ms comm-alone "
            f"{r['comm_s'] * 1e3:6.1f} ms mem/device x{r['memory_ratio']:.2f}")


if __name__ == "__main__":
  main()
