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
