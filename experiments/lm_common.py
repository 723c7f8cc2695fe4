"""Decoder-LM training pieces shared by seq_scaling.py, train_lm.py and the tests:
functional train step (nnx.split + optax), the training mesh (data x fsdp), data that
needs no download, checkpoints.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jflash.nn import DecoderLM, LMConfig

REPO = Path(__file__).resolve().parents[1]


# -- model + optimizer -------------------------------------------------------------

def make_optimizer(lr: float, steps: int, warmup: int, weight_decay: float = 0.1,
                   clip: float = 1.0) -> optax.GradientTransformation:
  """AdamW with linear warm-up then cosine decay to lr/10, and global-norm clipping."""
  sched = optax.warmup_cosine_decay_schedule(
      0.0, lr, warmup_steps=max(1, warmup), decay_steps=max(steps, warmup + 1),
      end_value=lr / 10)
  # Decay matrices only: decaying norm scales pulls them toward zero for no benefit.
  decay_mask = lambda params: jax.tree_util.tree_map(lambda p: p.ndim >= 2, params)
  return optax.chain(optax.clip_by_global_norm(clip),
                     optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=weight_decay,
                                 mask=decay_mask))


def init_model(cfg: LMConfig, seed: int = 0):
  """(graphdef, params): the model split into its static structure and its weights."""
  model = DecoderLM(cfg, rngs=nnx.Rngs(seed))
  graphdef, params = nnx.split(model, nnx.Param)
  return graphdef, params


def loss_fn(params, graphdef, tokens, targets, weights):
  """Weighted mean next-token cross-entropy (nats)."""
  logits = nnx.merge(graphdef, params)(tokens)
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  return jnp.sum(nll * weights) / jnp.maximum(jnp.sum(weights), 1)


def make_train_step(graphdef, tx, donate: bool = True):
  """jitted `(params, opt_state, tokens, targets, weights) -> (params, opt_state, loss)`.

  Parameters and optimizer state are donated, as in a real training loop, so compiled
  memory counts them once.
  """
  def step(params, opt_state, tokens, targets, weights):
    loss, grads = jax.value_and_grad(loss_fn)(params, graphdef, tokens, targets, weights)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
  return jax.jit(step, donate_argnums=(0, 1) if donate else ())


def make_eval_loss(graphdef):
  return jax.jit(lambda params, t, y, w: loss_fn(params, graphdef, t, y, w))


# -- the training mesh ---------------------------------------------------------------
# data: replicas that split the batch. fsdp: devices that split the batch too and hold
# one slice of every weight each (ZeRO-3 / FSDP): jit gathers a weight where it is used
# and reduce-scatters its gradient. Attention runs on each device's batch shard
# (jflash.sharding), with no collective.
MESH_AXES = ("data", "fsdp")


def parse_mesh(spec: str) -> dict[str, int]:
  """`"data=2,fsdp=4"` -> {"data": 2, "fsdp": 4}; ValueError names a bad entry."""
  axes = {}
  for item in spec.split(","):
    name, _, size = item.partition("=")
    if name == "seq":
      raise NotImplementedError(
          "--mesh seq=...: a sharded sequence is ring attention inside shard_map "
          "(jflash.parallel, LMConfig.context_parallel_axis), which this training loop "
          "does not run; shard data and fsdp")
    if name not in MESH_AXES or not size.isdigit() or int(size) < 1 or name in axes:
      raise ValueError(f"--mesh entry {item!r} must be <axis>=<size> with axis one of "
                       f"{MESH_AXES} (each once) and size >= 1, in {spec!r}")
    axes[name] = int(size)
  n = int(np.prod(list(axes.values())))
  if n > jax.device_count():
    raise ValueError(f"--mesh {spec!r} needs {n} devices, {jax.device_count()} are present")
  return axes


def make_mesh(axes: dict[str, int]) -> Mesh:
  """The data x fsdp mesh (Auto axes: jit places what the shardings below leave open)."""
  shape = tuple(axes.get(a, 1) for a in MESH_AXES)
  devices = np.asarray(jax.devices()[:int(np.prod(shape))]).reshape(shape)
  return Mesh(devices, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Sequences over every axis: data and fsdp both split the batch."""
  return NamedSharding(mesh, PartitionSpec(MESH_AXES))


def param_sharding(x, mesh: Mesh) -> NamedSharding:
  """One weight's FSDP sharding: its largest axis that fsdp divides, over fsdp (so
  each device holds 1/fsdp of it); a weight no axis of which it divides is replicated."""
  n = mesh.shape["fsdp"]
  fits = [i for i in np.argsort(x.shape)[::-1] if n > 1 and x.shape[i] % n == 0]
  spec = [None] * x.ndim
  if fits:
    spec[fits[0]] = "fsdp"
  return NamedSharding(mesh, PartitionSpec(*spec))


def shard_params(params, mesh: Mesh):
  return jax.device_put(params, jax.tree_util.tree_map(lambda x: param_sharding(x, mesh),
                                                       params))


# -- data ------------------------------------------------------------------------------

