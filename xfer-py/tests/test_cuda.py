"""The xfer package on CUDA memory (torch tensors): one process over tcp, two processes
over cuda-ipc and tcp, and the bad inputs of GPU memory. Skipped (visibly) without torch
and a GPU; XFER_REQUIRE_CUDA=1 makes them fail instead (scripts/py-gpu-proof.sh)."""

import gc
import json
import os
import weakref

import numpy as np
import pytest
from conftest import cuda_or_skip, pattern
from test_engine import PAGE, spawn_peer

import xfer

pytestmark = pytest.mark.cuda


def test_gpu_pages_over_tcp_in_one_process():
    torch = cuda_or_skip()
    with xfer.Agent(transport="tcp", memory="cuda") as a, xfer.Agent(transport="tcp", memory="cuda") as b:
        p = a.connect(b.info)
        src = torch.from_numpy(pattern(64 * PAGE, seed=11)).cuda()
        dst = torch.zeros(64 * PAGE, dtype=torch.uint8, device="cuda:0")
        rs, rd = a.register(src, remote_write=False), b.register(dst)
        assert rs.is_cuda and rd.is_cuda
        sp, dp = list(range(0, 64, 2)), list(range(63, 0, -2))
        assert a.write_pages(p, rs, rd.descriptor, sp, dp, PAGE, imm=3).wait(timeout=30) == 32 * PAGE
        b.wait_imm(3, timeout=30)
        s, d = src.view(64, PAGE), dst.view(64, PAGE)
        assert torch.equal(d[dp], s[sp])
        untouched = [i for i in range(64) if i not in dp]
        assert not d[untouched].any()


def test_one_agent_moves_host_and_gpu_memory():
    # Agents of GPU memory (auto: cuda-ipc and tcp) take numpy arrays too; each write goes
    # over the first transport both its buffers are registered on.
    torch = cuda_or_skip()
    with xfer.Agent(memory="cuda", name="a") as a, xfer.Agent(memory="cuda", name="b") as b:
        p = a.connect(b.info)
        assert p.transport == "cuda-ipc"
        host_src = pattern(4 * PAGE, seed=5)
        gpu_src = torch.from_numpy(pattern(4 * PAGE, seed=6)).cuda()
        gpu_dst = torch.zeros(8 * PAGE, dtype=torch.uint8, device="cuda:0")
        host_dst = np.zeros(4 * PAGE, dtype=np.uint8)
        rhs, rgs = a.register(host_src, remote_write=False), a.register(gpu_src, remote_write=False)
        rgd, rhd = b.register(gpu_dst), b.register(host_dst)
        a.write(p, rhs, rgd.descriptor, [(0, 0, 4 * PAGE)], imm=1).wait(timeout=30)
        a.write(p, rgs, rgd.descriptor, [(0, 4 * PAGE, 4 * PAGE)], imm=2).wait(timeout=30)
        a.write(p, rgs, rhd.descriptor, [(0, 0, 4 * PAGE)], imm=3).wait(timeout=30)
        for v in (1, 2, 3):
            b.wait_imm(v, timeout=30)
        got = gpu_dst.cpu().numpy()
        assert np.array_equal(got[: 4 * PAGE], host_src), "host -> GPU"
        assert np.array_equal(got[4 * PAGE :], gpu_src.cpu().numpy()), "GPU -> GPU"
        assert np.array_equal(host_dst, gpu_src.cpu().numpy()), "GPU -> host"


@pytest.mark.parametrize("transport", ["cuda-ipc", "tcp"])
def test_gpu_to_gpu_between_two_processes(transport):
    torch = cuda_or_skip()
    proc, addr, desc = spawn_peer("--transport", transport, "--device", "cuda", "--bytes", str(256 * PAGE))
    try:
        with xfer.Agent(transport=transport, memory="cuda", timeout=10.0) as e:
            p = e.connect(addr)
            src = torch.from_numpy(pattern(64 * PAGE, seed=12)).cuda()
            rs = e.register(src, remote_write=False)
            dst_pages = [int(x) for x in np.random.default_rng(6).permutation(256)[:64]]
            e.write_pages(p, rs, desc, list(range(64)), dst_pages, PAGE, imm=9).wait(timeout=30)
            cmd = {"imm": 9, "count": 1, "pages": dst_pages, "page_size": PAGE, "seed": 12}
            proc.stdin.write(json.dumps({"expect": cmd}) + "\n")
            proc.stdin.flush()
            assert json.loads(proc.stdout.readline())["ok"]
        proc.stdin.write(json.dumps({"exit": True}) + "\n")
        proc.stdin.flush()
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()


