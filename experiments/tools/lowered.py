"""Mosaic GPU kernels inside a lowered JAX program, as text.

A program lowered for CUDA (`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`,
which runs on any machine) carries each Mosaic GPU kernel as MLIR bytecode in its custom
call; these helpers print them. Light on imports: the kernel tests use them too.
"""
from __future__ import annotations

import re


def print_module(raw: str) -> str:
  """One module's MLIR bytecode, escaped as the lowered text carries it, as text."""
  from jax._src.interpreters import mlir
  from jax._src.lib.mlir import ir
  data, i = bytearray(), 0
  while i < len(raw):                  # MLIR's string escapes: \\, \" and \XX (hex)
    if raw[i] != "\\":
      data.append(ord(raw[i])); i += 1
    elif raw[i + 1] in '\\"':
      data.append(ord(raw[i + 1])); i += 2
    else:
      data.append(int(raw[i + 1:i + 3], 16)); i += 3
  with mlir.make_ir_context() as ctx:
    ctx.allow_unregistered_dialects = True
    return str(ir.Module.parse(bytes(data)))


def mosaic_modules(lowered: str) -> list[str]:
  """Every Mosaic GPU module inside a lowered program, printed as text."""
  return [print_module(raw) for raw in re.findall(r'module = "((?:[^"\\]|\\.)*)"', lowered)]


def normalized(module: str) -> list[str]:
  """The module's lines with SSA value and block names replaced, to read a difference
  by (equal modules are equal as printed; this only lines up the lines that differ)."""
  text = re.sub(r"%[\w.#]+", "%v", re.sub(r"\^bb\d+", "^bb", module))
  return [line.strip() for line in text.splitlines() if line.strip()]
