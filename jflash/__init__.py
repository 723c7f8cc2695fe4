"""jflash: exact, memory-efficient attention (FlashAttention) for JAX."""
from jflash import _registry  # noqa: F401  (registers the built-in implementations)
from jflash.api import (
    AttentionConfig,
    attention,
    available_implementations,
    default_implementation,
    prepare,
)
from jflash.config import BackendConfig, ChunkedConfig, HipConfig, MosaicGPUConfig, PallasConfig
from jflash.masks import Masks
from jflash.reference import attention_numpy, attention_tiled_numpy, attention_xla

__all__ = [
    "AttentionConfig",
    "BackendConfig",
    "ChunkedConfig",
    "HipConfig",
    "MosaicGPUConfig",
    "Masks",
    "PallasConfig",
    "attention",
    "attention_numpy",
    "attention_tiled_numpy",
    "attention_xla",
    "available_implementations",
    "default_implementation",
    "prepare",
]
__version__ = "0.1.0"


def __getattr__(name):
  # `jflash.nn` pulls in Flax; load it on first use so `import jflash` stays light.
  if name == "nn":
    import importlib
    return importlib.import_module("jflash.nn")
  raise AttributeError(f"module 'jflash' has no attribute {name!r}")
