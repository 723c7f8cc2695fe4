"""Memory and speed against sequence length: standard attention vs jflash vs cuDNN.

Two parts, each doubling the sequence length:
  attention  the op alone, forward and forward+backward: compiled memory (what XLA
             must hold resident) and measured time. The standard path is doubled until
             it runs out of memory; jflash continues to --seq-max.
  lm         one training step of the decoder LM (AdamW, donated state): compiled memory
             and tokens/s. The "h200" preset reproduces, in kind, the FlashAttention
             paper's GPT-2 table: 12 layers, hidden 1024, 8 heads x 128, batch 4, seq
             1K-8K, and flash training (with per-block remat) at 16K-32K.

An out-of-memory is a result, not a crash: a compile or run that fails with
RESOURCE_EXHAUSTED, or a compiled program larger than the memory budget (the device's
bytes_limit; host RAM on a CPU), is recorded as "oom" and that implementation stops
doubling. Writes <out-dir>/seq_scaling_<backend>.json and .png (see common.DEFAULT_OUT).

  python -m experiments.seq_scaling                  # CPU default (make demo)
  python -m experiments.seq_scaling --preset h200    # GPU table, ~4 minutes on an H200
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jflash
from experiments import common
from experiments.common import attention_flops, compile_with_memory, dense_pairs
from experiments.lm_common import init_model, make_optimizer, make_train_step
from experiments.scaling_common import (IMPLEMENTATIONS, attention_callable, failure,
                                        human_bytes, labels_for_backend, load_average,
                                        memory_budget_bytes, random_arrays, shape_struct)
from experiments.seq_scaling_report import plot, print_summary, summarize
from jflash.nn import LMConfig, lm_flops_per_token

# Per-backend sizes. Each is a complete config; flags override single fields.
PRESETS = {
    # 2 CPU cores: timings stop at 2K (a 2K fwd+bwd takes seconds there); memory is
    # compiled only (no arrays allocated), so it keeps doubling until standard exceeds
    # host RAM.
    "cpu": dict(batch=1, heads=4, kv_heads=4, head_dim=64, dtype="float32",
                seq_start=256, seq_max=65536, time_max_seq=2048, iters=3, warmup=1,
                lm_layers=2, lm_hidden=128, lm_heads=4, lm_head_dim=32, lm_vocab=256,
                lm_batch=2, lm_seqs="256,512,1024", lm_long_seqs="", lm_iters=3,
                lm_dtype="float32", lm_impls="standard,jflash", lm_cudnn_seqs="",
                lm_long_impls="jflash", lm_long_standard_seqs=""),
    # The A100 table's model on an H200 (bf16 compute, f32 master weights).
    "h200": dict(batch=4, heads=8, kv_heads=8, head_dim=128, dtype="bfloat16",
                 seq_start=1024, seq_max=32768, time_max_seq=32768, iters=5, warmup=1,
                 lm_layers=12, lm_hidden=1024, lm_heads=8, lm_head_dim=128, lm_vocab=32768,
                 lm_batch=4, lm_seqs="1024,2048,4096,8192", lm_long_seqs="16384,32768",
                 lm_iters=3, lm_dtype="bfloat16", lm_impls="standard,jflash",
                 lm_cudnn_seqs="4096", lm_long_impls="jflash", lm_long_standard_seqs="32768"),
    # A 16 GB MI50 (gfx906): standard attention against the HIP kernels up to 16K
    # tokens, float16 (gfx906 has no bf16 arithmetic), 10 warm-up runs and 50 measured
    # (median and p95). Run with --impls standard,hip --time-budget-s 600.
    "mi50": dict(batch=1, heads=8, kv_heads=8, head_dim=128, dtype="float16",
                 seq_start=1024, seq_max=16384, time_max_seq=16384, iters=50, warmup=10,
                 lm_layers=12, lm_hidden=1024, lm_heads=8, lm_head_dim=128, lm_vocab=32768,
                 lm_batch=1, lm_seqs="1024,2048,4096", lm_long_seqs="8192,16384", lm_iters=50,
                 lm_dtype="float16", lm_impls="standard,hip", lm_cudnn_seqs="",
                 lm_long_impls="hip", lm_long_standard_seqs="8192"),
    # Test-suite size: seconds.
    "tiny": dict(batch=1, heads=2, kv_heads=1, head_dim=16, dtype="float32",
                 seq_start=64, seq_max=128, time_max_seq=64, iters=1, warmup=1,
                 lm_layers=1, lm_hidden=32, lm_heads=2, lm_head_dim=16, lm_vocab=64,
                 lm_batch=1, lm_seqs="64", lm_long_seqs="128", lm_iters=1,
                 lm_dtype="float32", lm_impls="standard,jflash", lm_cudnn_seqs="",
                 lm_long_impls="jflash", lm_long_standard_seqs=""),
}


def parse_args(argv=None):
  p = common.preset_parser(
      __doc__, PRESETS, "size set; auto = cpu on a CPU, h200 on a GPU (sized for >=80 GB; "
                        "smaller GPUs record more OOMs, which is still a valid result)")
  p.add_argument("--parts", default="attention,lm", help="which parts to run")
  p.add_argument("--impls", default=None,
                 help=f"labels from {list(IMPLEMENTATIONS)}; default all available here "
                      "(cudnn only on GPU)")
  p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True,
                 help="causal attention, as in a decoder LM")
  p.add_argument("--memory-budget-gb", type=float, default=None,
                 help="treat compiled programs larger than this as OOM; default: the "
                      "device's bytes_limit, or host RAM on a CPU")
  p.add_argument("--time-budget-s", type=float, default=2.0,
                 help="rough seconds of timed calls per configuration: slow ones get "
                      "fewer repetitions (at least one after warm-up)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out-dir", type=Path, default=common.DEFAULT_OUT,
                 help="where the JSON and PNG go (tests pass a tmp dir)")
  common.add_preset_options(p, [
      ("batch", int, "attention batch"), ("heads", int, "query heads"),
      ("kv_heads", int, "key/value heads (GQA when fewer)"), ("head_dim", int, "head dim"),
      ("dtype", str, "attention input dtype (bf16 on GPU: what training uses)"),
      ("seq_start", int, "first sequence length"),
      ("seq_max", int, "stop doubling here even if standard still fits"),
      ("time_max_seq", int, "time only up to here (above: memory only, nothing allocated)"),
      ("iters", int, "timed repetitions (median reported), after the warm-up runs"),
      ("warmup", int, "untimed runs before the timed ones (attention and LM)"),
      ("lm_layers", int, "LM depth"), ("lm_hidden", int, "LM width"),
      ("lm_heads", int, "LM heads"), ("lm_head_dim", int, "LM head dim"),
      ("lm_vocab", int, "LM vocabulary"), ("lm_batch", int, "LM batch (sequences/step)"),
      ("lm_seqs", str, "LM sequence lengths, no remat"),
      ("lm_long_seqs", str, "LM sequence lengths with per-block remat (long context)"),
      ("lm_impls", str, "labels run at --lm-seqs"),
      ("lm_cudnn_seqs", str, "LM lengths also run with cuDNN attention (GPU only; one "
                             "length keeps the run short)"),
      ("lm_long_impls", str, "labels run at --lm-long-seqs (with remat)"),
      ("lm_long_standard_seqs", str, "long lengths where standard+remat is tried too, to "
                                     "record that it cannot (compile-only when over budget)"),
      ("lm_iters", int, "timed LM steps after the warm-up steps"),
      ("lm_dtype", str, "LM compute dtype (params stay float32)")])
  args = p.parse_args(argv)
  common.apply_preset(args, PRESETS, "h200")
  return args


def _seqs(start, stop):
  s, out = start, []
  while s <= stop:
    out.append(s)
    s *= 2
  return out


def over_budget(row, mem, budget) -> bool:
  """Marks `row` out of memory when its compiled program exceeds the budget."""
  if budget is not None and mem.get("total_bytes", 0) > budget:
    row.update(status="oom", error=f"compiled {human_bytes(mem['total_bytes'])} > "
                                   f"budget {human_bytes(budget)}")
    return True
  return False


def note_stop(stopped, key, row, what):
  """After an oom or error, later (longer) sequences of the same series are skipped."""
  if row["status"] in ("oom", "error"):
    stopped[key] = f"{row['status']} at seq {row['seq']}"
    common.note(f"  {what}: {row['status']}: {row['error'][:160]}")


# -- part 1: the attention op ----------------------------------------------------------

def run_attention(args, labels, budget):
  seqs = _seqs(args.seq_start, args.seq_max)
  rows, stopped = [], {}
  jobs = [(s, l, m) for s in seqs for l in labels for m in ("fwd", "fwd+bwd")]
  bar = common.progress(jobs, "attention", "cfg")
  for T, label, mode in bar:
    bar.set_postfix_str(f"{label} {mode} T={T}")
    row = dict(part="attention", impl=label, mode=mode, seq=T, batch=args.batch,
               heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
               dtype=args.dtype, causal=args.causal)
    if (label, mode) in stopped:
      rows.append(dict(row, status="skipped", reason=stopped[label, mode]))
      continue
    f = attention_callable(label, args.causal)
    if mode == "fwd":
      jitted = jax.jit(f)
    else:
      jitted = jax.jit(lambda q, k, v, do, f=f: jax.vjp(f, q, k, v)[1](do))
    qs = shape_struct((args.batch, T, args.heads, args.head_dim), args.dtype)
    ks = shape_struct((args.batch, T, args.kv_heads, args.head_dim), args.dtype)
    structs = (qs, ks, ks) + ((qs,) if mode != "fwd" else ())
    try:
      compiled, mem = compile_with_memory(jitted, *structs)
      row["memory"] = mem
      if over_budget(row, mem, budget):
        pass  # the row says oom; nothing is run
      elif T > args.time_max_seq:
        row.update(status="ok", timed=False)
      else:
        arrays = random_arrays(args.seed + T, structs)
        t = common.time_calls(lambda: compiled(*arrays), rounds=args.iters,
                              warmup=args.warmup, budget_s=args.time_budget_s)
        del arrays
        flops = attention_flops(args.batch, args.heads, args.head_dim,
                                dense_pairs(T, T, args.causal), mode)
        row.update(status="ok", timed=True, median_s=t["median_s"], min_s=t["min_s"],
                   tflops=flops / t["median_s"] / 1e12)
    except Exception as e:  # recorded, see failure()
      row.update(failure(e))
    note_stop(stopped, (label, mode), row, f"{label} {mode} T={T}")
    rows.append(row)
  return rows


# -- part 2: decoder-LM training step ---------------------------------------------------

def lm_config(args, label, T, remat):
  return LMConfig(vocab_size=args.lm_vocab, num_layers=args.lm_layers, hidden=args.lm_hidden,
                  num_heads=args.lm_heads, head_dim=args.lm_head_dim, seq_len=T,
                  attention_implementation=IMPLEMENTATIONS.get(label, label), remat=remat,
                  dtype=args.lm_dtype)


def lm_step(cfg, batch, rng, seed):
  """(jitted train step, its arguments (params, opt_state, tokens, targets, weights)):
  the model of `cfg` with AdamW, random tokens as their own targets."""
  graphdef, params = init_model(cfg, seed)
  tx = make_optimizer(1e-4, 1000, 100)
  tok = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, cfg.seq_len)), jnp.int32)
  w = jnp.ones((batch, cfg.seq_len), jnp.float32)
  return make_train_step(graphdef, tx), (params, tx.init(params), tok, tok, w)


def run_lm(args, labels, budget):
  ints = lambda text: [int(t) for t in text.split(",") if t]
  short = [l for l in labels_for_backend(args.lm_impls.split(",")) if l in labels]
  long = [l for l in labels_for_backend(args.lm_long_impls.split(",")) if l in labels]
  jobs = [(T, False, l) for T in ints(args.lm_seqs) for l in short]
  if "cudnn" in labels:
    jobs += [(T, False, "cudnn") for T in ints(args.lm_cudnn_seqs)]
  if "standard" in labels:
    jobs += [(T, True, "standard") for T in ints(args.lm_long_standard_seqs)]
  jobs += [(T, True, l) for T in ints(args.lm_long_seqs) for l in long]
  rows, stopped = [], {}
  rng = np.random.default_rng(args.seed)
  bar = common.progress(jobs, "lm train step", "cfg")
  for T, remat, label in bar:
    bar.set_postfix_str(f"{label} T={T}{' remat' if remat else ''}")
    cfg = lm_config(args, label, T, remat)
    row = dict(part="lm", impl=label, seq=T, batch=args.lm_batch, remat=remat,
               config=dataclasses.asdict(cfg))
    if (label, remat) in stopped:
      rows.append(dict(row, status="skipped", reason=stopped[label, remat]))
      continue
    try:
      step, (params, opt_state, tok, targets, w) = lm_step(cfg, args.lm_batch, rng, args.seed)
      row["params"] = int(sum(x.size for x in jax.tree_util.tree_leaves(params)))
      compiled, mem = compile_with_memory(step, params, opt_state, tok, targets, w)
      row["memory"] = mem
      if not over_budget(row, mem, budget):
        state = [params, opt_state]

        def one_step():
          state[0], state[1], loss = compiled(state[0], state[1], tok, targets, w)
          return loss
        t = common.time_calls(one_step, rounds=args.lm_iters, warmup=args.warmup,
                              budget_s=args.time_budget_s)
        med = t["median_s"]
        loss = float(one_step())
        tokens = args.lm_batch * T
        row.update(status="ok", median_s=med, min_s=t["min_s"], tokens_per_s=tokens / med,
                   loss=loss, model_tflops=lm_flops_per_token(cfg, T) * tokens / med / 1e12)
        del state
    except Exception as e:  # recorded, see failure()
      row.update(failure(e))
    note_stop(stopped, (label, remat), row, f"lm {label} T={T}")
    rows.append(row)
  return rows


def combine(paths, out_dir):
  """Joins partial runs (--parts attention / lm, each within one device call) into one
  JSON and one plot, keeping each part's own environment and config."""
  parts = [json.loads(Path(p).read_text()) for p in paths]
  rows = [r for part in parts for r in part["rows"]]
  env, cfg = parts[0]["environment"], parts[0]["config"]
  backend = env["backend"]
  name = f"seq_scaling_{backend}"
  payload = {"environment": env, "config": cfg, "argv": sys.argv, "rows": rows,
             "summary": summarize(rows), "combined_from": [
                 {"file": Path(p).name, "environment": part["environment"],
                  "config": part["config"]} for p, part in zip(paths, parts)]}
  out = Path(out_dir) / f"{name}.json"
  out.write_text(json.dumps(payload, indent=1, default=str) + "\n")
  plot(rows, Path(out_dir) / f"{name}.png",
       f"seq_scaling on {env['device']} ({backend}), preset {cfg['preset']}; "
       f"attention B={cfg['batch']} N={cfg['heads']} K={cfg['kv_heads']} H={cfg['head_dim']} "
       f"{cfg['dtype']}{' causal' if cfg['causal'] else ''}; LM {cfg['lm_layers']}L x "
       f"{cfg['lm_hidden']}, batch {cfg['lm_batch']}, {cfg['lm_dtype']}",
       cfg["memory_budget_bytes"])
  print_summary(rows)
  print(f"wrote {out} and .png")
  return out


