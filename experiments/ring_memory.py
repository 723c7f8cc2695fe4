"""Context parallelism on 8 CPU devices: per-device memory and bytes moved by ring attention.

The `jflash.nn.DecoderLM` runs one forward + backward step (loss and parameter
gradients) twice per sequence length: unsharded on one device, and with its sequence
sharded over 8 devices (`LMConfig(context_parallel_axis="sp")`, tokens in zigzag
order, attention = `jflash.parallel.ring_attention`). Reported per length:

  * compiled memory of each step (`experiments.common.compiled_memory`; for the
    sharded step the numbers are per device, as XLA partitions the program per device);
  * bytes each device sends per step through `ppermute` (the ring), counted from the
    step's jaxpr (scan bodies times their length), against the analytic count per
    attention layer, with kv = B * (T/P) * K * H * itemsize one key (or value) block:
        forward  (P-1) hops of (K, V)                        2 (P-1) kv
        backward (P-1) hops of (K, V) again, and P hops of the float32 dK/dV
                 accumulators (the last one takes them home)  2 (P-1) kv + 2 P kv32
    plus the all-reduce of the replicated parameters' gradients, reported apart;
  * for lengths up to --check-max: both steps run once, and the sharded loss and
    gradients are compared with the unsharded ones (they must agree to float32
    rounding).

With `--op`, the attention op alone instead: forward + backward (`jax.vjp`) of
`jflash.attention` on one device against `jflash.parallel.sharded_ring_attention` with
the sequence over P = 2 and 4 devices (zigzag layout), causal and not, per length: the
compiled bytes per device (arguments + outputs + temporaries) and their ratio to one
device's. Ideal is 1/P; the ring's own buffers (two key/value blocks in flight, the
float32 running output and the dQ/dK/dV accumulators, the dK/dV ones in flight) add to
it.

CPU "devices" here share one host's memory and cores, so times say nothing about
real interconnects; memory and bytes are what this script is for.

  python -m experiments.ring_memory --out-dir experiments/results        # ring_memory_cpu.json
  python -m experiments.ring_memory --op --out-dir experiments/results   # ring_memory_op_cpu.json
"""
from __future__ import annotations

import os

# Must precede the first jax import: the backend reads the device count once.
NUM_DEVICES = 8
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={NUM_DEVICES}")

import dataclasses  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec  # noqa: E402

from experiments import common  # noqa: E402
from experiments.common import block, compiled_memory, write_result  # noqa: E402
from jflash import parallel  # noqa: E402
from jflash.nn import DecoderLM, LMConfig  # noqa: E402

AXIS = "sp"


def parse_args(argv=None):
  p = common.parser(__doc__)
  p.add_argument("--devices", type=int, default=NUM_DEVICES, help="ring size P")
  p.add_argument("--seq-lens", default="2048,8192,32768",
                 help="global sequence lengths; multiples of 2P (zigzag chunks)")
  p.add_argument("--check-max", type=int, default=8192,
                 help="run both steps and compare them up to this length (2 CPU cores: "
                      "the unsharded step at 8192 takes a few seconds)")
  p.add_argument("--batch", type=int, default=1)
  # Attention-heavy: a narrow model, so activations (linear in T) and the attention
  # inputs dominate the parameters at these lengths.
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--hidden", type=int, default=64)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--kv-heads", type=int, default=2, help="GQA: 2 query heads per kv head")
  p.add_argument("--implementation", default="xla_chunked",
                 help="local block implementation (CPU: xla_chunked)")
  p.add_argument("--scan-layers", action="store_true",
                 help="nnx.scan over the blocks. Memory stays linear in T either way "
                      "(xla_chunked's key-block step is a remat boundary, so no per-step "
                      "[T, block_k] tile is kept); off by default because unrolled blocks "
                      "compile to less temporary memory here (measured unsharded at "
                      "T=8192: 213 MiB unrolled, 292 MiB scanned)")
  p.add_argument("--op", action="store_true",
                 help="the attention op alone (fwd + bwd) at --op-devices, not the LM step")
  p.add_argument("--op-devices", default="2,4", help="ring sizes P for --op")
  p.add_argument("--op-seq-lens", default="4096,8192", help="global lengths for --op")
  p.add_argument("--dtype", default="bfloat16", help="--op inputs' dtype")
  p.add_argument("--op-head-dim", type=int, default=64, help="--op head_dim")
  p.add_argument("--out", default=None,
                 help="<out-dir>/<out>.json; default ring_memory_cpu, with --op "
                      "ring_memory_op_cpu")
  p.add_argument("--out-dir", default=str(common.DEFAULT_OUT),
                 help="default experiments/results/local; experiments/results: the committed one")
  common.add_tiny(p, "T = 64 on a one-layer model, checked (--op: T = 64 at P = 2)")
  args = p.parse_args(argv)
  if args.tiny:
    args.seq_lens, args.check_max, args.layers, args.hidden = "64", 64, 1, 32
    args.op_devices, args.op_seq_lens = "2", "64"
    args.out = args.out or ("ring_memory_op_cpu_tiny" if args.op else "ring_memory_cpu_tiny")
  return args


