"""`DecoderLM.generate` and Flax's own `decode=True` with `make_attention_fn`: cached
decoding gives exactly what recomputing the whole sequence gives."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jflash.nn
from tests.attention_test_base import floor, max_err


def _model(scan_layers):
  cfg = jflash.nn.LMConfig(vocab_size=64, num_layers=2, hidden=32, num_heads=4, num_kv_heads=2,
                           scan_layers=scan_layers)
  return jflash.nn.DecoderLM(cfg, rngs=nnx.Rngs(0))


def _recompute_greedy(model, prompt, steps):
  """Greedy decoding by running the whole sequence at every step (no cache)."""
  seq = list(prompt)
  forward = nnx.jit(lambda m, t: m(t))
  for _ in range(steps):
    seq.append(int(jnp.argmax(forward(model, jnp.asarray([seq]))[0, -1])))
  return seq


@pytest.mark.parametrize("scan_layers", [True, False])
def test_greedy_generate_equals_recomputation_with_ragged_prompts(scan_layers):
  model = _model(scan_layers)
  r = np.random.default_rng(0)
  tokens = jnp.asarray(r.integers(0, 64, (3, 7)), jnp.int32)
  lengths = np.asarray([7, 3, 1])
  steps = 5
  out = np.asarray(model.generate(tokens, steps, prompt_lengths=jnp.asarray(lengths)))
  assert out.shape == (3, 7 + steps)
  for b, n in enumerate(lengths):
    want = _recompute_greedy(model, np.asarray(tokens[b, :n]), steps)
    assert out[b, :n + steps].tolist() == want, b
    assert np.all(out[b, n + steps:] == 0)


@pytest.mark.parametrize("scan_layers", [True, False])
def test_decode_loop_writes_the_cache_stack_in_place(scan_layers):
  # Each block appends to its own entry of the [L, ...] stack the loop carries (one
  # scatter, `KVCache.append_layer`): the compiled loop's temporaries stay below half
  # the stack, where taking each layer's cache out and stacking them again copies the
  # whole stack every step (temporaries of a stack or more). The attention that reads
  # each layer where it lies: on a GPU the decode kernel; on the CPU "xla", whose
  # loops XLA fuses with the slice (the kernel's interpreter copies its blocks, and
  # XLA:GPU copies matmul operands into cuBLAS layouts).
  from jflash import generate
  from jflash.kv_cache import KVCache
  L, B, S = 4, 2, 512
  impl = "pallas_decode" if jax.default_backend() == "gpu" else "xla"
  cfg = jflash.nn.LMConfig(vocab_size=64, num_layers=L, hidden=64, num_heads=4,
                           num_kv_heads=2, scan_layers=scan_layers, seq_len=S,
                           attention_implementation=impl)
  graphdef, state = nnx.split(jflash.nn.DecoderLM(cfg, rngs=nnx.Rngs(0)))
  shape = (L, B, S, cfg.kv_heads, cfg.dim_per_head)
  cache = KVCache(jnp.zeros(shape), jnp.zeros(shape), jnp.full((L, B), 100, jnp.int32))
  pick = lambda logits, key: generate.sample(logits, key, temperature=0.0, top_k=None)
  loop = jax.jit(lambda state, cache, token, positions: generate.decode_tokens(
      nnx.merge(graphdef, state), cache, token, positions, 3, pick=pick,
      rng=jax.random.key(0)), donate_argnums=(1,))
  compiled = loop.lower(state, cache, jnp.zeros((B,), jnp.int32),
                        jnp.full((B,), 100, jnp.int32)).compile()
  stack = cache.k.nbytes + cache.v.nbytes
  assert compiled.memory_analysis().temp_size_in_bytes < stack / 2


@pytest.mark.parametrize("scan_layers", [True, False])
def test_decode_kernel_reads_each_layer_inside_the_stack(scan_layers, monkeypatch):
  # The loop lowered for CUDA (no GPU needed) with the Triton kernels (not their
  # interpreter, whose blocks are copies): each decode step's kernel reads the [L * B,
  # S, K, H] rows of the carried stack, and no value of one layer's cache shape exists,
  # so no layer is copied out of the stack (nor zeroed: the kernel hides the padding).
  from jflash import generate
  from jflash.kv_cache import KVCache
  from pallas_kernels import common
  monkeypatch.setattr(common, "use_interpret", lambda i: False if i is None else i)
  L, B, S = 4, 2, 512
  cfg = jflash.nn.LMConfig(vocab_size=64, num_layers=L, hidden=64, num_heads=4,
                           num_kv_heads=2, scan_layers=scan_layers, seq_len=S,
                           attention_implementation="pallas_decode")
  graphdef, state = nnx.split(jflash.nn.DecoderLM(cfg, rngs=nnx.Rngs(0)))
  K, H = cfg.kv_heads, cfg.dim_per_head
  cache = KVCache(jnp.zeros((L, B, S, K, H)), jnp.zeros((L, B, S, K, H)),
                  jnp.full((L, B), 100, jnp.int32))
  pick = lambda logits, key: generate.sample(logits, key, temperature=0.0, top_k=None)
  loop = jax.jit(lambda state, cache, token, positions: generate.decode_tokens(
      nnx.merge(graphdef, state), cache, token, positions, 3, pick=pick,
      rng=jax.random.key(0)), donate_argnums=(1,))
  try:
    text = loop.trace(state, cache, jnp.zeros((B,), jnp.int32),
                      jnp.full((B,), 100, jnp.int32)).lower(
                          lowering_platforms=("cuda",)).as_text()
  except RuntimeError as e:
    if "No supported GPU devices found" not in str(e):
      raise
    pytest.skip("this JAX lowers Triton kernels only for a present (or abstract) GPU")
  kernels = [l for l in text.splitlines() if "custom_call @__gpu$xla.gpu.triton" in l]
  assert len(kernels) == (1 if scan_layers else L), len(kernels)
  rows = f"tensor<{L * B}x{S}x{K}x{H}xf32>"
  assert text.count(rows) >= 2 * len(kernels)               # K and V of each kernel
  assert f"tensor<{B}x{S}x{K}x{H}xf32>" not in text


def test_generate_through_the_decode_kernel_equals_recomputation():
  # Prompts of up to 7 tokens and decode steps all run the split-KV kernel
  # (interpreted), each layer read inside the cache stack.
  cfg = jflash.nn.LMConfig(vocab_size=64, num_layers=2, hidden=32, num_heads=4,
                           num_kv_heads=2, attention_implementation="pallas_decode")
  model = jflash.nn.DecoderLM(cfg, rngs=nnx.Rngs(0))
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 7)), jnp.int32)
  lengths = np.asarray([7, 2])
  out = np.asarray(model.generate(tokens, 4, prompt_lengths=jnp.asarray(lengths)))
  for b, n in enumerate(lengths):
    assert out[b, :n + 4].tolist() == _recompute_greedy(model, np.asarray(tokens[b, :n]), 4), b


def test_top_1_sampling_is_greedy_and_sampling_follows_the_key():
  model = _model(True)
  tokens = jnp.asarray([[3, 9, 27, 17]], jnp.int32)
  greedy = model.generate(tokens, 4)
  top1 = model.generate(tokens, 4, temperature=0.7, top_k=1, rng=jax.random.key(1))
  np.testing.assert_array_equal(top1, greedy)
  a = model.generate(tokens, 4, temperature=1.0, rng=jax.random.key(2))
  b = model.generate(tokens, 4, temperature=1.0, rng=jax.random.key(2))
  np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(a[:, :4], tokens)


@pytest.mark.parametrize("kw, match", [
    (dict(temperature=0.5), "rng"),
    (dict(top_k=65), "top_k"),
    (dict(temperature=-1.0), "temperature"),
    (dict(prompt_lengths=jnp.asarray([0])), "prompt_lengths"),
])
def test_bad_generate_arguments(kw, match):
  with pytest.raises(ValueError, match=match):
    _model(True).generate(jnp.zeros((1, 3), jnp.int32), 2, **kw)


def test_flax_decode_mode_equals_full_causal_attention():
  # Flax's own cache (decode=True) feeds one query against the whole cache buffer;
  # make_attention_fn aligns the causal mask bottom-right, so each step is full causal
  # attention's row (top-left alignment would show the query key 0 only).
  B, T, D = 2, 6, 16
  x = jnp.asarray(np.random.default_rng(1).standard_normal((B, T, D)), jnp.float32)
  fn = jflash.nn.make_attention_fn(is_causal=True)
  mha = nnx.MultiHeadAttention(num_heads=2, in_features=D, decode=False, rngs=nnx.Rngs(0),
                               attention_fn=fn)
  full = mha(x)
  mha.init_cache((B, T, D))
  steps = jnp.concatenate([mha(x[:, t:t + 1], decode=True) for t in range(T)], axis=1)
  plain = nnx.MultiHeadAttention(num_heads=2, in_features=D, decode=False, rngs=nnx.Rngs(0))
  ref = plain(x, mask=nnx.make_causal_mask(jnp.ones((B, T))))
  for got in (full, steps):   # equal to Flax's own up to float32 rounding
    assert max_err(got, np.asarray(ref, np.float64)) <= floor(jnp.float32, np.asarray(ref), T * D)
