"""xfer.weights: the Llama-shaped example (tiny dimensions, numpy, processes over tcp) from
tensor parallelism 2 to 4 and 1 with every byte checked, and in one process: layouts,
a failed destination failing alone and redone, a joiner pulling, errors."""

import doctest
import os

import numpy as np
import pytest
from conftest import cuda_or_skip

import xfer
import xfer.weights as w
from xfer.weights import Destination, Flat, LayoutBuilder, Plan, Source, WeightReceiver, WeightSender, split, whole

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def test_the_module_example_runs():
    failures, tried = doctest.testmod(w, verbose=False)
    assert tried > 0 and failures == 0


def test_llama_shaped_sync_from_tp2_to_tp4_and_tp1_checks_every_byte(monkeypatch):
    # On the path while it runs: its processes (spawned) import it by name.
    monkeypatch.syspath_prepend(EXAMPLES)
    import weights_llama  # noqa: PLC0415

    # Every tensor kind of Llama/Qwen (qkv biases included), tiny; two versions pushed,
    # then a joiner pulls the second.
    assert weights_llama.main(["--model", "tiny", "--transport", "tcp", "--versions", "2"]) == 0


@pytest.mark.cuda
@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_llama_shaped_sync_of_cuda_tensors(monkeypatch, transport):
    cuda_or_skip()
    monkeypatch.syspath_prepend(EXAMPLES)
    import weights_llama  # noqa: PLC0415

    # auto: cuda-ipc between the ranks' processes (one host); tcp: the network path.
    argv = ["--model", "tiny", "--device", "cuda", "--transport", transport, "--versions", "2"]
    assert weights_llama.main(argv) == 0


def test_the_example_layouts_are_vllm_s(monkeypatch):
    monkeypatch.syspath_prepend(EXAMPLES)
    import weights_llama  # noqa: PLC0415

    cfg = dict(weights_llama.CONFIGS["llama3-8b"], layers=1)
    parts = dict(weights_llama.vllm_parts(cfg, 4, 1))
    qkv = parts["model.layers.0.self_attn.qkv_proj.weight"]
    # Rank 1 of 4: query heads 8..16, key-value heads 2..4, 128 each, in that order.
    assert [(n.split(".")[-2], h[0]) for n, _, h in qkv] == [("q_proj", (1024, 2048)), ("k_proj", (256, 512)), ("v_proj", (256, 512))]
    src, dst = weights_llama.layouts(cfg)
    plan = Plan(src, dst)
    assert plan.check(src, dst) == plan.bytes
    # Each replica receives the model once: TP=4 as 4 quarters (norms in each), TP=1 whole.
    per = plan.destination_bytes()
    assert sum(per[:4]) >= per[4] > 0


def model(shape=(8, 16)):
    return np.arange(int(np.prod(shape)), dtype=np.uint32).reshape(shape)


def layouts():
    """2 sources (row halves of a 8 x 16 uint32 tensor and a whole bias) and 2 destinations
    (column halves, and a flat shard of the bias each): the tensors, the builders, the
    destinations' arrays and the plan."""
    full, bias = model(), np.arange(16, dtype=np.uint32) + 1000
    src_b, dst_b, outs = [], [], []
    for i in range(2):
        b = LayoutBuilder()
        b.add("w", np.ascontiguousarray(full[4 * i : 4 * i + 4]), [("w", (8, 16), split((8, 16), 0, 2, i))])
        b.add("b", bias.copy(), [("b", (16,), whole((16,)))])
        src_b.append(b)
        out, ob = np.zeros((8, 8), dtype=np.uint32), np.zeros(8, dtype=np.uint32)
        d = LayoutBuilder()
        d.add("w", out, [("w", (8, 16), split((8, 16), 1, 2, i))])
        d.add("b", ob, [("b", (16,), Flat(8 * i, 8 * i + 8))])
        dst_b.append(d)
        outs.append((out, ob))
    plan = Plan([b.layout for b in src_b], [b.layout for b in dst_b])
    return full, bias, src_b, dst_b, outs, plan


def sources_and_destinations(transport):
    """The senders and receivers of :func:`layouts`, every sender attached to every
    receiver."""
    full, bias, src_b, dst_b, outs, plan = layouts()
    senders = [WeightSender(xfer.Agent(transport=transport), plan, i, b) for i, b in enumerate(src_b)]
    receivers = [WeightReceiver(xfer.Agent(transport=transport), b, sources=2, rank=i) for i, b in enumerate(dst_b)]
    for s in senders:
        for r in receivers:
            s.attach(r.info())
    return full, bias, senders, receivers, outs


