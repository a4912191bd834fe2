"""Shared fixtures of the xfer test suite.

CUDA cases are marked `cuda`: they are skipped (and reported as skipped) where torch or a
CUDA GPU is missing, and fail instead when XFER_REQUIRE_CUDA=1.
"""

import os

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
    """Two engines of one process on the same transport, the first with the second as
    its peer: (a, b, peer)."""
    a = xfer.Engine(transport=request.param, timeout=5.0)
    b = xfer.Engine(transport=request.param, timeout=5.0)
    p = a.add_peer(b.address)
    yield a, b, p
    a.close()
    b.close()
