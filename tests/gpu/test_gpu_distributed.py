"""Multi-GPU training (issue 7) on a machine with two or more GPUs: TwELL MLPs under DDP and
FSDP2 over two ranks on NCCL and the CUDA kernels reach the single-GPU run's losses and weights,
and the JAX data-parallel step over two GPUs matches one GPU. Skipped with fewer GPUs; the same
logic runs on CPUs in tests/test_distributed.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import EXAMPLES, TORCHRUN, train_example

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

# Two ranks sum the gradients in another order than one process (and each rank's kernels see
# half the tokens): float32 agreement to a few units in the last places of the sums.
RTOL, ATOL = 1e-4, 1e-5


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "r.pt"
    return train_example([sys.executable], ["--single", "--tokens", "256", "--density", "0.05"], out, cpu=False)


@pytest.mark.parametrize("options", [[], ["--fsdp"]], ids=["ddp", "fsdp2"])
def test_two_gpus_match_one(tmp_path, single, options):
    got = train_example(TORCHRUN, [*options, "--tokens", "256", "--density", "0.05"], tmp_path / "r.pt", cpu=False)
    assert got["losses"][-1] < got["losses"][0]  # it trains
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(single["losses"]), rtol=RTOL, atol=ATOL)
    for name, value in single["state"].items():
        torch.testing.assert_close(got["state"][name], value, rtol=RTOL, atol=ATOL, msg=name)


def test_jax_data_parallel_step_over_two_gpus_matches_one():
    pytest.importorskip("jax")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # CuPy's kernels allocate beside XLA
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "jax_data_parallel.py"), "--check", "--rtol", str(RTOL)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    # Both GPUs took part (JAX seeing one would compare one device with one).
    assert "2 device(s) (gpu)" in done.stdout and "matches the single-device one" in done.stdout
