"""Reading a kernel's sm_90 machine code on any machine (no GPU): the opcodes of each loop of a
compiled cubin (cuobjdump), and its registers and spills (ptxas), with the tools Triton ships.
bench/sass_attention.py and bench/sass_gemv.py count their kernels' main loops with these.

An SM issues at most 128 thread-instructions a clock (4 schedulers of 32 lanes). At copy
bandwidth (about 4.3-4.8 TB/s over 132 SMs at 1.98 GHz: 16-18 bytes a clock an SM), a loop that
needs more than about 7 instructions for each byte it reads from memory cannot keep up with it,
whatever its settings; one under that is held by something else (latency, occupancy).
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compiling for a target, not interpreting
import triton  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
_ADDR = re.compile(r"\s+/\*([0-9a-f]{4,})\*/")
_BRANCH = re.compile(r"BRA\s+0x([0-9a-f]+)")
_OPCODE = re.compile(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")


def _tool(name: str, *args: str) -> str:
    out = subprocess.run([str(BIN / name), *args], capture_output=True, text=True)
    return out.stdout + out.stderr


def loops(cubin: bytes) -> list[collections.Counter]:
    """Opcode counts of each loop (a backward branch and what lies between), largest first."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    code = [(int(m.group(1), 16), line) for line in _tool("cuobjdump", "-sass", f.name).splitlines()
            if (m := _ADDR.match(line))]
    os.unlink(f.name)
    found = []
    for at, line in code:
        if (m := _BRANCH.search(line)) and int(m.group(1), 16) < at:
            body = [text for a, text in code if int(m.group(1), 16) <= a <= at]
            found.append(collections.Counter(m.group(1) for text in body if (m := _OPCODE.search(text))))
    return sorted(found, key=lambda c: -sum(c.values()))


def registers(ptx: str) -> str:
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    info = _tool("ptxas", "-arch=sm_90a", "-v", f.name, "-o", os.devnull)
    os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", info)
    spills = re.search(r"(\d+) bytes spill stores", info)
    return f"{regs.group(1) if regs else '?'} / {spills.group(1) if spills else '?'}"
