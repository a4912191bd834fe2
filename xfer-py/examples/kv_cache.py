"""Disaggregated prefill -> decode: moving a request's paged KV cache with xfer.

Two processes each hold a paged KV cache shaped like vLLM's,
``[layers, num_blocks, 2, block_size, kv_heads, head_dim]``. For every request the decode
process allocates free blocks of its cache and tells prefill their ids; prefill has
computed the request's KV (here: a pattern) into blocks of its own, scattered, other ids,
and writes them into decode's blocks one layer at a time (a layer is one ``write_pages``
of the request's blocks), each write carrying the request id as immediate data. Decode
waits until all the layers of the request have landed (``wait_imm(request, count=layers)``),
checks every byte, and frees the blocks.

    python kv_cache.py --device cpu                  # numpy, tcp
    python kv_cache.py --device cuda                 # torch on GPU; cuda-ipc (one host)
    python kv_cache.py --device cuda --transport tcp # torch on GPU, the network path
    python kv_cache.py --device cuda --gpus 0,1      # prefill on GPU 0, decode on GPU 1

Prints the bandwidth of the transfers (prefill's side) and the per-request latency (from
prefill's first write to decode seeing the last layer, on the host's monotonic clock,
which both processes share). Exits non-zero if any byte differs.
"""

import argparse
import multiprocessing as mp
import statistics
import sys
import time

import numpy as np

import xfer

DTYPES = {"float16": (np.float16, 2), "bfloat16": (None, 2), "float32": (np.float32, 4)}


def parse():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--transport", default="auto", help="auto (chosen per peer: cuda-ipc between GPU processes of one host, tcp otherwise), tcp, cuda-ipc")
    ap.add_argument("--rails", type=int, default=1)
    ap.add_argument("--gpus", default="0", help="prefill's GPU, decode's GPU (e.g. 0,1); one value for both")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--num-blocks", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16, help="tokens per block")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float16")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--blocks-per-request", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args()
    if args.requests < 2:
        ap.error("--requests: at least 2 (the first warms the connection up)")
    if args.blocks_per_request > args.num_blocks:
        ap.error("--blocks-per-request: at most --num-blocks")
    return args


class Cache:
    """A paged KV cache on the host (numpy) or a GPU (torch), with a byte view per block."""

    def __init__(self, args, gpu):
        self.args = args
        shape = (args.layers, args.num_blocks, 2, args.block_size, args.kv_heads, args.head_dim)
        self.block_bytes = 2 * args.block_size * args.kv_heads * args.head_dim * DTYPES[args.dtype][1]
        if args.device == "cuda":
            import torch  # noqa: PLC0415

            self.torch = torch
            self.dev = f"cuda:{gpu}"
            self.kv = torch.zeros(shape, dtype=getattr(torch, args.dtype), device=self.dev)
            self.bytes = self.kv.view(torch.uint8).view(args.layers, args.num_blocks, self.block_bytes)
            self.ramp = torch.arange(self.block_bytes, device=self.dev, dtype=torch.int32)
        else:
            np_dtype = DTYPES[args.dtype][0] or np.float16
            self.kv = np.zeros(shape, dtype=np_dtype)
            self.bytes = self.kv.view(np.uint8).reshape(args.layers, args.num_blocks, self.block_bytes)
            self.ramp = np.arange(self.block_bytes, dtype=np.int32)

    def expected(self, request, layer, j):
        """The bytes of block j of `request` at `layer`."""
        k = request * 131 + layer * 17 + j * 7
        if self.args.device == "cuda":
            return ((self.ramp + k) % 251).to(self.torch.uint8)
        return ((self.ramp + k) % 251).astype(np.uint8)

    def fill(self, request, blocks):
        for layer in range(self.args.layers):
            for j, b in enumerate(blocks):
                self.bytes[layer, int(b)] = self.expected(request, layer, j)
        if self.args.device == "cuda":
            self.torch.cuda.synchronize(self.dev)

    def check(self, request, blocks):
        """The (layer, block) pairs that differ from what prefill wrote."""
        bad = []
        for layer in range(self.args.layers):
            for j, b in enumerate(blocks):
                want = self.expected(request, layer, j)
                got = self.bytes[layer, int(b)]
                same = bool(self.torch.equal(got, want)) if self.args.device == "cuda" else np.array_equal(got, want)
                if not same:
                    bad.append((layer, int(b)))
        return bad

    def page(self, layer, block):
        """The index of (layer, block) as a page of block_bytes in the cache's memory."""
        return layer * self.args.num_blocks + block


