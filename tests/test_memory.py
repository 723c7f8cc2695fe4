"""Memory is linear in sequence length: compiled temporary bytes of fwd+bwd."""
import jax
import jax.numpy as jnp
import pytest

import jflash


def temp_bytes(implementation, seq, causal=True):
  shape = jax.ShapeDtypeStruct((1, seq, 2, 64), jnp.float32)

  def loss(q, k, v):
    return jnp.sum(jflash.attention(q, k, v, is_causal=causal,
                                    implementation=implementation) ** 2)

  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  return grad.lower(shape, shape, shape).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("implementation", ["xla_chunked", "pallas"])
def test_flash_temp_memory_grows_linearly(implementation):
  small, large = temp_bytes(implementation, 1024), temp_bytes(implementation, 8192)
  # 8x the tokens: at most ~8x the bytes (plus a small constant), never the 64x of T x S.
  assert large <= 8.5 * small + (1 << 20), (small, large)


def test_standard_attention_temp_memory_grows_quadratically():
  small, large = temp_bytes("xla", 1024), temp_bytes("xla", 8192)
  assert large >= 40 * small, (small, large)
  # and it is far above the flash path at 8K tokens
  assert large > 20 * temp_bytes("xla_chunked", 8192)


@pytest.mark.parametrize("implementation", ["xla_chunked", "pallas"])
def test_linear_inside_a_scanned_layer_stack(implementation):
  # Scanned layers (nnx.scan, lax.scan over blocks) differentiate attention inside an
  # outer scan; its residuals must stay (q, k, v, out, lse), not per-block score tiles.
  def temp(T):
    B, N, H = 1, 4, 64

    def layer(x, w):
      q = (x @ w).reshape(B, T, N, H)
      return jflash.attention(q, q, q, is_causal=True,
                              implementation=implementation).reshape(B, T, N * H)

    def loss(x, ws):
      y, _ = jax.lax.scan(lambda c, w: (layer(c, w), None), x, ws)
      return y.sum()

    x = jax.ShapeDtypeStruct((B, T, N * H), jnp.float32)
    ws = jax.ShapeDtypeStruct((2, N * H, N * H), jnp.float32)
    return jax.jit(jax.grad(loss, argnums=1)).lower(x, ws).compile().memory_analysis(
        ).temp_size_in_bytes

  small, large = temp(1024), temp(4096)
  assert large <= 4.5 * small, (small, large)
