"""xfer.kv: KV caches shaped like vLLM's and SGLang's (numpy here, torch on a GPU) moved
between prefill and decode ranks of other shapes (TP2 -> TP4, TP4 -> TP1, NHD and HND,
replicated heads, MLA), pushed and pulled, over mem in one process and over tcp between
processes, every decode byte checked against the slice of the logical cache; the
vLLM-shaped worker and the SGLang-shaped sender/receiver through whole requests; bad
layouts and calls refused; a request failed by a dead peer named."""

import doctest
import json
import os
import pickle
import subprocess
import sys
import time

import kvcases
import numpy as np
import pytest
from conftest import cuda_or_skip

import xfer
from xfer import kv

CASES = list(kvcases.CASES)
PEER = os.path.join(os.path.dirname(__file__), "kv_peer.py")
EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def test_the_module_example_runs():
    failures, tried = doctest.testmod(kv, verbose=False)
    assert tried > 0 and failures == 0


class Sides:
    """Both sides of a case in this process: a Rank per rank, each on its own agent."""

    def __init__(self, case, transport="mem", device="cpu", **agent):
        self.case = case
        self.pre_c = kvcases.side_caches(case, "prefill", device)
        self.dec_c = kvcases.side_caches(case, "decode", device)
        pre = [c.cache().layout for c in self.pre_c]
        dec = [c.cache().layout for c in self.dec_c]
        self.agents = []

        def make(side, caches):
            out = []
            for r, c in enumerate(caches):
                e = xfer.Agent(transport=transport, name=f"{case}-{side}-{r}", **agent)
                self.agents.append(e)
                out.append(kv.Rank(e, side, r, c.cache().regions, pre, dec))
            return out

        self.pre, self.dec = make("prefill", self.pre_c), make("decode", self.dec_c)
        for p in self.pre:
            for d in self.dec:
                p.attach(d.info())
                d.attach(p.info())

    def fill(self, seed):
        n, pt, dt = kvcases.request(self.case, seed)
        logical = kvcases.logical_cache(self.case, n, seed)
        for c in self.pre_c:
            c.put(c.phys, pt, n, logical)
            c.upload()
        return kv.Request(n, pt, dt), logical

    def check_decode(self, req, logical):
        for r, c in enumerate(self.dec_c):
            bad = kvcases.decode_matches(c, req.decode_blocks[0], req.num_tokens, logical)
            assert bad is None, f"{self.case}: decode rank {r}: {bad}"

    def clear_decode(self):
        for c in self.dec_c:
            for a in c.phys:
                a[...] = 0
            c.upload()

    def close(self):
        for e in self.agents:
            e.close()


@pytest.mark.parametrize("case", CASES)
def test_push_layer_by_layer_and_pull_in_one_process(case):
    s = Sides(case)
    try:
        req, logical = s.fill(seed=3)
        plan = s.pre[0].plan(req)
        kv.check([c.cache().layout for c in s.pre_c], [c.cache().layout for c in s.dec_c], req, plan)
        stats = plan.stats()
        layers, comps = s.pre[0].layout.num_layers, s.pre[0].layout.components
        assert stats["transfers"] == stats["runs"] * layers * comps > 0, stats
        assert stats["request_bytes"] == stats["bytes"] * layers * comps
        assert {(q["prefill"], q["decode"]) for q in stats["pairs"]} == set(plan.pairs)
        # Push: prefill hands each layer over; decode hears of every layer, then the request.
        sends = []
        for p in s.pre:
            t = p.push_layer("req-push", plan, 0)
            for layer in range(1, p.layers):
                t.extend(p.push_layer(b"req-push", plan, layer))
            # vLLM's caches hold a layer's K and V in one tensor: one strided transfer per
            # decode rank and layer, whatever the blocks and heads.
            assert len(t) == p.layers * sum(1 for q in plan.pairs if q[0] == p.rank)
            sends.append(t)
        for d in s.dec:
            d.wait("req-push", timeout=30)
            events = d.poll()
            assert kv.Event in {type(e) for e in events}
            assert [e.layer for e in events if e.layer is not None] != []
            assert any(e.layer is None and e.request == b"req-push" and e.kind == "landed" for e in events), events
        for t in sends:
            t.wait(30)
            assert t.done()
        s.check_decode(req, logical)
        # Pull: decode reads into zeroed caches; prefill learns that its readers are done.
        s.clear_decode()
        reads = [d.pull("req-pull", d.plan(req)) for d in s.dec]
        for t in reads:
            t.wait(30)
        s.check_decode(req, logical)
        for p in s.pre:
            if plan.sends(p.rank):
                p.wait("req-pull", timeout=30)
    finally:
        s.close()


