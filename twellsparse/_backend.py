"""Array-module, device and dtype helpers.

CuPy is optional: it is imported lazily, so NumPy-only users never pay for it.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import ml_dtypes
import numpy as np

bfloat16 = np.dtype(ml_dtypes.bfloat16)

#: Value dtypes a TwELL matrix may hold (float64 runs everywhere, the 16-bit ones are the fast paths).
VALUE_DTYPES: tuple[np.dtype, ...] = (
    np.dtype(np.float16),
    bfloat16,
    np.dtype(np.float32),
    np.dtype(np.float64),
)


@functools.cache
def cupy_module() -> ModuleType | None:
    """Return the ``cupy`` module, or None when it is not installed or cannot load."""
    try:
        import cupy
    except Exception:  # ImportError, or a broken CUDA install: both mean "no GPU path"
        return None
    return cupy


def gpu_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    cp = cupy_module()
    if cp is None:
        return False
    try:
        return bool(cp.cuda.runtime.getDeviceCount() > 0)
    except Exception:
        return False


def is_cupy_array(x: Any) -> bool:
    cp = cupy_module()
    return cp is not None and isinstance(x, cp.ndarray)


def is_jax_array(x: Any) -> bool:
    """A ``jax.Array`` (or tracer), told apart without importing JAX: the JAX adapter's matrices
    hold these, their spill padded to a static length."""
    return type(x).__module__.split(".")[0] in ("jax", "jaxlib")


def is_jax_tracer(x: Any) -> bool:
    """A JAX tracer (an abstract value inside ``jax.jit`` or another transformation): JAX is
    imported only for a value that is a JAX array."""
    if not is_jax_array(x):
        return False
    import jax

    return isinstance(x, jax.core.Tracer)


def array_module(x: Any) -> ModuleType:
    """NumPy or CuPy, whichever owns ``x``."""
    if is_cupy_array(x):
        cp = cupy_module()
        assert cp is not None
        return cp
    return np


def cupy_view(
    ptr: int, shape: tuple[int, ...], dtype: Any, owner: Any, device: int, strides: tuple[int, ...] | None = None
) -> Any:
    """A CuPy array over device memory owned by another framework's buffer, kept alive by
    ``owner``: no DLPack capsule and no stream handshake, so the caller orders the work itself
    (the adapters run on the stream the framework hands them). ``strides`` in bytes (C order
    when omitted); ``device`` spares CuPy a pointer-attribute query."""
    cp = cupy_module()
    assert cp is not None
    dtype = np.dtype(dtype)
    if strides is None:
        strides, step = (), dtype.itemsize
        for d in reversed(shape):
            strides, step = (step, *strides), step * max(d, 1)
    extent = dtype.itemsize + sum((d - 1) * s for d, s in zip(shape, strides, strict=True)) if all(shape) else 0
    memory = cp.cuda.UnownedMemory(ptr, extent, owner, device)
    return cp.ndarray(shape, dtype, cp.cuda.MemoryPointer(memory, 0), strides=strides)


def device_name(x: Any) -> str:
    """``"cpu"`` or ``"cuda:N"`` for an array; used in error messages and device checks."""
    if is_cupy_array(x):
        return f"cuda:{x.device.id}"
    return "cpu"


def as_array(x: Any, name: str) -> Any:
    """NumPy or CuPy view of ``x`` (zero-copy for DLPack producers such as torch tensors).

    Raises
    ------
    TypeError
        When ``x`` is neither an array nor convertible to one.
    """
    if isinstance(x, np.ndarray) or is_cupy_array(x):
        return x
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        if getattr(x, "requires_grad", False) and hasattr(x, "detach"):
            # torch exports no tensor that autograd records (an nn.Linear's weight); these ops
            # only read values (twellsparse.torch is the autograd-aware entry point).
            x = x.detach()
        device_type, _ = x.__dlpack_device__()
        if int(device_type) in (2, 3, 13):  # kDLCUDA, kDLCUDAHost, kDLCUDAManaged
            cp = cupy_module()
            if cp is None:
                raise TypeError(f"{name}: a CUDA array needs CuPy, which is not installed")
            return cp.from_dlpack(x)
        return _numpy_from_dlpack(x, name)
    if isinstance(x, (list, tuple, int, float)) or hasattr(x, "__array__"):
        return np.asarray(x)
    raise TypeError(f"{name}: expected an array (NumPy, CuPy or DLPack producer), got {type(x).__name__}")


def _numpy_from_dlpack(x: Any, name: str) -> np.ndarray:
    try:
        return np.from_dlpack(x)
    except (BufferError, TypeError, RuntimeError):
        pass
    # NumPy's DLPack import refuses bfloat16; a torch CPU tensor can still hand over its bits,
    # and producers with an array interface (JAX's, which gives ml_dtypes' bfloat16) a copy.
    if getattr(x, "dtype", None) is not None and str(x.dtype) == "torch.bfloat16":
        return np.from_dlpack(x.view(__import__("torch").int16)).view(bfloat16)
    if hasattr(x, "__array__"):
        try:
            return np.asarray(x)
        except (TypeError, ValueError, RuntimeError):
            pass
    raise TypeError(f"{name}: could not import {type(x).__name__} through DLPack on the CPU")


def to_host(x: Any) -> np.ndarray:
    """NumPy copy (or the array itself) of a NumPy/CuPy array."""
    if is_cupy_array(x):
        return x.get()
    return np.asarray(x)


def value_dtype(dtype: Any, name: str = "dtype") -> np.dtype:
    """Validate and normalise a value dtype (accepts ``"bfloat16"`` and ml_dtypes' type)."""
    try:
        dt = bfloat16 if str(dtype) == "bfloat16" else np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{name}: expected a floating dtype, got {dtype!r}") from None
    if dt not in VALUE_DTYPES:
        expected = ", ".join(d.name for d in VALUE_DTYPES)
        raise TypeError(f"{name}: expected one of {expected}, got {dt.name}")
    return dt


def result_dtype(*dtypes: np.dtype) -> np.dtype:
    """Promotion among value dtypes: the widest wins; bfloat16 with float16 gives float32."""
    ds = set(dtypes)
    if len(ds) == 1:
        return dtypes[0]
    if np.dtype(np.float64) in ds:
        return np.dtype(np.float64)
    return np.dtype(np.float32)
