"""Multi-device training on CPUs, through the reference path: TwELL MLPs under PyTorch DDP and
FSDP2 (two torchrun ranks on gloo, each training on half of one batch, reach the single-process
losses and weights), and a JAX data-parallel step over two host devices (shard_map) matching
one device."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import EXAMPLES, TORCHRUN, train_example

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return train_example([sys.executable], ["--single"], tmp_path_factory.mktemp("single") / "r.pt")


@pytest.mark.parametrize("options", [[], ["--fsdp"]], ids=["ddp", "fsdp2"])
def test_two_ranks_match_one_process(tmp_path, single, options):
    record = tmp_path / "r.jsonl"
    got = train_example(TORCHRUN, [*options, "--json", str(record)], tmp_path / "r.pt")
    assert len(got["losses"]) == 3 and got["losses"][-1] < got["losses"][0]  # it trains
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=1e-6)
    assert got["state"].keys() == single["state"].keys()
    for name, value in single["state"].items():
        torch.testing.assert_close(got["state"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    # rank 0's record of the run: one line, the slowest rank's steps, tokens per rank
    (line,) = record.read_text().splitlines()
    rec = json.loads(line)
    assert rec["mode"] == ("fsdp2" if options else "ddp") and rec["world"] == 2 and rec["mlp"] == "twell"
    assert rec["tokens_per_rank"] == 32 and len(rec["step_ms"]["all"]) == 3 and rec["losses"] == got["losses"]
    assert rec["tokens_per_s_per_rank"] == pytest.approx(32 / (rec["step_ms"]["median"] / 1e3))
    assert rec["commit"] and "date" in rec


def test_density_sets_every_layers_threshold(tmp_path):
    """--density: each TwELL layer keeps about that fraction (thresholds from the first batch,
    the last of 3 steps measured), and the dense twin takes the same thresholds: one function,
    so the runs' losses differ only by the sparse model's L1 term, which the dense one lacks."""
    record = tmp_path / "r.jsonl"
    runs = {}
    for mlp in ("twell", "dense"):
        options = ["--single", "--density", "0.1", "--l1", "0", "--json", str(record)]
        options += ["--dense"] if mlp == "dense" else []
        runs[mlp] = train_example([sys.executable], options, tmp_path / f"{mlp}.pt")
    sparse, dense = (json.loads(line) for line in record.read_text().splitlines())
    assert sparse["density"] == pytest.approx(0.1, abs=0.02) and dense["density"] is None
    torch.testing.assert_close(torch.tensor(runs["twell"]["losses"]), torch.tensor(runs["dense"]["losses"]))


def test_jax_data_parallel_step_matches_one_device():
    """examples/jax_data_parallel.py --check on two host devices (shard_map over "data")."""
    pytest.importorskip("jax")
    script = EXAMPLES / "jax_data_parallel.py"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "2 device(s) (cpu)" in done.stdout and "matches the single-device one" in done.stdout


def test_jax_records_a_run_and_its_dense_twin(tmp_path):
    """--density builds a gate firing at that rate, --dense runs the same step on the dense
    block (the same function: the same losses), --json records each run."""
    pytest.importorskip("jax")
    script = EXAMPLES / "jax_data_parallel.py"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    record = tmp_path / "r.jsonl"
    for extra in ([], ["--dense"]):
        cmd = [sys.executable, str(script), "--density", "0.1", "--steps", "2", "--json", str(record), *extra]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    sparse, dense = (json.loads(line) for line in record.read_text().splitlines())
    assert (sparse["mlp"], dense["mlp"]) == ("twell", "dense") and sparse["world"] == 2
    assert sparse["tokens_per_rank"] == 32 and len(sparse["step_ms"]["all"]) == 2
    assert sparse["losses"] == pytest.approx(dense["losses"], rel=1e-5)
