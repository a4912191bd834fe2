"""The package's names are the Rust library's (Agent, Region, AgentClosed, connect, info,
Notification.imm); the old ones (Engine, Registration, EngineClosed, add_peer, address,
Notification.value, and the helpers' `engine` attribute) still work, each with a
DeprecationWarning at the caller's line, and are not in `xfer.__all__`.

The rest of the suite uses the new names only: it passes with `-W error::DeprecationWarning`."""

import warnings

import numpy as np
import pytest

import xfer
from xfer import kv
from xfer.weights import Destination, LayoutBuilder, Plan, WeightReceiver, WeightSender, whole

PAGE = 4096
OLD = {"Engine": "Agent", "Registration": "Region", "EngineClosed": "AgentClosed"}


def test_the_new_names_are_exported_and_the_old_ones_are_not():
    for new in ("Agent", "Region", "AgentClosed", "Peer", "Handle", "Notification"):
        assert new in xfer.__all__, new
        assert getattr(xfer, new).__name__ == new
    for old in OLD:
        assert old not in xfer.__all__, old
    assert issubclass(xfer.AgentClosed, xfer.Error)
    assert "Agent" in repr(xfer.Agent(transport="mem"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a star import takes the new names, and warns of nothing
        names = {}
        exec("from xfer import *", names)
    assert {"Agent", "Region", "AgentClosed"} <= names.keys() and not OLD.keys() & names.keys()


@pytest.mark.parametrize("old", sorted(OLD))
def test_each_old_class_name_warns_and_is_the_new_class(old):
    with pytest.warns(DeprecationWarning, match=f"xfer.{old} is deprecated: use xfer.{OLD[old]}") as said:
        value = getattr(xfer, old)
    assert value is getattr(xfer, OLD[old])
    assert len(said) == 1 and said[0].filename == __file__, "the warning names the caller's line"
    with pytest.raises(AttributeError, match="NoSuchName"):
        _ = xfer.NoSuchName


def test_an_old_class_name_still_builds_and_catches():
    with pytest.warns(DeprecationWarning, match="xfer.Engine"):
        a = xfer.Engine(transport="mem")
    assert isinstance(a, xfer.Agent)
    r = a.register(np.zeros(PAGE, dtype=np.uint8))
    with pytest.warns(DeprecationWarning, match="xfer.Registration"):
        assert isinstance(r, xfer.Registration)
    a.close()
    with pytest.warns(DeprecationWarning, match="xfer.EngineClosed"):
        closed = xfer.EngineClosed
    with pytest.raises(closed):  # `except xfer.EngineClosed` catches AgentClosed
        a.register(np.zeros(PAGE, dtype=np.uint8))
    with pytest.raises(xfer.AgentClosed, match="the agent is closed"):
        _ = a.info


def test_add_peer_and_address_warn_and_do_what_connect_and_info_do():
    with xfer.Agent(transport="mem") as a, xfer.Agent(transport="mem") as b:
        with pytest.warns(DeprecationWarning, match="Agent.address is deprecated: use Agent.info") as said:
            address = b.address
        assert said[0].filename == __file__
        assert address == b.info
        with pytest.warns(DeprecationWarning, match="Agent.add_peer is deprecated: use Agent.connect"):
            p = a.add_peer(address)
        assert isinstance(p, xfer.Peer) and p.name == b.name
        src, dst = np.full(PAGE, 5, dtype=np.uint8), np.zeros(PAGE, dtype=np.uint8)
        rs, rd = a.register(src, remote_write=False), b.register(dst)
        assert a.write(p, rs, rd.descriptor, [(0, 0, PAGE)], imm=9).wait(timeout=10) == PAGE
        b.wait_imm(9, timeout=10)
        assert (dst == 5).all(), "the peer add_peer returned works"
        with pytest.warns(DeprecationWarning), pytest.raises(xfer.InvalidArgument, match="info: "):
            a.add_peer(b"not an agent's info")


def test_notification_value_warns_and_is_imm():
    with xfer.Agent(transport="mem") as a, xfer.Agent(transport="mem", name="receiver") as b:
        b.know(a.info)
        p = a.connect(b.info)
        rs, rd = a.register(np.ones(PAGE, dtype=np.uint8)), b.register(np.zeros(PAGE, dtype=np.uint8))
        a.write(p, rs, rd.descriptor, [(0, 0, PAGE)], imm=42, message=b"m").wait(timeout=10)
        n = b.next_notification(timeout=10)
        assert (n.sender, n.imm, n.count, n.message) == (a.name, 42, 1, b"m")
        assert "imm=42" in repr(n)
        with pytest.warns(DeprecationWarning, match="Notification.value is deprecated: use Notification.imm"):
            assert n.value == n.imm == 42


def test_the_helpers_take_an_agent_and_their_engine_attribute_warns():
    a, b = xfer.Agent(transport="mem"), xfer.Agent(transport="mem")
    src, dst = LayoutBuilder(), LayoutBuilder()
    src.add("w", np.arange(8, dtype=np.uint8), [("w", (8,), whole((8,)))])
    dst.add("w", np.zeros(8, dtype=np.uint8), [("w", (8,), whole((8,)))])
    plan = Plan([src.layout], [dst.layout])
    sender, receiver = WeightSender(a, plan, 0, src), WeightReceiver(b, dst, sources=1, rank=0)
    for helper, name in ((sender, "WeightSender"), (receiver, "WeightReceiver")):
        with pytest.warns(DeprecationWarning, match=f"{name}.engine is deprecated: use {name}.agent"):
            assert helper.engine is helper.agent
    sender.attach(receiver.info())
    assert sender.send_weights(1) == {}
    receiver.update_weights({"version": 1, "timeout": 10})
    assert (dst.objects[0] == np.arange(8)).all()
    # The native classes take the agent positionally, or as agent=.
    d = Destination(agent=b, layout=dst.layout, registrations=[b.register(np.zeros(8, dtype=np.uint8))], sources=1)
    assert d.sources == 1
    m = kv.Model(num_layers=1, kv_heads=1, head_dim=8, elem_size=2)
    lay = kv.Layout.vllm_flash_attn(m, kv.heads_for_rank(1, 1, 0), 2, 4)
    memory = [np.zeros(n, dtype=np.uint8) for n in lay.region_sizes()]
    assert kv.Rank(agent=a, side="decode", rank=0, memory=memory, prefill=[lay], decode=[lay]).side == "decode"
    mgr = kv.KvManager(a, "prefill", 0, 1, kv.Cache(lay, [np.zeros(n, dtype=np.uint8) for n in lay.region_sizes()], ["l0"]))
    with pytest.warns(DeprecationWarning, match="KvManager.engine is deprecated: use KvManager.agent"):
        assert mgr.engine is mgr.agent is a
    worker = kv.KvWorker(a, "decode", 0, 1, 1)
    with pytest.warns(DeprecationWarning, match="KvWorker.engine is deprecated"):
        assert worker.engine is a
    a.close()
    b.close()
