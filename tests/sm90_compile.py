"""Compile Triton kernels ahead of time for an H100/H200 (sm_90) on a machine without a GPU.

The interpreter that runs the kernels in CI accepts programs the GPU compiler rejects (a tuple
of dtypes, shapes that only broadcast in numpy): such kernels pass every CPU test and fail on
the first GPU forward. Triton compiles to a cubin for a named target without a device, so the
tests do that too. Run as a script (the interpreter must be off, so never inside the test
process): ``python tests/sm90_compile.py JSON_SPECS``; a test builds each kernel's argument
types and constexpr values (with the helpers below, which a test process may import) and
passes them to ``compile_in_child``.
"""
from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

# A child process (this script, or one that imports this module before triton) compiles, so the
# interpreter goes off before triton is imported; a test process imports the module only for its
# helpers and keeps the interpreter on for the kernels it runs and the processes it starts.
if "pytest" not in sys.modules:
    os.environ.pop("TRITON_INTERPRET", None)

try:
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    SM90 = GPUTarget("cuda", 90, 32)
except ImportError:  # no triton: the compile tests skip, and the modules that hold them still import
    pass


# Shared memory one block may use on an H100/H200 (227 KB): a kernel asking more compiles, and
# fails at its first launch (Triton's OutOfResources), so the compile tests hold every spec to it.
SM90_SHARED_BYTES = 227 * 1024


def ints(*names: str) -> dict[str, str]:
    """Runtime arguments that are 32-bit integers (sizes, strides)."""
    return dict.fromkeys(names, "i32")


def attention_types(cache: str = "*bf16", scales: str = "*bf16") -> dict[str, str]:
    """Runtime argument types of paged_attention's prefill kernel, and the decode kernel's
    without its split outputs (``decode_types``), for a bf16 query and output and a cache of
    ``cache`` elements with ``scales`` (a 16-bit cache: any pointer, never read)."""
    return {"q_ptr": "*bf16", "kc_ptr": cache, "vc_ptr": cache, "ks_ptr": scales, "vs_ptr": scales,
            "bt_ptr": "*i32", "seqlens_ptr": "*i32", "cuq_ptr": "*i32", "out_ptr": "*bf16", "qk_scale": "fp32",
            "sinks_ptr": "*bf16",  # the query when SINKS is off (never read)
            **ints("stride_qt", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs",
                   "stride_vh", "stride_gb", "stride_gs", "stride_gh", "stride_ksb", "stride_ksh",
                   "stride_bt", "stride_ot", "stride_oh")}


def decode_types(cache: str = "*bf16", scales: str = "*bf16") -> dict[str, str]:
    """``attention_types`` and the decode kernel's fp32 partial outputs of a split sequence."""
    return {**attention_types(cache, scales), "mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32",
            **ints("stride_mob", "stride_moh", "stride_mos", "stride_mlb", "stride_mlh")}


def compile_in_child(specs: list[dict]) -> None:
    """Compile every spec (``{"kernel": "MODULE:KERNEL", "types": .., "constexprs": ..}``) in a
    child process running this script; fails with the compiler's messages unless all compile
    within an sm_90 block's shared memory (SM90_SHARED_BYTES)."""
    proc = subprocess.run([sys.executable, str(Path(__file__)), json.dumps(specs)], capture_output=True, text=True,
                          timeout=840)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.stdout.count("ok ") == len(specs), proc.stdout[-4000:]


def ttgir_in_child(spec: dict) -> str:
    """The TTGIR of one spec (as ``compile_in_child`` takes; may name ``divisible`` and
    ``options``), compiled in a child process: the layouts Triton chose."""
    proc = subprocess.run([sys.executable, str(Path(__file__)), "--ttgir", json.dumps(spec)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def with_defaults(kernel, constexprs: dict[str, object]) -> dict[str, object]:
    """``constexprs`` and the defaults of the compile-time arguments it leaves out (so that a
    kernel can gain an option without every caller's list naming it). PDL is on where a kernel
    takes it: on sm_90 the engine launches those kernels with it (kernels/_triton.pdl)."""
    defaults = {p.name: p.default for p in kernel.params if p.is_constexpr and p.default is not inspect.Parameter.empty}
    if "PDL" in kernel.arg_names:
        defaults["PDL"] = True
    return {**defaults, **constexprs}


def compile_sm90(kernel, types: dict[str, str], constexprs: dict[str, object], divisible: list[str] = (),
                 options: dict | None = None):
    """``types``: Triton type strings for the runtime arguments (``*bf16``, ``*u8``, ``i32``,
    ``fp32``); ``constexprs``: values of the compile-time ones (``with_defaults``);
    ``divisible``: arguments a launch finds divisible by 16 (pointers from torch, strides of
    whole 16-element rows), which Triton specializes on and which decide its vector widths and
    layouts; ``options``: num_warps, num_stages. Returns the compiled kernel."""
    constexprs = with_defaults(kernel, constexprs)
    sig = {name: ("constexpr" if name in constexprs else types[name]) for name in kernel.arg_names}
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    return triton_compile(ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs), target=SM90,
                          options=options)


def _kernel(spec: dict):
    module, name = spec["kernel"].split(":")
    return getattr(importlib.import_module(module), name)


if __name__ == "__main__":
    if sys.argv[1] == "--ttgir":  # one spec: print its TTGIR (the layouts Triton chose)
        spec = json.loads(sys.argv[2])
        print(compile_sm90(_kernel(spec), spec["types"], spec["constexprs"], spec.get("divisible", ()),
                           spec.get("options")).asm["ttgir"])
        sys.exit(0)
    failures = 0
    for spec in json.loads(sys.argv[1]):
        kernel = _kernel(spec)
        try:
            compiled = compile_sm90(kernel, spec["types"], spec["constexprs"], spec.get("divisible", ()),
                                    spec.get("options"))
            if compiled.metadata.shared > SM90_SHARED_BYTES:
                raise RuntimeError(f"{compiled.metadata.shared} bytes of shared memory, more than an H200 block's "
                                   f"{SM90_SHARED_BYTES}")
            print(f"ok {spec['kernel']} {spec['constexprs']}")
        except Exception as e:  # the compiler's own error types
            failures += 1
            print(f"FAILED {spec['kernel']} {spec['constexprs']}: {type(e).__name__}: {e}"[:2000])
    sys.exit(1 if failures else 0)
