"""The xfer package on host memory: two agents of one process (mem and tcp), two
processes (tcp), bad inputs, a peer killed mid-transfer, and registration lifetime."""

import asyncio
import gc
import json
import os
import signal
import subprocess
import sys
import time
import warnings
import weakref

import numpy as np
import pytest
from conftest import pattern

import xfer

PEER = os.path.join(os.path.dirname(__file__), "peer.py")
PAGE = 4096


def varint(b, at):
    """The unsigned LEB128 varint of `b` at `at` (postcard's integers): (value, end)."""
    value, shift = 0, 0
    while True:
        byte = b[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if byte < 0x80:
            return value, at
        shift += 7


def to_varint(v):
    out = bytearray()
    while True:
        if v < 0x80:
            out.append(v)
            return bytes(out)
        out.append(v & 0x7F | 0x80)
        v >>= 7


def lie_about_length(desc, length):
    """A host-memory region descriptor (the library's byte form: "XFRD", then postcard's
    version, owner, len, memory, access, transports) whose length and every rail's length
    are `length`, keys, owner and addresses kept."""
    assert desc[:4] == b"XFRD"
    version, at = varint(desc, 4)
    assert version == 2, "the layout of metadata version 2"
    _, at = varint(desc, at)  # owner: the registering agent's instance
    head = bytearray(desc[:at])
    _, at = varint(desc, at)  # len
    head += to_varint(length)
    assert desc[at] == 0, "host memory"
    head += desc[at : at + 2]  # memory (Host), access (one byte)
    at += 2
    n, at2 = varint(desc, at)  # transports
    head += desc[at:at2]
    at = at2
    for _ in range(n):
        start = at
        _, at = varint(desc, at)  # transport kind
        rails, at = varint(desc, at)
        head += desc[start:at]
        for _ in range(rails):
            start = at
            _, at = varint(desc, at)  # addr
            head += desc[start:at]
            _, at = varint(desc, at)  # len
            head += to_varint(length)
            start = at
            _, at = varint(desc, at)  # key
            head += desc[start:at]
    assert at == len(desc)
    return bytes(head)


def test_explicit_segments_land_where_they_are_sent(pair):
    a, b, p = pair
    src = pattern(64 * 1024, seed=1)
    dst = np.zeros(64 * 1024, dtype=np.uint8)
    rs, rd = a.register(src, remote_write=False), b.register(dst)
    segs = [(0, 40_000, 1000), (5000, 0, 3), (20_000, 10_000, 9000)]
    assert a.write(p, rs, rd.descriptor, segs).wait(timeout=10) == 10_003
    want = np.zeros_like(dst)
    for s, d, n in segs:
        want[d : d + n] = src[s : s + n]
    assert np.array_equal(dst, want), "every byte sent, and no other byte touched"
    # The same segments as an (n, 3) int64 array, into a fresh target.
    dst2 = np.zeros_like(dst)
    rd2 = b.register(dst2)
    a.write(p, rs, rd2.descriptor, np.array(segs, dtype=np.int64)).wait(timeout=10)
    assert np.array_equal(dst2, want)


def test_paged_writes_with_strides_and_numpy_page_lists(pair):
    a, b, p = pair
    # A vLLM-like layout: pages of 4 KiB at a stride of 8 KiB on the source side.
    src = pattern(16 * 8192, seed=2)
    dst = np.zeros(32 * PAGE, dtype=np.uint8)
    rs, rd = a.register(src), b.register(dst)
    sp, dp = np.array([7, 0, 15, 3], dtype=np.int64), [30, 2, 11, 12]
    h = a.write_pages(p, rs, rd.descriptor, sp, dp, PAGE, src_stride=8192, imm=77)
    assert h.wait(timeout=10) == 4 * PAGE
    b.wait_imm(77, timeout=10)
    for s, d in zip(sp, dp):
        assert np.array_equal(dst[d * PAGE : (d + 1) * PAGE], src[s * 8192 : s * 8192 + PAGE])
    untouched = np.ones(32, dtype=bool)
    untouched[dp] = False
    assert not dst.reshape(32, PAGE)[untouched].any()


def test_immediate_data_is_counted_per_value(pair):
    a, b, p = pair
    src, dst = np.ones(PAGE, dtype=np.uint8), np.zeros(4 * PAGE, dtype=np.uint8)
    rs, rd = a.register(src), b.register(dst)
    hs = [a.write_pages(p, rs, rd.descriptor, [0], [i], PAGE, imm=5) for i in range(3)]
    hs.append(a.write_pages(p, rs, rd.descriptor, [0], [3], PAGE, imm=6))
    for h in hs:
        h.wait(timeout=10)
    b.wait_imm(5, count=3, timeout=10)
    with pytest.raises(xfer.TimedOut):
        b.wait_imm(5, count=1, timeout=0.2)  # all three were taken
    b.wait_imm(6, timeout=10)  # kept aside while waiting for 5
    assert dst.all()


@pytest.mark.parametrize("transport", ["mem", "tcp"])
def test_a_receiver_that_looks_late_loses_no_notification(transport):
    # 70 000 one-page writes of 7 values while the receiver does not look: an agent used
    # to keep 65 536 events and drop the rest.
    with xfer.Agent(transport=transport) as a, xfer.Agent(transport=transport) as b:
        p = a.connect(b.info)
        src, dst = np.ones(PAGE, dtype=np.uint8), np.zeros(64 * PAGE, dtype=np.uint8)
        rs, rd = a.register(src), b.register(dst)
        n, pending = 70_000, []
        for i in range(n):
            pending.append(a.write_pages(p, rs, rd.descriptor, [0], [i % 64], PAGE, imm=i % 7))
            if len(pending) == 256:
                for h in pending:
                    h.wait(timeout=30)
                pending.clear()
        for h in pending:
            h.wait(timeout=30)
        for v in range(7):
            b.wait_imm(v, count=len(range(v, n, 7)), timeout=30)
        assert b.notifications() == []


def test_notifications_name_their_sender_and_mix_with_wait_imm(pair):
    _, b, p = pair
    c = xfer.Agent(transport=p.transport, name="named-sender")
    try:
        b.know(c.info)
        pc = c.connect(b.info)
        src, dst = np.ones(PAGE, dtype=np.uint8), np.zeros(4 * PAGE, dtype=np.uint8)
        rc, rd = c.register(src), b.register(dst)
        for i in range(4):
            c.write_pages(pc, rc, rd.descriptor, [0], [i], PAGE, imm=3 + i % 2).wait(timeout=10)
        # Values 3, 4, 3, 4 from one sender: the first taken is the first that arrived,
        # wait_imm takes both 4s, and the one 3 left is all there is.
        first = b.next_notification(timeout=10)
        assert (first.sender, first.imm, first.count) == ("named-sender", 3, 1)
        b.wait_imm(4, count=2, timeout=10)
        last = b.next_notification(timeout=10)
        assert (last.sender, last.imm, last.count) == ("named-sender", 3, 1)
        assert b.notifications() == []
        with pytest.raises(xfer.TimedOut):
            b.next_notification(timeout=0.05)

        async def later():
            return await b.next_notification_async(timeout=10)

        c.write_pages(pc, rc, rd.descriptor, [0], [1], PAGE, imm=11).wait(timeout=10)
        n = asyncio.run(later())
        assert (n.sender, n.imm, n.count) == ("named-sender", 11, 1)
    finally:
        c.close()


def test_a_message_names_its_request_and_follows_the_bytes(pair):
    a, b, p = pair
    b.know(a.info)
    src, dst = np.full(8 * PAGE, 7, dtype=np.uint8), np.zeros(8 * PAGE, dtype=np.uint8)
    rs, rd = a.register(src), b.register(dst)
    for r in range(20):
        a.write_pages(p, rs, rd.descriptor, list(range(8)), list(range(8)), PAGE,
                      imm=r % 3, message=b"request %d" % r).wait(timeout=10)
    for r in range(20):
        n = b.next_notification(timeout=10)
        assert (n.imm, n.message, n.count) == (r % 3, b"request %d" % r, 1)
        assert n.sender == a.name
    assert dst.all()
    assert b.notifications() == []
    with pytest.raises(xfer.InvalidArgument, match="4096"):
        a.write(p, rs, rd.descriptor, [(0, 0, PAGE)], message=bytes(4097))


def test_another_agents_peer_or_registration_is_refused():
    with xfer.Agent(transport="mem") as a, xfer.Agent(transport="mem") as b:
        t = xfer.Agent(transport="mem")
        try:
            src, dst = np.ones(PAGE, dtype=np.uint8), np.zeros(PAGE, dtype=np.uint8)
            ra, rb, rt = a.register(src), b.register(src), t.register(dst)
            pa, pb = a.connect(t.info), b.connect(t.info)
            with pytest.raises(xfer.ForeignHandle, match="peer belongs to another agent"):
                a.write(pb, ra, rt.descriptor, [(0, 0, PAGE)])
            with pytest.raises(xfer.ForeignHandle, match="region belongs"):
                a.write(pa, rb, rt.descriptor, [(0, 0, PAGE)])
            with pytest.raises(xfer.InvalidArgument):  # ForeignHandle is one
                a.remove_peer(pb)
            with pytest.raises(xfer.ForeignHandle):
                a.offer("x", rb)
            assert not dst.any()
            # b's peer was not marked removed by a's refusal.
            b.write(pb, rb, rt.descriptor, [(0, 0, PAGE)]).wait(timeout=10)
            assert dst.all()
        finally:
            t.close()


def test_metrics_are_the_prometheus_exposition_of_the_agents_figures(pair):
    a, b, p = pair
    src, dst = np.ones(PAGE, dtype=np.uint8), np.zeros(PAGE, dtype=np.uint8)
    rs, rd = a.register(src), b.register(dst)
    a.write(p, rs, rd.descriptor, [(0, 0, PAGE)], imm=1).wait(timeout=10)
    b.wait_imm(1, timeout=10)
    text = a.metrics()
    assert "# TYPE xfer_rail_bytes_total counter" in text
    sent = [
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("xfer_rail_bytes_total{")
    ]
    assert sum(sent) == PAGE, text
    got = [
        float(line.split()[-1])
        for line in b.metrics().splitlines()
        if line.startswith("xfer_rail_notifications_total{")
    ]
    assert sum(got) == 1


def test_a_handle_is_awaitable(pair):
    a, b, p = pair
    src, dst = pattern(8 * PAGE, seed=3), np.zeros(8 * PAGE, dtype=np.uint8)
    rs, rd = a.register(src), b.register(dst)

    async def main():
        hs = [a.write_pages(p, rs, rd.descriptor, [i], [7 - i], PAGE) for i in range(8)]
        return await asyncio.wait_for(asyncio.gather(*hs), timeout=10)

    assert asyncio.run(main()) == [PAGE] * 8
    assert np.array_equal(dst.reshape(8, PAGE)[::-1], src.reshape(8, PAGE))


def test_a_failed_transfer_raises_from_await_and_wait(pair):
    a, b, p = pair
    rs, rd = a.register(np.ones(2 * PAGE, dtype=np.uint8)), b.register(np.zeros(PAGE, dtype=np.uint8))
    with pytest.raises(xfer.InvalidArgument, match="outside the remote region"):
        a.write(p, rs, rd.descriptor, [(0, PAGE, PAGE)])  # the descriptor says it does not fit
    # A descriptor that lies about its length: the target itself refuses the write.
    lying = lie_about_length(rd.descriptor, 2 * PAGE)
    h = a.write(p, rs, lying, [(0, PAGE, PAGE)])

    async def main():
        return await h

    with pytest.raises(xfer.OutOfBounds):
        asyncio.run(main())
    with pytest.raises(xfer.OutOfBounds):
        h.wait(timeout=10)
    assert h.done() and isinstance(h.exception(), xfer.OutOfBounds)


def test_reads_pull_pages_and_ranges_from_the_peer(pair):
    a, b, p = pair
    # The owner (b) allows reads and does nothing else; a pulls its pages.
    remote = pattern(16 * PAGE, seed=9)
    owner = b.register(remote, remote_write=False, remote_read=True)
    local = np.zeros(8 * PAGE, dtype=np.uint8)
    mine = a.register(local)
    lp, rp = [5, 0, 7], np.array([15, 2, 9], dtype=np.int64)
    assert a.read_pages(p, mine, owner.descriptor, lp, rp, PAGE).wait(timeout=10) == 3 * PAGE
    for l, r in zip(lp, rp):
        assert np.array_equal(local[l * PAGE : (l + 1) * PAGE], remote[r * PAGE : (r + 1) * PAGE])
    untouched = np.ones(8, dtype=bool)
    untouched[lp] = False
    assert not local.reshape(8, PAGE)[untouched].any(), "no other page touched"
    assert a.read(p, mine, owner.descriptor, [(10, 3 * PAGE + 7, 100)]).wait(timeout=10) == 100
    assert np.array_equal(local[10:110], remote[3 * PAGE + 7 : 3 * PAGE + 107])


def test_reads_the_owner_did_not_allow_are_refused(pair):
    a, b, p = pair
    mine = a.register(np.zeros(PAGE, dtype=np.uint8))
    no_read = b.register(np.ones(PAGE, dtype=np.uint8))  # remote_read defaults to False
    with pytest.raises(xfer.PermissionDenied):
        a.read(p, mine, no_read.descriptor, [(0, 0, PAGE)]).wait(timeout=10)
    readable = b.register(np.ones(PAGE, dtype=np.uint8), remote_write=False, remote_read=True)
    source_only = a.register(np.zeros(PAGE, dtype=np.uint8), remote_write=False)
    with pytest.raises(xfer.Error):
        # A read-only local registration cannot receive a read.
        a.read(p, source_only, readable.descriptor, [(0, 0, PAGE)]).wait(timeout=10)


def test_the_target_refuses_writes_it_did_not_allow(pair):
    a, b, p = pair
    rs = a.register(np.ones(PAGE, dtype=np.uint8))
    ro = b.register(np.zeros(PAGE, dtype=np.uint8), remote_write=False)
    with pytest.raises(xfer.PermissionDenied):
        a.write(p, rs, ro.descriptor, [(0, 0, PAGE)]).wait(timeout=10)
    closed = b.register(np.zeros(PAGE, dtype=np.uint8))
    desc = closed.descriptor
    closed.close()
    with pytest.raises(xfer.RemoteKeyInvalid):
        a.write(p, rs, desc, [(0, 0, PAGE)]).wait(timeout=10)


def test_bad_memory_is_refused_with_the_fix_named():
    with xfer.Agent(transport="mem") as e:
        with pytest.raises(xfer.InvalidArgument, match="ascontiguousarray"):
            e.register(np.zeros((8, 8))[:, ::2])
        with pytest.raises(xfer.InvalidArgument, match="read-only"):
            e.register(b"immutable bytes", remote_write=True)
        e.register(b"immutable bytes", remote_write=False).close()  # fine as a source
        ro = np.zeros(16, dtype=np.uint8)
        ro.flags.writeable = False
        with pytest.raises(xfer.InvalidArgument, match="read-only"):
            e.register(ro)
        with pytest.raises(xfer.InvalidArgument, match="empty"):
            e.register(bytearray())
        with pytest.raises(xfer.InvalidArgument, match="buffer protocol"):
            e.register(object())

        class CpuTensor:  # what a torch CPU tensor offers: DLPack, no buffer protocol
            def __dlpack_device__(self):
                return (1, 0)

        with pytest.raises(xfer.InvalidArgument, match=r"tensor\.numpy\(\)"):
            e.register(CpuTensor())

        class FakeCuda:  # a "CUDA" array whose pointer is host memory
            def __init__(self):
                self.host = np.zeros(64, dtype=np.uint8)
                self.__cuda_array_interface__ = {
                    "data": (self.host.ctypes.data, False),
                    "shape": (64,),
                    "typestr": "|u1",
                    "strides": None,
                    "version": 3,
                }

        with pytest.raises(xfer.InvalidArgument, match="host memory only"):
            e.register(FakeCuda())  # the mem transport moves host memory only
    with xfer.Agent(transport="tcp") as t:
        # Without CUDA there is no driver to ask; with it, the driver says it is not ours.
        with pytest.raises((xfer.InvalidArgument, xfer.Unsupported)):
            t.register(FakeCuda())


def test_bad_arguments_are_invalid_argument(pair):
    a, b, p = pair
    rs, rd = a.register(np.ones(PAGE, dtype=np.uint8)), b.register(np.zeros(PAGE, dtype=np.uint8))
    bad = [
        lambda: a.connect(b"not an address"),
        lambda: a.connect(b.info[:-1]),
        lambda: a.write(p, rs, b"junk", [(0, 0, 1)]),
        lambda: a.write(p, rs, rd.descriptor[:10], [(0, 0, 1)]),
        lambda: a.write(p, rs, rd.descriptor + b"x", [(0, 0, 1)]),
        lambda: a.write(p, rs, rd.descriptor, [(0, 0, PAGE + 1)]),  # past the local region
        lambda: a.write(p, rs, rd.descriptor, [(-1, 0, 1)]),
        lambda: a.write(p, rs, rd.descriptor, [(0, 0)]),
        lambda: a.write(p, rs, rd.descriptor, [(0, 0, 1)], imm=-1),
        lambda: a.write(p, rs, rd.descriptor, [(0, 0, 1)], imm=1 << 32),
        lambda: a.write(p, rs, rd.descriptor, [(0, 0, 1)], timeout=-1),
        lambda: a.write_pages(p, rs, rd.descriptor, [0, 1], [0], PAGE),
        lambda: a.write_pages(p, rs, rd.descriptor, [-1], [0], PAGE),
        lambda: a.write_pages(p, rs, rd.descriptor, [0], [0], 0),
        lambda: a.write_pages(p, rs, rd.descriptor, [0], [0], PAGE, src_stride=PAGE // 2),
        lambda: a.write_pages(p, rs, rd.descriptor, ["x"], [0], PAGE),
        lambda: b.write(p, rd, rs.descriptor, [(0, 0, 1)]),  # a's peer used on b
        lambda: a.write(p, rd, rd.descriptor, [(0, 0, 1)]),  # b's registration used on a
        lambda: b.wait_imm(1, count=-1),
        lambda: xfer.Agent(transport="carrier-pigeon"),
        lambda: xfer.Agent(transport="mem", rails=0),
        lambda: xfer.Agent(transport="mem", auth_token="secret"),
        lambda: xfer.Agent(transport="tcp", listen="localhost:1"),
        lambda: xfer.Agent(transport="cuda-ipc"),  # needs memory="cuda"
    ]
    for i, call in enumerate(bad):
        with pytest.raises(xfer.InvalidArgument):
            call()
            pytest.fail(f"bad call {i} was accepted")
    # Nothing was lost: the pair still works.
    assert a.write(p, rs, rd.descriptor, [(0, 0, PAGE)]).wait(timeout=10) == PAGE


def test_rails_on_named_nics():
    with xfer.Agent(transport="tcp", rails=2, nics=["lo"]) as a, xfer.Agent(transport="tcp") as b:
        assert a.rails == 2
        p = a.connect(b.info)
        src, dst = pattern(32 * PAGE, seed=8), np.zeros(32 * PAGE, dtype=np.uint8)
        rs, rd = a.register(src), b.register(dst)
        a.write(p, rs, rd.descriptor, [(0, 0, 32 * PAGE)], imm=1).wait(timeout=10)
        b.wait_imm(1, timeout=10)
        assert np.array_equal(dst, src)
    with pytest.raises(xfer.InvalidArgument, match="no-such-nic0"):
        xfer.Agent(transport="tcp", nics=["no-such-nic0"])


@pytest.mark.parametrize("provider", ["tcp", "sockets"])
def test_the_efa_transport_on_a_libfabric_provider(provider):
    try:
        a = xfer.Agent(transport="efa", provider=provider)
    except (xfer.Unsupported, xfer.TransportFailed) as e:
        if os.environ.get("XFER_REQUIRE_LIBFABRIC") == "1":
            raise
        pytest.skip(f"libfabric's {provider} provider cannot be opened here: {e}")
    with a, xfer.Agent(transport="efa", provider=provider) as b:
        p = a.connect(b.info)
        src, dst = pattern(16 * PAGE, seed=31), np.zeros(16 * PAGE, dtype=np.uint8)
        rs, rd = a.register(src), b.register(dst)
        a.write_pages(p, rs, rd.descriptor, [15, 0, 7], [1, 2, 3], PAGE, imm=12).wait(timeout=20)
        b.wait_imm(12, timeout=20)
        for s, d in ((15, 1), (0, 2), (7, 3)):
            assert np.array_equal(dst[d * PAGE : (d + 1) * PAGE], src[s * PAGE : (s + 1) * PAGE])
    with pytest.raises(xfer.Error, match="no-such-provider"):
        xfer.Agent(transport="efa", provider="no-such-provider")


def test_mixing_transports_is_refused():
    with xfer.Agent(transport="mem") as m, xfer.Agent(transport="tcp") as t:
        with pytest.raises(xfer.InvalidArgument, match="same transport"):
            m.connect(t.info)


def test_closed_things_say_so(pair):
    a, b, p = pair
    rs, rd = a.register(np.ones(PAGE, dtype=np.uint8)), b.register(np.zeros(PAGE, dtype=np.uint8))
    rs.close()
    rs.close()  # twice is fine
    with pytest.raises(xfer.InvalidArgument, match="closed"):
        a.write(p, rs, rd.descriptor, [(0, 0, 1)])
    a.remove_peer(p)
    rs2 = a.register(np.ones(PAGE, dtype=np.uint8))
    with pytest.raises(xfer.InvalidArgument, match="removed"):
        a.write(p, rs2, rd.descriptor, [(0, 0, 1)])
    a.close()
    assert a.closed
    with pytest.raises(xfer.AgentClosed):
        a.register(np.ones(PAGE, dtype=np.uint8))
    with pytest.raises(xfer.AgentClosed):
        _ = a.info


def test_a_registration_keeps_its_memory_alive_until_closed():
    with xfer.Agent(transport="tcp") as a, xfer.Agent(transport="tcp") as b:
        p = a.connect(b.info)
        dst = np.zeros(16 * PAGE, dtype=np.uint8)
        alive = weakref.ref(dst)
        rd = b.register(dst)
        del dst
        gc.collect()
        assert alive() is not None, "the registration holds the array"
        src = pattern(16 * PAGE, seed=4)
        rs = a.register(src)
        a.write(p, rs, rd.descriptor, [(0, 0, 16 * PAGE)], imm=1).wait(timeout=10)
        b.wait_imm(1, timeout=10)
        assert np.array_equal(rd.obj, src), "the bytes landed in the deleted array's memory"
        rd.close()
        assert rd.obj is None
        gc.collect()
        assert alive() is None, "closing gave the array back"
        # Registrations dropped without close, and an agent closed with some open.
        dst2 = np.zeros(PAGE, dtype=np.uint8)
        alive2 = weakref.ref(dst2)
        r2 = b.register(dst2)
        del dst2
        b.close()
        del r2
        gc.collect()
        assert alive2() is None, "the agent's close gave the array back"


@pytest.mark.parametrize("rails", [1, 2])
def test_a_registration_in_use_cannot_be_closed_and_loses_nothing(rails):
    """Closing a registration that an unfinished transfer reads raises RegionInUse and
    leaves it open and usable; once the transfers complete, the target holds exactly the
    source's bytes and the registration closes. The transfers cannot finish early: the
    target's process is stopped (SIGSTOP), so nothing it receives is placed or acknowledged
    until it goes on. With two rails each transfer is one chunk on one rail, and the rail
    that holds none of it must not deregister the region either."""
    size = 64 * PAGE
    half = size // 2
    proc, addr, desc = spawn_peer("--transport", "tcp", "--bytes", str(size))
    try:
        with xfer.Agent(transport="tcp", rails=rails, timeout=30.0) as e:
            p = e.connect(addr)
            src = pattern(size, seed=12)
            rs = e.register(src, remote_write=False)
            stop(proc)
            first = e.write(p, rs, desc, [(0, 0, half)], imm=21)
            with pytest.raises(xfer.RegionInUse):
                rs.close()
            assert not rs.closed
            second = e.write(p, rs, desc, [(half, half, half)], imm=21)  # still usable
            assert not first.done() and not second.done(), "the target is stopped"
            os.kill(proc.pid, signal.SIGCONT)
            assert first.wait(timeout=30) == half
            assert second.wait(timeout=30) == half
            cmd = {"imm": 21, "count": 2, "pages": list(range(64)), "page_size": PAGE, "seed": 12}
            proc.stdin.write(json.dumps({"expect": cmd}) + "\n")
            proc.stdin.flush()
            assert json.loads(proc.stdout.readline()) == {"ok": True, "why": "pages differ: []"}
            rs.close()
            assert rs.closed
        proc.stdin.write(json.dumps({"exit": True}) + "\n")
        proc.stdin.flush()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait(timeout=10)


def stop(proc):
    """SIGSTOPs `proc` and returns once every thread of it is stopped: the signal is
    delivered asynchronously, and a thread still running (a worker reading its socket)
    would place and acknowledge what arrives meanwhile."""
    os.kill(proc.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    task = f"/proc/{proc.pid}/task"
    while time.monotonic() < deadline:
        states = []
        for t in os.listdir(task):
            try:
                with open(f"{task}/{t}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # a thread that just ended
                pass
        if states and all(s in "tT" for s in states):
            return
        time.sleep(0.001)
    pytest.fail(f"process {proc.pid} did not stop within 10 s")


def spawn_peer(*args):
    proc = subprocess.Popen(
        [sys.executable, PEER, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    hello = json.loads(proc.stdout.readline())
    return proc, bytes.fromhex(hello["info"]), bytes.fromhex(hello["descriptor"])


def test_two_processes_over_tcp():
    proc, addr, desc = spawn_peer("--transport", "tcp", "--bytes", str(256 * PAGE))
    try:
        with xfer.Agent(transport="tcp", timeout=5.0) as e:
            p = e.connect(addr)
            src = pattern(64 * PAGE, seed=9)
            rs = e.register(src, remote_write=False)
            dst_pages = list(np.random.default_rng(5).permutation(256)[:64])
            for layer in range(4):  # four transfers with the same immediate value
                part = slice(layer * 16, (layer + 1) * 16)
                e.write_pages(p, rs, desc, list(range(64))[part], dst_pages[part], PAGE, imm=42).wait(timeout=10)
            cmd = {"imm": 42, "count": 4, "pages": [int(x) for x in dst_pages], "page_size": PAGE, "seed": 9}
            proc.stdin.write(json.dumps({"expect": cmd}) + "\n")
            proc.stdin.flush()
            assert json.loads(proc.stdout.readline()) == {"ok": True, "why": "pages differ: []"}
        proc.stdin.write(json.dumps({"exit": True}) + "\n")
        proc.stdin.flush()
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()


def test_a_peer_killed_mid_transfer_is_unreachable_within_the_timeout():
    size = 64 << 20
    proc, addr, desc = spawn_peer("--transport", "tcp", "--bytes", str(size))
    timeout = 2.0
    with xfer.Agent(transport="tcp", timeout=timeout) as e:
        p = e.connect(addr)
        rs = e.register(np.ones(size, dtype=np.uint8))
        e.write(p, rs, desc, [(0, 0, size)]).wait(timeout=30)  # connected and moving
        handles = [e.write(p, rs, desc, [(0, 0, size)]) for _ in range(4)]
        proc.kill()
        killed = time.monotonic()
        proc.wait(timeout=10)
        err = None
        deadline = killed + 4 * timeout + 5
        while err is None and time.monotonic() < deadline:
            for h in handles:
                try:
                    h.wait(timeout=max(0.0, deadline - time.monotonic()))
                except xfer.Error as x:
                    err = x
                    break
            else:  # all had landed before the kill: new writes must fail
                try:
                    handles = [e.write(p, rs, desc, [(0, 0, size)])]
                except xfer.Error as x:
                    err = x
        took = time.monotonic() - killed
        assert isinstance(err, xfer.PeerUnreachable), f"{type(err).__name__}: {err}"
        assert took < 4 * timeout + 5, f"reported after {took:.1f}s"
        # The agent is still usable for other peers.
        with xfer.Agent(transport="tcp") as other:
            q = e.connect(other.info)
            ro = other.register(np.zeros(PAGE, dtype=np.uint8))
            assert e.write(q, rs, ro.descriptor, [(0, 0, PAGE)]).wait(timeout=10) == PAGE


def test_a_stopped_peer_is_stalled_not_dead_and_the_transfer_goes_on():
    size = 64 << 20
    proc, addr, desc = spawn_peer("--transport", "tcp", "--bytes", str(size))
    try:
        with xfer.Agent(transport="tcp", stall_timeout=0.3) as e:
            p = e.connect(addr)
            rs = e.register(pattern(size, seed=4), remote_write=False)
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                h = e.write(p, rs, desc, [(0, 0, size)], imm=8)
                start = time.monotonic()
                with pytest.raises(xfer.PeerStalled, match="stalled"):
                    h.wait(timeout=30)
                assert 0.3 <= time.monotonic() - start < 10
                assert not h.done()
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            # The connection stood: the transfer goes on. A peer slow to resume (a loaded
            # machine) may still read as stalled for a wait or two; only a real end counts.
            until = time.monotonic() + 30
            while True:
                try:
                    h.wait(timeout=30)
                    break
                except xfer.PeerStalled:
                    assert time.monotonic() < until, "the transfer did not go on"
        cmd = {"imm": 8, "count": 1, "pages": list(range(size // PAGE)), "page_size": PAGE, "seed": 4}
        proc.stdin.write(json.dumps({"expect": cmd}) + "\n")
        proc.stdin.flush()
        assert json.loads(proc.stdout.readline())["ok"]
        assert issubclass(xfer.PeerStalled, xfer.TimedOut)
    finally:
        proc.kill()


def test_a_peer_stopped_beyond_the_liveness_timeout_is_dead():
    """With liveness_timeout=1, a stopped peer that leaves a write unanswered for longer is
    declared dead: the write fails with PeerUnreachable (not a stall, not a hang). A bad
    value is refused."""
    with pytest.raises(xfer.InvalidArgument, match="liveness_timeout"):
        xfer.Agent(transport="tcp", liveness_timeout=-1.0)
    size = 64 * PAGE
    proc, addr, desc = spawn_peer("--transport", "tcp", "--bytes", str(size))
    try:
        with xfer.Agent(transport="tcp", liveness_timeout=1.0) as e:
            p = e.connect(addr)
            rs = e.register(pattern(size, seed=6), remote_write=False)
            stop(proc)
            try:
                h = e.write(p, rs, desc, [(0, 0, size)])
                with pytest.raises(xfer.PeerUnreachable):
                    h.wait(timeout=30)
            finally:
                os.kill(proc.pid, signal.SIGCONT)
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_help_reads_well():
    doc = xfer.Agent.__doc__
    for word in ("transport", "rails", "nics", "memory", "gpu", "auth_token", "timeout"):
        assert word in doc, word
    for name in ("register", "connect", "remove_peer", "write", "write_pages", "wait_imm", "close"):
        assert getattr(xfer.Agent, name).__doc__, name
    for name in ("wait", "done", "exception"):
        assert getattr(xfer.Handle, name).__doc__, name
    assert issubclass(xfer.PeerUnreachable, xfer.Error) and issubclass(xfer.Error, Exception)


def test_the_mem_transport_refuses_another_process(tmp_path):
    proc, addr, _ = spawn_peer("--transport", "mem", "--bytes", str(PAGE))
    try:
        with xfer.Agent(transport="mem") as e:
            with pytest.raises(xfer.InvalidArgument, match="one process"):
                e.connect(addr)
    finally:
        proc.kill()
        proc.wait(timeout=10)


class DlpackOnly:
    """An object that offers its memory through DLPack only (like a torch CPU tensor)."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, stream=None):
        return self.array.__dlpack__()

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def test_dlpack_host_tensors_are_registered_without_copies(pair):
    a, b, p = pair
    src = pattern(8 * PAGE, seed=21)
    dst = np.zeros((8, PAGE // 4), dtype=np.float32)  # a 2-D float tensor, seen as bytes
    rs, rd = a.register(DlpackOnly(src)), b.register(DlpackOnly(dst))
    assert rd.nbytes == dst.nbytes
    a.write_pages(p, rs, rd.descriptor, [1, 2], [6, 0], PAGE, imm=4).wait(timeout=10)
    b.wait_imm(4, timeout=10)
    got = dst.view(np.uint8).reshape(8, PAGE)
    assert np.array_equal(got[6], src[PAGE : 2 * PAGE]) and np.array_equal(got[0], src[2 * PAGE : 3 * PAGE])
    with pytest.raises(xfer.InvalidArgument, match=r"contiguous\(\)"):
        a.register(DlpackOnly(np.zeros((8, 8), dtype=np.float32)[:, ::2]))


def test_auto_agents_of_one_process_over_host_memory_reach_each_other_over_tcp():
    with xfer.Agent() as a, xfer.Agent() as b:  # the defaults: transport="auto", nics="auto"
        assert "tcp" in a.transports and "cuda-ipc" not in a.transports  # host memory
        assert a.transport == ("tcp" if a.transports == ["tcp"] else "auto")
        p = a.connect(b.info)
        assert p.transport == "tcp" and p.name in repr(p)
        src, dst = pattern(8 * PAGE, seed=41), np.zeros(8 * PAGE, dtype=np.uint8)
        rs, rd = a.register(src, remote_write=False), b.register(dst)
        a.write_pages(p, rs, rd.descriptor, [0, 5], [7, 1], PAGE, imm=3).wait(timeout=10)
        b.wait_imm(3, timeout=10)
        assert np.array_equal(dst[7 * PAGE :], src[:PAGE])
        assert np.array_equal(dst[PAGE : 2 * PAGE], src[5 * PAGE : 6 * PAGE])
        assert a.counters()["transfers"] >= 1


def test_peer_transport_is_the_one_both_agents_offer(pair):
    a, b, p = pair
    assert p.transport == a.transport == b.transport
    assert a.transports == [a.transport]


def test_an_auto_address_from_another_process_is_accepted():
    proc, addr, desc = spawn_peer("--transport", "auto", "--bytes", str(16 * PAGE))
    try:
        with xfer.Agent(timeout=5.0) as e:
            p = e.connect(addr)
            assert p.transport == "tcp"
            src = pattern(4 * PAGE, seed=42)
            rs = e.register(src, remote_write=False)
            e.write_pages(p, rs, desc, [0, 1, 2, 3], [9, 3, 15, 0], PAGE, imm=8).wait(timeout=10)
            cmd = {"imm": 8, "count": 1, "pages": [9, 3, 15, 0], "page_size": PAGE, "seed": 42}
            proc.stdin.write(json.dumps({"expect": cmd}) + "\n")
            proc.stdin.flush()
            assert json.loads(proc.stdout.readline()) == {"ok": True, "why": "pages differ: []"}
        proc.stdin.write(json.dumps({"exit": True}) + "\n")
        proc.stdin.flush()
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()


def test_bytes_that_are_not_an_address_name_the_metadata_error(pair):
    a, b, p = pair
    rd = b.register(np.zeros(PAGE, dtype=np.uint8))
    cases = [
        (b"garbage bytes", "not an xfer agent"),
        (rd.descriptor, "not an xfer agent"),  # a region's descriptor is not an address
        (b.info[:-3], "malformed agent"),
        (b"XFAG" + bytes([3]) + b.info[5:], "metadata version 3"),
        (b.info + b"\0", "after the agent"),
    ]
    for bad, why in cases:
        with pytest.raises(xfer.InvalidArgument, match=f"info: .*{why}"):
            a.connect(bad)
    with pytest.raises(xfer.InvalidArgument, match="remote_descriptor: not an xfer region"):
        a.write(p, a.register(np.ones(PAGE, dtype=np.uint8)), b.info, [(0, 0, 1)])


def test_the_library_options_are_keyword_arguments():
    with xfer.Agent(transport="tcp", pin="auto", nics="auto", rails=2, tcp_congestion="reno") as e:
        assert e.rails == 2
        with xfer.Agent(pin="off") as f:
            p = e.connect(f.info)
            rd = f.register(np.zeros(PAGE, dtype=np.uint8))
            rs = e.register(np.ones(PAGE, dtype=np.uint8))
            assert e.write(p, rs, rd.descriptor, [(0, 0, PAGE)]).wait(timeout=10) == PAGE
    for bad in (
        lambda: xfer.Agent(pin="sometimes"),
        lambda: xfer.Agent(nics="lo"),  # a name is a list: nics=["lo"]
        lambda: xfer.Agent(nics=[""]),
        lambda: xfer.Agent(transport="tcp", provider="tcp"),  # efa only
        lambda: xfer.Agent(transport="mem", nics=["lo"]),  # mem runs on no NIC
        lambda: xfer.Agent(timeout=0),
        lambda: xfer.Agent(tcp_congestion="cu bic"),
    ):
        with pytest.raises(xfer.InvalidArgument):
            bad()
    # An algorithm the kernel does not have stops the agent, named.
    with pytest.raises(xfer.Error, match="no_such_algo"):
        xfer.Agent(transport="tcp", tcp_congestion="no_such_algo")
    assert "pin" in xfer.Agent.__doc__ and "auto" in xfer.Agent.__doc__
    assert xfer.Peer.transport.__doc__


def _write_page(src, dst):
    """Writes a page from agent `src` into a region of agent `dst`; the bytes landed."""
    rd = dst.register(np.zeros(PAGE, dtype=np.uint8))
    rs = src.register(pattern(PAGE, 11))
    p = src.connect(dst.info)
    got = src.write(p, rs, rd.descriptor, [(0, 0, PAGE)]).wait(timeout=10)
    return got == PAGE and np.array_equal(rd.obj, rs.obj)


@pytest.mark.parametrize("contents", [b"s3cret\n", b"s3cret\r\n", b"s3cret"])
def test_a_token_from_a_file_lets_its_holders_in_and_no_one_else(tmp_path, contents):
    path = tmp_path / "token"
    path.write_bytes(contents)
    with xfer.Agent(transport="tcp", auth_token_file=path, timeout=2.0) as guarded:
        with xfer.Agent(transport="tcp", auth_token_file=str(path)) as holder:
            assert _write_page(holder, guarded)
        with xfer.Agent(transport="tcp", auth_token="s3cret") as same:
            assert _write_page(same, guarded)
        for other in ({}, {"auth_token": "wrong"}):
            with xfer.Agent(transport="tcp", timeout=2.0, **other) as outsider:
                with pytest.raises(xfer.Error):
                    _write_page(outsider, guarded)
                    pytest.fail(f"a peer with {other or 'no token'} got in")


def test_token_files_that_cannot_serve_are_invalid_arguments_naming_the_file(tmp_path):
    both = tmp_path / "both"
    both.write_text("s3cret")
    with pytest.raises(xfer.InvalidArgument, match="both given"):
        xfer.Agent(transport="tcp", auth_token="s3cret", auth_token_file=both)
    missing = tmp_path / "missing"
    with pytest.raises(xfer.InvalidArgument, match=f"cannot read .*{missing.name}"):
        xfer.Agent(transport="tcp", auth_token_file=missing)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(xfer.InvalidArgument, match="empty"):
        xfer.Agent(transport="tcp", auth_token_file=empty)


def test_require_auth_refuses_an_agent_beyond_loopback_without_a_token(tmp_path):
    with pytest.raises(xfer.InvalidArgument, match="no auth token.*not loopback"):
        xfer.Agent(transport="tcp", listen="0.0.0.0", require_auth=True)
    path = tmp_path / "token"
    path.write_text("s3cret\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        xfer.Agent(transport="tcp", listen="0.0.0.0", require_auth=True, auth_token_file=path).close()
        xfer.Agent(transport="tcp", listen="0.0.0.0", require_auth=True, auth_token="s3cret").close()
        xfer.Agent(transport="tcp", require_auth=True).close()  # loopback


def test_an_agent_beyond_loopback_without_a_token_warns():
    with pytest.warns(UserWarning, match=r"no auth token.*tcp rails listen beyond loopback \(.*:\d+\)") as said:
        e = xfer.Agent(transport="tcp", listen="0.0.0.0")
    e.close()
    assert len(said) == 1
    assert "auth_token_file" in str(said[0].message) and said[0].filename == __file__
    # On loopback, with a token, or with no tcp rail: nothing said.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        xfer.Agent(transport="tcp").close()
        xfer.Agent(transport="tcp", listen="0.0.0.0", auth_token="s3cret").close()
        xfer.Agent(transport="mem", listen="0.0.0.0").close()
    # Warnings turned into errors stop the agent from being made.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning):
            xfer.Agent(transport="tcp", listen="0.0.0.0")
