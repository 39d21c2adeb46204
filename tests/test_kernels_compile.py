"""Every kernel instantiation compiles through NVRTC for sm_90a, with no GPU needed."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from twellsparse import _kernels


def _nvrtc_or_skip():
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
    except Exception as exc:  # no CuPy or no NVRTC library
        if os.environ.get("CI"):
            pytest.fail(f"CI must compile the kernels, but NVRTC is unavailable: {exc}")
        pytest.skip(f"NVRTC unavailable: {exc}")


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_every_instantiation_compiles(arch):
    _nvrtc_or_skip()
    sizes = _kernels.compile_all_offline(arch)
    own_target = {name for name, (target, _) in _kernels.ARCH_SOURCES.items() if target == arch}
    assert set(sizes) == set(_kernels.INSTANTIATIONS) | own_target
    assert all(size > 0 for size in sizes.values())


def test_sources_found_and_hashed():
    names = _kernels.source_names()
    assert "twell_types.cuh" in names
    assert set(_kernels.INSTANTIATIONS) | set(_kernels.ARCH_SOURCES) <= set(names)
    assert len(_kernels.source_hash()) == 16
    assert any(opt.startswith("-DTWELL_SOURCES_SHA=") for opt in _kernels.compile_options())


def test_measurement_switches_reach_the_compiler_and_are_validated(monkeypatch):
    monkeypatch.setenv("TWELL_GATHER_MIN_BLOCKS", "4")
    monkeypatch.setenv("TWELL_L2_HINTS", "0")
    options = _kernels.compile_options()
    assert "-DTWELL_GATHER_MIN_BLOCKS=4" in options and "-DTWELL_L2_HINTS=0" in options
    monkeypatch.setenv("TWELL_GATHER_MIN_BLOCKS", "many")
    with pytest.raises(ValueError, match="TWELL_GATHER_MIN_BLOCKS: expected a block count from 0 to 6, got 'many'"):
        _kernels.compile_options()
    monkeypatch.setenv("TWELL_GATHER_MIN_BLOCKS", "")
    monkeypatch.setenv("TWELL_CUT_MAX_REGS", "152")
    assert "-DTWELL_CUT_MAX_REGS=152" in _kernels.compile_options()
    monkeypatch.setenv("TWELL_CUT_MAX_REGS", "40")
    with pytest.raises(ValueError, match="TWELL_CUT_MAX_REGS: expected a register count from 64 to 255, got '40'"):
        _kernels.compile_options()


def _compiles_with(source_name: str, checks: str, failure: str) -> None:
    """Compile a kernel source (NVRTC, sm_90a) with ``checks`` (static_asserts) appended; fail
    the test with ``failure`` and the compiler's log when they do not hold."""
    from cupy_backends.cuda.libs import nvrtc

    source = _kernels.read_source(source_name) + "\n" + checks + "\n"
    prog = nvrtc.createProgram(source, "check.cu", [], [])
    try:
        nvrtc.compileProgram(prog, ["-arch=compute_90a", *_kernels.compile_options()])
    except Exception as exc:
        pytest.fail(f"{failure}: {exc}\n{nvrtc.getProgramLog(prog)}")
    finally:
        nvrtc.destroyProgram(prog)


def test_tiled_pack_constants_match_the_kernels():
    """The tiled SpMM's pack layout as Python reads and writes it (the models, the tests, the
    places of the one-pack FFN) against the kernels' own constants and word functions, checked
    by NVRTC at compile time: a word built or decoded on either side means the same there."""
    _nvrtc_or_skip()

    from twellsparse import _tiled_spmm as T

    constants = {
        "TSPMM_ROWS": T.ROWS,
        "TSPMM_COLS": T.COLS,
        "TSPMM_GROUP": T.GROUP,
        "TSPMM_CHUNK": T.CHUNK,
        "TSPMM_BOX": T.BOX,
        "TSPMM_KGROUP": T.KGROUP,
        "TSPMM_PAD": T.PAD,
        "TSPMM_PAD_BIT": T.PAD_BIT,
        "TSPMM_ROW_SHIFT": T.ROW_SHIFT,
        "TSPMM_SHARED_BYTES": T.SHARED_BYTES,
    }
    checks = [f'static_assert(twell::{k} == {v}, "{k}");' for k, v in constants.items()]
    for value, row, b_row in ((0x1234, 5, 300), (0xFFFF, 7, 511), (0, 0, 0), (0x8001, 3, 8)):
        w = T.word(value, row, b_row)
        assert (int(T.word_rows(w)), int(T.word_b_rows(w))) == (row, b_row)
        checks += [
            f'static_assert(twell::tspmm_word({value}, {row}, {b_row}) == {w}u, "word {value} {row} {b_row}");',
            f'static_assert(twell::tspmm_word_row({w}u) == {row}, "row of {w}");',
            f'static_assert(twell::tspmm_word_b_row({w}u) == {b_row}, "B row of {w}");',
        ]
    _compiles_with("twell_tiled_spmm.cu", "\n".join(checks), "pack constants disagree with the kernels")