def test_a_layer_is_waited_for_alone_and_a_request_not_sent_times_out_named():
    s = Sides(CASES[0])
    try:
        req, _ = s.fill(seed=4)
        plan = s.pre[0].plan(req)
        for p in s.pre:
            p.push_layer("r1", plan, 1).wait(30)
        d = s.dec[1]
        d.wait_layer("r1", 1, timeout=30)
        with pytest.raises(xfer.TimedOut, match=r'"r1".*1 of 3 layers'):
            d.wait("r1", timeout=0.05)
        with pytest.raises(xfer.TimedOut, match='"never-sent"'):
            d.wait_layer("never-sent", 0, timeout=0.05)
    finally:
        s.close()


def spawn(case, side, *extra):
    proc = subprocess.Popen(
        [sys.executable, PEER, "--case", case, "--side", side, *extra],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.path.dirname(__file__),
    )
    hello = json.loads(proc.stdout.readline())
    return proc, [bytes.fromhex(i) for i in hello["infos"]]


def tell(proc, **cmd):
    proc.stdin.write(json.dumps(cmd) + "\n")
    proc.stdin.flush()


def ask(proc, **cmd):
    tell(proc, **cmd)
    return json.loads(proc.stdout.readline())


@pytest.mark.parametrize("case", CASES)
def test_push_and_pull_between_processes_over_tcp(case):
    # The prefill side is another process; this one is decode.
    proc, infos = spawn(case, "prefill")
    try:
        dec_c = kvcases.side_caches(case, "decode")
        pre, dec = kvcases.layouts(case, "prefill"), kvcases.layouts(case, "decode")
        agents = [xfer.Agent(transport="tcp", timeout=5.0) for _ in dec_c]
        ranks = [kv.Rank(e, "decode", r, c.cache().regions, pre, dec) for r, (e, c) in enumerate(zip(agents, dec_c, strict=True))]
        for r in ranks:
            for i in infos:
                r.attach(i)
        assert ask(proc, attach=[r.info().hex() for r in ranks])["ok"]
        n, pt, dt = kvcases.request(case, 7)
        logical = kvcases.logical_cache(case, n, 7)
        assert ask(proc, fill={"seed": 7})["ok"]
        got = ask(proc, push={"id": "tcp-push", "seed": 7})
        assert got["ok"], got
        for r in ranks:
            r.wait("tcp-push", timeout=30)
        for i, c in enumerate(dec_c):
            assert kvcases.decode_matches(c, dt, n, logical) is None, f"push, decode rank {i}"
        for c in dec_c:
            for a in c.phys:
                a[...] = 0
        req = kv.Request(n, pt, dt)
        for t in [r.pull("tcp-pull", r.plan(req)) for r in ranks]:
            t.wait(30)
        for i, c in enumerate(dec_c):
            assert kvcases.decode_matches(c, dt, n, logical) is None, f"pull, decode rank {i}"
        got = ask(proc, read={"id": "tcp-pull", "seed": 7})
        assert got["ok"], got
        tell(proc, exit=True)
        assert proc.wait(timeout=60) == 0
        for e in agents:
            e.close()
    finally:
        proc.kill()


