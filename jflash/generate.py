"""Sampling from a `jflash.nn.DecoderLM` with a KV cache: one prefill of the prompts
with the flash kernels, then one decode step per new token, the whole loop one jitted
program (`lax.fori_loop`).

Prompts are right-padded to T0 with their lengths in `prompt_lengths`; row b's new
tokens follow its own prompt (positions p_b, p_b + 1, ...), and the returned
[B, T0 + max_new_tokens] array holds prompt, new tokens, then zeros. The cache holds
T0 + max_new_tokens positions per row; attention reads each row's keys up to its own
length (`jflash.kv_cache.attention`: bottom-right causal alignment), so a row never
sees another row's padding.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jflash import api

Array = jax.Array


def _check(tokens, max_new_tokens, prompt_lengths, temperature, top_k, rng, vocab_size):
  if (not hasattr(tokens, "dtype") or not jnp.issubdtype(tokens.dtype, jnp.integer)
      or tokens.ndim != 2 or tokens.shape[1] < 1):
    raise ValueError("tokens must be an integer [B, T0] array with T0 >= 1, got "
                     f"{getattr(tokens, 'dtype', type(tokens))} "
                     f"{tuple(getattr(tokens, 'shape', ()))}")
  B, T0 = tokens.shape
  if (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer))
      or max_new_tokens < 1):
    raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
  if prompt_lengths is None:
    prompt_lengths = jnp.full((B,), T0, jnp.int32)
  else:
    prompt_lengths = api.check_lengths("prompt_lengths", prompt_lengths, B, T0)
    if not isinstance(prompt_lengths, jax.core.Tracer) and int(jnp.min(prompt_lengths)) < 1:
      raise ValueError(f"prompt_lengths must be >= 1 (a prompt of no token has no "
                       f"logits to sample from), got {np.asarray(prompt_lengths).tolist()}")
  if (isinstance(temperature, bool) or not isinstance(temperature, (int, float, np.number))
      or not np.isfinite(temperature) or temperature < 0):
    raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
  if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer))
                            or not 1 <= top_k <= vocab_size):
    raise ValueError(f"top_k must be None or an int in [1, {vocab_size}], got {top_k!r}")
  if temperature > 0 and rng is None:
    raise ValueError(f"temperature={temperature} samples: pass rng (a PRNG key)")
  return prompt_lengths


def sample(logits, key, *, temperature: float, top_k: int | None):
  """[B, vocab] float logits -> [B] int32 tokens: argmax at temperature 0, else a draw
  from softmax(logits / temperature), restricted to the top_k largest when given."""
  if temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits / temperature
  if top_k is not None:
    kth = lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def generate(model, tokens, max_new_tokens: int, *, prompt_lengths=None,
             temperature: float = 0.0, top_k: int | None = None, rng=None) -> Array:
  """`DecoderLM.generate`: [B, T0] right-padded prompts -> [B, T0 + max_new_tokens]
  tokens (see the module docstring). `rng` is a PRNG key, needed when temperature > 0."""
  prompt_lengths = _check(tokens, max_new_tokens, prompt_lengths, temperature, top_k, rng,
                          model.cfg.vocab_size)
  if rng is None:
    rng = jax.random.key(0)      # unused at temperature 0
  graphdef, state = nnx.split(model)
  return _generate(graphdef, state, jnp.asarray(tokens, jnp.int32), prompt_lengths, rng,
                   max_new_tokens=int(max_new_tokens), temperature=float(temperature),
                   top_k=top_k)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "temperature",
                                             "top_k"))
def _generate(graphdef, state, tokens, prompt_lengths, rng, *, max_new_tokens, temperature,
              top_k):
  model = nnx.merge(graphdef, state)
  B, T0 = tokens.shape
  rows = jnp.arange(B)
  pick = functools.partial(sample, temperature=temperature, top_k=top_k)
  cache = model.init_cache(B, T0 + max_new_tokens)
  logits, cache = model(tokens, positions=jnp.broadcast_to(jnp.arange(T0), (B, T0)),
                        cache=cache, new_lengths=prompt_lengths)
  last = logits[rows, prompt_lengths - 1]                       # [B, vocab]
  rng, key = jax.random.split(rng)
  token = pick(last, key)
  out = jnp.zeros((B, T0 + max_new_tokens), jnp.int32)
  out = out.at[:, :T0].set(jnp.where(jnp.arange(T0) < prompt_lengths[:, None], tokens, 0))
  out = out.at[rows, prompt_lengths].set(token)
  new, _ = decode_tokens(model, cache, token, prompt_lengths, max_new_tokens - 1, pick=pick,
                         rng=rng)
  cols = prompt_lengths[:, None] + 1 + jnp.arange(max_new_tokens - 1)
  return out.at[rows[:, None], cols].set(new)


def decode_tokens(model, cache, token, positions, steps: int, *, pick, rng):
  """`steps` decode steps from `token` [B] at `positions` [B] (the cache holds every
  earlier position): each feeds the last token, appends its keys to the cache and picks
  the next with `pick(logits [B, vocab], key)`. Returns ([B, steps] tokens, cache). The
  loop is one `lax.fori_loop`: jit the caller."""
  B = token.shape[0]
  out = jnp.zeros((B, steps), jnp.int32)
  # The module's arrays ride in the loop's carry and the body rebuilds it from them:
  # Flax modules do not cross the trace levels of a JAX loop.
  graphdef, state = nnx.split(model)

  def step(i, carry):
    out, cache, token, rng, state = carry
    logits, cache = nnx.merge(graphdef, state)(token[:, None], positions=(positions + i)[:, None],
                                               cache=cache)
    rng, key = jax.random.split(rng)
    token = pick(logits[:, 0], key)
    return out.at[:, i].set(token), cache, token, rng, state

  out, cache, *_ = lax.fori_loop(0, steps, step, (out, cache, token, rng, state))
  return out, cache