def make_agent(args, gpu):
    memory = "cuda" if args.device == "cuda" else "host"
    return xfer.Agent(transport=args.transport, rails=args.rails, memory=memory, gpu=gpu, timeout=args.timeout)


def decode(args, conn, gpu):
    cache = Cache(args, gpu)
    with make_agent(args, gpu) as e:
        reg = e.register(cache.kv)
        conn.send((e.info, reg.descriptor))
        rng = np.random.default_rng(1)
        lat, failures = [], 0
        for r in range(args.requests):
            request = r + 1
            free = rng.permutation(args.num_blocks)[: args.blocks_per_request]
            conn.send((request, [int(b) for b in free]))
            e.wait_imm(request, count=args.layers, timeout=args.timeout)
            landed = time.monotonic_ns()
            started = conn.recv()
            lat.append((landed - started) / 1e3)
            bad = cache.check(request, free)
            if bad:
                failures += 1
                print(f"decode: request {request}: {len(bad)} blocks differ, e.g. {bad[:4]}", flush=True)
        conn.send(None)
        print(conn.recv(), flush=True)  # prefill's summary first
        lat = sorted(lat[1:])  # the first request warms the connection up
        print(
            f"decode: {args.requests} requests checked byte for byte, {failures} failed; latency per request "
            f"after the first (first write -> last layer landed): median {statistics.median(lat):.0f} us, "
            f"p90 {lat[int(0.9 * (len(lat) - 1))]:.0f} us, max {lat[-1]:.0f} us",
            flush=True,
        )
        reg.close()
    sys.exit(1 if failures else 0)


def prefill(args, conn, gpu):
    cache = Cache(args, gpu)
    with make_agent(args, gpu) as e:
        reg = e.register(cache.kv, remote_write=False)
        info, descriptor = conn.recv()
        peer = e.connect(info)
        rng = np.random.default_rng(2)
        moved, busy = 0, 0.0
        while (msg := conn.recv()) is not None:
            request, dst_blocks = msg
            src_blocks = rng.permutation(args.num_blocks)[: len(dst_blocks)]
            cache.fill(request, src_blocks)
            t0 = time.perf_counter()
            conn_started = time.monotonic_ns()
            handles = [
                e.write_pages(
                    peer,
                    reg,
                    descriptor,
                    [cache.page(layer, int(b)) for b in src_blocks],
                    [cache.page(layer, b) for b in dst_blocks],
                    cache.block_bytes,
                    imm=request,
                )
                for layer in range(args.layers)
            ]
            conn.send(conn_started)
            for h in handles:
                moved += h.wait(timeout=args.timeout)
            busy += time.perf_counter() - t0
        conn.send(
            f"prefill: {peer.transport} x{e.rails} rail(s), {args.device} memory: moved {moved / 2**20:.1f} MiB in "
            f"{args.requests} requests x {args.layers} layers x {args.blocks_per_request} blocks of "
            f"{cache.block_bytes // 1024} KiB: {moved * 8 / busy / 1e9:.2f} Gbps"
        )
        reg.close()


def main():
    args = parse()
    gpus = [int(g) for g in args.gpus.split(",")]
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    d = ctx.Process(target=decode, args=(args, a, gpus[-1]), name="decode")
    p = ctx.Process(target=prefill, args=(args, b, gpus[0]), name="prefill")
    d.start()
    p.start()
    p.join(timeout=args.timeout * (args.requests + 2))
    d.join(timeout=args.timeout)
    for proc in (p, d):
        if proc.is_alive():
            proc.kill()
            print(f"{proc.name} did not finish", file=sys.stderr)
            sys.exit(1)
    codes = (p.exitcode, d.exitcode)
    if codes != (0, 0):
        print(f"failed: prefill exit {codes[0]}, decode exit {codes[1]}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
