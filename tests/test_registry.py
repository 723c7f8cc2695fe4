"""The implementation registry: the order `implementation=None` tries, derived from
what each implementation declares, and the import rule between jflash's modules."""
import ast
import pathlib
import types

import jax
import pytest

from jflash import api, platforms

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _device(platform, version="", capability=None):
  return types.SimpleNamespace(platform=platform, compute_capability=capability,
                               client=types.SimpleNamespace(platform_version=version))


# (device, its kinds, what implementation=None tries there)
DEVICES = [
    (_device("gpu", "cuda 13.0", "9.0"), ("hopper", "cuda", "gpu", "any"),
     ("pallas_decode", "mosaic_gpu", "pallas", "xla_chunked")),
    (_device("gpu", "cuda 13.0", "8.0"), ("cuda", "gpu", "any"), ("pallas", "xla_chunked")),
    (_device("gpu", "rocm 7.0"), ("rocm", "gpu", "any"), ("pallas", "xla_chunked")),
    (_device("cpu"), ("cpu", "any"), ("xla_chunked",)),
    (_device("tpu"), ("tpu", "any"), ("xla_chunked",)),
]


@pytest.mark.parametrize("device, kinds, order", DEVICES)
def test_default_order_is_derived_from_the_declarations(monkeypatch, device, kinds, order):
  monkeypatch.setattr(jax, "devices", lambda *a: [device])
  assert platforms.device_kinds() == kinds
  assert api.default_implementation() == order
  assert api.default_implementation(device) == order


def test_default_order_on_this_device():
  # The device the suite runs on (CI's CPU, a Hopper GPU) is one of the kinds above and
  # gets that kind's order.
  orders = {kinds: order for _, kinds, order in DEVICES}
  kinds = platforms.device_kinds()
  assert kinds in orders, kinds
  assert api.default_implementation() == orders[kinds]


def test_a_registered_implementation_takes_its_place_in_the_order(monkeypatch):
  # Preferred on "gpu" it comes after what is preferred on Hopper and after the
  # earlier-registered "pallas", before what runs anywhere.
  api.register_implementation("extra", lambda: api.Implementation(
      "extra", direct=lambda *a: None, preferred_on=("gpu",)))
  try:
    hopper = _device("gpu", "cuda 13.0", "9.0")
    assert api.default_implementation(hopper) == (
        "pallas_decode", "mosaic_gpu", "pallas", "extra", "xla_chunked")
    assert api.default_implementation(_device("cpu")) == ("xla_chunked",)
  finally:
    api.unregister_implementation("extra")
  assert "extra" not in api.available_implementations()
  with pytest.raises(ValueError, match="implementation='extra' is not registered"):
    api.unregister_implementation("extra")


def _jflash_imports(path):
  """Modules a file imports from jflash (module level and inside functions)."""
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jflash"):
      names.add(node.module)
      names.update(f"{node.module}.{a.name}" for a in node.names)
    elif isinstance(node, ast.Import):
      names.update(a.name for a in node.names if a.name.startswith("jflash"))
  return names


@pytest.mark.parametrize("adapter", ["pallas_impl", "decode_impl", "mosaic_impl", "hip_impl",
                                     "chunked", "derivatives", "platforms"])
def test_no_backend_adapter_imports_the_api(adapter):
  # jflash.api imports the adapters (through the registry); an adapter importing it
  # back would make a circle.
  imports = _jflash_imports(ROOT / "jflash" / f"{adapter}.py")
  assert not {"jflash.api", "jflash._registry"} & imports, imports