def lm_config(args, seq_len, axis):
  return LMConfig(vocab_size=256, num_layers=args.layers, hidden=args.hidden,
                  num_heads=args.heads, num_kv_heads=args.kv_heads, seq_len=seq_len,
                  attention_implementation=args.implementation,
                  scan_layers=args.scan_layers, context_parallel_axis=axis)


def nll_sum(params, graphdef, tokens, targets):
  logits = nnx.merge(graphdef, params)(tokens)
  return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, targets))


def unsharded_step(graphdef):
  def step(params, tokens, targets):
    total, grads = jax.value_and_grad(nll_sum)(params, graphdef, tokens, targets)
    n = tokens.size
    return total / n, jax.tree_util.tree_map(lambda g: g / n, grads)
  return step


def sharded_step(graphdef, mesh):
  """The same step with the sequence sharded: tokens/targets in zigzag order."""
  def local(params, tokens, targets):
    total, grads = jax.value_and_grad(nll_sum)(params, graphdef, tokens, targets)
    # Parameters are replicated, so their gradient is the sum of every shard's part.
    n = tokens.size * jax.lax.axis_size(AXIS)
    total, grads = jax.lax.psum((total, grads), AXIS)
    return total / n, jax.tree_util.tree_map(lambda g: g / n, grads)

  seq = PartitionSpec(None, AXIS)
  # check_vma=False: the psum above sums the replicated parameters' gradient over the
  # ring by hand. With the varying-axes checker on, JAX already sums it when it
  # transposes the parameters' implicit broadcast to the varying axis, and the psum
  # would count every shard P times (measured: gradients 8x the unsharded ones at P=8).
  return jax.shard_map(local, mesh=mesh, in_specs=(PartitionSpec(), seq, seq),
                       out_specs=(PartitionSpec(), PartitionSpec()), check_vma=False)


def _subjaxprs(eqn):
  # Duck-typed (a Jaxpr has .eqns, a ClosedJaxpr a .jaxpr): the classes' import path
  # moved between jax versions.
  for v in eqn.params.values():
    for x in (v if isinstance(v, (list, tuple)) else (v,)):
      if hasattr(x, "eqns"):
        yield x
      elif hasattr(getattr(x, "jaxpr", None), "eqns"):
        yield x.jaxpr


def collective_bytes(jaxpr, mult=1, acc=None):
  """Bytes one device sends per collective primitive, scan bodies times their length.

  Every device runs the same program, so one device's operand bytes of each ppermute
  are what it sends per hop.
  """
  acc = {} if acc is None else acc
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name in ("ppermute", "psum", "psum_invariant", "all_gather", "all_to_all",
                "reduce_scatter", "psum_scatter"):
      nbytes = sum(v.aval.size * v.aval.dtype.itemsize for v in eqn.invars)
      row = acc.setdefault(name, {"bytes": 0, "ops": 0})
      row["bytes"] += mult * nbytes
      row["ops"] += mult
    if name == "while":
      raise NotImplementedError("a while loop's trip count is unknown to this count")
    inner = mult * eqn.params["length"] if name == "scan" else mult
    if name == "cond":  # branches are alternatives: counted once, not summed
      jaxprs = list(_subjaxprs(eqn))
      branch = [collective_bytes(j, 1, {}) for j in jaxprs]
      if any(branch):
        raise NotImplementedError("collectives inside cond branches are not counted")
      continue
    for sub in _subjaxprs(eqn):
      collective_bytes(sub, inner, acc)
  return acc


