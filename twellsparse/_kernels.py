"""Kernel sources, instantiations and compilation: the only module that touches ``RawModule``.

Kernel sources are the ``.cu``/``.cuh`` files of the ``twellsparse.cuda`` package, found with
:mod:`importlib.resources` (so an installed wheel works, not only a checkout). Each source is
compiled once per (value type, device) with the template instantiations of that value type
(``name_expressions``).
Local ``#include "x.cuh"`` lines are expanded here, so the code handed to NVRTC is
self-contained (no ``-I`` path into the install, which an installed namespace package need not
have). The options also carry a hash of every kernel source, as CuPy's on-disk cache keys on code
and options only: editing a header can never serve a stale binary.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.resources
import itertools
import os
import re
from typing import Any

import numpy as np

from ._backend import VALUE_DTYPES, bfloat16, cupy_module

#: dtype -> C++ storage type used in template arguments (the one table of it).
CXX_TYPE: dict[np.dtype, str] = {
    np.dtype(np.float16): "twell::f16",
    bfloat16: "twell::bf16",
    np.dtype(np.float32): "float",
    np.dtype(np.float64): "double",
}

#: Activation name -> template argument (twell::Activation in twell_types.cuh).
ACTIVATION_ID = {"relu": 0, "relu2": 1, "silu": 2, "gelu": 3, "identity": 4}

#: Values per thread of the SpMM kernels (template argument).
SPMM_VPT = 4
SPMM_THREADS = 128

#: Elements per block of the two-launch device scans (SCAN_CHUNK in cuda/twell_scan.cuh).
SCAN_CHUNK = 4096
SCAN_THREADS = 256

#: Row-gather kernels (twell_gather.cu): passes of KV 16-byte vectors per lane over the columns,
#: U pairs' rows in flight at a time. GATHER_VARIANTS are the (KV, U) instantiations of every
#: kernel and type; GATHER_DEFAULT the fastest of them per kernel on the H200 (standard problem,
#: bench/results/2026-12-02-ffn.jsonl, commit 72f5ef8: (4, 4) took the SDDMM from 0.387 to
#: 0.360 ms at 0.5% and from 0.679 to 0.619 ms at 1%; the benchmark times the others beside it).
GATHER_VARIANTS = ((8, 2), (4, 4))
GATHER_DEFAULT = {
    "spmm": (8, 2),
    "spmm_e4m3": (8, 2),  # as the SpMM it mirrors (not timed on its own yet)
    "sddmm": (4, 4),
    "sddmm_gated_bwd": (4, 4),  # as the SDDMM it extends (not timed on its own yet)
    "gated_up": (4, 4),
    "gated_up_e4m3": (4, 4),  # as the kernel it mirrors (not timed on its own yet)
    "csr_spmm": (8, 2),
    "csr_spmm_pair": (4, 4),
}


#: Rows (warps, one row each) per block of the row-gather kernels. A block's registers and warp
#: slots are freed only when its last warp ends, so a block of rows of unequal length holds its
#: shorter rows' slots idle until its longest ends: at 0.5% on the standard problem a row of the
#: gated up projection takes one batch of 32 entries or, ~20% of the time, two, so ~59% of
#: 4-row blocks wait on a second batch. One-row blocks took 1.5-4% off the up projection and
#: SDDMMs and 5-6% off the backward's dX by gathers at 0.5 / 1% against 4-row ones, 2-row
#: blocks in between (H200, bench/NOTES.md, thirty-fifth session). ``TWELL_GATHER_BLOCK_WARPS``
#: (1, 2 or 4, read at import) sets it for measurements (``bash scripts/device_run.sh
#: gatherblocks``).
_GATHER_WARPS_SETTING = os.environ.get("TWELL_GATHER_BLOCK_WARPS", "") or "1"
if _GATHER_WARPS_SETTING not in ("1", "2", "4"):
    raise ValueError(f"TWELL_GATHER_BLOCK_WARPS: expected 1, 2 or 4, got {_GATHER_WARPS_SETTING!r}")
GATHER_WARPS = int(_GATHER_WARPS_SETTING)


def gather_expression(kind: str, dtype: Any, kv: int, u: int, scale: bool = False) -> str:
    """Name expression of a row-gather kernel: kind "spmm", "spmm_sum" (two products of one
    structure summed), "sddmm", "gated_up" (the gated consumer's up projection and value
    product), "csr_spmm", "csr_spmm_pair" (two matrices of one structure times the same dense
    one, in one pass), each with a "_cut" twin that takes a segment plan (long rows cut into
    runs: ``_gpu_convert.SegmentPlan``), "spmm_e4m3" and "gated_up_e4m3" (with fp8 e4m3 rows and row scales;
    2-byte types),
    or the ReLU-mask-driven consumers "mask_gated" and "mask_spmm"."""
    t = CXX_TYPE[np.dtype(dtype)]
    if kind == "spmm":
        return f"twell_gather_spmm<{t}, {kv}, {u}>"
    if kind == "spmm_sum":
        return f"twell_gather_spmm<{t}, {kv}, {u}, true>"
    if kind == "spmm_e4m3":
        return f"twell_gather_spmm_e4m3<{t}, {kv}, {u}>"
    if kind == "sddmm":
        return f"twell_gather_sddmm<{t}, {'true' if scale else 'false'}, {kv}, {u}>"
    if kind == "gated_up":
        return f"twell_gather_gated_up<{t}, {kv}, {u}>"
    if kind == "gated_up_e4m3":
        return f"twell_gather_gated_up_e4m3<{t}, {kv}, {u}>"
    if kind == "csr_spmm":
        return f"twell_gather_csr_spmm<{t}, {kv}, {u}>"
    if kind == "csr_spmm_pair":
        return f"twell_gather_csr_spmm<{t}, {kv}, {u}, true>"
    if kind == "csr_spmm_cut":  # the 2-byte types' kernel has a register cap (cuda/twell_gather.cu)
        capped = "_capped" if np.dtype(dtype).itemsize == 2 else ""
        return f"twell_gather_csr_spmm_cut{capped}<{t}, {kv}, {u}>"
    if kind == "csr_spmm_pair_cut":
        return f"twell_gather_csr_spmm_cut<{t}, {kv}, {u}, true>"
    if kind == "sddmm_gated_bwd":
        return f"twell_gather_sddmm_gated_bwd<{t}, {kv}, {u}>"
    if kind in ("mask_gated", "mask_spmm"):
        return f"twell_{kind}<{t}, {kv}, {u}>"
    kinds = (
        "'spmm', 'spmm_sum', 'spmm_e4m3', 'sddmm', 'sddmm_gated_bwd', 'gated_up', 'gated_up_e4m3', 'csr_spmm', "
        "'csr_spmm_pair', 'csr_spmm_cut', 'csr_spmm_pair_cut', 'mask_gated' or 'mask_spmm'"
    )
    raise ValueError(f"kind: expected {kinds}, got {kind!r}")


def _instantiations() -> dict[str, list[str]]:
    """Every template instantiation, per source file."""
    types = [CXX_TYPE[d] for d in VALUE_DTYPES]
    convert = [f"dense_to_twell<{t}, {a}>" for t, a in itertools.product(types, ACTIVATION_ID.values())]
    for t in types:
        convert += [
            f"csr_to_twell<{t}>",
            f"twell_scatter_dense<{t}>",
            f"spill_scatter_dense<{t}>",
            f"twell_slots_to_csr<{t}>",
            f"twell_spill_to_csr<{t}>",
        ]
    convert += [f"relu_mask_to_twell<{CXX_TYPE[d]}, {p}>" for d in VALUE_DTYPES if d.itemsize <= 4 for p in (0, 1)]
    convert += ["twell_tile_totals", "twell_transpose_mark", "twell_transpose_sums", "twell_transpose_first"]
    convert += ["twell_transpose_place", "spill_layout_sums", "spill_layout_place", "row_tile_entry_totals"]
    convert += ["twell_segment_plan"]
    spmm = []
    for t in types:
        spmm += [
            f"twell_spmm<{t}, {SPMM_VPT}>",
            f"twell_spmm_t<{t}, {SPMM_VPT}>",
            f"twell_cast_from_acc<{t}>",
        ]
    sddmm = [f"twell_sddmm_{part}<{t}, {s}>" for part in ("slots", "spill") for t in types for s in ("false", "true")]
    gather = [
        gather_expression(kind, dt, kv, u, scale)
        for dt in VALUE_DTYPES
        for kv, u in GATHER_VARIANTS
        for kind, scale in (
            ("spmm", False),
            ("spmm_sum", False),
            ("csr_spmm", False),
            ("csr_spmm_pair", False),
            ("gated_up", False),
            ("sddmm", False),
            ("sddmm", True),
            ("sddmm_gated_bwd", False),
        )
    ]
    gather += ["twell_row_buckets", "twell_row_scatter"]
    # The transposed products with long rows cut into runs: the variants they run only.
    gather += [
        gather_expression(f"{kind}_cut", dt, *GATHER_DEFAULT[kind])
        for dt in VALUE_DTYPES
        for kind in ("csr_spmm", "csr_spmm_pair")
    ]
    gather += [
        gather_expression(kind, dt, kv, u)
        for dt in VALUE_DTYPES
        if dt.itemsize <= 4  # the cuBLASLt ReLU-mask producer's types
        for kv, u in GATHER_VARIANTS
        for kind in ("mask_gated", "mask_spmm")
    ]
    gather += [
        gather_expression(kind, dt, kv, u)
        for dt in VALUE_DTYPES
        if dt.itemsize == 2
        for kv, u in GATHER_VARIANTS
        for kind in ("spmm_e4m3", "gated_up_e4m3")
    ]
    elementwise = [
        f"ffn_{kind}<{t}, {a}>"
        for kind in ("act_mul", "kept_count")
        for t, a in itertools.product(types, ACTIVATION_ID.values())
    ]
    elementwise.append("twell_spin")
    return {
        "twell_convert.cu": convert,
        "twell_spmm.cu": spmm,
        "twell_sddmm.cu": sddmm,
        "twell_gather.cu": gather,
        "twell_elementwise.cu": elementwise,
        "twell_quantize.cu": [f"twell_quantize_rows_e4m3<{t}>" for t in types],
        "twell_dense_transpose.cu": [f"dense_transpose<{t}>" for t in types],
        "twell_stationary.cu": [
            f"stationary_pack<{CXX_TYPE[d]}, {dual}, {width}>"
            for d in VALUE_DTYPES
            if d.itemsize == 2  # the packed words hold 16-bit values
            for dual in (0, 1)  # one product, or the sum of two (A @ B + A2 @ B2)
            for width in (16, 32)  # lanes per row: half-warps or whole warps
        ]
        + [
            f"twell_stationary_spmm<{CXX_TYPE[d]}, {dual}, {mode}>"
            for d in VALUE_DTYPES
            if d.itemsize == 2
            for dual in (0, 1)
            for mode in (0, 1, 2)  # one band, a band before the last, the last (column bands)
        ]
        + ["stationary_row_sizes", "stationary_row_sums", "stationary_row_place"],
    }


INSTANTIATIONS: dict[str, list[str]] = _instantiations()

#: Activations of the fused Hopper producer (cuda/twell_hopper_gemm.cu), each with or without a
#: magnitude threshold.
HOPPER_ACTIVATIONS = ("relu", "relu2", "silu")

#: The tiled SpMM's operand choices (``_tiled_spmm.OPERAND``) as its FRAGS and PREFETCH template
#: arguments: the one-hot operand loaded from the fragments pass, or shuffled from the words,
#: those words prefetched into L1 a chunk ahead or not.
TILED_OPERANDS = {"fragments": "true, false", "shuffles": "false, false", "prefetched": "false, true"}

#: Sources built for one target only, whose instructions (wgmma, setmaxnreg, TMA) exist nowhere else:
#: source -> (NVRTC target, instantiations). Compiled here with NVRTC and loaded as a cubin.
ARCH_SOURCES: dict[str, tuple[str, list[str]]] = {
    "twell_hopper_gemm.cu": (
        "sm_90a",
        [
            name
            for d in (np.dtype(np.float16), bfloat16)
            for a in HOPPER_ACTIVATIONS
            for name in (
                f"twell_gemm_pack<{CXX_TYPE[d]}, {ACTIVATION_ID[a]}, 0>",
                f"twell_gemm_pack<{CXX_TYPE[d]}, {ACTIVATION_ID[a]}, 1>",
                f"twell_gemm_pack_pair<{CXX_TYPE[d]}, {ACTIVATION_ID[a]}>",
            )
        ],
    ),
    # The tiled up projection (its slices staged by TMA; x loaded per tile or per quad; the
    # forward's up projection or the backward's sampled product; single blocks or pairs sharing
    # x's slices) and its gate pack.
    "twell_tiled_up.cu": (
        "sm_90a",
        [
            f"{kernel}<{CXX_TYPE[d]}, {b}, {backward}>"
            for kernel in ("twell_tiled_gated_up", "twell_tiled_gated_up_pair")
            for d in (np.dtype(np.float16), bfloat16)
            for b in (0, 1)
            for backward in (0, 1)
        ]
        + [f"{k}<{w}>" for k in ("tiled_up_count", "tiled_up_place") for w in (16, 32)],
    ),
    # The tiled SpMM on the tensor cores (B's chunks staged by TMA) and its pack: each operand
    # choice of TILED_OPERANDS at both warp counts.
    "twell_tiled_spmm.cu": (
        "sm_90a",
        [
            f"twell_tiled_spmm<{CXX_TYPE[d]}, {w}, {switches}>"
            for d in (np.dtype(np.float16), bfloat16)
            for w in (16, 32)
            for switches in TILED_OPERANDS.values()
        ]
        + [f"tiled_spmm_fixup<{CXX_TYPE[d]}>" for d in (np.dtype(np.float16), bfloat16)]
        + ["tiled_spmm_count", "tiled_spmm_place", "tiled_spmm_count_t", "tiled_spmm_place_t", "tiled_spmm_balance"]
        + ["tiled_spmm_fragments"],
    ),
    # The gated consumer's up projection on the tiled SpMM's pack of the gate.
    "twell_tiled_ffn.cu": (
        "sm_90a",
        [
            f"{k}<{CXX_TYPE[d]}, {b}>"
            for k in ("twell_tiled_ffn_up", "twell_tiled_ffn_up_pair")
            for d in (np.dtype(np.float16), bfloat16)
            for b in (0, 1)
        ],
    ),
}


_LOCAL_INCLUDE = re.compile(r'^#include "([\w.]+)"\s*$', re.MULTILINE)


def sources_root() -> Any:
    """The ``twellsparse.cuda`` resource folder (a Traversable), wherever the package is installed."""
    return importlib.resources.files("twellsparse.cuda")


def _resource_text(name: str) -> str:
    return sources_root().joinpath(name).read_text()


def source_names() -> list[str]:
    """Every kernel source and header shipped in ``twellsparse.cuda``, sorted."""
    return sorted(p.name for p in sources_root().iterdir() if p.name.endswith((".cu", ".cuh")))


@functools.cache
def source_hash() -> str:
    """SHA-256 (first 16 hex digits) over every kernel source and header, in name order."""
    h = hashlib.sha256()
    for name in source_names():
        h.update(name.encode())
        h.update(_resource_text(name).encode())
    return h.hexdigest()[:16]


def compile_options() -> tuple[str, ...]:
    """NVRTC options. Eight measurement switches are read from the environment when a module is
    first compiled, one at import: ``TWELL_GATHER_ROW_ORDER=1`` (:data:`GATHER_ROW_ORDER`) has the
    row-gather kernels over TwELL rows read their row from an order (``_gpu_ops.row_order``),
    ``TWELL_L2_HINTS=0`` turns off the gather kernels' L2 eviction hint (cuda/twell_gather.cu),
    ``TWELL_MMA_DOTS=0`` gives their dot products to the FMA pipes instead of the tensor cores,
    ``TWELL_HOPPER_PACK=0`` leaves the fused producer's epilogue out (cuda/twell_hopper_gemm.cu:
    wrong results, the GEMM's time alone), ``TWELL_HOPPER_TILE256=0`` sends relu on 256-column
    row-tiles through the fused producer's run-time geometry epilogue,
    ``TWELL_TILED_UP_ORDERED_A=1`` has the tiled up projection pass its A fragments in load order
    (cuda/twell_tiled_up.cu: wrong sums, the time of a W_up stored in the fragment's order), and
    ``TWELL_GATHER_MIN_BLOCKS=N`` replaces the launch bounds of the 2-byte SpMM and
    transposed-product kernels (by default a minimum of 1 block per
    SM for the single-output ones, none for dX's dual pass): N blocks per SM for all of them, 0
    for no minimum; ``TWELL_CUT_MAX_REGS=N`` caps the 2-byte single-output cut transposed product
    at N registers instead of 152 (cuda/twell_gather.cu, ``twell_gather_csr_spmm_cut_capped``)."""
    switches = []
    for name in (
        "TWELL_L2_HINTS",
        "TWELL_MMA_DOTS",
        "TWELL_HOPPER_PACK",
        "TWELL_HOPPER_TILE256",
        "TWELL_TILED_UP_ORDERED_A",
    ):
        value = env_switch(name)
        switches += [f"-D{name}={int(value)}"] if value is not None else []
    switches += ["-DTWELL_GATHER_ROW_ORDER=1"] if GATHER_ROW_ORDER else []
    blocks = os.environ.get("TWELL_GATHER_MIN_BLOCKS", "")
    if blocks not in ("", "0", "1", "2", "3", "4", "5", "6"):
        raise ValueError(f"TWELL_GATHER_MIN_BLOCKS: expected a block count from 0 to 6, got {blocks!r}")
    switches += [f"-DTWELL_GATHER_MIN_BLOCKS={blocks}"] if blocks else []
    regs = os.environ.get("TWELL_CUT_MAX_REGS", "")
    if regs and not (regs.isdigit() and 64 <= int(regs) <= 255):
        raise ValueError(f"TWELL_CUT_MAX_REGS: expected a register count from 64 to 255, got {regs!r}")
    switches += [f"-DTWELL_CUT_MAX_REGS={regs}"] if regs else []
    return ("-std=c++17", f"-DTWELL_SOURCES_SHA=0x{source_hash()}", *switches)


def env_switch(name: str) -> bool | None:
    """An on/off switch from the environment: ``1`` True, ``0`` False, unset or empty None;
    anything else raises ``ValueError`` naming the variable."""
    value = os.environ.get(name, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{name}: expected 0 or 1, got {value!r}")
    return None if value == "" else value == "1"


def env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """A setting from the environment, one of ``choices`` (``default`` when unset or empty);
    anything else raises ``ValueError`` naming the variable and the choices."""
    value = os.environ.get(name, "") or default
    if value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


#: Whether the row-gather kernels over TwELL rows read their row from an order
#: (``TWELL_GATHER_ROW_ORDER=1``, read once at import so that the build and
#: ``_gpu_ops.row_order``, which must hand such a build an order, always agree).
GATHER_ROW_ORDER = env_switch("TWELL_GATHER_ROW_ORDER") is True


@functools.cache
def read_source(name: str) -> str:
    """A kernel source with its local includes expanded (each header once)."""
    seen: set[str] = set()

    def expand(match: re.Match) -> str:
        header = match.group(1)
        if header in seen:
            return ""
        seen.add(header)
        return _LOCAL_INCLUDE.sub(expand, _resource_text(header))

    return _LOCAL_INCLUDE.sub(expand, _resource_text(name))


def _value_type_of(expression: str) -> str:
    """First template argument of a name expression ("" for a plain kernel)."""
    return expression.partition("<")[2].split(",")[0].rstrip(">").strip()


@functools.cache
def _module(name: str, value_type: str, device_id: int) -> Any:
    """One source's instantiations for one value type, compiled for one device (memoised).

    Compiling per value type keeps the first call of an op to the code it needs.
    """
    cp = cupy_module()
    if cp is None:
        raise RuntimeError("GPU kernels need CuPy: pip install 'twellsparse[cuda12]' or '[cuda13]'")
    expressions = [e for e in INSTANTIATIONS[name] if _value_type_of(e) == value_type]
    with cp.cuda.Device(device_id):
        mod = cp.RawModule(code=read_source(name), options=compile_options(), name_expressions=expressions)
        mod.compile()
    return mod


def _nvrtc_cubin(name: str, expressions: list[str], arch: str, code: str | None = None) -> tuple[bytes, dict[str, str]]:
    """Compile one source's instantiations with NVRTC for ``arch`` (no GPU needed): the cubin
    and each expression's lowered (mangled) name. ``code``: the source's text, when it is not
    the shipped source ``name`` (bench/tma_probe.py's kernel).

    Raises
    ------
    RuntimeError
        With NVRTC's log when the source fails to compile.
    """
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(read_source(name) if code is None else code, name, [], [])
    try:
        for expr in expressions:
            nvrtc.addNameExpression(prog, expr)
        try:
            nvrtc.compileProgram(prog, [f"-arch={arch}", *compile_options()])
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(f"{name}: NVRTC failed for {arch}:\n{nvrtc.getProgramLog(prog)}") from exc
        lowered = {expr: nvrtc.getLoweredName(prog, expr) for expr in expressions}  # raises if one is missing
        return nvrtc.getCUBIN(prog), lowered
    finally:
        nvrtc.destroyProgram(prog)


def cubin_cache_dir() -> Any:
    """Where compiled :data:`ARCH_SOURCES` cubins are kept between processes: ``TWELL_CACHE_DIR``,
    else ``~/.cache/twellsparse``; None (no cache) when ``TWELL_CACHE_DIR`` is ``0``. The
    Hopper producer's source takes ~15 s of NVRTC per process; every test file, benchmark and
    profiler run of a device session would pay it again."""
    import pathlib

    value = os.environ.get("TWELL_CACHE_DIR", "")
    if value == "0":
        return None
    return pathlib.Path(value) if value else pathlib.Path.home() / ".cache" / "twellsparse"


def _cached_cubin(name: str, expressions: list[str], arch: str) -> tuple[bytes, dict[str, str]]:
    """:func:`_nvrtc_cubin` through the disk cache of :func:`cubin_cache_dir`, keyed by the
    expanded source, the compile options (which carry every source's hash), the target, the
    instantiations and NVRTC's version: a stale cubin can never be served. A cache that cannot
    be read or written is skipped (the cubin is compiled)."""
    import json

    from cupy_backends.cuda.libs import nvrtc

    directory = cubin_cache_dir()
    if directory is None:
        return _nvrtc_cubin(name, expressions, arch)
    key = hashlib.sha256(
        json.dumps([read_source(name), list(compile_options()), arch, expressions, list(nvrtc.getVersion())]).encode()
    ).hexdigest()[:32]
    stem = f"{name}.{arch}.{key}"
    try:
        cubin = (directory / f"{stem}.cubin").read_bytes()
        return cubin, json.loads((directory / f"{stem}.json").read_text())
    except (OSError, ValueError):
        pass
    cubin, lowered = _nvrtc_cubin(name, expressions, arch)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # The names first, the cubin last (a reader finds both or no cubin); each file is written
        # under a name of this process's and renamed into place, which is atomic.
        for suffix, data in ((".json", json.dumps(lowered).encode()), (".cubin", cubin)):
            tmp = directory / f"{stem}{suffix}.{os.getpid()}.tmp"
            tmp.write_bytes(data)
            tmp.replace(directory / f"{stem}{suffix}")
    except OSError:
        pass
    return cubin, lowered


@functools.cache
def _arch_module(name: str, device_id: int) -> tuple[Any, dict[str, str]]:
    """An :data:`ARCH_SOURCES` source compiled for its target and loaded on one device."""
    cp = cupy_module()
    assert cp is not None
    arch, expressions = ARCH_SOURCES[name]
    cubin, lowered = _cached_cubin(name, expressions, arch)
    with cp.cuda.Device(device_id):
        module = cp.cuda.function.Module()
        module.load(cubin)
    return module, lowered


@functools.cache
def _arch_function(expression: str, device_id: int, shared_mem: int) -> Any:
    name = next(n for n, (_, exprs) in ARCH_SOURCES.items() if expression in exprs)
    module, lowered = _arch_module(name, device_id)
    func = module.get_function(lowered[expression])
    if shared_mem > 48 * 1024:
        cp = cupy_module()
        assert cp is not None
        driver = cp.cuda.driver
        driver.funcSetAttribute(func.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_mem)
    return func


@functools.cache
def max_active_clusters(expression: str, device_id: int, threads: int, shared_mem: int, cluster: int) -> int:
    """How many clusters of an :data:`ARCH_SOURCES` kernel with compile-time cluster dimensions
    fit on the device at once (cuOccupancyMaxActiveClusters): a persistent grid of more would run
    its last clusters in a second wave. 0 where the query fails (callers then do without
    clusters)."""
    import ctypes

    func = _arch_function(expression, device_id, shared_mem)

    class LaunchConfig(ctypes.Structure):
        _fields_ = [
            ("grid", ctypes.c_uint * 3),
            ("block", ctypes.c_uint * 3),
            ("shared_mem", ctypes.c_uint),
            ("stream", ctypes.c_void_p),
            ("attrs", ctypes.c_void_p),
            ("n_attrs", ctypes.c_uint),
        ]

    config = LaunchConfig((ctypes.c_uint * 3)(cluster, 1, 1), (ctypes.c_uint * 3)(threads, 1, 1), shared_mem)
    count = ctypes.c_int(0)
    fn = ctypes.CDLL("libcuda.so.1").cuOccupancyMaxActiveClusters
    fn.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.POINTER(LaunchConfig)]
    fn.restype = ctypes.c_int
    if fn(ctypes.byref(count), ctypes.c_void_p(func.ptr), ctypes.byref(config)) != 0:
        return 0
    return max(count.value, 0)


def check_current_device(args: tuple) -> int:
    """The current device's id, after checking that the launch's first array argument lives
    there (CuPy's convention: work runs on the current device, whose allocations, stream and
    compiled modules the launch uses; an array of another device would be read through a
    pointer that device 0 cannot follow)."""
    cp = cupy_module()
    assert cp is not None
    current = cp.cuda.Device().id
    for a in args:
        if isinstance(a, cp.ndarray):
            if a.device.id != current:
                raise ValueError(
                    f"device: expected the arrays on the current device cuda:{current}, got them on "
                    f"cuda:{a.device.id}; call under `with cupy.cuda.Device({a.device.id}):`"
                )
            break
    return current


def launch_arch(expression: str, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, shared_mem: int) -> None:
    """Launch an :data:`ARCH_SOURCES` kernel on CuPy's current stream (empty grids are skipped)."""
    if min(grid) <= 0:
        return
    cp = cupy_module()
    assert cp is not None
    func = _arch_function(expression, check_current_device(args), shared_mem)
    func(grid, block, args, shared_mem=shared_mem, stream=cp.cuda.get_current_stream())


def _source_of(expression: str) -> str:
    for name, exprs in INSTANTIATIONS.items():
        if expression in exprs:
            return name
    raise KeyError(f"no kernel instantiation {expression!r}")


@functools.cache
def _function(expression: str, device_id: int) -> Any:
    return _module(_source_of(expression), _value_type_of(expression), device_id).get_function(expression)


def get_kernel(expression: str) -> Any:
    """The ``RawKernel`` of a name expression, compiled for the current device."""
    cp = cupy_module()
    assert cp is not None
    return _function(expression, cp.cuda.Device().id)


def launch(expression: str, n_threads: int, threads_per_block: int, args: tuple, shared_mem: int = 0) -> None:
    """Launch over a 1-D grid covering ``n_threads`` threads on CuPy's current stream, with
    ``shared_mem`` bytes of dynamic shared memory per block (as :func:`launch_grid`)."""
    blocks = -(-n_threads // threads_per_block)
    launch_grid(expression, (blocks,), (threads_per_block,), args, shared_mem)


def launch_grid(
    expression: str, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, shared_mem: int = 0
) -> None:
    """Launch with an explicit grid on CuPy's current stream (empty grids are skipped).

    ``shared_mem`` bytes of dynamic shared memory; above 48 KB the kernel's limit is raised first.
    """
    if min(grid) <= 0:
        return
    kernel = _function(expression, check_current_device(args))
    if shared_mem > 48 * 1024 and kernel.max_dynamic_shared_size_bytes < shared_mem:
        kernel.max_dynamic_shared_size_bytes = shared_mem
    kernel(grid, block, args, shared_mem=shared_mem)


@functools.cache
def _attribute(device_id: int, name: str) -> int:
    cp = cupy_module()
    assert cp is not None
    return int(cp.cuda.Device(device_id).attributes[name])


def device_attribute(name: str) -> int:
    """A CUDA device attribute of the current device (CuPy's name for it), read once per device."""
    cp = cupy_module()
    assert cp is not None
    return _attribute(cp.cuda.Device().id, name)


def runs_here(source: str) -> bool:
    """Whether the current device is the one target of the :data:`ARCH_SOURCES` source
    ``source`` (sm_90a: compute capability 9.0 exactly; its "a" features exist nowhere else)."""
    cp = cupy_module()
    assert cp is not None
    return str(cp.cuda.Device().compute_capability) == ARCH_SOURCES[source][0].removeprefix("sm_").rstrip("a")


def sm_count() -> int:
    """Multiprocessors of the current device (for persistent grids)."""
    return device_attribute("MultiProcessorCount")


def l2_bytes() -> int:
    """The current device's L2 cache size in bytes: the kernel choices that read weight rows
    once per entry (the row gathers) run at L2 speed only for weights within it."""
    return int(device_attribute("L2CacheSize"))


def null_pointer() -> np.uint64:
    """A null device pointer argument (a kernel's optional input that is absent)."""
    return np.uint64(0)


def is_null(arg: Any) -> bool:
    """Whether a kernel argument is :func:`null_pointer`'s."""
    return isinstance(arg, np.uint64) and int(arg) == 0


def compile_all_offline(arch: str = "sm_90a") -> dict[str, int]:
    """Compile every instantiation with NVRTC for ``arch`` without touching a GPU, and every
    :data:`ARCH_SOURCES` source for its own target when that is ``arch``.

    Uses CuPy's low-level NVRTC binding, which needs only the NVRTC library (the
    ``nvidia-cuda-nvrtc`` wheel), not a driver. Returns the cubin size of each source.

    Raises
    ------
    RuntimeError
        With NVRTC's log when a source fails to compile.
    """
    sizes = {name: len(_nvrtc_cubin(name, expressions, arch)[0]) for name, expressions in INSTANTIATIONS.items()}
    for name, (target, expressions) in ARCH_SOURCES.items():
        if target == arch:
            sizes[name] = len(_nvrtc_cubin(name, expressions, target)[0])
    return sizes
