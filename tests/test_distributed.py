"""Multi-device training on CPUs, through the reference path: TwELL MLPs under PyTorch DDP and
FSDP2 (two torchrun ranks on gloo, each training on half of one batch, reach the single-process
losses and weights), and a JAX data-parallel step over two host devices (shard_map) matching
one device."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "examples" / "distributed_train.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


# torch's gloo teardown can still abort a rank after the run is complete (a joinable C++ thread
# destroyed at exit, pytorch/pytorch#179291); that says nothing about the training, so such a run
# is repeated once. Any other failure, or the abort before every step printed, fails at once.
TEARDOWN_ABORT = "terminate called without an active exception"


def _train(launcher: list[str], options: list[str], out: pathlib.Path, steps: int = 3) -> dict:
    cmd = [*launcher, str(SCRIPT), "--cpu", "--steps", str(steps), *options, "--out", str(out)]
    for attempt in range(2):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        finished = f"step {steps - 1}:" in done.stdout and out.exists()
        if done.returncode == 0 or attempt == 1 or not (finished and TEARDOWN_ABORT in done.stderr):
            break
        out.unlink()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return torch.load(out)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _train([sys.executable], ["--single"], tmp_path_factory.mktemp("single") / "r.pt")


@pytest.mark.parametrize("options", [[], ["--fsdp"]], ids=["ddp", "fsdp2"])
def test_two_ranks_match_one_process(tmp_path, single, options):
    got = _train(TORCHRUN, options, tmp_path / "r.pt")
    assert len(got["losses"]) == 3 and got["losses"][-1] < got["losses"][0]  # it trains
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=1e-6)
    assert got["state"].keys() == single["state"].keys()
    for name, value in single["state"].items():
        torch.testing.assert_close(got["state"][name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_jax_data_parallel_step_matches_one_device():
    """examples/jax_data_parallel.py --check on two host devices (shard_map over "data")."""
    pytest.importorskip("jax")
    script = SCRIPT.parent / "jax_data_parallel.py"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "2 device(s) (cpu)" in done.stdout and "matches the single-device one" in done.stdout
