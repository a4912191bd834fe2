#!/usr/bin/env python3
"""xfer, NIXL and Mooncake's Transfer Engine side by side: the same paged WRITEs between
two processes of one host, host memory, over TCP (NIXL's UCX backend restricted to its tcp
transport, Mooncake's tcp transport with its metadata by P2P handshake, xfer's tcp
transport), interleaved round by round; the median of the rounds.

Each transfer writes `--pages` pages of `--page-kib` KiB from random pages of the
initiator's region to random pages of the target's (a fixed permutation), the way a KV
cache moves; `--transfers` of them are timed per round, one in flight at a time (`--depth`
for more). Every engine posts one transfer as one call: xfer's `write_pages`, NIXL's
prepared transfer, Mooncake's `batch_transfer_async_write` (one batch of `--pages`
requests, waited for with `get_batch_transfer_status`). The target's pages are checked
against the source's after each engine's rounds.

Setup (any Python 3.10+; a venv of its own, NIXL brings UCX):

    python3 -m venv /tmp/peers-venv
    /tmp/peers-venv/bin/pip install numpy target/wheels/xfer-*.whl mooncake-transfer-engine-non-cuda
    /tmp/peers-venv/bin/pip install nixl   # or, without torch: --no-deps nixl nixl-cu12
    /tmp/peers-venv/bin/python scripts/peers-side-by-side.py --page-kib 64 --rails 1

`--engines` picks a subset (e.g. `xfer,mooncake` without NIXL). No system packages beyond
Debian 12's base are needed. NIXL picks its CUDA flavour (nixl-cu12 or nixl-cu13) from
what it finds; on a machine without a GPU either works for host memory (its Python API
runs without torch for host memory). Mooncake's default wheel (`mooncake-transfer-engine`)
links libcuda.so.1 and libcudart.so.12, which a machine without a GPU driver lacks; the
`-non-cuda` build of the same version is the same engine without CUDA. Mooncake runs with its defaults but one: its queue of requests per peer is
raised to its maximum (`MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER=65535` unless given; at the
default 1024, four batches of 1024 pages in flight fail), and its per-batch INFO log is
quietened (`GLOG_minloglevel=1` unless given). UCX_TLS is set to tcp unless
given: UCX would otherwise use shared memory between processes of one host, which is not
the link being compared. Prints one JSON line per engine and round and a summary: the
rate, and the CPU time each process (initiator, target; all threads) spent per GB moved
in the timed rounds.
"""

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import queue
import statistics
import sys
import time

import numpy as np


def pages_of(args):
    rng = np.random.default_rng(7)
    n = args.region_pages
    src = rng.permutation(n)[: args.pages].astype(np.int64)
    dst = rng.permutation(n)[: args.pages].astype(np.int64)
    return src, dst


def cpu_seconds():
    """User and system CPU time of this process, all its threads."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def digest(buf, pages, page):
    h = hashlib.sha256()
    for p in pages:
        h.update(buf[int(p) * page : (int(p) + 1) * page].tobytes())
    return h.hexdigest()


def cpu_pair(conn):
    """CPU seconds so far of this process and of the target's."""
    conn.send("cpu")
    return cpu_seconds(), conn.recv()


def cpu_spent(conn, before):
    """CPU seconds this process and the target's spent since `before` (cpu_pair)."""
    now = cpu_pair(conn)
    return now[0] - before[0], now[1] - before[1]


def serve(conn, buf, page, busy=False, between=None):
    """The target's side of the driver's protocol, until "stop": "cpu" is answered with
    this process's CPU seconds, a list of pages with the digest of those pages of `buf`
    (which is then zeroed for the next round). `busy` polls the pipe instead of blocking
    on it; `between` (if given) runs after every message, and between polls."""
    while True:
        if not busy or conn.poll():
            cmd = conn.recv()
            if cmd == "stop":
                break
            if cmd == "cpu":
                conn.send(cpu_seconds())
            else:
                conn.send(digest(buf, cmd, page))
                buf[:] = 0
        if between is not None:
            between()


def drive(args, conn, rounds_out, post, wait, buf, pages):
    """The initiator's side: `args.depth` warm-up transfers (connections, first pages),
    then `args.rounds` timed rounds of `args.transfers` transfers with at most `args.depth`
    in flight (`post()` starts one and returns what `wait` waits for), each round's
    seconds and CPU seconds (this process, the target's) appended to `rounds_out`; then the
    target's pages are checked against ours. `pages` is (source pages, destination
    pages). Returns whether they matched."""
    src_pages, dst_pages = pages
    for _ in range(args.depth):
        wait(post())
    for _ in range(args.rounds):
        cpu = cpu_pair(conn)
        t = time.perf_counter()
        inflight = []
        for _ in range(args.transfers):
            if len(inflight) == args.depth:
                wait(inflight.pop(0))
            inflight.append(post())
        for h in inflight:
            wait(h)
        rounds_out.append((time.perf_counter() - t, cpu_spent(conn, cpu)))
    conn.send(dst_pages.tolist())
    ok = conn.recv() == digest(buf, src_pages, args.page_kib << 10)
    conn.send("stop")
    return ok


