"""Finding and loading NVIDIA shared libraries for the cffi bindings (no compiler needed).

A library is looked for in an environment variable naming its path, then the NVIDIA pip wheels
(the ``nvidia`` namespace package: ``<lib>/lib``, ``cu13/lib``, ``cu12/lib``), then
``CUDA_PATH`` / ``CUDA_HOME`` / ``/usr/local/cuda``, then the dynamic loader's own search.
"""

from __future__ import annotations

import ctypes.util
import glob
import os
from collections.abc import Iterator
from typing import Any


def ffi(cdef: str, what: str, error: type[Exception]) -> Any:
    """A cffi FFI holding ``cdef``; ``error`` naming the missing package when cffi is absent."""
    try:
        import cffi
    except ImportError as exc:
        raise error(f"{what} bindings need cffi: pip install 'twellsparse[cuda12]' (or [cuda13])") from exc
    out = cffi.FFI()
    out.cdef(cdef)
    return out


def candidates(env_var: str, stem: str, wheel_dir: str, sonames: tuple[str, ...]) -> Iterator[str]:
    """Paths and sonames to try for ``lib<stem>.so``, in order."""
    explicit = os.environ.get(env_var)
    if explicit:
        yield explicit
    pattern = f"lib{stem}.so*"
    try:
        import nvidia  # the namespace package of NVIDIA's pip wheels

        for root in list(getattr(nvidia, "__path__", [])):
            for sub in (f"{wheel_dir}/lib", "cu13/lib", "cu12/lib"):
                yield from sorted(glob.glob(os.path.join(root, sub, pattern)), reverse=True)
    except ImportError:
        pass
    for var in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(var):
            yield from sorted(glob.glob(os.path.join(os.environ[var], "lib64", pattern)), reverse=True)
    yield from sorted(glob.glob(f"/usr/local/cuda/lib64/{pattern}"), reverse=True)
    found = ctypes.util.find_library(stem)
    if found:
        yield found
    yield from sonames


def load(ffi: Any, tried_candidates: Iterator[str], what: str, hint: str, error: type[Exception]) -> Any:
    """``ffi.dlopen`` the first candidate that loads; else ``error`` naming every place tried."""
    tried = []
    for candidate in tried_candidates:
        try:
            return ffi.dlopen(candidate)
        except OSError as exc:
            tried.append(f"{candidate} ({exc})")
    raise error(f"{what}: no library could be loaded; {hint}. Tried: " + "; ".join(tried))