def landed(full, bias, outs, i):
    out, ob = outs[i]
    return np.array_equal(out, full[:, 8 * i : 8 * i + 8]) and np.array_equal(ob, bias[8 * i : 8 * i + 8])


@pytest.mark.parametrize("transport", ["mem", "tcp"])
def test_push_wait_and_the_vllm_call_order(transport):
    full, bias, senders, receivers, outs = sources_and_destinations(transport)
    for r in receivers:
        r.init_transfer_engine({})
        r.start_weight_update()
    for s in senders:
        assert s.send_weights(1) == {}
    for i, r in enumerate(receivers):
        r.update_weights({"version": 1, "timeout": 10})
        assert r.finish_weight_update() == 1
        assert landed(full, bias, outs, i)


def test_a_failed_destination_fails_alone_with_its_exception_and_is_redone():
    full, bias, senders, receivers, outs = sources_and_destinations("tcp")
    # Destination 1's regions are closed: transfers to it are refused there.
    good = receivers[1].info()
    for reg in receivers[1].registrations:
        reg.close()
    failed = senders[0].send_weights(5)
    assert list(failed) == [1]
    assert isinstance(failed[1], xfer.Error)
    assert "destination 1" in str(failed[1])
    assert senders[1].send_weights(5).keys() == {1}
    receivers[0].update_weights({"version": 5, "timeout": 10})
    assert landed(full, bias, outs, 0)
    with pytest.raises(xfer.TimedOut, match=r"sources \[0, 1\]"):
        receivers[1].destination.wait(5, timeout=0.05)
    # It comes back with its memory registered again; both sources redo it alone.
    again = [receivers[1].agent.register(o) for o in (outs[1][0], outs[1][1])]
    for s in senders:
        s.source.attach(1, s.agent.connect(good["address"]), [r.descriptor for r in again])
        report = s.source.push(5, destinations=[1])
        assert list(report) == [1] and isinstance(report[1], dict), report
    fresh = Destination(receivers[1].agent, receivers[1].layout, again, sources=2, rank=1)
    fresh.wait(5, timeout=10)
    assert landed(full, bias, outs, 1)


def test_a_joiner_pulls_the_current_version_and_the_sources_do_nothing():
    full, bias, senders, receivers, outs = sources_and_destinations("tcp")
    with pytest.raises(xfer.TimedOut):
        # Nothing pushed yet: no version at rest to pull.
        j0 = WeightReceiver(xfer.Agent(transport="tcp"), whole_builder()[0], sources=2)
        j0.init_transfer_engine({"sources": [s.info() for s in senders]})
        j0.update_weights({"mode": "pull", "timeout": 0.2})
    for s in senders:
        assert s.send_weights(3) == {}
    b, (out, ob) = whole_builder()
    j = WeightReceiver(xfer.Agent(transport="tcp"), b, sources=2)
    j.init_transfer_engine({"sources": [s.info() for s in senders]})
    j.start_weight_update()
    j.update_weights({"mode": "pull", "timeout": 10})
    assert j.finish_weight_update() == 3
    assert np.array_equal(out, full) and np.array_equal(ob, bias)
    with pytest.raises(xfer.TimedOut, match="version 4"):
        j.update_weights({"mode": "pull", "version": 4, "timeout": 0.2})


def whole_builder():
    out, ob = np.zeros((8, 16), dtype=np.uint32), np.zeros(16, dtype=np.uint32)
    b = LayoutBuilder()
    b.add("w", out, [("w", (8, 16), whole((8, 16)))])
    b.add("b", ob, [("b", (16,), whole((16,)))])
    return b, (out, ob)


def test_layouts_refuse_what_does_not_fit():
    b = LayoutBuilder()
    with pytest.raises(xfer.InvalidArgument, match="its parts are 256 bytes, the tensor 128"):
        b.add("w", np.zeros(32, dtype=np.uint32), [("w", (8, 16), split((8, 16), 0, 2, 0))])
    l = w.Layout()
    l.add_tensor("t", [4], 2)
    l.add_region("r", 4)
    l.add_piece("t", "r", 0, box=[(0, 4)])
    with pytest.raises(xfer.InvalidArgument, match="invalid layout"):
        l.validate()
    with pytest.raises(xfer.InvalidArgument):
        w.Layout.from_json("{}")
    again = w.Layout.from_json(LayoutBuilder().add("x", np.zeros(4, np.uint8), [("x", (4,), whole((4,)))]).layout.to_json())
    assert again.regions == [("x", 4)]
    with pytest.raises(xfer.InvalidArgument):
        split((4,), 1, 2, 0)