def main(argv=None):
  if argv is None:
    argv = sys.argv[1:]
  if argv and argv[0] == "--combine":
    out_dir = common.DEFAULT_OUT
    if "--out-dir" in argv:
      i = argv.index("--out-dir")
      out_dir, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    return combine(argv[1:], out_dir)
  args = parse_args(argv)
  t0 = time.perf_counter()
  load_start = load_average()
  labels = labels_for_backend(args.impls.split(",") if args.impls else None)
  budget, budget_src = memory_budget_bytes(args.memory_budget_gb)
  parts = args.parts.split(",")
  print(f"seq_scaling: preset={args.preset} backend={jax.default_backend()} impls={labels} "
        f"budget={human_bytes(budget)} ({budget_src}) jflash default="
        f"{jflash.default_implementation()}")
  rows = []
  if "attention" in parts:
    rows += run_attention(args, labels, budget)
  if "lm" in parts:
    rows += run_lm(args, labels, budget)
  backend = jax.default_backend()
  name = f"seq_scaling_{backend}" + ("" if args.preset in ("cpu", "h200") else f"_{args.preset}")
  if set(parts) != {"attention", "lm"}:
    name += "_" + "_".join(parts)   # a partial run never overwrites the full one
  config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
  config.update(load_average_at_start=load_start, load_average_at_end=load_average(),
                memory_budget_bytes=budget, memory_budget_source=budget_src, impls=labels,
                jflash_default_implementation=list(jflash.default_implementation()),
                implementation_names={l: IMPLEMENTATIONS.get(l, l) for l in labels})
  summary = summarize(rows)
  elapsed = time.perf_counter() - t0
  path = common.write_result(name, config, rows, extra={"summary": summary,
                                                         "elapsed_s": elapsed},
                             out_dir=args.out_dir)
  env = common.environment()
  plot(rows, Path(args.out_dir) / f"{name}.png",
       f"seq_scaling on {env['device']} ({backend}), preset {args.preset}; "
       f"attention B={args.batch} N={args.heads} K={args.kv_heads} H={args.head_dim} "
       f"{args.dtype}{' causal' if args.causal else ''}; LM {args.lm_layers}L x "
       f"{args.lm_hidden}, batch {args.lm_batch}, {args.lm_dtype}", budget)
  print_summary(rows)
  if summary.get("jflash_speedup_tokens_per_s"):
    print("jflash / standard tokens/s:", summary["jflash_speedup_tokens_per_s"])
  print(f"wrote {path} and .png in {elapsed:.0f} s")
  return path


if __name__ == "__main__":
  main()
