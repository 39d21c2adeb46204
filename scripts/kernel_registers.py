"""Registers and spills of every kernel instantiation: NVRTC (as the library compiles) to PTX,
then ``ptxas -v`` for sm_90a. Needs NVRTC and a CUDA toolkit's ptxas, no GPU.

Usage: python scripts/kernel_registers.py [FILTER]   (FILTER: a substring of the kernel names)
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile

from cupy_backends.cuda.libs import nvrtc

from twellsparse import _kernels


def report(name_filter: str = "") -> list[tuple[str, int, int]]:
    """(kernel, registers, spill bytes) for every instantiation whose name has the filter."""
    rows = []
    options = ["-arch=compute_90a", *_kernels.compile_options()]
    sources = {**_kernels.INSTANTIATIONS, **{n: e for n, (_, e) in _kernels.ARCH_SOURCES.items()}}
    for name, expressions in sources.items():
        prog = nvrtc.createProgram(_kernels.read_source(name), name, [], [])
        for expr in expressions:
            nvrtc.addNameExpression(prog, expr)
        nvrtc.compileProgram(prog, options)
        lowered = {nvrtc.getLoweredName(prog, e): e for e in expressions}
        ptx = nvrtc.getPTX(prog)
        nvrtc.destroyProgram(prog)
        with tempfile.NamedTemporaryFile("wb", suffix=".ptx") as f:
            f.write(ptx if isinstance(ptx, bytes) else ptx.encode())
            f.flush()
            log = subprocess.run(
                ["ptxas", "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"], capture_output=True, text=True, check=True
            ).stderr
        current = None
        for line in log.splitlines():
            m = re.search(r"Compiling entry function '(\w+)'", line)
            if m:
                current = lowered.get(m.group(1), m.group(1))
            m = re.search(r"(\d+) bytes spill stores", line)
            if m and current is not None:
                spill = int(m.group(1))
            m = re.search(r"Used (\d+) registers", line)
            if m and current is not None:
                if name_filter in current:
                    rows.append((current, int(m.group(1)), spill))
                current = None
    return rows


if __name__ == "__main__":
    for kernel, regs, spill in sorted(report(sys.argv[1] if len(sys.argv) > 1 else "")):
        print(f"{regs:4d} regs {spill:5d} B spilled  {kernel}")