def copy_batch(rng: np.random.Generator, batch: int, seq: int, vocab: int):
  """Copying across the whole context: the second half repeats the first.

  Tokens x[0..seq] with x[i] = x[i - P], P = seq // 2. Inputs x[:seq], targets x[1:];
  targets that are copies (t + 1 >= P) carry weight 1, so the loss on them starts at
  ln(vocab) and reaches 0 only by attending exactly P - 1 positions back.
  """
  P = seq // 2
  first = rng.integers(0, vocab, size=(batch, P))
  reps = -(-(seq + 1) // P)
  x = np.tile(first, (1, reps))[:, :seq + 1]
  w = (np.arange(seq) + 1 >= P).astype(np.float32)
  return x[:, :-1].astype(np.int32), x[:, 1:].astype(np.int32), np.broadcast_to(w, (batch, seq)).copy()


def recall_batch(rng: np.random.Generator, batch: int, seq: int, vocab: int):
  """Multi-query associative recall: key-value pairs, then the keys again, each
  followed by its value. Keys come from the lower half of the vocabulary, values from
  the upper half; only the recalled values are scored (chance: ln(vocab / 2)).
  """
  nk = vocab // 2
  pairs = min(nk, seq // 4)
  if pairs < 1:
    raise ValueError(f"recall needs seq >= 4 and vocab >= 2, got {seq=}, {vocab=}")
  x = np.zeros((batch, seq + 1), np.int64)
  w = np.zeros((batch, seq), np.float32)
  for b in range(batch):
    keys = rng.permutation(nk)[:pairs]
    vals = rng.integers(nk, vocab, size=pairs)
    order = rng.permutation(pairs)
    ctx = np.stack([keys, vals], 1).reshape(-1)
    qry = np.stack([keys[order], vals[order]], 1).reshape(-1)
    # Left-pad with value tokens: keys then occur only in the context and the queries,
    # so "the token after this key's earlier occurrence" is unambiguous.
    pad = seq + 1 - 2 * len(ctx)
    x[b] = np.concatenate([rng.integers(nk, vocab, size=pad), ctx, qry])
    start = pad + len(ctx)                 # position of the first query key
    w[b, start::2] = 1.0                   # target at t = start + 2i is its value
  return x[:, :-1].astype(np.int32), x[:, 1:].astype(np.int32), w


def text_corpus(paths=None, exts=(".md", ".py")) -> bytes:
  """Bytes of the text files under `paths` (default: this repository, minus .venv)."""
  roots = [Path(p) for p in (paths or [REPO])]
  files = []
  for root in roots:
    if root.is_file():
      files.append(root)
      continue
    for p in sorted(root.rglob("*")):
      parts = set(p.relative_to(root).parts)
      if p.is_file() and p.suffix in exts and not parts & {".venv", ".git", "results",
                                                             "__pycache__", "_build"}:
        files.append(p)
  data = b"\n".join(p.read_bytes() for p in files)
  if not data:
    raise ValueError(f"no {exts} files under {[str(r) for r in roots]}")
  return data


class TextData:
  """Character (byte) level language modelling on a corpus: vocab 256, a train/val
  split by position (last 10%), random crops."""

  def __init__(self, data: bytes, seq: int, val_fraction: float = 0.1):
    arr = np.frombuffer(data, np.uint8).astype(np.int32)
    n_val = max(seq + 2, int(len(arr) * val_fraction))
    if len(arr) < n_val + seq + 2:
      raise ValueError(f"corpus of {len(arr)} bytes is too small for {seq=}")
    self.train, self.val, self.seq = arr[:-n_val], arr[-n_val:], seq

  def batch(self, rng: np.random.Generator, batch: int, split: str = "train"):
    src = self.train if split == "train" else self.val
    starts = rng.integers(0, len(src) - self.seq - 1, size=batch)
    x = np.stack([src[s:s + self.seq + 1] for s in starts])
    return x[:, :-1], x[:, 1:], np.ones((batch, self.seq), np.float32)


# -- checkpoints -----------------------------------------------------------------------

def _orbax():
  try:
    import orbax.checkpoint as ocp
    return ocp
  except ImportError:  # optional: plain msgpack below
    return None


def save_checkpoint(ckpt_dir: Path, step: int, params, opt_state, meta: dict) -> Path:
  """Writes step_<n>/ (orbax StandardCheckpointer, or state.msgpack) + meta.json."""
  ckpt_dir = Path(ckpt_dir).resolve()
  path = ckpt_dir / f"step_{step:07d}"
  state = {"params": params, "opt_state": opt_state}
  ocp = _orbax()
  if ocp is not None:
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(path / "state", state, force=True)
    ckptr.wait_until_finished()
  else:
    from flax import serialization
    path.mkdir(parents=True, exist_ok=True)
    (path / "state.msgpack").write_bytes(serialization.to_bytes(state))
  (path / "meta.json").write_text(json.dumps(dict(meta, step=step), indent=1, default=str))
  return path


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
  steps = sorted(p for p in Path(ckpt_dir).glob("step_*") if (p / "meta.json").exists())
  return steps[-1] if steps else None


def restore_checkpoint(path: Path, params, opt_state):
  """Restores into the structure of (params, opt_state); returns (params, opt_state, meta)."""
  path = Path(path).resolve()
  target = {"params": params, "opt_state": opt_state}
  meta = json.loads((path / "meta.json").read_text())
  if (path / "state.msgpack").exists():
    from flax import serialization
    state = serialization.from_bytes(target, (path / "state.msgpack").read_bytes())
  else:
    ocp = _orbax()
    abstract = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x, target)
    state = ocp.StandardCheckpointer().restore(path / "state", abstract)
  return state["params"], state["opt_state"], meta


def config_dict(cfg: LMConfig) -> dict:
  return dataclasses.asdict(cfg)