def test_tiled_up_constants_match_the_kernel():
    """The tiled up projection's geometry and shared memory as Python sizes its launches against
    the kernel's own constants (NVRTC, at compile time)."""
    _nvrtc_or_skip()

    from twellsparse import _tiled_up as U

    constants = {
        "TILED_COLS": U.SLICE_COLS,
        "TILED_WARPS": U.WARPS,
        "TILED_MAX_TILES": U.MAX_TILES,
        "TILED_QUAD": U.QUAD,
        "TILED_TILE": U.TILE,
        "TILED_MAX_UNITS": U.MAX_UNITS,
        "TILED_BUFFER_ROWS": U.BUFFER_ROWS,
        "TILED_BUFFER_BYTES": U.BUFFER_BYTES,
        "TILED_SHARED_BYTES": U.shared_bytes(),
    }
    checks = "\n".join(f'static_assert(twell::{k} == {v}, "{k}");' for k, v in constants.items())
    _compiles_with("twell_tiled_up.cu", checks, "launch constants disagree with the kernel")


@pytest.mark.parametrize(
    ("module", "reader", "variable", "values", "default"),
    [
        ("_tiled_spmm", "_warps", "TWELL_TILED_WARPS", ("16", "32"), "16"),
        ("_tiled_spmm", "_operand", "TWELL_TILED_OPERAND", ("fragments", "shuffles", "prefetched"), "prefetched"),
        ("_tiled_up", "_pack_width", "TWELL_TILED_UP_PACK_WIDTH", ("16", "32"), "16"),
        ("_stationary", "_pack_width", "TWELL_STATIONARY_PACK_WIDTH", ("16", "32"), "32"),
    ],
)
def test_tiled_switches_are_validated(monkeypatch, module, reader, variable, values, default):
    import importlib

    read = getattr(importlib.import_module(f"twellsparse.{module}"), reader)
    as_read = int if values[0].isdigit() else str
    for value in values:
        monkeypatch.setenv(variable, value)
        assert read() == as_read(value)
    monkeypatch.setenv(variable, "")
    assert read() == as_read(default)
    monkeypatch.setenv(variable, "8")
    listed = ", ".join(map(repr, values))
    with pytest.raises(ValueError, match=re.escape(f"{variable}: expected one of {listed}, got '8'")):
        read()


def test_local_includes_expanded():
    code = _kernels.read_source("twell_spmm.cu")
    assert '#include "' not in code
    assert "namespace twell" in code


def test_every_dtype_has_a_cxx_type():
    from twellsparse._backend import VALUE_DTYPES

    assert set(_kernels.CXX_TYPE) == set(VALUE_DTYPES)


def test_hopper_launch_shape_matches_the_kernel():
    """The fused producer's launch (threads, dynamic shared memory, hand-off words) is computed in
    Python; the kernel's own constants must agree, or a launch would overrun shared memory."""
    _nvrtc_or_skip()

    from twellsparse import _hopper_producer as hp

    checks = "\n".join(
        f"static_assert(twell::hopper::Schedule<{split}>::SMEM_BYTES == {hp.shared_mem(bool(split))}, "
        f'"shared memory, SPLIT={split}");\n'
        f"static_assert(twell::hopper::Schedule<{split}>::THREADS == {hp.THREADS}, "
        f'"threads, SPLIT={split}");'
        for split in (0, 1)
    )
    constants = {"BM": hp.BLOCK_ROWS, "BN": hp.BLOCK_COLS, "BK": hp.BLOCK_K, "MAX_ROW_SLOTS": hp.MAX_ROW_SLOTS}
    checks += "".join(f'\nstatic_assert(twell::hopper::{k} == {v}, "{k}");' for k, v in constants.items())
    _compiles_with("twell_hopper_gemm.cu", checks, "launch constants disagree with the kernel")


def test_arch_cubins_are_cached_on_disk_by_content(tmp_path, monkeypatch):
    """The one-target cubins are compiled once and then read from TWELL_CACHE_DIR (keyed by the
    source, options, target and instantiations: another option compiles anew); 0 turns it off."""
    _nvrtc_or_skip()
    calls = []
    real = _kernels._nvrtc_cubin
    monkeypatch.setattr(_kernels, "_nvrtc_cubin", lambda *args: calls.append(args) or real(*args))
    monkeypatch.setenv("TWELL_CACHE_DIR", str(tmp_path))
    arch, expressions = _kernels.ARCH_SOURCES["twell_tiled_spmm.cu"]
    first = _kernels._cached_cubin("twell_tiled_spmm.cu", expressions, arch)
    again = _kernels._cached_cubin("twell_tiled_spmm.cu", expressions, arch)
    assert len(calls) == 1 and again == first and len(list(tmp_path.iterdir())) == 2
    monkeypatch.setenv("TWELL_L2_HINTS", "0")  # another compile option: another key
    _kernels._cached_cubin("twell_tiled_spmm.cu", expressions, arch)
    assert len(calls) == 2
    monkeypatch.setenv("TWELL_CACHE_DIR", "0")
    _kernels._cached_cubin("twell_tiled_spmm.cu", expressions, arch)
    assert len(calls) == 3 and len(list(tmp_path.iterdir())) == 4