# ---- xfer ----------------------------------------------------------------------------


def xfer_target(args, conn):
    import xfer

    page = args.page_kib << 10
    buf = np.zeros(args.region_pages * page, dtype=np.uint8)
    with xfer.Agent(transport="tcp", rails=args.rails) as e:
        reg = e.register(buf)
        conn.send((e.info, reg.descriptor))
        serve(conn, buf, page)


def xfer_initiator(args, conn, rounds_out):
    import xfer

    page = args.page_kib << 10
    src_pages, dst_pages = pages_of(args)
    buf = np.random.default_rng(3).integers(0, 256, args.region_pages * page, dtype=np.uint8)
    address, desc = conn.recv()
    with xfer.Agent(transport="tcp", rails=args.rails) as e:
        peer = e.connect(address)
        reg = e.register(buf, remote_write=False)
        return drive(
            args,
            conn,
            rounds_out,
            lambda: e.write_pages(peer, reg, desc, src_pages, dst_pages, page),
            lambda h: h.wait(timeout=60),
            buf,
            (src_pages, dst_pages),
        )


# ---- NIXL ----------------------------------------------------------------------------


def nixl_target(args, conn):
    from nixl._api import nixl_agent, nixl_agent_config

    page = args.page_kib << 10
    buf = np.zeros(args.region_pages * page, dtype=np.uint8)
    agent = nixl_agent("target", nixl_agent_config(backends=["UCX"]))
    agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), buf.ctypes.data))
    # UCX's tcp transport moves a PUT through the target's worker. With --nixl-target idle
    # (the default) NIXL's own progress thread does it (2.5x the busy mode's rate on two
    # cores); busy polls the agent here too, as a serving engine's loop might.
    serve(conn, buf, page, busy=args.nixl_target != "idle", between=agent.get_new_notifs)


def nixl_initiator(args, conn, rounds_out):
    from nixl._api import nixl_agent, nixl_agent_config

    page = args.page_kib << 10
    src_pages, dst_pages = pages_of(args)
    buf = np.random.default_rng(3).integers(0, 256, args.region_pages * page, dtype=np.uint8)
    meta, base = conn.recv()
    agent = nixl_agent("initiator", nixl_agent_config(backends=["UCX"]))
    agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    remote = agent.add_remote_agent(meta)
    n = args.region_pages
    local_descs = np.array([(buf.ctypes.data + i * page, page, 0) for i in range(n)], dtype=np.int64)
    remote_descs = np.array([(base + i * page, page, 0) for i in range(n)], dtype=np.int64)
    # NIXL's prepared path (prepXferDlist once, makeXferReq per transfer by index), as
    # vLLM's NIXL connector uses it.
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local_descs, "DRAM")
    far = agent.prep_xfer_dlist(remote, remote_descs, "DRAM")
    si, di = src_pages.astype(np.int32), dst_pages.astype(np.int32)

    def post():
        h = agent.make_prepped_xfer("WRITE", local, si, far, di)
        state = agent.transfer(h)
        if state == "ERR":
            raise RuntimeError("NIXL transfer failed to post")
        return h

    def wait(h):
        while True:
            state = agent.check_xfer_state(h)
            if state == "DONE":
                agent.release_xfer_handle(h)
                return
            if state == "ERR":
                raise RuntimeError("NIXL transfer failed")

    return drive(args, conn, rounds_out, post, wait, buf, (src_pages, dst_pages))


# ---- Mooncake ------------------------------------------------------------------------


def mooncake_engine():
    """A Mooncake Transfer Engine on its tcp transport, its metadata by P2P handshake (no
    etcd); its session id, `host:port` of its RPC listener, names it to a peer."""
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    if te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("Mooncake: initialize failed")
    return te, f"127.0.0.1:{te.get_rpc_port()}"


def mooncake_target(args, conn):
    page = args.page_kib << 10
    buf = np.zeros(args.region_pages * page, dtype=np.uint8)
    te, session = mooncake_engine()
    if te.register_memory(buf.ctypes.data, buf.nbytes) != 0:
        raise RuntimeError("Mooncake: register_memory failed")
    conn.send((session, buf.ctypes.data))
    # Mooncake's tcp transport receives on its own threads: the target only waits.
    serve(conn, buf, page)
    te.unregister_memory(buf.ctypes.data)


