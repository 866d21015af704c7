"""Kernels launched every step do not take what varies from step to step for a new variant.

Triton compiles a kernel again for each new specialization of its arguments: an integer equal
to 1 or divisible by 16, a pointer aligned to 16 bytes. A server met one mid-serving (a mixed
step's prefill part reads the step's metadata from the sequence after its decodes, aligned or
not as the decode count falls) and every request waited about a second for it. Checked with the
binder Triton's launcher keys its kernel cache by, on the CPU."""
from __future__ import annotations

import pytest
import torch
import triton.runtime.jit as triton_jit
from triton.backends.compiler import BaseBackend

from kvship.kernels import graph_inputs, mla_attention, paged_attention

SPECIALIZE_OPTIONS = ("do_not_specialize", "do_not_specialize_on_alignment")


def jit_function(kernel) -> triton_jit.JITFunction:
    if isinstance(kernel, triton_jit.JITFunction):
        return kernel
    # interpreted (the CPU tests): the same function, compiled
    return triton_jit.JITFunction(kernel.fn, **{k: kernel.kwargs.get(k) for k in SPECIALIZE_OPTIONS})


def specialization(kernel, varied: dict) -> list:
    """The specialization Triton keys ``kernel``'s cache by, for arguments that are all the same
    but ``varied`` (name -> value): pointers an int32 tensor, integers 1000, constexprs their
    default or 1."""
    kernel = jit_function(kernel)
    buffer = torch.zeros(64, dtype=torch.int32)
    args = {}
    for p in kernel.params:
        if p.name in varied:
            args[p.name] = varied[p.name]
        elif p.is_constexpr:
            if not p.has_default:
                args[p.name] = 1
        elif p.name.endswith("_ptr"):
            args[p.name] = buffer
        else:
            args[p.name] = 1000
    binder = triton_jit.create_function_from_signature(kernel.signature, kernel.params, BaseBackend)
    return binder(**args)[1]


def offsets(names: list[str], offset: int) -> dict:
    """Each named pointer an int32 view starting ``offset`` elements into its buffer (1: 4 bytes
    past a 16-byte boundary)."""
    return {n: torch.zeros(64, dtype=torch.int32)[offset:] for n in names}


ATTENTION = [paged_attention._prefill_kernel, paged_attention._decode_kernel, mla_attention._mla_prefill_kernel,
             mla_attention._mla_decode_kernel]


@pytest.mark.parametrize("kernel", ATTENTION, ids=lambda k: k.fn.__name__)
def test_attention_kernels_ignore_where_a_steps_metadata_starts(kernel):
    pointers = paged_attention.STEP_POINTERS
    aligned = specialization(kernel, {**offsets(pointers, 0), "stride_bt": 64})
    for offset, width in ((1, 67), (2, 1), (3, 48)):
        assert specialization(kernel, {**offsets(pointers, offset), "stride_bt": width}) == aligned


def test_the_check_sees_an_alignment_that_does_specialize():
    """The query pointer is still specialized (its rows' loads vectorize): the binder tells."""
    kernel = paged_attention._prefill_kernel
    assert specialization(kernel, offsets(["q_ptr"], 1)) != specialization(kernel, offsets(["q_ptr"], 0))


def test_graph_staging_kernel_ignores_the_steps_sizes():
    kernel = graph_inputs._stage_kernel
    sizes = ("n", "width", "num_fix", "stride_bt")
    first = specialization(kernel, dict.fromkeys(sizes, 1))
    for value in (16, 37, 256):
        assert specialization(kernel, dict.fromkeys(sizes, value)) == first


def compile_info(kernel, varied: dict) -> dict:
    """What Triton's hooks get as ``compile`` for that launch: each argument's type, its
    specialization attribute, the constexprs' values."""
    spec = specialization(kernel, varied)
    names = [p.name for p in jit_function(kernel).params]
    return {"signature": {n: ty for n, (ty, _) in zip(names, spec)},
            "configs": [{(i,): BaseBackend.parse_attr(attr) for i, (_, attr) in enumerate(spec)
                         if isinstance(attr, str) and attr}],
            "constants": {(i,): v for i, (ty, v) in enumerate(spec) if ty == "constexpr"}}


def test_compiles_reach_every_watcher_with_the_kernel_its_time_and_what_was_new():
    """What a GPU server logs (runner/model_runner.py) and profile_step.py --host lists: Triton
    calls its cache hook before a compile and the post-compile hook after, by keyword; the
    arguments that made a variant new are named against the closest one compiled before."""
    from triton import knobs
    from triton.runtime.jit import JitFunctionInfo

    from kvship.kernels import _triton

    kernel = paged_attention._prefill_kernel
    saved = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook, list(_triton._compile_watchers),
             dict(_triton._variants))
    first, second = [], []
    try:
        knobs.runtime.jit_cache_hook = knobs.runtime.jit_post_compile_hook = None
        _triton._compile_watchers.clear()
        _triton._variants.clear()
        _triton.watch_compiles(lambda *a: first.append(a))
        _triton.watch_compiles(lambda *a: second.append(a))
        for q_offset in (0, 0, 1):  # a variant, the same again (another engine), the query unaligned
            info = compile_info(kernel, offsets(["q_ptr"], q_offset))
            hook = dict(key=(q_offset,), repr="r", fn=JitFunctionInfo(paged_attention, "_prefill_kernel", None),
                        compile={"key": (q_offset,), **info}, is_manual_warmup=False, already_compiled=False)
            assert not knobs.runtime.jit_cache_hook(**hook)  # falsy: Triton goes on to compile
            knobs.runtime.jit_post_compile_hook(**hook)
        knobs.runtime.jit_post_compile_hook(**{**hook, "compile": {"odd": 1}})  # a Triton that says less
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = saved[:2]
        _triton._compile_watchers[:] = saved[2]
        _triton._variants.clear()
        _triton._variants.update(saved[3])
    assert first == second and [name for name, _, _ in first] == ["_prefill_kernel"] * 4
    assert all(0 <= seconds < 5 for _, seconds, _ in first)
    assert [new for _, _, new in first[:2]] == ["", ""]
    assert first[2][2] == "q_ptr *i32 divisibility 16 -> *i32"