def test_versions_that_cannot_be_signalled_are_refused():
    _, _, senders, _, _ = sources_and_destinations("mem")
    with pytest.raises(xfer.InvalidArgument, match="cannot be signalled"):
        senders[0].source.push(2**31)
    with pytest.raises(xfer.InvalidArgument):
        senders[0].source.push(-1)


def test_the_prepare_hook_sees_each_piece_once_before_it_goes():
    full, bias, senders, receivers, outs = sources_and_destinations("mem")
    seen = []
    report = senders[0].source.push(2, prepare=lambda piece, tensor, region: seen.append((piece, tensor, region)))
    assert all(isinstance(r, dict) for r in report.values()), report
    assert sorted(seen) == [(0, "w", 0), (1, "b", 1)] or sorted(seen) == [(0, "w", 0)]

    def boom(piece, tensor, region):
        raise RuntimeError("no such dtype")

    report = senders[1].source.push(3, prepare=boom)
    assert all(isinstance(r, xfer.InvalidArgument) and "no such dtype" in str(r) for r in report.values()), report


def test_members_meet_by_name_through_the_directory_and_a_joiner_is_planned_in(tmp_path):
    """Sources and destinations find each other through a file:// directory: each offers its
    record and regions and joins under its agent's name; the sources attach the planned
    destinations from their records and push; a replica that joins later (no rank) is
    planned in by the sources' refresh and gets the next push, and attaches the sources
    for pulls by its own refresh."""
    directory = xfer.Directory(f"file://{tmp_path}/members.json", cluster="weights")
    full, bias, src_b, dst_b, outs, plan = layouts()
    senders = [WeightSender(xfer.Agent(transport="tcp"), plan, i, b) for i, b in enumerate(src_b)]
    receivers = [WeightReceiver(xfer.Agent(transport="tcp"), b, sources=2, rank=i) for i, b in enumerate(dst_b)]
    joined = []
    for s in senders:
        s.source.offer()
        joined.append(directory.join(s.agent))
    for r in receivers:
        r.destination.offer()
        joined.append(directory.join(r.agent))
    follows = [directory.follow(s.agent) for s in senders]
    for s, f in zip(senders, follows):
        changes = s.source.wait_attached(f, 2, timeout=30)
        assert sorted(changes["attached"]) == sorted((i, r.agent.name) for i, r in enumerate(receivers))
        assert {r.agent.name for r in receivers} <= set(f.peers())
    for s in senders:
        assert s.send_weights(1) == {}
    for i, r in enumerate(receivers):
        r.update_weights({"version": 1, "timeout": 10})
        assert landed(full, bias, outs, i)
    # A replica of the whole model joins.
    b, (out, ob) = whole_builder()
    j = WeightReceiver(xfer.Agent(transport="tcp"), b, sources=2)
    j.destination.offer()
    joined.append(directory.join(j.agent))
    for s, f in zip(senders, follows):
        changes = s.source.wait_attached(f, 3, timeout=30)
        assert [name for _, name in changes["attached"]] == [j.agent.name]
        assert sorted(s.source.attached) == [0, 1, 2]
    for s in senders:
        assert s.send_weights(2) == {}
    j.destination.wait(2, timeout=10)
    assert np.array_equal(out, full) and np.array_equal(ob, bias)
    jf = directory.follow(j.agent)
    changes = j.destination.wait_sources(jf, timeout=30)
    assert sorted(changes["attached"]) == sorted((i, s.agent.name) for i, s in enumerate(senders))
    # A destination that finds no sources in its cluster times out, naming what it waits for.
    alone = xfer.Directory(f"file://{tmp_path}/members.json", cluster="empty")
    lonely = WeightReceiver(xfer.Agent(transport="tcp"), whole_builder()[0], sources=2)
    with pytest.raises(xfer.TimedOut, match="source"):
        lonely.destination.wait_sources(alone.follow(lonely.agent), timeout=0.2)
    for p in joined:
        p.withdraw()
    for f in follows + [jf]:
        f.close()
    with pytest.raises(xfer.InvalidArgument, match="closed"):
        jf.peers()