def mooncake_initiator(args, conn, rounds_out):
    page = args.page_kib << 10
    src_pages, dst_pages = pages_of(args)
    buf = np.random.default_rng(3).integers(0, 256, args.region_pages * page, dtype=np.uint8)
    session, base = conn.recv()
    te, _ = mooncake_engine()
    if te.register_memory(buf.ctypes.data, buf.nbytes) != 0:
        raise RuntimeError("Mooncake: register_memory failed")
    # The address lists are built once; each transfer is one batch of `--pages` requests.
    srcs = [buf.ctypes.data + int(p) * page for p in src_pages]
    dsts = [base + int(p) * page for p in dst_pages]
    lengths = [page] * len(srcs)

    def post():
        batch = te.batch_transfer_async_write(session, srcs, dsts, lengths)
        if batch <= 0:
            raise RuntimeError("Mooncake transfer failed to post")
        return batch

    def wait(batch):
        # Waits for the batch (polling its status) and frees it.
        if te.get_batch_transfer_status([batch]) != 0:
            raise RuntimeError("Mooncake transfer failed")

    ok = drive(args, conn, rounds_out, post, wait, buf, (src_pages, dst_pages))
    te.unregister_memory(buf.ctypes.data)
    return ok


# ---- driver --------------------------------------------------------------------------

ENGINES = {
    "xfer": (xfer_target, xfer_initiator),
    "nixl": (nixl_target, nixl_initiator),
    "mooncake": (mooncake_target, mooncake_initiator),
}


def initiator_proc(name, args, conn, out):
    rounds = []
    ok = ENGINES[name][1](args, conn, rounds)
    out.put((rounds, ok))


def one_round(name, args):
    """One process pair, `args.rounds` timed rounds: (seconds per round, verified)."""
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    out = ctx.Queue()
    t = ctx.Process(target=ENGINES[name][0], args=(args, b))
    i = ctx.Process(target=initiator_proc, args=(name, args, a, out))
    t.start()
    i.start()
    deadline = time.monotonic() + 600
    while True:
        try:
            rounds, ok = out.get(timeout=1)
            break
        except queue.Empty:
            if not i.is_alive() or time.monotonic() > deadline:
                i.kill()
                t.kill()
                print(f"{name}: the initiator failed (exit code {i.exitcode})", file=sys.stderr)
                sys.exit(4)
    i.join(60)
    t.join(60)
    return rounds, ok


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--page-kib", type=int, default=64)
    ap.add_argument("--pages", type=int, default=256, help="pages per transfer")
    ap.add_argument("--region-pages", type=int, default=1024)
    ap.add_argument("--transfers", type=int, default=100, help="transfers per round")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per process pair")
    ap.add_argument("--pairs", type=int, default=3, help="process pairs per engine, interleaved")
    ap.add_argument("--depth", type=int, default=1, help="transfers in flight")
    ap.add_argument("--rails", type=int, default=1, help="xfer's tcp rails")
    ap.add_argument("--engines", default="xfer,nixl,mooncake")
    ap.add_argument("--nixl-target", choices=["idle", "busy"], default="idle", help="whether the NIXL target process only waits, leaving progress to NIXL's own thread (idle, its faster mode here), or polls its agent (busy)")
    args = ap.parse_args()
    os.environ.setdefault("UCX_TLS", "tcp")
    os.environ.setdefault("GLOG_minloglevel", "1")
    # Mooncake's tcp transport queues at most 1024 requests per peer by default and fails
    # the rest: four batches of 1024 pages in flight need more.
    os.environ.setdefault("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "65535")
    bytes_per_round = args.transfers * args.pages * (args.page_kib << 10)
    rates, cpus = {}, {}
    gb = bytes_per_round / 1e9
    for _ in range(args.pairs):
        for name in args.engines.split(","):
            rounds, ok = one_round(name, args)
            for s, (cpu_init, cpu_target) in rounds:
                gbps = bytes_per_round * 8 / s / 1e9
                rates.setdefault(name, []).append(gbps)
                per_gb = (cpu_init / gb, cpu_target / gb)
                cpus.setdefault(name, []).append(per_gb)
                print(json.dumps({"engine": name, "gbps": round(gbps, 2), "verified": ok, "cpu_s_per_gb": {"initiator": round(per_gb[0], 3), "target": round(per_gb[1], 3)}}), flush=True)
            if not ok:
                print(f"{name}: the target's pages differ from the source's", file=sys.stderr)
                sys.exit(3)
    summary = {name: round(statistics.median(r), 2) for name, r in rates.items()}
    for name, c in cpus.items():
        summary[f"{name}_cpu_s_per_gb"] = {
            "initiator": round(statistics.median(x[0] for x in c), 3),
            "target": round(statistics.median(x[1] for x in c), 3),
        }
    for peer in ("nixl", "mooncake"):
        if "xfer" in summary and peer in summary:
            summary[f"xfer/{peer}"] = round(summary["xfer"] / summary[peer], 3)
    summary.update(page_kib=args.page_kib, pages=args.pages, depth=args.depth, rails=args.rails, ucx_tls=os.environ["UCX_TLS"])
    print(json.dumps({"median_gbps": summary}), flush=True)


if __name__ == "__main__":
    main()