def test_hopper_schedule_auto_takes_inline_for_few_tiles_per_sm():
    """``auto`` runs the inline epilogue up to INLINE_TILES_PER_SM output tiles per SM (nothing to
    overlap with few tiles per block) and the pair schedule above; a named schedule is kept."""
    from twellsparse import _hopper_producer as hp

    sms = 132
    assert hp.schedule_for("auto", 1, sms) == "inline"
    assert hp.schedule_for("auto", hp.INLINE_TILES_PER_SM * sms, sms) == "inline"
    assert hp.schedule_for("auto", hp.INLINE_TILES_PER_SM * sms + 1, sms) == "pair"
    for named in hp.SCHEDULES:
        assert hp.schedule_for(named, 1, sms) == named
        assert hp.schedule_for(named, 10**6, sms) == named


def test_gather_blocks_follow_the_rows_per_block_setting(monkeypatch):
    """The row-gather grids put GATHER_WARPS rows (one warp each) in a block, and the e4m3 gated
    up projection's shared x stages follow it; the environment switch takes 1, 2 or 4 only."""
    import subprocess
    import sys

    from twellsparse import _gpu_ops

    for warps in (1, 2, 4):
        monkeypatch.setattr(_kernels, "GATHER_WARPS", warps)
        assert _gpu_ops._gather_grid(1001) == ((-(-1001 // warps),), (32 * warps,))
        assert _gpu_ops._x_stage_bytes(2048) == warps * 2048 * 2
    bad = subprocess.run(
        [sys.executable, "-c", "import twellsparse._kernels"],
        env={**os.environ, "TWELL_GATHER_BLOCK_WARPS": "3"},
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0 and "TWELL_GATHER_BLOCK_WARPS: expected 1, 2 or 4, got '3'" in bad.stderr


def test_transposed_products_split_no_further_than_their_column_passes():
    from twellsparse import _gpu_ops

    # bf16 rows of 2048 values: (8, 2) makes one 2048-value pass, (4, 4) two of 1024
    assert _gpu_ops.column_warps(2, 2048, 8, 2) == 1
    assert _gpu_ops.column_warps(2, 2048, 4, 2) == 2
    assert _gpu_ops.column_warps(7, 4096, 4, 2) == 4
    assert _gpu_ops.column_warps(3, 100, 4, 8) == 1  # float64: 256 values a pass
    assert _gpu_ops.column_warps(2, 0, 4, 2) == 1  # no columns: one warp, nothing to do


def test_the_row_order_build_of_the_gather_kernels_compiles(monkeypatch):
    """The TWELL_GATHER_ROW_ORDER=1 build (the kernels read their row from an order) is a
    measurement build of the same instantiations: it compiles for sm_90a too."""
    _nvrtc_or_skip()
    monkeypatch.setattr(_kernels, "GATHER_ROW_ORDER", True)
    assert "-DTWELL_GATHER_ROW_ORDER=1" in _kernels.compile_options()
    name = "twell_gather.cu"
    cubin = _kernels._nvrtc_cubin(name, _kernels.INSTANTIATIONS[name], "sm_90a")[0]
    assert len(cubin) > 0


def test_the_cut_products_take_their_kernels_and_another_register_cap_compiles(monkeypatch):
    """The 2-byte single cut product runs the register-capped kernel, the pair and the wider types
    the launch-bounded one; the TWELL_CUT_MAX_REGS build (another cap, for measurements) compiles
    the same instantiations for sm_90a."""
    assert _kernels.gather_expression("csr_spmm_cut", np.dtype("float16"), 8, 2).startswith(
        "twell_gather_csr_spmm_cut_capped<"
    )
    assert _kernels.gather_expression("csr_spmm_cut", np.dtype("float32"), 8, 2).startswith(
        "twell_gather_csr_spmm_cut<"
    )
    assert _kernels.gather_expression("csr_spmm_pair_cut", np.dtype("float16"), 4, 4).startswith(
        "twell_gather_csr_spmm_cut<"
    )
    _nvrtc_or_skip()
    monkeypatch.setenv("TWELL_CUT_MAX_REGS", "168")
    name = "twell_gather.cu"
    expressions = [e for e in _kernels.INSTANTIATIONS[name] if "csr_spmm_cut" in e]
    assert any("_capped<" in e for e in expressions)
    assert len(_kernels._nvrtc_cubin(name, expressions, "sm_90a")[0]) > 0
