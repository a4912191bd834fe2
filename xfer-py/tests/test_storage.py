"""What a registration holds of the memory it was given (issue 52, item 7).

A torch tensor is not its memory: `t.set_(other)` points it at another storage and frees
the old one once nothing else holds it, and `t.resize_(bigger)` reallocates its storage in
place. A registration holds the tensor's storage, so `set_` and `del` leave the registered
memory valid, and a resize is refused with `xfer.RegionInvalidated` at the next local use.
Read-only memory (bytes, read-only views and arrays, DLPack 1.x exports marked read-only)
is never registered for peers' writes.

The torch cases run on CPU tensors (skipped where torch is not installed); the storage
check itself is also exercised without torch, through an object that looks like a tensor.
"""

import gc

import numpy as np
import pytest
from conftest import pattern
from test_engine import PAGE

import xfer


def torch_or_skip():
    return pytest.importorskip("torch", reason="needs torch (CPU is enough)")


def send(a, b, p, reg, n, imm):
    """Writes `n` bytes of `reg` into a fresh array of `b`; returns the array."""
    dst = np.zeros(n, dtype=np.uint8)
    rd = b.register(dst)
    a.write(p, reg, rd.descriptor, [(0, 0, n)], imm=imm).wait(timeout=10)
    b.wait_imm(imm, timeout=10)
    rd.close()
    return dst


def test_a_tensor_pointed_elsewhere_or_deleted_keeps_its_registered_storage(pair):
    torch = torch_or_skip()
    a, b, p = pair
    data = pattern(4 * PAGE, seed=71)
    t = torch.tensor(data)  # its own (resizable) storage, not numpy's
    rs = a.register(t, remote_write=False)
    weak = t.untyped_storage()._weak_ref()
    try:
        # The tensor now views other memory, and is gone: neither frees the registered one.
        t.set_(torch.zeros(8, dtype=torch.uint8))
        del t
        gc.collect()
        assert not torch.UntypedStorage._expired(weak), "the registration holds the storage"
        # Allocations of the same size would take the memory had it been freed.
        taken = [torch.full((4 * PAGE,), 0xAB, dtype=torch.uint8) for _ in range(8)]
        assert np.array_equal(send(a, b, p, rs, 4 * PAGE, imm=1), data)
        del taken
        rs.close()
        gc.collect()
        assert torch.UntypedStorage._expired(weak), "closing gave the storage back"
    finally:
        torch.UntypedStorage._free_weak_ref(weak)


def test_a_registered_tensor_resized_is_refused_at_its_next_use(pair):
    torch = torch_or_skip()
    a, b, p = pair
    data = pattern(PAGE, seed=72)
    src = torch.tensor(data)
    rs = a.register(src, remote_write=False)
    assert np.array_equal(send(a, b, p, rs, PAGE, imm=2), data)
    src.resize_(64 * PAGE)  # beyond its storage: reallocated, the registered memory freed
    dst = np.zeros(PAGE, dtype=np.uint8)
    rd = b.register(dst)
    with pytest.raises(xfer.RegionInvalidated, match="resized or replaced") as e:
        a.write(p, rs, rd.descriptor, [(0, 0, PAGE)])
    assert isinstance(e.value, xfer.InvalidArgument)
    assert "register the tensor again" in str(e.value)
    with pytest.raises(xfer.RegionInvalidated):
        a.write_pages(p, rs, rd.descriptor, [0], [0], PAGE)
    assert not dst.any(), "nothing was sent"
    # Closing closes all the same, and says so.
    with pytest.raises(xfer.RegionInvalidated, match="closed"):
        rs.close()
    assert rs.closed
    rs.close()  # closed: nothing more to say
    # Registered again, the tensor's new memory is what is sent.
    again = a.register(src, remote_write=False)
    assert again.nbytes == 64 * PAGE
    assert np.array_equal(send(a, b, p, again, PAGE, imm=3), src[:PAGE].numpy())
    again.close()

    # A destination: its storage freed (FSDP's resize_(0)); reads into it are refused.
    readable = b.register(pattern(PAGE, seed=73), remote_write=False, remote_read=True)
    into = torch.zeros(PAGE, dtype=torch.uint8)
    ri = a.register(into)
    into.untyped_storage().resize_(0)
    with pytest.raises(xfer.RegionInvalidated):
        a.read(p, ri, readable.descriptor, [(0, 0, PAGE)])
    with pytest.raises(xfer.RegionInvalidated):
        a.read_pages(p, ri, readable.descriptor, [0], [0], PAGE)
    with pytest.raises(xfer.RegionInvalidated):
        a.offer("cache", ri)
    with pytest.raises(xfer.RegionInvalidated):
        ri.close()


class Storage:
    """A storage as torch's looks to xfer: data_ptr(), nbytes(), and resize_ that moves
    the memory (a new array)."""

    def __init__(self, array):
        self.array = array

    def data_ptr(self):
        return self.array.ctypes.data

    def nbytes(self):
        return self.array.nbytes

    def resize_(self, n):
        grown = np.zeros(n, dtype=np.uint8)
        grown[: min(n, self.array.nbytes)] = self.array[:n]
        self.array = grown


class Tensor:
    """A tensor as torch's looks to xfer: DLPack (no buffer protocol) and a storage,
    which is `storage` (by default the exported memory itself)."""

    def __init__(self, array, storage=None):
        self.array = array
        self.storage = storage if storage is not None else Storage(array)

    def __dlpack__(self, stream=None, max_version=None):
        return self.array.__dlpack__(max_version=max_version)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()

    def untyped_storage(self):
        return self.storage


