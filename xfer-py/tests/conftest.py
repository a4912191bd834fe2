"""Shared fixtures of the xfer test suite.

CUDA cases are marked `cuda`: they are skipped (and reported as skipped) where torch or a
CUDA GPU is missing, and fail instead when XFER_REQUIRE_CUDA=1.
"""

import os
import shutil
import socket
import subprocess
import time

import numpy as np
import pytest

import xfer

REQUIRE_CUDA = os.environ.get("XFER_REQUIRE_CUDA") == "1"


def cuda_or_skip():
    """torch, when it has a CUDA GPU; else skips (or fails under XFER_REQUIRE_CUDA=1)."""
    why = None
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        why = "torch is not installed"
    else:
        if not torch.cuda.is_available():
            why = "torch sees no CUDA GPU"
    if why is None:
        return torch
    if REQUIRE_CUDA:
        pytest.fail(f"XFER_REQUIRE_CUDA=1 but {why}")
    pytest.skip(f"needs a CUDA GPU and torch: {why}")


def pattern(n, seed):
    """`n` bytes of a pattern that differs from page to page and from seed to seed."""
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.fixture(params=["mem", "tcp"])
def pair(request):
    """Two agents of one process on the same transport, the first with the second as
    its peer: (a, b, peer)."""
    a = xfer.Agent(transport=request.param, timeout=5.0)
    b = xfer.Agent(transport=request.param, timeout=5.0)
    p = a.connect(b.info)
    yield a, b, p
    a.close()
    b.close()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def etcd_url(tmp_path):
    exe = shutil.which("etcd")
    if exe is None:
        if os.environ.get("XFER_REQUIRE_ETCD"):
            pytest.fail("XFER_REQUIRE_ETCD is set but no etcd is on PATH (Debian: etcd-server)")
        pytest.skip("needs etcd on PATH (Debian: etcd-server)")
    c, p = free_port(), free_port()
    cu, pu = f"http://127.0.0.1:{c}", f"http://127.0.0.1:{p}"
    log = open(tmp_path / "etcd.log", "wb")
    proc = subprocess.Popen(
        [exe, "--name", "t", "--data-dir", str(tmp_path / "data"),
         "--listen-client-urls", cu, "--advertise-client-urls", cu,
         "--listen-peer-urls", pu, "--initial-advertise-peer-urls", pu,
         "--initial-cluster", f"t={pu}", "--logger", "zap", "--log-level", "warn"],
        stdout=log, stderr=log)
    url = f"etcd://127.0.0.1:{c}"
    deadline = time.monotonic() + 20
    while True:
        try:
            xfer.Directory(url)
            break
        except xfer.DirectoryError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail("etcd did not start: " + (tmp_path / "etcd.log").read_text())
    yield url
    proc.kill()
    proc.wait()
