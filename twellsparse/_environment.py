"""The facts every recorded measurement carries: date, GPU, driver, CUDA/CuPy versions, commit."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
from pathlib import Path
from typing import Any

import numpy as np

from ._backend import cupy_module, gpu_available


def git_commit() -> str | None:
    """``TWELL_COMMIT`` if set, else the checkout's HEAD (with ``-dirty`` when it has
    uncommitted changes), else (a copy of the tree sent to another machine, without .git) the
    commit written to ``bench/.commit`` beside the package by :func:`git_commit` before the
    copy, else None."""
    if os.environ.get("TWELL_COMMIT"):
        return os.environ["TWELL_COMMIT"]
    root = Path(__file__).resolve().parents[1]
    if (root / ".git").exists():
        try:
            sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
            dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True)
            return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
        except (OSError, subprocess.CalledProcessError):
            pass
    recorded = root / "bench" / ".commit"
    if recorded.is_file() and recorded.read_text().strip():
        return recorded.read_text().strip()
    return None


def append_records(path: str | None, records: list[dict[str, Any]]) -> None:
    """Append measurement records to a JSON-lines file (nothing when ``path`` is None)."""
    if not path:
        return
    with open(path, "a") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")


#: TWELL_* environment variables that say where a run came from, not how it computed.
_NOT_SETTINGS = ("TWELL_COMMIT", "TWELL_TESTS", "TWELL_STAGES", "TWELL_PROBE_PATH")


def environment() -> dict[str, Any]:
    """A JSON-ready description of where a measurement ran."""
    from . import __version__

    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "twellsparse": __version__,
        "commit": git_commit(),
        "python": platform.python_version(),
        "numpy": np.__version__,
    }
    settings = {k: v for k, v in os.environ.items() if k.startswith("TWELL_") and k not in _NOT_SETTINGS}
    if settings:  # build and dispatch switches that change what was measured
        env["settings"] = dict(sorted(settings.items()))
    cp = cupy_module()
    if cp is not None:
        env["cupy"] = cp.__version__
    if gpu_available():
        assert cp is not None
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        env["gpu"] = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        env["sm"] = f"{props['major']}{props['minor']}"
        env["driver"] = cp.cuda.runtime.driverGetVersion()
        env["cuda_runtime"] = cp.cuda.runtime.runtimeGetVersion()
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
            )
            env["driver_version"] = smi.stdout.strip().splitlines()[0] if smi.stdout.strip() else None
        except OSError:
            pass
    return env


def run_record(step_ms: list[float], tokens_per_rank: int, skip: int = 1, **fields: Any) -> dict[str, Any]:
    """A timed run's record (the multi-device examples' ``--json``): ``fields``, the step times
    in ms with their median over the steps after the first ``skip`` (which pay the compiles and
    the allocations), the tokens per second per rank at that median, and :func:`environment`."""
    median = statistics.median(step_ms[skip:] or step_ms[-1:])
    timing = {
        "step_ms": {"median": median, "all": step_ms, "skipped": min(skip, len(step_ms) - 1)},
        "tokens_per_s_per_rank": tokens_per_rank / (median / 1e3),
    }
    return {**fields, "tokens_per_rank": tokens_per_rank, **timing, **environment()}