def test_the_storage_check_without_torch(pair):
    a, b, p = pair
    data = pattern(2 * PAGE, seed=74)
    t = Tensor(data.copy())
    rs = a.register(t, remote_write=False)
    assert np.array_equal(send(a, b, p, rs, 2 * PAGE, imm=4), data)
    t.storage.resize_(4 * PAGE)
    dst = b.register(np.zeros(PAGE, dtype=np.uint8))
    with pytest.raises(xfer.RegionInvalidated, match="resized or replaced"):
        a.write(p, rs, dst.descriptor, [(0, 0, PAGE)])
    with pytest.raises(xfer.RegionInvalidated):
        rs.close()
    # Registered bytes that are not the storage's memory are refused at registration.
    with pytest.raises(xfer.InvalidArgument, match="not inside its storage"):
        a.register(Tensor(np.zeros(PAGE, dtype=np.uint8), Storage(np.zeros(PAGE, dtype=np.uint8))))

    class Broken(Storage):
        def data_ptr(self):
            raise RuntimeError("no data")

    with pytest.raises(xfer.InvalidArgument, match="no data"):
        arr = np.zeros(PAGE, dtype=np.uint8)
        a.register(Tensor(arr, Broken(arr)))


class DlpackOnly:
    """Memory offered through DLPack only, by a producer that speaks DLPack 1.x (numpy's
    __dlpack__ marks a read-only array's export read-only)."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, stream=None, max_version=None):
        return self.array.__dlpack__(max_version=max_version)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def read_only_array(seed):
    a = pattern(PAGE, seed=seed)
    a.flags.writeable = False
    return a


@pytest.mark.parametrize("transport", ["mem", "tcp"])
def test_read_only_memory_is_a_source_never_a_target(transport):
    """Read-only memory in each form xfer takes: refused with remote_write=True (the
    default), taken as a source and for peers' reads. DLPack is new here (its read-only
    flag was ignored); the buffer protocol's was checked before."""
    with xfer.Agent(transport=transport, timeout=5.0) as a, xfer.Agent(transport=transport, timeout=5.0) as b:
        p, q = a.connect(b.info), b.connect(a.info)
        data = bytes(pattern(PAGE, seed=75))
        kinds = {
            "bytes": lambda: data,
            "read-only memoryview": lambda: memoryview(bytearray(data)).toreadonly(),
            "numpy writeable=False": lambda: np.frombuffer(data, dtype=np.uint8),
            "DLPack read-only": lambda: DlpackOnly(np.frombuffer(data, dtype=np.uint8)),
        }
        for n, (kind, make) in enumerate(kinds.items()):
            with pytest.raises(xfer.InvalidArgument, match="read-only"):
                a.register(make())
            with pytest.raises(xfer.InvalidArgument, match="read-only"):
                a.register(make(), remote_write=True, remote_read=True)
            reg = a.register(make(), remote_write=False, remote_read=True)
            assert np.array_equal(send(a, b, p, reg, PAGE, imm=10 + n), np.frombuffer(data, np.uint8)), kind
            # A peer reads it.
            got = np.zeros(PAGE, dtype=np.uint8)
            rg = b.register(got)
            b.read(q, rg, reg.descriptor, [(0, 0, PAGE)]).wait(timeout=10)
            assert got.tobytes() == data, kind
            rg.close()
            reg.close()
        # Writable DLPack memory (1.x and the unversioned protocol) is still a target.
        dst = np.zeros(PAGE, dtype=np.uint8)
        rd = a.register(DlpackOnly(dst))
        rs = b.register(np.frombuffer(data, dtype=np.uint8), remote_write=False)
        b.write(q, rs, rd.descriptor, [(0, 0, PAGE)], imm=20).wait(timeout=10)
        a.wait_imm(20, timeout=10)
        assert dst.tobytes() == data


def test_a_weight_push_refuses_a_resized_tensor_and_one_prepare_reallocated():
    """The weight sync's pushes check the sources' storages before they start, and each
    piece's again after its prepare hook ran (FSDP frees and regathers a parameter's
    storage with resize_, which moves it)."""
    torch = torch_or_skip()
    from xfer.weights import LayoutBuilder, Plan, WeightReceiver, WeightSender, whole  # noqa: PLC0415

    w = torch.arange(64, dtype=torch.int32)
    out = np.zeros(64, dtype=np.int32)
    sb, db = LayoutBuilder(), LayoutBuilder()
    sb.add("w", w, [("w", (64,), whole((64,)))])
    db.add("w", out, [("w", (64,), whole((64,)))])
    plan = Plan([sb.layout], [db.layout])
    sender = WeightSender(xfer.Agent(transport="mem"), plan, 0, sb)
    receiver = WeightReceiver(xfer.Agent(transport="mem"), db, sources=1, rank=0)
    sender.attach(receiver.info())
    assert sender.send_weights(1) == {}
    receiver.destination.wait(1, timeout=10)
    # (Not w.numpy(): a numpy view makes a CPU storage non-resizable.)
    assert np.array_equal(out, np.arange(64, dtype=np.int32))

    def regather(piece, tensor, region):
        storage = w.untyped_storage()
        n = storage.nbytes()
        storage.resize_(0)  # freed...
        storage.resize_(n)  # ...and gathered again, elsewhere

    report = sender.source.push(2, prepare=regather)
    assert list(report) == [0] and isinstance(report[0], xfer.Error), report
    assert "piece 0 after prepare" in str(report[0]) and "resized or replaced" in str(report[0])
    with pytest.raises(xfer.RegionInvalidated, match="this push is refused"):
        sender.source.push(3)