def analytic_ring_bytes(cfg: LMConfig, batch, seq_len, P, itemsize=4):
  kv = batch * (seq_len // P) * cfg.kv_heads * cfg.dim_per_head * itemsize
  kv32 = batch * (seq_len // P) * cfg.kv_heads * cfg.dim_per_head * 4
  fwd = 2 * (P - 1) * kv
  bwd = 2 * (P - 1) * kv + 2 * P * kv32
  return {"kv_block_bytes": kv, "forward_per_layer": fwd, "backward_per_layer": bwd,
          "per_step": cfg.num_layers * (fwd + bwd),
          "hops_per_layer": {"kv_forward": P - 1, "kv_backward": P - 1, "dkv_backward": P}}


def max_rel_diff(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def run_length(args, mesh, seq_len):
  P = args.devices
  if seq_len % (2 * P):
    raise ValueError(f"seq_len={seq_len} must be a multiple of 2P={2 * P}")
  rng = np.random.default_rng(seq_len)
  stream = rng.integers(0, 256, size=(args.batch, seq_len + 1)).astype(np.int32)
  tokens, targets = stream[:, :-1], stream[:, 1:]

  cfg_1 = lm_config(args, seq_len, None)
  cfg_p = dataclasses.replace(cfg_1, context_parallel_axis=AXIS)
  # Same seed, same weights: the CP flag changes no parameter.
  graphdef_1, params = nnx.split(DecoderLM(cfg_1, rngs=nnx.Rngs(0)), nnx.Param)
  graphdef_p, params_p = nnx.split(DecoderLM(cfg_p, rngs=nnx.Rngs(0)), nnx.Param)
  same = jax.tree_util.tree_all(jax.tree_util.tree_map(
      lambda a, b: bool(jnp.array_equal(a, b)), params, params_p))
  if not same:
    raise RuntimeError("the sharded and unsharded models did not get the same weights")

  step_1 = unsharded_step(graphdef_1)
  step_p = sharded_step(graphdef_p, mesh)
  # zigzag order: device i holds chunks i and 2P-1-i; the mean loss ignores token order.
  tok_p = parallel.zigzag_permute(jnp.asarray(tokens), P)
  tgt_p = parallel.zigzag_permute(jnp.asarray(targets), P)

  row = {"seq_len": seq_len, "local_seq_len": seq_len // P}
  t0 = time.perf_counter()
  row["memory_unsharded"] = compiled_memory(step_1, params, tokens, targets)
  row["memory_sharded_per_device"] = compiled_memory(step_p, params, tok_p, tgt_p)
  row["compile_s"] = round(time.perf_counter() - t0, 2)
  for key in ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes"):
    u = row["memory_unsharded"].get(key)
    s = row["memory_sharded_per_device"].get(key)
    if u and s:
      row.setdefault("unsharded_over_sharded", {})[key] = round(u / s, 3)

  counted = collective_bytes(jax.make_jaxpr(step_p)(params, tok_p, tgt_p).jaxpr)
  analytic = analytic_ring_bytes(cfg_p, args.batch, seq_len, P)
  row["bytes_sent_per_device"] = counted
  row["ring_bytes_analytic"] = analytic
  row["ring_bytes_match"] = counted.get("ppermute", {}).get("bytes") == analytic["per_step"]

  if seq_len <= args.check_max:
    t0 = time.perf_counter()
    loss_1, g_1 = block(jax.jit(step_1)(params, tokens, targets))
    t1 = time.perf_counter()
    loss_p, g_p = block(jax.jit(step_p)(params, tok_p, tgt_p))
    t2 = time.perf_counter()
    diffs = jax.tree_util.tree_leaves(jax.tree_util.tree_map(max_rel_diff, g_p, g_1))
    row["check"] = {"loss_unsharded": float(loss_1), "loss_sharded": float(loss_p),
                    "loss_rel_diff": abs(float(loss_p) - float(loss_1)) / abs(float(loss_1)),
                    "grad_max_rel_diff": max(diffs),
                    "first_call_s": {"unsharded": round(t1 - t0, 2),
                                     "sharded": round(t2 - t1, 2)}}
  return row


def op_rows(args):
  """Per-device compiled memory of the attention op, one device against the ring."""
  import functools
  import jflash

  def fwd_bwd(attn):
    def f(q, k, v, do):
      out, vjp = jax.vjp(attn, q, k, v)
      return (out, *vjp(do))
    return f

  B, N, K, H = args.batch, args.heads, args.kv_heads, args.op_head_dim
  dtype = jnp.dtype(args.dtype)
  rows = []
  for T in (int(x) for x in args.op_seq_lens.split(",")):
    rng = np.random.default_rng(T)
    mk = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32), dtype)
    q, k, v, do = mk(B, T, N, H), mk(B, T, K, H), mk(B, T, K, H), mk(B, T, N, H)
    for causal in (True, False):
      one = compiled_memory(fwd_bwd(functools.partial(
          jflash.attention, is_causal=causal, implementation=args.implementation)),
          q, k, v, do)
      row = {"seq_len": T, "causal": causal, "memory_one_device": one, "ring": {}}
      for P in (int(x) for x in args.op_devices.split(",")):
        mesh = parallel.make_mesh(P, AXIS)
        ring = fwd_bwd(parallel.sharded_ring_attention(
            mesh, AXIS, is_causal=causal, layout="zigzag",
            implementation=args.implementation))
        shard = jax.sharding.NamedSharding(mesh, PartitionSpec(None, AXIS))
        per = compiled_memory(ring, *(jax.device_put(x, shard) for x in (q, k, v, do)))
        row["ring"][str(P)] = {"memory_per_device": per, "ratio_total_bytes": round(
            per["total_bytes"] / one["total_bytes"], 3)}
        print(f"T={T:6d} causal={causal!s:5}  one device {one['total_bytes'] / 2**20:8.2f} MiB"
              f"  P={P}: {per['total_bytes'] / 2**20:8.2f} MiB per device"
              f" ({row['ring'][str(P)]['ratio_total_bytes']:.3f}x)", flush=True)
      rows.append(row)
  return rows


def main(argv=None):
  args = parse_args(argv)
  if args.op:
    rows = op_rows(args)
    cfg = vars(args) | {"shape": {"B": args.batch, "N": args.heads, "K": args.kv_heads,
                                  "H": args.op_head_dim}}
    notes = {"devices": "fake CPU devices of one host (XLA_FLAGS "
                        "--xla_force_host_platform_device_count): XLA's per-device "
                        "compiled allocation",
             "total_bytes": "arguments + outputs + temporaries - aliases "
                            "(experiments.common.compile_with_memory)"}
    path = write_result(args.out or "ring_memory_op_cpu", cfg, rows,
                        extra={"notes": notes}, out_dir=args.out_dir)
    print(f"wrote {path}")
    return
  if jax.device_count() < args.devices:
    raise SystemExit(f"need {args.devices} devices, have {jax.device_count()}: set "
                     f"XLA_FLAGS=--xla_force_host_platform_device_count={args.devices} "
                     "before jax starts")
  mesh = parallel.make_mesh(args.devices, AXIS)
  rows = []
  for T in (int(x) for x in args.seq_lens.split(",")):
    row = run_length(args, mesh, T)
    rows.append(row)
    mu, ms = row["memory_unsharded"], row["memory_sharded_per_device"]
    print(f"T={T:6d}  temp unsharded {mu.get('temp_size_in_bytes', 0) / 2**20:8.2f} MiB"
          f"  sharded/device {ms.get('temp_size_in_bytes', 0) / 2**20:8.2f} MiB"
          f"  ring bytes/device {row['bytes_sent_per_device'].get('ppermute', {}).get('bytes')}"
          f" (analytic {row['ring_bytes_analytic']['per_step']})"
          + (f"  grad rel diff {row['check']['grad_max_rel_diff']:.2e}" if "check" in row else ""),
          flush=True)
  cfg = vars(args) | {"model": dataclasses.asdict(lm_config(args, rows[0]["seq_len"], AXIS))}
  notes = {
      "devices": "fake CPU devices of one host (XLA_FLAGS "
                 "--xla_force_host_platform_device_count): memory is XLA's per-device "
                 "compiled allocation, times are not interconnect measurements",
      "bytes_sent_per_device": "operand bytes of each collective in the step's jaxpr, "
                               "scan bodies times their length; ppermute = the ring, "
                               "psum = the replicated parameters' gradient all-reduce",
  }
  path = write_result(args.out or "ring_memory_cpu", cfg, rows, extra={"notes": notes},
                      out_dir=args.out_dir)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
