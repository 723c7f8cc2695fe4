"""What `pip install jflash` ships: the wheel holds the three packages (every subpackage
found, none listed by hand) and the HIP sources, and the JAX range pyproject declares is
the one CI tests. (CI installs the wheel into a fresh venv and runs it: .ci/wheel_check.)"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import jax
import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("jflash", "pallas_kernels", "hip_ffi")


def _setuptools_version():
  try:
    import setuptools
  except ImportError:
    return None
  return tuple(int(x) for x in re.findall(r"\d+", setuptools.__version__)[:2])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
  """The wheel built offline (no build isolation) from a copy of the checkout, so that no
  earlier build/ folder leaks stale files into it."""
  version = _setuptools_version()
  if version is None or version < (77,):
    if os.environ.get("CI"):
      pytest.fail("CI is set but setuptools>=77 is missing: the dev extra installs it")
    pytest.skip(f"building the wheel needs setuptools>=77 (pyproject's backend), have {version}")
  tmp = tmp_path_factory.mktemp("wheel")
  src = tmp / "src"
  shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
      ".git", ".venv*", "build", "*.egg-info", "__pycache__", ".pytest_cache", "_build",
      "results"))
  subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                  "-q", "-w", str(tmp / "dist"), str(src)], check=True, timeout=300)
  path, = (tmp / "dist").glob("jflash-*.whl")
  return zipfile.ZipFile(path).namelist()


def test_wheel_holds_the_three_packages_and_the_license(wheel):
  top = {name.split("/")[0] for name in wheel}
  dist_info, = (t for t in top if t.endswith(".dist-info"))
  assert top == {*PACKAGES, dist_info}
  assert f"{dist_info}/licenses/LICENSE" in wheel


def test_wheel_holds_every_module_and_the_kernel_sources(wheel):
  """Every .py under the three packages (a new subpackage included) and every HIP/C++
  source hip_ffi.build compiles."""
  for package in PACKAGES:
    for path in (REPO / package).rglob("*"):
      rel = path.relative_to(REPO).as_posix()
      if "__pycache__" in rel or "_build" in rel or not path.is_file():
        continue
      if path.suffix == ".py" or path.suffix in (".hip", ".h", ".cc"):
        assert rel in wheel, f"{rel} is not in the wheel"


def test_declared_jax_range_is_the_tested_range():
  """pyproject's floor is the version CI's first run pins (.ci/jax-lowest.txt), and the
  JAX running this suite lies inside the declared range."""
  deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
  pins = dict(re.findall(r"^(\w+)==(\S+)$", (REPO / ".ci" / "jax-lowest.txt").read_text(), re.M))
  running = {"jax": jax.__version__, "jaxlib": jax.lib.__version__}
  as_tuple = lambda v: tuple(int(x) for x in v.split("."))
  for name in ("jax", "jaxlib"):
    floor, ceiling = re.fullmatch(rf"{name}>=(\S+),<(\S+)", next(
        d for d in deps if re.match(rf"{name}\b", d))).groups()
    assert pins[name] == floor, (name, pins[name], floor)
    assert as_tuple(floor) <= as_tuple(running[name]) < as_tuple(ceiling), (name, running[name])