def test_bad_gpu_memory_is_refused_with_the_fix_named():
    torch = cuda_or_skip()
    with xfer.Agent(transport="cuda-ipc", memory="cuda") as e:
        with pytest.raises(xfer.InvalidArgument, match=r"contiguous\(\)"):
            e.register(torch.zeros(64, 64, device="cuda:0")[:, ::2])
        with pytest.raises(xfer.InvalidArgument, match=r"tensor\.cuda\(\)"):
            e.register(torch.zeros(64))  # a CPU tensor on an agent of GPU memory
        with pytest.raises(xfer.InvalidArgument, match="host memory"):
            e.register(np.zeros(64, dtype=np.uint8))

        class FakeCuda:  # claims to be CUDA memory, but the pointer is host memory
            def __init__(self):
                self.host = np.zeros(4096, dtype=np.uint8)
                self.__cuda_array_interface__ = {
                    "data": (self.host.ctypes.data, False),
                    "shape": (4096,),
                    "typestr": "|u1",
                    "strides": None,
                    "version": 3,
                }

        with pytest.raises(xfer.InvalidArgument, match="not memory of the agent's GPU"):
            e.register(FakeCuda())
    if torch.cuda.device_count() < 2:
        if os.environ.get("XFER_REQUIRE_GPUS") == "2":
            pytest.fail("XFER_REQUIRE_GPUS=2 but torch sees one GPU")
        pytest.skip("the other-GPU case needs two GPUs")
    with xfer.Agent(transport="tcp", memory="cuda", gpu=0) as e:
        with pytest.raises(xfer.InvalidArgument, match=r'to\("cuda:0"\)'):
            e.register(torch.zeros(64, device="cuda:1"))


def test_a_cuda_registration_keeps_its_tensor_alive():
    torch = cuda_or_skip()
    with xfer.Agent(transport="tcp", memory="cuda") as a, xfer.Agent(transport="tcp", memory="cuda") as b:
        p = a.connect(b.info)
        dst = torch.zeros(16 * PAGE, dtype=torch.uint8, device="cuda:0")
        alive = weakref.ref(dst)
        rd = b.register(dst)
        del dst
        gc.collect()
        assert alive() is not None
        src = torch.from_numpy(pattern(16 * PAGE, seed=13)).cuda()
        rs = a.register(src)
        a.write(p, rs, rd.descriptor, [(0, 0, 16 * PAGE)], imm=2).wait(timeout=30)
        b.wait_imm(2, timeout=30)
        assert torch.equal(rd.obj, src)
        rd.close()
        gc.collect()
        assert alive() is None


def test_a_cuda_tensor_set_elsewhere_keeps_its_storage_and_a_resize_is_refused():
    """A tensor registered through __cuda_array_interface__: the registration holds its
    storage, so set_() and del leave the registered memory valid (the caching allocator
    would hand it out again otherwise); resize_() beyond the storage moves it, and the next
    write (and close) raises RegionInvalidated."""
    torch = cuda_or_skip()
    with xfer.Agent(transport="tcp", memory="cuda") as a, xfer.Agent(transport="tcp", memory="cuda") as b:
        p = a.connect(b.info)
        data = pattern(4 * PAGE, seed=14)
        t = torch.from_numpy(data).cuda()
        rs = a.register(t, remote_write=False)
        weak = t.untyped_storage()._weak_ref()
        try:
            t.set_(torch.zeros(8, dtype=torch.uint8, device="cuda:0"))
            del t
            gc.collect()
            assert not torch.UntypedStorage._expired(weak), "the registration holds the storage"
            taken = [torch.full((4 * PAGE,), 0xAB, dtype=torch.uint8, device="cuda:0") for _ in range(8)]
            dst = torch.zeros(4 * PAGE, dtype=torch.uint8, device="cuda:0")
            rd = b.register(dst)
            a.write(p, rs, rd.descriptor, [(0, 0, 4 * PAGE)], imm=5).wait(timeout=30)
            b.wait_imm(5, timeout=30)
            assert np.array_equal(dst.cpu().numpy(), data)
            del taken
            rs.close()
            gc.collect()
            assert torch.UntypedStorage._expired(weak), "closing gave the storage back"
        finally:
            torch.UntypedStorage._free_weak_ref(weak)
        src = torch.from_numpy(data).cuda()
        rs = a.register(src, remote_write=False)
        src.resize_(64 * PAGE)
        with pytest.raises(xfer.RegionInvalidated, match="resized or replaced"):
            a.write(p, rs, rd.descriptor, [(0, 0, PAGE)])
        with pytest.raises(xfer.RegionInvalidated):
            rs.close()
        assert rs.closed


# Stream order: the source is computed by a kernel queued behind about half a second of GPU
# time, and the transfer is submitted at once. It must move the kernel's bytes, not what
# was there before; and the target, reading on a stream of its own right after wait_imm,
# must see them.
ORDER_BYTES = 64 << 20


def late_fill(torch, t, value, stream=None):
    """Queues ~0.5 s of GPU time, then t.fill_(value), on `stream` (default: current)."""
    with torch.cuda.stream(stream or torch.cuda.current_stream()):
        torch.cuda._sleep(1_000_000_000)  # cycles: about half a second at ~2 GHz
        t.fill_(value)