def test_a_decode_process_killed_fails_the_request_by_name():
    case = CASES[0]
    proc, infos = spawn(case, "decode")
    pre_c = kvcases.side_caches(case, "prefill")
    pre, dec = kvcases.layouts(case, "prefill"), kvcases.layouts(case, "decode")
    agents = [xfer.Agent(transport="tcp", timeout=2.0) for _ in pre_c]
    try:
        ranks = [kv.Rank(e, "prefill", r, c.cache().regions, pre, dec) for r, (e, c) in enumerate(zip(agents, pre_c, strict=True))]
        for r in ranks:
            for i in infos:
                r.attach(i)
        n, pt, dt = kvcases.request(case, 9)
        req = kv.Request(n, pt, dt)
        # A request that lands first: the peer is up and attached.
        assert ask(proc, attach=[r.info().hex() for r in ranks])["ok"]
        logical = kvcases.logical_cache(case, n, 9)
        for c in pre_c:
            c.put(c.phys, pt, n, logical)
        for t in [r.push("before", r.plan(req)) for r in ranks]:
            t.wait(30)
        got = ask(proc, landed={"id": "before", "seed": 9})
        assert got["ok"], got
        proc.kill()
        proc.wait()
        with pytest.raises(xfer.Error, match='"after-kill"') as err:
            for t in [r.push("after-kill", r.plan(req)) for r in ranks]:
                t.wait(30)
        assert not isinstance(err.value, xfer.InvalidArgument), err.value
    finally:
        proc.kill()
        for e in agents:
            e.close()


def test_layouts_from_vllm_tensors_name_their_shape():
    heads = 8
    # FlashAttention (2, blocks, block_size, heads, head_dim), TP 4 rank 2: heads 4..6.
    fa = {f"l{i}": np.zeros((2, 10, 16, 2, 64), np.float16) for i in range(3)}
    lay = kv.layout_from_vllm(fa, heads, 4, 2)
    assert (lay.num_layers, lay.num_blocks, lay.block_size, lay.heads, lay.elem_size) == (3, 10, 16, (4, 6), 2)
    assert (lay.head_stride, lay.token_stride, lay.block_stride) == (128, 256, 4096)
    assert lay.places[1] == (0, 10 * 4096) and lay.places[2] == (1, 0)
    assert lay == kv.Layout.vllm_flash_attn(kv.Model(3, 8, 64, 2), (4, 6), 10, 16)
    assert pickle.loads(pickle.dumps(lay)) == lay == kv.Layout.from_json(lay.to_json())
    assert lay.region_sizes() == [2 * 10 * 4096] * 3
    # FlashInfer HND: vLLM's permuted view of (blocks, 2, heads, block_size, head_dim) memory.
    phys = [np.zeros((10, 2, 2, 16, 64), np.float16) for _ in range(2)]
    views = [p.transpose(0, 1, 3, 2, 4) for p in phys]
    c = kv.cache_from_vllm(views, heads, 4, 0, backend="flashinfer", kv_layout="HND")
    assert (c.layout.token_stride, c.layout.head_stride) == (128, 16 * 128)
    assert all(r.flags.c_contiguous and np.shares_memory(r, p) for r, p in zip(c.regions, phys, strict=True))
    with pytest.raises(xfer.InvalidArgument, match="kv_layout='HND'"):
        kv.layout_from_vllm(views, heads, 4, 0, backend="flashinfer", kv_layout="NHD")
    # Replicated heads: 2 KV heads over TP 8, one each.
    rep = [np.zeros((12, 2, 8, 1, 16), np.float16)]
    assert kv.layout_from_vllm(rep, 2, 8, 5, backend="flashinfer").heads == (1, 2)
    # MLA and SGLang.
    mla = kv.layout_from_vllm([np.zeros((6, 64, 576), np.float16)] * 2, 1, 4, 3, backend="mla")
    assert (mla.components, mla.token_stride, mla.heads) == (1, 1152, (0, 1))
    k = [np.zeros((33 * 4, 2, 16), np.float16) for _ in range(2)]
    v = [np.zeros((33 * 4, 2, 16), np.float16) for _ in range(2)]
    sg = kv.cache_from_sglang(k, v, 4, 4, 2, 1)
    assert sg.layout.num_blocks == 33 and sg.layout.heads == (2, 4) and sg.regions[1] is v[0]
    assert kv.layout_from_sglang_mla([np.zeros((16, 1, 576), np.float16)], 8).num_blocks == 2


