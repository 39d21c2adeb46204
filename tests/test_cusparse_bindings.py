"""The cuSPARSE bindings without a GPU: the library is found and loaded (the CUDA extras install
it), its version is read, and a missing library gives an error naming every place tried."""

from __future__ import annotations

import importlib.util

import pytest
from twellsparse.bindings import cusparse

#: The library itself needs cffi and the CUDA extras (cuda12 / cuda13); the rest runs without.
needs_library = pytest.mark.skipif(
    importlib.util.find_spec("cffi") is None, reason="the cuSPARSE bindings need cffi (a CUDA extra)"
)


@needs_library
def test_library_loads_and_reports_version():
    major, minor, patch = cusparse.version()
    assert major >= 12 and minor >= 0 and patch >= 0


def test_candidates_start_with_the_environment_override(monkeypatch):
    monkeypatch.setenv(cusparse.ENV_LIBRARY, "/opt/custom/libcusparse.so.12")
    assert next(cusparse.library_candidates()) == "/opt/custom/libcusparse.so.12"


@needs_library
def test_missing_library_names_what_was_tried(monkeypatch):
    monkeypatch.setattr(cusparse, "library_candidates", lambda: iter(["/nonexistent/libcusparse.so.12"]))
    cusparse.library.cache_clear()
    try:
        with pytest.raises(
            cusparse.CuSparseError,
            match=r"cuSPARSE: no library could be loaded; .* Tried: /nonexistent/libcusparse.so.12",
        ):
            cusparse.library()
    finally:
        monkeypatch.undo()
        cusparse.library.cache_clear()
    assert cusparse.version()[0] >= 12  # the real library loads again


@needs_library
def test_failed_status_is_named():
    with pytest.raises(cusparse.CuSparseError, match="cusparseGetProperty: CUSPARSE_STATUS_INVALID_VALUE"):
        cusparse._check(3, "cusparseGetProperty")


def test_value_types_and_algorithms():
    assert cusparse.SPMM_ALGS["csr_alg3"] == 12 and cusparse.SPMM_ALGS["blocked_ell_alg1"] == 13
    assert cusparse._value_type("bfloat16") == 14
    with pytest.raises(ValueError, match="dtype: expected one of"):
        cusparse._value_type("int8")


@pytest.mark.parametrize("raw", ["0", "-2", "eight"])
def test_gemm_candidates_setting_is_checked(monkeypatch, raw):
    from twellsparse.bindings import cublaslt

    monkeypatch.setenv(cublaslt.ENV_CANDIDATES, raw)
    with pytest.raises(ValueError, match=f"TWELL_GEMM_CANDIDATES: expected a positive integer, got {raw!r}"):
        cublaslt.candidates_from_environment()
    monkeypatch.setenv(cublaslt.ENV_CANDIDATES, "3")
    assert cublaslt.candidates_from_environment() == 3


def test_timed_choices_are_shared_by_size_class():
    """Token counts in (2**(c - 1), 2**c] share a timed algorithm: a plan adopts it when the
    heuristic offers it again, and keeps every candidate (to time them) otherwise."""
    from twellsparse.bindings import cublaslt

    assert [cublaslt.size_class(m) for m in (1, 2, 3, 4, 5, 4096, 4097, 8192)] == [0, 1, 2, 2, 3, 12, 13, 13]
    offered = [(b"a", 0), (b"b", 64), (b"c", 32)]
    same = lambda algo: algo  # noqa: E731  (the algorithms here are their own bytes)
    assert cublaslt.adopt(offered, b"c", same) == [(b"c", 32)]
    assert cublaslt.adopt(offered, b"z", same) == offered  # not offered for this count: time again
    assert cublaslt.adopt(offered, None, same) == offered
