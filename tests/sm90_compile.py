"""Compile Triton kernels ahead of time for an H100/H200 (sm_90) on a machine without a GPU.

The interpreter that runs the kernels in CI accepts programs the GPU compiler rejects (a tuple
of dtypes, shapes that only broadcast in numpy): such kernels pass every CPU test and fail on
the first GPU forward. Triton compiles to a cubin for a named target without a device, so the
tests do that too. Run as a script (the interpreter must be off, so never inside the test
process): ``python tests/sm90_compile.py MODULE:KERNEL JSON_ARGS``; the test passes each
kernel's argument types and constexpr values.
"""
from __future__ import annotations

import importlib
import inspect
import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

from triton import compile as triton_compile  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)


def compile_sm90(kernel, types: dict[str, str], constexprs: dict[str, object]) -> None:
    """``types``: Triton type strings for the runtime arguments (``*bf16``, ``*u8``, ``i32``,
    ``fp32``); ``constexprs``: values of the compile-time ones (those left out take their
    defaults, so that a kernel can gain an option without every caller's list naming it)."""
    defaults = {p.name: p.default for p in kernel.params if p.is_constexpr and p.default is not inspect.Parameter.empty}
    constexprs = {**defaults, **constexprs}
    sig = {name: ("constexpr" if name in constexprs else types[name]) for name in kernel.arg_names}
    triton_compile(ASTSource(fn=kernel, signature=sig, constexprs=constexprs), target=SM90)


if __name__ == "__main__":
    failures = 0
    for spec in json.loads(sys.argv[1]):
        module, name = spec["kernel"].split(":")
        kernel = getattr(importlib.import_module(module), name)
        try:
            compile_sm90(kernel, spec["types"], spec["constexprs"])
            print(f"ok {spec['kernel']} {spec['constexprs']}")
        except Exception as e:  # the compiler's own error types
            failures += 1
            print(f"FAILED {spec['kernel']} {spec['constexprs']}: {type(e).__name__}: {e}"[:2000])
    sys.exit(1 if failures else 0)