def test_bad_layouts_and_calls_are_refused_with_what_is_wrong():
    fa = [np.zeros((2, 10, 16, 2, 64), np.float16) for _ in range(2)]
    with pytest.raises(xfer.InvalidArgument, match="hold 2 KV heads.*holds 4"):
        kv.layout_from_vllm(fa, 8, 2, 0)
    with pytest.raises(xfer.InvalidArgument, match="not contiguous"):
        kv.layout_from_vllm([np.zeros((2, 20, 16, 2, 64), np.float16)[:, ::2]], 8, 4, 0)
    with pytest.raises(xfer.InvalidArgument, match="'1'.*float32"):
        kv.layout_from_vllm([fa[0], fa[1].astype(np.float32)], 8, 4, 0)
    with pytest.raises(xfer.InvalidArgument, match="neither divides"):
        kv.layout_from_vllm(fa, 6, 4, 0)
    with pytest.raises(xfer.InvalidArgument, match="backend='flashinfer'"):
        kv.layout_from_vllm(fa, 8, 4, 0, kv_layout="HND")
    with pytest.raises(xfer.InvalidArgument, match="5 dimensions"):
        kv.layout_from_vllm([np.zeros((10, 16, 64), np.float16)], 8, 4, 0)
    with pytest.raises(xfer.InvalidArgument, match="not whole pages"):
        kv.layout_from_sglang([np.zeros((10, 2, 8))], [np.zeros((10, 2, 8))], 4, 2, 1, 0)
    with pytest.raises(xfer.InvalidArgument, match="no layers"):
        kv.layout_from_vllm({}, 8, 4, 0)
    m = kv.Model(2, 4, 8, 2)
    with pytest.raises(xfer.InvalidArgument, match="heads"):
        kv.Layout.vllm_flash_attn(m, (3, 9), 4, 4)
    with pytest.raises(xfer.InvalidArgument, match="order"):
        kv.Layout.vllm_flashinfer(m, (0, 4), 4, 4, order="NDH")
    with pytest.raises(xfer.InvalidArgument, match="as many"):
        kv.Layout.vllm_flash_attn(m, (0, 2), 4, 4).with_heads((0, 4))
    with pytest.raises(xfer.InvalidArgument, match="not a KV layout"):
        kv.Layout.from_json("{}")
    lay = kv.Layout.vllm_flash_attn(m, (0, 4), 4, 4)
    with pytest.raises(xfer.InvalidArgument, match="block 9"):
        kv.plan([lay], [lay], kv.Request(8, [0, 9], [1, 2]))
    with pytest.raises(xfer.InvalidArgument, match="twice"):
        kv.plan([lay], [lay], kv.Request(8, [0, 0], [1, 2]))
    with pytest.raises(xfer.InvalidArgument, match="block table"):
        kv.Request(8, "blocks", [1])
    with xfer.Agent(transport="mem") as e, xfer.Agent(transport="mem") as e2:
        small = [np.zeros(100, np.uint8), np.zeros(100, np.uint8)]
        with pytest.raises(xfer.InvalidArgument, match="needs .* bytes of region"):
            kv.Rank(e, "prefill", 0, small, [lay], [lay])
        with pytest.raises(xfer.InvalidArgument, match="side"):
            kv.Rank(e, "middle", 0, small, [lay], [lay])
        mem = [np.zeros(n, np.uint8) for n in lay.region_sizes()]
        p = kv.Rank(e, "prefill", 0, mem, [lay], [lay])
        other = kv.Layout.vllm_flash_attn(m, (0, 4), 5, 4)
        d = kv.Rank(e2, "decode", 0, [np.zeros(n, np.uint8) for n in other.region_sizes()], [lay], [other])
        with pytest.raises(xfer.InvalidArgument, match="other than the layout"):
            p.attach(d.info())
        with pytest.raises(xfer.InvalidArgument, match="not a KV rank's info"):
            p.attach(b"garbage")
        plan = p.plan(kv.Request(8, [0, 1], [1, 2]))
        with pytest.raises(xfer.InvalidArgument, match="not attached"):
            p.push("r", plan)
        with pytest.raises(xfer.InvalidArgument, match="only a prefill rank can push"):
            d.push("r", plan)
        with pytest.raises(xfer.InvalidArgument, match="layer 9"):
            p.push_layer("r", plan, 9)
        with pytest.raises(xfer.InvalidArgument, match="request id of 0 bytes"):
            p.push_layer("", plan, 0)
        with pytest.raises(xfer.InvalidArgument, match="stream= orders"):
            p.push_layer("r", plan, 0, stream=0)