@pytest.mark.parametrize("transport", ["cuda-ipc", "tcp"])
@pytest.mark.parametrize("where", ["current", "side"])
def test_a_write_waits_for_the_kernel_that_computes_its_source(transport, where):
    torch = cuda_or_skip()
    with xfer.Agent(transport=transport, memory="cuda") as a, xfer.Agent(transport=transport, memory="cuda") as b:
        p = a.connect(b.info)
        src = torch.zeros(ORDER_BYTES, dtype=torch.uint8, device="cuda:0")
        dst = torch.zeros(ORDER_BYTES, dtype=torch.uint8, device="cuda:0")
        rs, rd = a.register(src, remote_write=False), b.register(dst)
        torch.cuda.synchronize()
        side = torch.cuda.Stream() if where == "side" else None
        late_fill(torch, src, 7, side)
        # At once: torch's current stream by default, the named one otherwise.
        h = a.write(p, rs, rd.descriptor, [(0, 0, ORDER_BYTES)], imm=5, stream=side)
        assert h.wait(timeout=30) == ORDER_BYTES
        b.wait_imm(5, timeout=30)
        reader = torch.cuda.Stream()
        with torch.cuda.stream(reader):
            filled = int((dst == 7).sum().item())
        assert filled == ORDER_BYTES, f"{filled} of {ORDER_BYTES} bytes carry the kernel's fill"


def hmem_libfabric_or_skip(torch):
    """Skips when the libfabric xfer loads cannot register CUDA memory (Debian's is built
    without CUDA; XFER_LIBFABRIC names one that is), or fails under XFER_REQUIRE_HMEM=1."""
    try:
        with xfer.Agent(transport="efa", provider="shm", memory="cuda") as e:
            e.register(torch.zeros(4096, dtype=torch.uint8, device="cuda:0"))
    except (xfer.Unsupported, xfer.TransportFailed) as err:
        if os.environ.get("XFER_REQUIRE_HMEM") == "1":
            pytest.fail(f"XFER_REQUIRE_HMEM=1 but {err}")
        pytest.skip(f"needs a libfabric built with CUDA (XFER_LIBFABRIC): {err}")


def test_a_write_over_efa_shm_between_processes_waits_for_the_kernel():
    torch = cuda_or_skip()
    hmem_libfabric_or_skip(torch)
    proc, addr, desc = spawn_peer(
        "--transport", "efa", "--provider", "shm", "--device", "cuda", "--bytes", str(ORDER_BYTES)
    )
    try:
        with xfer.Agent(transport="efa", provider="shm", memory="cuda", timeout=10.0) as e:
            p = e.connect(addr)
            src = torch.zeros(ORDER_BYTES, dtype=torch.uint8, device="cuda:0")
            rs = e.register(src, remote_write=False)
            torch.cuda.synchronize()
            late_fill(torch, src, 7)
            e.write(p, rs, desc, [(0, 0, ORDER_BYTES)], imm=6).wait(timeout=30)
            proc.stdin.write(json.dumps({"filled": {"imm": 6, "value": 7}}) + "\n")
            proc.stdin.flush()
            assert json.loads(proc.stdout.readline()) == {"filled": ORDER_BYTES}
        proc.stdin.write(json.dumps({"exit": True}) + "\n")
        proc.stdin.flush()
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()


def test_a_stream_argument_on_host_memory_is_refused():
    torch = cuda_or_skip()
    with xfer.Agent(transport="tcp") as a, xfer.Agent(transport="tcp") as b:
        p = a.connect(b.info)
        rs, rd = a.register(np.zeros(4096, dtype=np.uint8), remote_write=False), b.register(np.zeros(4096, dtype=np.uint8))
        with pytest.raises(xfer.InvalidArgument, match="host memory"):
            a.write(p, rs, rd.descriptor, [(0, 0, 4096)], stream=torch.cuda.current_stream())


def test_auto_agents_of_two_gpu_processes_of_one_host_use_cuda_ipc():
    torch = cuda_or_skip()
    proc, addr, desc = spawn_peer("--transport", "auto", "--device", "cuda", "--bytes", str(64 * PAGE))
    try:
        with xfer.Agent(memory="cuda", timeout=10.0) as e:  # transport="auto"
            assert e.transport == "auto" and e.transports[0] == "cuda-ipc" and "tcp" in e.transports
            p = e.connect(addr)
            assert p.transport == "cuda-ipc"
            src = torch.from_numpy(pattern(8 * PAGE, seed=14)).cuda()
            rs = e.register(src, remote_write=False)
            e.write_pages(p, rs, desc, list(range(8)), list(range(56, 64)), PAGE, imm=10).wait(timeout=30)
            cmd = {"imm": 10, "count": 1, "pages": list(range(56, 64)), "page_size": PAGE, "seed": 14}
            proc.stdin.write(json.dumps({"expect": cmd}) + "\n")
            proc.stdin.flush()
            assert json.loads(proc.stdout.readline())["ok"]
        proc.stdin.write(json.dumps({"exit": True}) + "\n")
        proc.stdin.flush()
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
