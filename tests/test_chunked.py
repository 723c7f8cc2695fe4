"""The plain-JAX blockwise implementation through the shared test base."""
from tests.attention_test_base import AttentionTestBase


class TestXlaChunked(AttentionTestBase):
  implementation = "xla_chunked"