def _vllm_workers(case, side, agents):
    caches = kvcases.side_caches(case, side)
    workers = []
    for r, c in enumerate(caches):
        e = xfer.Agent(transport="mem", name=f"w-{side}-{r}")
        agents.append(e)
        w = kv.KvWorker(e, side, r, c.tp, c.total_heads, backend=c.backend, kv_layout=c.kv_layout, timeout=30)
        w.register_kv_caches(c.kv_caches())
        workers.append(w)
    return caches, workers


def _finished(workers, which, rid):
    """Calls get_finished on each worker until each has reported `rid` (sending: 0,
    recving: 1); a deadline, not a sleep."""
    left = set(range(len(workers)))
    deadline = time.monotonic() + 30
    while left and time.monotonic() < deadline:
        for i in list(left):
            if rid in workers[i].get_finished(set())[which]:
                left.discard(i)
    assert not left, f"workers {sorted(left)} never reported {rid}"


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("case", ["tp2-nhd-to-tp4-hnd-replicated", "tp4-hnd-to-tp1-nhd", "mla-tp2-to-tp4"])
def test_the_vllm_shaped_worker_moves_a_request(case, mode):
    agents = []
    try:
        pre_c, pre = _vllm_workers(case, "prefill", agents)
        dec_c, dec = _vllm_workers(case, "decode", agents)
        n, pt, dt = kvcases.request(case, 5)
        logical = kvcases.logical_cache(case, n, 5)
        rid = f"cmpl-{mode}"
        meta_p = kv.ConnectorMetadata([kv.ReqMeta(rid, n, pt, dt, mode, [w.info() for w in dec])])
        meta_d = kv.ConnectorMetadata([kv.ReqMeta(rid, n, pt, dt, mode, [w.info() for w in pre])])
        names = pre_c[0].names
        # Prefill's forward: each layer computed, then saved.
        for w in pre:
            w.start_load_kv(meta_p)
        for c in pre_c:
            c.put(c.phys, pt, n, logical)
        for layer, name in enumerate(names):
            for w, c in zip(pre, pre_c, strict=True):
                w.save_kv_layer(name, c.kv_caches()[name], None)
            if mode == "push" and layer == 0:
                # Decode's step starts while prefill is still saving.
                for w in dec:
                    w.start_load_kv(meta_d)
        for w in pre:
            w.wait_for_save()
        if mode == "pull":
            for w in dec:
                w.start_load_kv(meta_d)
        for name in names:
            for w in dec:
                w.wait_for_layer_load(name)
        _finished(dec, 1, rid)
        _finished(pre, 0, rid)
        for w in pre + dec:
            assert not w.failures and not w.get_block_ids_with_load_errors()
        for i, c in enumerate(dec_c):
            assert kvcases.decode_matches(c, dt, n, logical) is None, f"decode rank {i}"
    finally:
        for e in agents:
            e.close()


