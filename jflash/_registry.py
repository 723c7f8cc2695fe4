"""The built-in implementations, registered lazily so `import jflash` stays light."""
from __future__ import annotations

from jflash import config
from jflash.api import Implementation, register_implementation


def _xla():
  from jflash import reference

  def direct(q, k, v, cfg, masks):
    return reference.attention_xla(q, k, v, scale=cfg.scale, masks=masks)
  return Implementation("xla", direct=direct, broadcast_axes="BNTS")


def _xla_chunked():
  from jflash import chunked
  return Implementation("xla_chunked", forward=chunked.forward, backward=chunked.backward,
                        config_type=config.ChunkedConfig, preferred_on=chunked.PREFERRED_ON,
                        broadcast_axes="BNTS")


def _pallas():
  from jflash import pallas_impl
  return Implementation("pallas", forward=pallas_impl.forward,
                        backward=pallas_impl.backward, supports=pallas_impl.supports,
                        config_type=config.PallasConfig,
                        preferred_on=pallas_impl.PREFERRED_ON)


def _pallas_decode():
  # Its backward is the "pallas" one: the decode kernel's (out, lse) are the forward's.
  from jflash import decode_impl, pallas_impl
  return Implementation("pallas_decode", forward=decode_impl.forward,
                        backward=pallas_impl.backward, supports=decode_impl.supports,
                        preferred_on=decode_impl.PREFERRED_ON, masks_padding=True,
                        forward_stacked=decode_impl.forward_stacked)


def _mosaic_gpu():
  from jflash import mosaic_impl
  return Implementation("mosaic_gpu", forward=mosaic_impl.forward,
                        backward=mosaic_impl.backward, supports=mosaic_impl.supports,
                        config_type=config.MosaicGPUConfig,
                        preferred_on=mosaic_impl.PREFERRED_ON)


def _hip():
  # Preferred nowhere: the MI50 kernels take half precision and no dense mask, bias
  # or dropout, so they run when named.
  from jflash import hip_impl
  return Implementation("hip", forward=hip_impl.forward, backward=hip_impl.backward,
                        supports=hip_impl.supports, config_type=config.HipConfig)


def _cudnn():
  from jflash import cudnn_impl
  return Implementation("cudnn", direct=cudnn_impl.direct, supports=cudnn_impl.supports,
                        preferred_on=cudnn_impl.PREFERRED_ON, returns_lse=False)


register_implementation("xla", _xla)
register_implementation("xla_chunked", _xla_chunked)
register_implementation("pallas", _pallas)
# Before "mosaic_gpu": on Hopper, `implementation=None` tries the split-KV decode
# kernel first (it refuses all but small T), ties being broken by registration order.
register_implementation("pallas_decode", _pallas_decode)
register_implementation("mosaic_gpu", _mosaic_gpu)
register_implementation("hip", _hip)
register_implementation("cudnn", _cudnn)
