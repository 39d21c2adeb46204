"""cffi bindings (ABI mode) to cuBLASLt for two jobs: the plain product ``x @ w.T`` (one plan
per shape, so that the library's dense GEMMs can be captured in CUDA graphs: CuPy's cuBLAS
wrapper refuses calls during a capture) and ``relu(x @ w.T)`` with the ReLU bit-mask epilogue
(``CUBLASLT_EPILOGUE_RELU_AUX``).

The bit-mask (one bit per output element, set where the GEMM result was positive) lets the
TwELL producer read 1/16 of the bytes a dense bf16 scan reads to find the nonzeros: the pack
then gathers only the values whose bit is set. Library discovery as in :mod:`._loader`
(``TWELL_CUBLASLT``, the ``nvidia-cublas`` wheels, the CUDA toolkit). Enum values are those of
``cublasLt.h``.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any

import numpy as np

from . import _loader

CDEF = """
typedef int cublasStatus_t;
typedef struct cublasLtContext* cublasLtHandle_t;
typedef struct { uint64_t data[32]; } cublasLtMatmulDescOpaque_t;
typedef cublasLtMatmulDescOpaque_t* cublasLtMatmulDesc_t;
typedef struct { uint64_t data[8]; } cublasLtMatrixLayoutOpaque_t;
typedef cublasLtMatrixLayoutOpaque_t* cublasLtMatrixLayout_t;
typedef struct { uint64_t data[8]; } cublasLtMatmulPreferenceOpaque_t;
typedef cublasLtMatmulPreferenceOpaque_t* cublasLtMatmulPreference_t;
typedef struct { uint64_t data[8]; } cublasLtMatmulAlgo_t;
typedef struct {
  cublasLtMatmulAlgo_t algo;
  size_t workspaceSize;
  cublasStatus_t state;
  float wavesCount;
  int reserved[4];
} cublasLtMatmulHeuristicResult_t;
typedef void* cudaStream_t;

size_t cublasLtGetVersion(void);
cublasStatus_t cublasLtCreate(cublasLtHandle_t* handle);
cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc, int compute_type, int scale_type);
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc);
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc, int attr, const void* buf, size_t size);
cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, int type, uint64_t rows, uint64_t cols,
    int64_t ld);
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout);
cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref);
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref);
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref, int attr, const void* buf,
    size_t size);
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
    cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
    cublasLtMatmulPreference_t pref, int requested, cublasLtMatmulHeuristicResult_t* results, int* returned);
cublasStatus_t cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void* alpha, const void* a,
    cublasLtMatrixLayout_t a_desc, const void* b, cublasLtMatrixLayout_t b_desc, const void* beta, const void* c,
    cublasLtMatrixLayout_t c_desc, void* d, cublasLtMatrixLayout_t d_desc, const cublasLtMatmulAlgo_t* algo,
    void* workspace, size_t workspace_size, cudaStream_t stream);