def test_the_sglang_shaped_sender_and_receiver_move_a_request():
    heads, layers, dim, page = 4, 2, 8, 4
    boot = kv.LocalBootstrap()
    agents, mgrs = [], {"prefill": [], "decode": []}
    bufs = {}
    for side, tp, pages in (("prefill", 2, 12), ("decode", 4, 10)):
        for r in range(tp):
            h = kv.heads_for_rank(heads, tp, r)
            k = [np.zeros((pages * page, h[1] - h[0], dim), np.float16) for _ in range(layers)]
            v = [np.zeros_like(x) for x in k]
            bufs[side, r] = (k, v)
            e = xfer.Agent(transport="mem", name=f"sg-{side}-{r}")
            agents.append(e)
            cache = kv.cache_from_sglang(k, v, page, heads, tp, r)
            mgrs[side].append(kv.KvManager(e, side, r, tp, cache, bootstrap=boot, timeout=30))
    try:
        for m in mgrs["prefill"]:
            m.connect([d.info() for d in mgrs["decode"]])
        for m in mgrs["decode"]:
            m.connect([p.info() for p in mgrs["prefill"]])
        ppages, dpages = [7, 2, 9, 0, 4], [3, 8, 1, 6, 5]
        tokens = len(ppages) * page
        rng = np.random.default_rng(1)
        logical = rng.integers(0, 256, (layers, 2, tokens, heads, dim * 2), dtype=np.uint8)
        slots = np.array(ppages)[np.arange(tokens) // page] * page + np.arange(tokens) % page
        for r in range(2):
            h0, h1 = kv.heads_for_rank(heads, 2, r)
            for layer in range(layers):
                for c, buf in enumerate(bufs["prefill", r]):
                    buf[layer].view(np.uint8)[slots] = logical[layer, c, :, h0:h1]
        senders = [kv.KVSender(m, None, 42) for m in mgrs["prefill"]]
        receivers = [kv.KVReceiver(m, None, 42) for m in mgrs["decode"]]
        for s in senders:
            s.init(len(ppages))
            assert s.poll() == kv.KVPoll.Bootstrapping
        assert receivers[0].poll() == kv.KVPoll.WaitingForInput
        for rcv in receivers:
            rcv.init(dpages)
        for s in senders:
            assert s.poll() == kv.KVPoll.WaitingForInput
            s.send(ppages[:3])
            assert s.poll() == kv.KVPoll.WaitingForInput
            s.send(ppages[3:])
        deadline = time.monotonic() + 30
        ends = senders + receivers
        while any(x.poll() not in (kv.KVPoll.Success, kv.KVPoll.Failed) for x in ends) and time.monotonic() < deadline:
            pass
        assert [x.poll() for x in ends] == [kv.KVPoll.Success] * len(ends), [str(x.failure) for x in ends]
        dslots = np.array(dpages)[np.arange(tokens) // page] * page + np.arange(tokens) % page
        for r in range(4):
            h0, h1 = kv.heads_for_rank(heads, 4, r)
            for layer in range(layers):
                for c, buf in enumerate(bufs["decode", r]):
                    assert np.array_equal(buf[layer].view(np.uint8)[dslots], logical[layer, c, :, h0:h1]), (r, layer, c)
        # A receiver whose request never comes fails, with the request named.
        lost = kv.KVReceiver(mgrs["decode"][0], None, "lost")
        mgrs["decode"][0].timeout = 0.0
        lost.init([0])
        assert lost.poll() == kv.KVPoll.Failed
        assert isinstance(lost.failure_exception(), xfer.TimedOut) and "lost" in str(lost.failure_exception())
    finally:
        for e in agents:
            e.close()


def test_the_connector_examples_import_without_vllm_or_sglang(monkeypatch):
    monkeypatch.syspath_prepend(EXAMPLES)
    import sglang_connector  # noqa: PLC0415
    import vllm_connector  # noqa: PLC0415

    assert vllm_connector.XferConnectorWorker is not None
    assert sglang_connector.XferKVSender is not None


@pytest.mark.cuda
@pytest.mark.parametrize("case", ["tp2-nhd-to-tp4-hnd-replicated", "mla-tp2-to-tp4"])
def test_gpu_caches_pushed_after_each_layers_kernel_in_one_process(case):
    torch = cuda_or_skip()
    s = Sides(case, transport="auto", device="cuda:0", memory="cuda", timeout=10.0)
    try:
        n, pt, dt = kvcases.request(case, 8)
        logical = kvcases.logical_cache(case, n, 8)
        req = kv.Request(n, pt, dt)
        plan = s.pre[0].plan(req)
        # The full caches' bytes, computed on a side stream layer by layer; each layer's
        # push is ordered after its own kernel, not the whole model.
        want = []
        for c in s.pre_c:
            full = [np.zeros_like(p) for p in c.phys]
            c.put(full, pt, n, logical)
            want.append([torch.from_numpy(f).cuda() for f in full])
        stream = torch.cuda.Stream()
        sends = []
        for layer in range(s.pre[0].layers):
            for p, c, w in zip(s.pre, s.pre_c, want, strict=True):
                with torch.cuda.stream(stream):
                    torch.cuda._sleep(1_000_000)
                    c.memory[layer].copy_(w[layer])
                sends.append(p.push_layer("gpu", plan, layer, stream=stream))
        for d in s.dec:
            d.wait("gpu", timeout=30)
        for t in sends:
            t.wait(30)
        s.check_decode(req, logical)
    finally:
        s.close()


@pytest.mark.cuda
@pytest.mark.parametrize("transport", ["cuda-ipc", "tcp"])
def test_gpu_caches_between_processes(transport):
    cuda_or_skip()
    case = CASES[0]
    proc, infos = spawn(case, "prefill", "--device", "cuda:0", "--transport", transport)
    try:
        dec_c = kvcases.side_caches(case, "decode", "cuda:0")
        pre, dec = kvcases.layouts(case, "prefill"), kvcases.layouts(case, "decode")
        agents = [xfer.Agent(transport=transport, memory="cuda", timeout=10.0) for _ in dec_c]
        ranks = [kv.Rank(e, "decode", r, c.cache().regions, pre, dec) for r, (e, c) in enumerate(zip(agents, dec_c, strict=True))]
        for r in ranks:
            for i in infos:
                r.attach(i)
        assert ask(proc, attach=[r.info().hex() for r in ranks])["ok"]
        n, pt, dt = kvcases.request(case, 2)
        logical = kvcases.logical_cache(case, n, 2)
        assert ask(proc, fill={"seed": 2})["ok"]
        assert ask(proc, push={"id": "gpu-push", "seed": 2})["ok"]
        for r in ranks:
            r.wait("gpu-push", timeout=30)
        for i, c in enumerate(dec_c):
            assert kvcases.decode_matches(c, dt, n, logical) is None, f"decode rank {i}"
        tell(proc, exit=True)
        assert proc.wait(timeout=60) == 0
        for e in agents:
            e.close()
    finally:
        proc.kill()


def test_the_disaggregation_example_streams_and_checks_every_byte_between_processes():
    # Both shapes, TP 2 -> 4 and 4 -> 1, each rank a process over tcp; 40 tokens leave the
    # last block of each table part-filled.
    script = os.path.join(EXAMPLES, "kv_disagg.py")
    args = ["--device", "cpu", "--tokens", "40", "--shape", "both", "--tp", "2:4,4:1", "--requests", "2", "--timeout", "60"]
    done = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=600)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    for pair in ("prefill TP2 -> decode TP4", "prefill TP4 -> decode TP1"):
        assert out.count(pair) == 2, out  # llama and mla
    assert out.count("bytes checked") == 8 and "BYTES DIFFER" not in out, out
    assert "every decode byte checked: 20 (request, decode rank) caches" in out, out
    for word in ("transfers", "runs", "per-block, per-head path", "after its save", "Gbps"):
        assert word in out, out


def test_the_disaggregation_examples_check_sees_a_misplaced_byte(monkeypatch):
    monkeypatch.syspath_prepend(EXAMPLES)
    import kv_disagg as ex  # noqa: PLC0415

    a = ex.Arrays("cpu")
    for name, tp, rank in (("llama", 4, 1), ("mla", 2, 1)):
        shape = ex.SHAPES[name]._replace(layers=2)
        heads = ex.heads_of(shape, tp, rank)
        table, n = [5, 0, 3], 2 * shape.block_size + 1
        caches = [a.cache(ex.cache_shape(shape, 6, heads), ex.DECODE_EMPTY) for _ in range(shape.layers)]
        tokens = a.arange(n)
        for layer, c in enumerate(caches):
            ex.put(a, shape, c, ex.places(a, shape, table, n), ex.values(a, shape, 7, layer, tokens, heads))
        assert ex.mismatches(a, shape, caches, heads, 7, table, n) == []
        # Another request's values, a byte out of place, a slot the request does not own.
        assert ex.mismatches(a, shape, caches, heads, 8, table, n) != []
        c = caches[1].view(np.uint8).reshape(-1)
        c[7] ^= 1
        assert ex.mismatches(a, shape, caches, heads, 7, table, n) == [f"layer 1: 1 of {caches[1].size} elements differ"]
        c[7] ^= 1
        # Block 1 is not the request's, nor the last slot of its last block (3).
        for place in ((1,), (3, shape.block_size - 1)):
            cells = a.cells(caches[0])
            at = (slice(None), *place) if name == "llama" else place
            saved = cells[at].copy()
            cells[at] = 0
            assert len(ex.mismatches(a, shape, caches, heads, 7, table, n)) == 1, place
            cells[at] = saved
    # The logical cache's slices: heads 2..4 of TP 4 rank 1 are heads 2..4 of the whole.
    llama = ex.SHAPES["llama"]
    whole = ex.values(a, llama, 3, 5, a.arange(4), (0, 8))
    assert np.array_equal(ex.values(a, llama, 3, 5, a.arange(4), (2, 4)), whole[:, :, 2:4])
