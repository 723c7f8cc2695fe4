"""Train the decoder LM with standard and with flash attention; the loss curves should
overlap within noise (same initial weights, same batches, only attention differs).

Tasks, no downloads:
  copy    the second half of each sequence repeats the first (dependency distance
          seq/2: long range by construction); loss on the copied half, chance ln(vocab).
  recall  multi-query associative recall: key-value pairs, then keys -> values.
  text    character (byte) level LM on text files on disk (default: this repository's
          .md/.py files), validation on the held-out last 10%.

With --mesh (e.g. data=2,fsdp=4) the step runs on that many devices: the batch split
over both axes, every weight and its Adam state split over fsdp (`lm_common.
param_sharding`); the losses are the single device's up to float32 rounding.

Optax AdamW with warm-up + cosine decay. Checkpoints every --ckpt-every steps (orbax
when installed, else flax msgpack) under --ckpt-dir/<task>_<impl>/; --resume continues
from the latest, loss history and data-stream state included.
Writes <out-dir>/train_lm_<backend>.json and .png (see common.DEFAULT_OUT).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
import time
from pathlib import Path

import jax
import numpy as np

from experiments import common
from experiments.lm_common import (REPO, TextData, batch_sharding, copy_batch, init_model,
                                   latest_checkpoint, make_eval_loss, make_mesh,
                                   make_optimizer, make_train_step, parse_mesh,
                                   recall_batch, restore_checkpoint, save_checkpoint,
                                   shard_params, text_corpus)
from experiments.scaling_common import IMPLEMENTATIONS, load_average, setup_matplotlib
from jflash.nn import LMConfig, lm_flops_per_token

PRESETS = {
    # Two tasks x two implementations in under two minutes on 2 CPU cores, most of it
    # compiling the four train steps; the copy task is learnt well before the end.
    "cpu": dict(tasks="copy,text", steps=100, batch=8, seq=64, layers=2, hidden=64,
                heads=4, head_dim=16, lr=3e-3, warmup=15, eval_every=25, eval_batches=2,
                dtype="float32", remat=False, synthetic_vocab=16, ckpt_every=100),
    # The seq_scaling model on an H200: 12 x 1024, 8 heads x 128, batch 4 x 4K tokens;
    # one checkpoint at the end (2 GB of weights + Adam state per save).
    "h200": dict(tasks="copy,text", steps=80, batch=4, seq=4096, layers=12, hidden=1024,
                 heads=8, head_dim=128, lr=6e-4, warmup=10, eval_every=40,
                 eval_batches=2, dtype="bfloat16", remat=False, synthetic_vocab=64,
                 ckpt_every=80),
    "tiny": dict(tasks="text", steps=6, batch=2, seq=32, layers=1, hidden=32, heads=2,
                 head_dim=16, lr=3e-3, warmup=2, eval_every=3, eval_batches=1,
                 dtype="float32", remat=False, synthetic_vocab=16, ckpt_every=3),
}


def parse_args(argv=None):
  p = common.preset_parser(__doc__, PRESETS, "auto = cpu on a CPU, h200 on a GPU")
  p.add_argument("--impls", default="standard,jflash",
                 help=f"labels from {list(IMPLEMENTATIONS)}; standard vs flash by default")
  p.add_argument("--text-paths", nargs="*", default=None,
                 help="files/folders for the text task (default: this repo's .md/.py)")
  p.add_argument("--ckpt-dir", type=Path, default=None,
                 help="checkpoint folder (default: build/checkpoints/train_lm_<backend>, "
                      "git-ignored; <out-dir>/checkpoints/... when --out-dir is given)")
  p.add_argument("--ckpt-every", type=int, default=None,
                 help="steps between checkpoints (default: preset; always at the end)")
  p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
  p.add_argument("--seed", type=int, default=0, help="same seed for every implementation")
  p.add_argument("--out-dir", type=Path, default=common.DEFAULT_OUT,
                 help="where the JSON and PNG go (tests pass a tmp dir)")
  common.add_preset_options(p, [
      ("tasks", str, "comma-separated from copy, recall, text"), ("steps", int, "optimizer steps"),
      ("batch", int, "sequences per step"), ("seq", int, "tokens per sequence"),
      ("layers", int, "depth"), ("hidden", int, "width"), ("heads", int, "heads"),
      ("head_dim", int, "head dim"), ("lr", float, "peak learning rate"),
      ("warmup", int, "linear warm-up steps"), ("eval_every", int, "steps between evals"),
      ("eval_batches", int, "batches per eval"),
      ("dtype", str, "compute dtype (params float32)"),
      ("synthetic_vocab", int, "vocabulary of copy/recall (small: learnable in minutes)")])
  p.add_argument("--remat", action=argparse.BooleanOptionalAction, default=None,
                 help="per-block jax.checkpoint (default: preset)")
  p.add_argument("--mesh", default=None,
                 help="devices as data=D,fsdp=F (batch over both, weights over fsdp); "
                      "default: one device")
  args = p.parse_args(argv)
  common.apply_preset(args, PRESETS, "h200")
  if args.ckpt_dir is None:
    # Never beside the committed results: checkpoints are large binaries.
    results = (common.RESULTS, common.DEFAULT_OUT)
    root = (REPO / "build") if Path(args.out_dir).resolve() in results else Path(args.out_dir)
    args.ckpt_dir = root / "checkpoints" / f"train_lm_{jax.default_backend()}"
  return args


class Data:
  """Batches for one task from a seeded NumPy generator whose state is checkpointed."""

  def __init__(self, task, args, seed, corpus: bytes | None = None):
    self.task, self.args = task, args
    self.rng = np.random.default_rng(seed)
    self.eval_rng = np.random.default_rng(seed + 10_000)   # fixed eval batches
    if task == "text":
      self.text = TextData(corpus, args.seq)
      self.vocab = 256
    elif task in ("copy", "recall"):
      self.vocab = args.synthetic_vocab
    else:
      raise ValueError(f"unknown task {task!r}; choose copy, recall or text")
    self.eval_set = [self._batch(self.eval_rng, "val") for _ in range(args.eval_batches)]

  def _batch(self, rng, split):
    a = self.args
    if self.task == "text":
      return self.text.batch(rng, a.batch, split)
    make = copy_batch if self.task == "copy" else recall_batch
    return make(rng, a.batch, a.seq, self.vocab)

  def next(self):
    return self._batch(self.rng, "train")

  @property
  def chance(self):
    """Loss of a uniform guess over the scored tokens (nats)."""
    if self.task == "recall":
      return math.log(self.vocab - self.vocab // 2)
    return math.log(self.vocab)


def train_one(task, label, args, corpus=None):
  data = Data(task, args, args.seed, corpus)
  cfg = LMConfig(vocab_size=data.vocab, num_layers=args.layers, hidden=args.hidden,
                 num_heads=args.heads, head_dim=args.head_dim, seq_len=args.seq,
                 attention_implementation=IMPLEMENTATIONS.get(label, label),
                 remat=args.remat, dtype=args.dtype)
  graphdef, params = init_model(cfg, args.seed)
  mesh = make_mesh(parse_mesh(args.mesh)) if args.mesh else None
  place = lambda batch: batch
  if mesh is not None:
    params = shard_params(params, mesh)  # the Adam state below takes the same shardings
    place = lambda batch: jax.device_put(batch, batch_sharding(mesh))
    data.eval_set = [place(b) for b in data.eval_set]
  tx = make_optimizer(args.lr, args.steps, args.warmup)
  opt_state = tx.init(params)
  step_fn = make_train_step(graphdef, tx)
  eval_fn = make_eval_loss(graphdef)
  ckpt_dir = Path(args.ckpt_dir) / f"{task}_{label}"
  hist = {"step": [], "train_loss": [], "eval_step": [], "eval_loss": []}
  start = 0
  if args.resume and (latest := latest_checkpoint(ckpt_dir)) is not None:
    params, opt_state, meta = restore_checkpoint(latest, params, opt_state)
    start, hist = meta["step"], meta["history"]
    data.rng.bit_generator.state = meta["data_rng"]
    common.note(f"  resumed {task}/{label} from {latest} (step {start})")

  def evaluate():
    return float(np.mean([eval_fn(params, *b) for b in data.eval_set]))

  t_train, tokens = 0.0, 0
  bar = common.progress(range(start, args.steps), f"{task}/{label}", "step",
                        leave=False)
  for step in bar:
    x, y, w = place(data.next())
    t0 = time.perf_counter()
    params, opt_state, loss = step_fn(params, opt_state, x, y, w)
    loss = float(loss)                       # waits for the step
    if step > start:                         # the first step includes compilation
      t_train += time.perf_counter() - t0
      tokens += x.size
    hist["step"].append(step + 1)
    hist["train_loss"].append(loss)
    if not math.isfinite(loss):
      raise FloatingPointError(f"{task}/{label}: loss became {loss} at step {step + 1}")
    if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
      hist["eval_step"].append(step + 1)
      hist["eval_loss"].append(evaluate())
      bar.set_postfix(loss=f"{loss:.3f}", eval=f"{hist['eval_loss'][-1]:.3f}")
    if (step + 1) % args.ckpt_every == 0 or step + 1 == args.steps:
      save_checkpoint(ckpt_dir, step + 1, params, opt_state,
                      {"history": hist, "data_rng": data.rng.bit_generator.state,
                       "config": dataclasses.asdict(cfg), "task": task, "impl": label})
  tok_s = tokens / t_train if t_train > 0 else None
  return {"task": task, "impl": label, "config": dataclasses.asdict(cfg), "mesh": args.mesh,
          "chance_loss": data.chance, "history": hist,
          "final_train_loss": hist["train_loss"][-1] if hist["train_loss"] else None,
          "final_eval_loss": hist["eval_loss"][-1] if hist["eval_loss"] else None,
          "tokens_per_s": tok_s, "resumed_from": start or None,
          "model_tflops": (lm_flops_per_token(cfg) * tok_s / 1e12) if tok_s else None}


def plot(rows, path, title):
  plt = setup_matplotlib()
  tasks = list(dict.fromkeys(r["task"] for r in rows))
  fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4.2), squeeze=False)
  colors = {"standard": "tab:red", "jflash": "tab:blue", "cudnn": "tab:green"}
  for ax, task in zip(axes[0], tasks):
    for r in (r for r in rows if r["task"] == task):
      h, c = r["history"], colors.get(r["impl"])
      ls = "-" if r["impl"] == "standard" else "--"   # dashed on top: overlap stays visible
      ax.plot(h["step"], h["train_loss"], ls, color=c, lw=1, alpha=0.8, label=f"{r['impl']} train")
      # Hollow circles vs crosses: both stay visible when the evals coincide.
      mk = dict(marker="o", mfc="none", ms=8) if r["impl"] == "standard" else dict(marker="x", ms=6)
      ax.plot(h["eval_step"], h["eval_loss"], ls="none", color=c, label=f"{r['impl']} eval", **mk)
    chance = next(r["chance_loss"] for r in rows if r["task"] == task)
    ax.axhline(chance, color="gray", ls=":", lw=1, label=f"chance ln V = {chance:.2f}")
    ax.set(title=f"task: {task}", xlabel="step", ylabel="loss (nats/token)", yscale="log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None):
  args = parse_args(argv)
  t0 = time.perf_counter()
  rows = []
  labels = args.impls.split(",")
  # Read the corpus once: every implementation must see the same bytes (the repo's
  # files may change while this runs).
  corpus = text_corpus(args.text_paths) if "text" in args.tasks.split(",") else None
  corpus_info = None if corpus is None else {
      "bytes": len(corpus), "sha256": hashlib.sha256(corpus).hexdigest()}
  for task in args.tasks.split(","):
    for label in labels:
      rows.append(train_one(task, label, args, corpus))
      r = rows[-1]
      print(f"{task:6s} {label:9s} train {r['final_train_loss']:.4f} eval "
            f"{r['final_eval_loss']:.4f} (chance {r['chance_loss']:.3f})"
            + (f", {r['tokens_per_s']:.0f} tok/s" if r["tokens_per_s"] else ""))
  # Standard vs flash: the largest gap between the train-loss curves, step by step.
  agreement = {}
  for task in args.tasks.split(","):
    rs = {r["impl"]: r for r in rows if r["task"] == task}
    if "standard" in rs and "jflash" in rs:
      a = np.asarray(rs["standard"]["history"]["train_loss"])
      b = np.asarray(rs["jflash"]["history"]["train_loss"])
      n = min(len(a), len(b))
      agreement[task] = {"max_abs_train_loss_gap": float(np.max(np.abs(a[:n] - b[:n]))),
                         "final_eval_gap": abs(rs["standard"]["final_eval_loss"]
                                               - rs["jflash"]["final_eval_loss"])}
  elapsed = time.perf_counter() - t0
  backend = jax.default_backend()
  name = f"train_lm_{backend}" + ("" if args.preset in ("cpu", "h200") else f"_{args.preset}")
  config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
  config["load_average_at_end"] = load_average()  # a busy host slows CPU timings
  path = common.write_result(name, config, rows,
                             extra={"agreement": agreement, "corpus": corpus_info,
                                    "elapsed_s": elapsed},
                             out_dir=args.out_dir)
  plot(rows, Path(args.out_dir) / f"{name}.png",
       f"decoder LM {args.layers}L x {args.hidden}, {args.heads} heads x {args.head_dim}, "
       f"seq {args.seq}, batch {args.batch}, {args.dtype} on {common.environment()['device']}"
       " - standard (solid) vs jflash (dashed)")
  for task, a in agreement.items():
    print(f"  {task}: standard vs jflash max train-loss gap {a['max_abs_train_loss_gap']:.2e}")
  print(f"wrote {path} and .png in {elapsed:.0f} s")
  return path


if __name__ == "__main__":
  main()