"""

# cublasLt.h / cublas_api.h / library_types.h
STATUS_SUCCESS = 0
COMPUTE_32F = 68
CUDA_R = {"float16": 2, "bfloat16": 14, "float32": 0}
_CUDA_R_32F = 0
OP_N, OP_T = 0, 1
DESC_TRANSA, DESC_TRANSB, DESC_EPILOGUE = 3, 4, 7
DESC_EPILOGUE_AUX_POINTER, DESC_EPILOGUE_AUX_LD = 11, 12
EPILOGUE_RELU, EPILOGUE_RELU_AUX = 2, 2 | 128
PREF_MAX_WORKSPACE_BYTES = 1
#: Workspace offered to the heuristic (cuBLAS's own default on Hopper is 32 MiB).
WORKSPACE_BYTES = 32 << 20
ENV_LIBRARY = "TWELL_CUBLASLT"
ENV_CANDIDATES = "TWELL_GEMM_CANDIDATES"
#: Launches per candidate when a plan times the heuristic's candidates (after one warm-up).
TUNING_REPS = 3
#: Plans launched inside a CUDA graph capture: the graph replays their workspace address, so
#: they live as long as the process (a plan cache may drop its own reference).
_CAPTURED: set[Any] = set()
#: The algorithm a plan chose by timing (its bytes), per (plan class, F, K, dtype, device, size
#: class of M): a later plan of that key adopts it without timing where the heuristic offers
#: it, so a server meeting many token counts times once per size class, not once per count.
_CHOSEN: dict[tuple, bytes] = {}


def size_class(m: int) -> int:
    """The token counts that share a timed choice: M in (2**(c - 1), 2**c] is class c."""
    return max(m - 1, 0).bit_length()


def adopt(candidates: list, chosen: bytes | None, key: Any) -> list:
    """``candidates`` narrowed to the one whose ``key(algorithm)`` bytes equal ``chosen`` (a
    timed choice of the same size class), or unchanged when there is none or it is not offered."""
    if chosen is None:
        return candidates
    same = [c for c in candidates if key(c[0]) == chosen]
    return same[:1] or candidates


def candidates_from_environment() -> int:
    """How many of the heuristic's algorithms a plan times on its first call (``TWELL_GEMM_CANDIDATES``,
    default 8; 1 takes the heuristic's first choice untimed, as cuBLASLt's own default does)."""
    raw = os.environ.get(ENV_CANDIDATES) or "8"  # unset or empty: the default
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{ENV_CANDIDATES}: expected a positive integer, got {raw!r}")
    return int(raw)


def _l2_eviction_buffer() -> Any:
    """A device buffer twice the current device's L2 size, whose fill evicts a GEMM's operands
    from L2 before a timed launch (the memory pool keeps it for the next plan's timing); None
    where the device has no room for it (the candidates are then timed from a warm L2)."""
    import cupy as cp

    properties = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    l2_bytes = int(properties.get("l2CacheSize", 0)) or 64 << 20
    try:
        return cp.empty(2 * l2_bytes, dtype=cp.uint8)
    # A nearly full GPU: time warm rather than fail the call. CuPy's pool raises its own error;
    # an allocator it was handed (torch's, inside the torch adapter) raises a RuntimeError.
    except (cp.cuda.memory.OutOfMemoryError, MemoryError, RuntimeError):
        return None


class CuBlasLtError(RuntimeError):
    """A cuBLASLt call failed, or the library could not be loaded."""


@functools.cache
def _ffi() -> Any:
    return _loader.ffi(CDEF, "cuBLASLt", CuBlasLtError)


@functools.cache
def library() -> Any:
    """The loaded cuBLASLt library; :class:`CuBlasLtError` naming every place tried if none loads."""
    candidates = _loader.candidates(
        ENV_LIBRARY, "cublasLt", "cublas", ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so")
    )
    hint = f"install nvidia-cublas-cu12 (CUDA 12) or nvidia-cublas (CUDA 13), or set {ENV_LIBRARY} to its path"
    return _loader.load(_ffi(), candidates, "cuBLASLt", hint, CuBlasLtError)


def version() -> int:
    """cuBLASLt's version number (needs the library, not a GPU)."""
    return int(library().cublasLtGetVersion())


def _check(status: int, call: str) -> None:
    if status != STATUS_SUCCESS:
        raise CuBlasLtError(f"{call}: cuBLAS status {status}")


def mask_ld(n_out: int) -> int:
    """Bits per token row of the ReLU mask: ``n_out`` rounded up to 128 (cuBLASLt's rule)."""
    return -(-n_out // 128) * 128


@functools.cache
def _handle(device: int) -> Any:
    h = _ffi().new("cublasLtHandle_t*")
    _check(library().cublasLtCreate(h), "cublasLtCreate")
    return h[0]


def _algo_bytes(algo: Any) -> bytes:
    """The bytes of a ``cublasLtMatmulAlgo_t*`` (the opaque algorithm, compared by value)."""
    return bytes(_ffi().buffer(algo))


class Gemm:
    """``out = x @ w.T`` (row-major, M x F), planned once for one shape: fp32 accumulation, on
    CuPy's current stream, capturable in a CUDA graph (no host synchronisation, a workspace
    owned by the plan). Subclasses add an epilogue.

    The plan asks the heuristic for up to :func:`candidates_from_environment` algorithms and, on
    its first call outside a CUDA-graph capture, times each on that call's operands (each launch
    from a cold L2) and keeps the fastest (a host synchronisation, once per plan; a plan whose
    size class of M already has a timed choice that the heuristic offers again takes it
    untimed, :func:`adopt`). Why: the
    heuristic's first choice ran 5-12% slower than torch's GEMM at 16384 x 4096 -> 14336 in
    bf16 on the H200 (bench/NOTES.md, fifteenth session), which cost the dense remainder of
    ``dispatch="auto"`` as much. Calls inside a capture before that take the first choice.
    Another process may time its way to another algorithm, and so to other last bits;
    ``TWELL_GEMM_CANDIDATES=1`` keeps the heuristic's first choice.
    """

    #: cuBLASLt epilogue (CUBLASLT_EPILOGUE_DEFAULT).
    EPILOGUE = 1

    def __init__(self, m: int, f: int, k: int, dtype: Any) -> None:
        import cupy as cp

        name = np.dtype(dtype).name
        if name not in CUDA_R:
            raise ValueError(f"dtype: expected one of {', '.join(CUDA_R)}, got {name}")
        lib, ffi = library(), _ffi()
        self.shape, self.dtype = (m, f, k), np.dtype(dtype)
        self._lock = threading.RLock()  # set-attribute, timing and launch of one call, per thread
        self._keep: list = []  # cffi buffers the descriptors point to
        dt = CUDA_R[name]
        desc = ffi.new("cublasLtMatmulDesc_t*")
        _check(lib.cublasLtMatmulDescCreate(desc, COMPUTE_32F, _CUDA_R_32F), "cublasLtMatmulDescCreate")
        self._desc = desc[0]
        self._set(DESC_TRANSA, "int32_t", OP_T)
        self._set(DESC_TRANSB, "int32_t", OP_N)
        self._set(DESC_EPILOGUE, "uint32_t", self.EPILOGUE)
        self._configure_epilogue()
        # Column-major view: D (F x M, ld F) = op(A) op(B), A = w (K x F col-major, ld K), B = x (K x M).
        self._layouts = [self._layout(dt, k, f, k), self._layout(dt, k, m, k), self._layout(dt, f, m, f)]
        pref = ffi.new("cublasLtMatmulPreference_t*")
        _check(lib.cublasLtMatmulPreferenceCreate(pref), "cublasLtMatmulPreferenceCreate")
        size = ffi.new("uint64_t*", WORKSPACE_BYTES)
        _check(
            lib.cublasLtMatmulPreferenceSetAttribute(pref[0], PREF_MAX_WORKSPACE_BYTES, size, 8),
            "cublasLtMatmulPreferenceSetAttribute",
        )
        wanted = candidates_from_environment()
        result, returned = ffi.new(f"cublasLtMatmulHeuristicResult_t[{wanted}]"), ffi.new("int*")
        a, b, d = self._layouts
        self._handle = _handle(cp.cuda.Device().id)
        _check(
            lib.cublasLtMatmulAlgoGetHeuristic(self._handle, self._desc, a, b, d, d, pref[0], wanted, result, returned),
            "cublasLtMatmulAlgoGetHeuristic",
        )
        lib.cublasLtMatmulPreferenceDestroy(pref[0])
        found = [result[i] for i in range(returned[0]) if result[i].state == STATUS_SUCCESS]
        if not found:
            raise CuBlasLtError(f"cuBLASLt: no algorithm for the {type(self).__name__} of shape {self.shape} in {name}")
        # (algorithm, workspace bytes), the heuristic's order; the first is the one launched, and
        # the only one left once the plan is tuned.
        candidates = [(ffi.new("cublasLtMatmulAlgo_t*", r.algo), int(r.workspaceSize)) for r in found]
        self._tuning_key = (type(self).__name__, f, k, name, cp.cuda.Device().id, size_class(m))
        self._candidates = adopt(candidates, _CHOSEN.get(self._tuning_key), _algo_bytes)
        self._workspace = cp.empty(max(max(size for _, size in self._candidates), 1), dtype=cp.uint8)
        self._alpha, self._beta = np.ones(1, np.float32), np.zeros(1, np.float32)

    @property
    def candidates(self) -> int:
        """Algorithms still to be timed (1 once the plan has chosen, or when only one was offered)."""
        return len(self._candidates)

    def _tune(self, x: Any, w: Any, out: Any) -> None:
        """Time every candidate on these operands (``out`` is overwritten) and keep the fastest."""
        import cupy as cp

        times = []
        evict = _l2_eviction_buffer()
        for candidate in self._candidates:
            workspace = cp.empty(max(candidate[1], 1), dtype=cp.uint8)
            try:
                self._matmul(x, w, out, candidate[0], workspace)  # warm-up; an algorithm that refuses drops out
            except CuBlasLtError:
                continue
            # Each launch timed alone from a cold L2, as it runs in a model (the other layers'
            # weights pass through L2 between two calls of one shape): with the operands left
            # in L2 by the previous launch, small-M products (weights of tens of MB, under
            # L2's size) chose algorithms that ran ~10% slower than torch's from memory
            # (bench/NOTES.md, thirty-second session).
            marks = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(TUNING_REPS)]
            for start, stop in marks:
                if evict is not None:
                    evict.fill(0)
                start.record()
                self._matmul(x, w, out, candidate[0], workspace)
                stop.record()
            marks[-1][1].synchronize()
            times.append((sum(cp.cuda.get_elapsed_time(a, b) for a, b in marks), candidate))
        if not times:
            raise CuBlasLtError(f"cuBLASLt: every algorithm refused the {type(self).__name__} of shape {self.shape}")
        best = min(times, key=lambda t: t[0])[1]
        self._candidates = [best]
        _CHOSEN[self._tuning_key] = _algo_bytes(best[0])
        if self not in _CAPTURED:  # a graph replays the plan's workspace address: keep it (it fits every candidate)
            self._workspace = cp.empty(max(best[1], 1), dtype=cp.uint8)

    def _configure_epilogue(self) -> None:
        """Set the epilogue's attributes (none for the plain product)."""

    def _set(self, attr: int, ctype: str, value: int) -> None:
        buf = _ffi().new(f"{ctype}*", value)
        self._keep.append(buf)
        _check(
            library().cublasLtMatmulDescSetAttribute(self._desc, attr, buf, _ffi().sizeof(ctype)),
            "cublasLtMatmulDescSetAttribute",
        )

    def _layout(self, dt: int, rows: int, cols: int, ld: int) -> Any:
        layout = _ffi().new("cublasLtMatrixLayout_t*")
        _check(library().cublasLtMatrixLayoutCreate(layout, dt, rows, cols, ld), "cublasLtMatrixLayoutCreate")
        return layout[0]

    def _check_operands(self, x: Any, w: Any, out: Any) -> None:
        m, f, k = self.shape
        for name, arr, shape in (("x", x, (m, k)), ("w", w, (f, k)), ("out", out, (m, f))):
            if tuple(arr.shape) != shape or not arr.flags.c_contiguous or arr.dtype != self.dtype:
                raise ValueError(f"{name}: expected a C-contiguous {self.dtype} array of shape {shape}")

    def _launch(self, x: Any, w: Any, out: Any) -> None:
        import cupy as cp

        capturing = cp.cuda.get_current_stream().is_capturing()
        # A graph keeps the algorithm it captured; a later eager call still times the candidates
        # (on workspaces of its own, leaving the plan's, whose address the graph replays).
        if len(self._candidates) > 1 and not capturing:
            self._tune(x, w, out)
        if capturing:  # the graph holds this plan's workspace address: never free it
            _CAPTURED.add(self)
        algo, size = self._candidates[0]
        # Outside a capture each call takes its workspace from the current stream's allocator
        # (stream-ordered), so GEMMs of one shape may run on several streams at once; a capture
        # takes the plan's own, made with the plan (a warmed-up capture allocates nothing) and
        # kept with it.
        workspace = self._workspace if capturing else cp.empty(max(size, 1), dtype=cp.uint8)
        self._matmul(x, w, out, algo, workspace)

    def _matmul(self, x: Any, w: Any, out: Any, algo: Any, workspace: Any) -> None:
        import cupy as cp

        ffi, lib = _ffi(), library()
        a, b, d = self._layouts
        ptr = lambda arr: ffi.cast("void*", int(arr.data.ptr))  # noqa: E731
        _check(
            lib.cublasLtMatmul(
                self._handle, self._desc, ffi.cast("void*", self._alpha.ctypes.data), ptr(w), a, ptr(x), b,
                ffi.cast("void*", self._beta.ctypes.data), ptr(out), d, ptr(out), d, algo,
                ptr(workspace), workspace.size, ffi.cast("cudaStream_t", cp.cuda.get_current_stream().ptr),
            ),
            "cublasLtMatmul",
        )  # fmt: skip

    def __call__(self, x: Any, w: Any, out: Any) -> None:
        """Fill ``out`` (M x F, C-contiguous) with ``x @ w.T``."""
        self._check_operands(x, w, out)
        with self._lock:
            self._launch(x, w, out)


class ReluGemm(Gemm):
    """``out = relu(x @ w.T)`` (row-major, M x F), planned for one shape: the plain product with
    cuBLASLt's ReLU epilogue and no mask (the dense remainder of a non-gated ReLU block, which
    then goes straight to its down GEMM)."""

    EPILOGUE = EPILOGUE_RELU


class ReluMaskGemm(Gemm):
    """``out = relu(x @ w.T)`` (row-major, M x F) and its ReLU bit-mask, planned for one shape.

    The mask holds ``mask_ld(F)`` bits per token row (uint32 words, row ``m`` at word
    ``m * mask_ld(F) // 32``); bit ``f`` of a row is set where the GEMM result was positive.
    fp32 accumulation; on CuPy's current stream.
    """

    EPILOGUE = EPILOGUE_RELU_AUX

    def _configure_epilogue(self) -> None:
        self._set(DESC_EPILOGUE_AUX_LD, "int64_t", mask_ld(self.shape[1]))

    def __call__(self, x: Any, w: Any, out: Any, mask: Any = None) -> None:
        """Fill ``out`` (M x F, C-contiguous) and ``mask`` (uint32, M * mask_ld(F) / 32 words)."""
        m, f, _ = self.shape
        self._check_operands(x, w, out)
        if mask is None or mask.dtype != np.uint32 or mask.size != m * mask_ld(f) // 32:
            got = "None" if mask is None else f"{mask.size} {mask.dtype}"
            raise ValueError(f"mask: expected {m * mask_ld(f) // 32} uint32 words, got {got}")
        ffi = _ffi()
        aux = ffi.new("void**", ffi.cast("void*", int(mask.data.ptr)))
        with self._lock:  # the mask pointer lives on the descriptor until the launch has read it
            _check(
                library().cublasLtMatmulDescSetAttribute(
                    self._desc, DESC_EPILOGUE_AUX_POINTER, aux, ffi.sizeof("void*")
                ),
                "cublasLtMatmulDescSetAttribute",
            )
            self._launch(x, w, out)
