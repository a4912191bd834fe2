"""Disaggregated prefill -> decode with xfer.kv: a request's KV cache streamed layer by
layer from a prefill TP group into a decode TP group of another size, every rank its own
process, every byte checked.

Shapes (``--shape``):

- llama: Llama-3-8B, 32 layers, 8 KV heads of 128, BF16, block 16, in vLLM's
  FlashAttention cache: per layer ``(2, num_blocks, 16, heads, 128)``, a TP rank holding
  its share of the KV heads (``kv.heads_for_rank``: TP 2 holds 4 each, TP 4 holds 2);
- mla: DeepSeek-V3's MLA cache, 61 layers of one latent of 576 BF16 (kv_lora_rank 512 +
  rope 64), vLLM's ``(num_blocks, 64, 576)`` per layer, held whole by every rank: the
  planner spreads each request over the prefill ranks that hold it.

For each TP pair (``--tp 2:4,4:1``: prefill TP 2 -> decode TP 4, then 4 -> 1) the script
starts one process per rank ("spawn"), each with its own ``xfer.Agent`` and its vLLM-shaped
per-layer caches, registered through ``kv.cache_from_vllm`` and ``kv.Rank``. The ranks
exchange their ``Rank.info()`` (here through the parent process, in a server through the
scheduler's metadata) and attach to the other side's. Then, per request:

1. The parent (the scheduler) draws random block tables: the prefill blocks holding the
   request's tokens and the decode blocks that will take them, the same per side.
2. Every prefill rank plans the request (``Rank.plan``: a handful of strided runs per rank
   pair, the same for every layer) and "computes" the model layer by layer: on a GPU a
   kernel of known duration (``torch.cuda._sleep``) then a fill of the layer's blocks on
   the current stream, and ``push_layer(..., stream=)`` as soon as that is queued, so the
   layer's transfers start when its kernels are done, not when the model is; on the host
   a numpy fill, then ``push_layer``.
3. Every decode rank learns of each layer, then of the request, from notifications
   (``wait_layer``, ``wait``: never polling its memory), and checks every byte of its
   cache: the request's tokens must hold the slice of the full logical cache that its
   heads make, the other slots must be untouched. The values are derived from their
   coordinates (request, layer, K/V, token, head, element), so a rank checks its slice
   without anyone holding the full cache.
4. The same request is pushed once more, whole (``Rank.push``, nothing to compute), for
   the transfer's own throughput.

Run it:

    python kv_disagg.py --device cpu                    # numpy, tcp between processes
    python kv_disagg.py --device cuda                   # torch on GPU 0, cuda-ipc
    python kv_disagg.py --device cuda --shape llama --tp 2:4 --tokens 4096 --layer-ms 2

Per request it prints the bytes, the plan's figures (strided transfers and runs, against
the block x head copies a per-block path would make), the time from the last layer's save
(its kernels done) to the last decode rank's notification that the request is whole, and
the throughput of the whole push. It exits non-zero if any byte differs or a rank fails.
Times are on the host's monotonic clock, which the processes of one host share.
"""

import argparse
import math
import multiprocessing as mp
import queue
import statistics
import sys
import time
import traceback
from typing import NamedTuple

import numpy as np

import xfer
from xfer import kv


class Shape(NamedTuple):
    """A model's KV cache as vLLM lays it out per layer."""

    name: str
    layers: int
    kv_heads: int  # MLA: 1, its latent, held by every rank
    head_dim: int  # MLA: the latent's width
    block_size: int  # tokens per block
    backend: str  # vLLM's attention backend (the cache's layout)


SHAPES = {
    "llama": Shape("llama", layers=32, kv_heads=8, head_dim=128, block_size=16, backend="flash_attn"),
    "mla": Shape("mla", layers=61, kv_heads=1, head_dim=512 + 64, block_size=64, backend="mla"),
}
ELEM = 2  # BF16: numpy has no bfloat16, so the host caches are uint16 (the same bytes)

# The cells' values: coordinates mixed modulo a prime below 2**16, so that the two
# sentinels never occur and any misplaced token, head, element or layer shows.
P = 65521
MIX = {"seed": 104729, "layer": 7919, "kv": 3571, "token": 40503, "head": 9973, "elem": 131}
PREFILL_EMPTY = 0xFFFE  # prefill's blocks before their tokens are computed
DECODE_EMPTY = 0xFFFF  # decode's blocks before a request lands


class Config(NamedTuple):
    """One TP pair's run, as every rank's process gets it."""

    device: str
    shape: str
    prefill_tp: int
    decode_tp: int
    tokens: int
    prefill_blocks: int
    decode_blocks: int
    layer_ms: float
    timeout: float

    def tp(self, side):
        return self.prefill_tp if side == "prefill" else self.decode_tp

    def blocks(self, side):
        return self.prefill_blocks if side == "prefill" else self.decode_blocks


# --- arrays: numpy on the host, torch on GPU 0 ------------------------------------------


class Arrays:
    """The few array calls the example needs, on numpy or on torch's GPU 0."""

    def __init__(self, device):
        self.cuda = device == "cuda"
        if self.cuda:
            import torch  # noqa: PLC0415  (only with --device cuda)

            self.torch = torch
            self.dev = torch.device("cuda", 0)
            torch.cuda.set_device(self.dev)

    def ints(self, values):
        if self.cuda:
            return self.torch.as_tensor(values, dtype=self.torch.int64, device=self.dev)
        return np.asarray(values, dtype=np.int64)

    def arange(self, start, stop=None):
        start, stop = (0, start) if stop is None else (start, stop)
        if self.cuda:
            return self.torch.arange(start, stop, dtype=self.torch.int64, device=self.dev)
        return np.arange(start, stop, dtype=np.int64)

    def cache(self, shape, bits):
        """A BF16 tensor of `shape` (uint16 on the host) whose every element is `bits`."""
        if self.cuda:
            t = self.torch.empty(shape, dtype=self.torch.bfloat16, device=self.dev)
        else:
            t = np.empty(shape, dtype=np.uint16)
        self.fill(t, bits)
        return t

    def fill(self, t, bits):
        """Sets every element of a cache to `bits` (0..65535)."""
        if self.cuda:
            self.cells(t).fill_(bits - 65536 if bits >= 32768 else bits)
        else:
            t.fill(bits)

    def cells(self, t):
        """A cache's elements as 16-bit integers (a view)."""
        return t.view(self.torch.int16) if self.cuda else t

    def to_cells(self, v):
        """Values 0..65535 (int64) as the cells' integers."""
        if self.cuda:
            return (((v + 32768) & 0xFFFF) - 32768).to(self.torch.int16)
        return v.astype(np.uint16)

    def differing(self, a, b):
        """How many elements of `a` and `b` differ."""
        if self.cuda:
            return int((a != b).sum().item())
        return int(np.count_nonzero(a != b))

    def stream(self):
        """What push_layer's stream= orders after: torch's current stream (None: host)."""
        return self.torch.cuda.current_stream() if self.cuda else None

    def mark(self):
        """A point in the work queued so far: on the GPU an event, on the host the time."""
        if not self.cuda:
            return time.monotonic()
        e = self.torch.cuda.Event()
        e.record()
        return e

    def time_of(self, mark):
        """When `mark` was passed (spins on the GPU's event, for a precise time)."""
        if not self.cuda:
            return mark
        while not mark.query():
            pass
        return time.monotonic()

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def sleep_cycles(self, ms):
        """GPU cycles of torch.cuda._sleep that take about `ms` milliseconds (measured)."""
        torch = self.torch
        torch.cuda._sleep(1_000_000)  # warm up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(20_000_000)
        end.record()
        end.synchronize()
        return max(1, int(20_000_000 * ms / start.elapsed_time(end)))


# --- the logical cache, sliced --------------------------------------------------------


def heads_of(shape, tp, rank):
    """The KV heads a rank holds: its TP share, or MLA's one latent, held by all."""
    return (0, 1) if shape.backend == "mla" else kv.heads_for_rank(shape.kv_heads, tp, rank)


def cache_shape(shape, num_blocks, heads):
    """vLLM's per-layer cache tensor of a rank holding `heads`."""
    if shape.backend == "mla":
        return (num_blocks, shape.block_size, shape.head_dim)
    return (2, num_blocks, shape.block_size, heads[1] - heads[0], shape.head_dim)


def values(a, shape, seed, layer, tokens, heads):
    """What layer `layer` of request `seed` holds for `tokens` (int64, positions in the
    request) and KV heads `heads` (global ids): (2, tokens, heads, head_dim) for K and V,
    (tokens, latent) for MLA; the slice of the full logical cache, from coordinates."""
    base = seed * MIX["seed"] + layer * MIX["layer"]
    elem = a.arange(shape.head_dim) * MIX["elem"]
    if shape.backend == "mla":
        v = base + tokens[:, None] * MIX["token"] + elem[None, :]
    else:
        kv_ = a.arange(2)[:, None, None, None] * MIX["kv"]
        t = tokens[None, :, None, None] * MIX["token"]
        h = a.arange(heads[0], heads[1])[None, None, :, None] * MIX["head"]
        v = base + kv_ + t + h + elem
    return a.to_cells(v % P)


def put(a, shape, layer_cache, slots_of, vals):
    """Writes `vals` (as values() gives them) into a layer's cache at the tokens' (block,
    slot) places."""
    blocks, slots = slots_of
    cells = a.cells(layer_cache)
    if shape.backend == "mla":
        cells[blocks, slots] = vals
    else:
        cells[:, blocks, slots] = vals


def places(a, shape, table, num_tokens):
    """Each token's (block, slot) through a block table."""
    tokens = a.arange(num_tokens)
    return a.ints(table)[tokens // shape.block_size], tokens % shape.block_size


def mismatches(a, shape, caches, heads, seed, table, num_tokens):
    """Where a decode rank's caches differ from what the request must leave: each token
    the slice of the logical cache for the rank's heads, every other slot untouched. []
    when every byte is right."""
    tokens = a.arange(num_tokens)
    where = places(a, shape, table, num_tokens)
    bad = []
    for layer, got in enumerate(caches):
        want = a.cache(tuple(got.shape), DECODE_EMPTY)
        put(a, shape, want, where, values(a, shape, seed, layer, tokens, heads))
        n = a.differing(a.cells(got), a.cells(want))
        if n:
            bad.append(f"layer {layer}: {n} of {math.prod(got.shape)} elements differ")
    return bad


def layouts(shape, tp, num_blocks):
    """Every rank's Layout of a TP group (what each rank's kv.cache_from_vllm gives): the
    ranks of both sides need both sides' to plan. A server learns the other side's from
    its ranks' infos (kv.read_info), as KvWorker does."""
    if shape.backend == "mla":
        model = kv.Model.mla(shape.layers, shape.head_dim, ELEM)
        rank0 = kv.Layout.vllm_mla(model, num_blocks, shape.block_size)
    else:
        model = kv.Model(shape.layers, shape.kv_heads, shape.head_dim, ELEM)
        rank0 = kv.Layout.vllm_flash_attn(model, heads_of(shape, tp, 0), num_blocks, shape.block_size)
    return kv.side_layouts(rank0, tp)


# --- a rank's process -----------------------------------------------------------------


def rank_main(cfg, side, rank, commands, results, barrier):
    """One rank: its agent, its caches, its kv.Rank; then the parent's requests."""
    try:
        RankProcess(cfg, side, rank, barrier).serve(commands, results)
    except BaseException:
        results.put((side, rank, "error", traceback.format_exc()))
        barrier.abort()  # the other ranks' waits fail rather than hang
        sys.exit(1)


class RankProcess:
    def __init__(self, cfg, side, rank, barrier):
        self.cfg, self.side, self.r, self.barrier = cfg, side, rank, barrier
        self.a = Arrays(cfg.device)
        self.shape = shape = SHAPES[cfg.shape]
        tp, nb = cfg.tp(side), cfg.blocks(side)
        self.heads = heads_of(shape, tp, rank)
        # vLLM's kv_caches, as register_kv_caches gets them: one tensor per layer.
        empty = PREFILL_EMPTY if side == "prefill" else DECODE_EMPTY
        kv_caches = {
            f"model.layers.{i}.self_attn.attn": self.a.cache(cache_shape(shape, nb, self.heads), empty)
            for i in range(shape.layers)
        }
        cache = kv.cache_from_vllm(kv_caches, shape.kv_heads, tp, rank, backend=shape.backend)
        self.caches = list(kv_caches.values())
        pre = layouts(shape, cfg.prefill_tp, cfg.prefill_blocks)
        dec = layouts(shape, cfg.decode_tp, cfg.decode_blocks)
        assert cache.layout == (pre if side == "prefill" else dec)[rank], "the tensors' layout is the side's"
        if cfg.device == "cuda":
            # transport "auto": cuda-ipc between GPU processes of one host, tcp beyond.
            self.agent = xfer.Agent(transport="auto", memory="cuda", gpu=0, name=f"{side}-{rank}", timeout=cfg.timeout)
            self.cycles = self.a.sleep_cycles(cfg.layer_ms) if side == "prefill" else 0
        else:
            self.agent = xfer.Agent(transport="tcp", name=f"{side}-{rank}", timeout=cfg.timeout)
        # Registers the caches: readable by peers on prefill, writable on decode.
        self.rank = kv.Rank(self.agent, side, rank, cache.regions, pre, dec)

    def serve(self, commands, results):
        results.put((self.side, self.r, "info", self.rank.info()))
        for info in commands.get():  # the other side's ranks
            self.rank.attach(info)
        results.put((self.side, self.r, "attached", None))
        while (req := commands.get()) is not None:
            run = self.prefill if self.side == "prefill" else self.decode
            results.put((self.side, self.r, "done", run(*req)))
        self.agent.close()

    def prefill(self, rid, seed, num_tokens, prefill_table, decode_table):
        cfg, a, shape = self.cfg, self.a, self.shape
        t = time.perf_counter()
        plan = self.rank.plan(kv.Request(num_tokens, prefill_table, decode_table))
        plan_us = (time.perf_counter() - t) * 1e6
        tokens, where = a.arange(num_tokens), places(a, shape, prefill_table, num_tokens)
        self.barrier.wait(cfg.timeout)  # the decode ranks are ready for the request
        start = time.monotonic()
        sends = []
        for layer, cache in enumerate(self.caches):
            # The layer's "forward": a kernel of known duration, then its KV written into
            # the request's blocks, all queued on the current stream.
            if a.cuda:
                a.torch.cuda._sleep(self.cycles)
            put(a, shape, cache, where, values(a, shape, seed, layer, tokens, self.heads))
            saved = a.mark()
            # Pushed as soon as queued: the transfers wait for the stream's work so far.
            sends.append(self.rank.push_layer(rid, plan, layer, stream=a.stream()))
        last_saved = a.time_of(saved)
        for s in sends:
            s.wait(cfg.timeout)
        # The same request again, whole and already computed: the transfer's throughput.
        self.barrier.wait(cfg.timeout)
        bulk_start = time.monotonic()
        self.rank.push(rid + "-bulk", plan).wait(cfg.timeout)
        return {"stats": plan.stats(), "plan_us": plan_us, "start": start, "last_saved": last_saved,
                "bulk_start": bulk_start, "sends": plan.sends(self.r)}

    def decode(self, rid, seed, num_tokens, prefill_table, decode_table):
        cfg, a = self.cfg, self.a
        for c in self.caches:  # blocks handed out afresh: what they held must not pass
            a.fill(c, DECODE_EMPTY)
        a.sync()
        self.barrier.wait(cfg.timeout)
        for layer in range(self.shape.layers):
            # A notification per layer: decode's layer `layer` could run its attention now.
            self.rank.wait_layer(rid, layer, cfg.timeout)
        self.rank.wait(rid, cfg.timeout)  # and the request's
        landed = time.monotonic()
        self.rank.poll()  # drains the events the waits heard (each layer, then the request)
        self.rank.forget(rid)
        bad = mismatches(a, self.shape, self.caches, self.heads, seed, decode_table, num_tokens)
        self.barrier.wait(cfg.timeout)
        self.rank.wait(rid + "-bulk", cfg.timeout)
        bulk_landed = time.monotonic()
        self.rank.poll()
        self.rank.forget(rid + "-bulk")
        return {"landed": landed, "bulk_landed": bulk_landed, "bad": bad}


# --- the parent: the scheduler of one TP pair ---------------------------------------------


def gather(results, procs, kind, deadline):
    """The `kind` message of every rank, by (side, rank); raises if a rank failed."""
    got = {}
    while len(got) < len(procs):
        try:
            side, rank, what, body = results.get(timeout=0.5)
        except queue.Empty:
            dead = [k for k, p in procs.items() if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"rank {dead[0]} died (exit {procs[dead[0]].exitcode})") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"waiting for {kind}: ranks {sorted(set(procs) - set(got))} did not answer") from None
            continue
        if what == "error":
            raise RuntimeError(f"{side} rank {rank} failed:\n{body}")
        assert what == kind, (what, kind)
        got[side, rank] = body
    return got


def deadline(cfg):
    """When the ranks' next answer is late (start-up, imports and CUDA included)."""
    return time.monotonic() + cfg.timeout + 60


def run_pair(cfg, requests):
    """Runs `requests` requests over one TP pair; returns the mismatches found."""
    shape = SHAPES[cfg.shape]
    ctx = mp.get_context("spawn")
    results, barrier = ctx.Queue(), ctx.Barrier(cfg.prefill_tp + cfg.decode_tp)
    procs, commands = {}, {}
    for side in ("prefill", "decode"):
        for r in range(cfg.tp(side)):
            commands[side, r] = ctx.Queue()
            args = (cfg, side, r, commands[side, r], results, barrier)
            procs[side, r] = ctx.Process(target=rank_main, args=args, name=f"{side}-{r}")
            procs[side, r].start()
    bad = []
    try:
        infos = gather(results, procs, "info", deadline(cfg))
        for (side, _), q in commands.items():
            q.put([info for (s, _), info in sorted(infos.items()) if s != side])
        gather(results, procs, "attached", deadline(cfg))
        rng = np.random.default_rng([cfg.prefill_tp, cfg.decode_tp, len(cfg.shape)])
        need = -(-cfg.tokens // shape.block_size)
        figures = []
        for i in range(requests):
            # The scheduler's part: free blocks of each side, in no order.
            pt = [int(b) for b in rng.permutation(cfg.prefill_blocks)[:need]]
            dt = [int(b) for b in rng.permutation(cfg.decode_blocks)[:need]]
            seed = 1000 * i + cfg.prefill_tp * 10 + cfg.decode_tp
            for q in commands.values():
                q.put((f"{cfg.shape}-tp{cfg.prefill_tp}-tp{cfg.decode_tp}-{i}", seed, cfg.tokens, pt, dt))
            out = gather(results, procs, "done", deadline(cfg))
            figures.append(report(cfg, i, out, bad))
        for q in commands.values():
            q.put(None)
        for p in procs.values():
            p.join(cfg.timeout)
        if len(figures) > 1:
            lat = statistics.median(f[0] for f in figures[1:])
            gbps = statistics.median(f[1] for f in figures[1:])
            print(f"  median of requests 1..{len(figures) - 1}: last layer landed {lat:.0f} us after its save, "
                  f"whole push {gbps:.1f} Gbps")
    finally:
        for p in procs.values():
            if p.is_alive():
                p.terminate()
                p.join()
    return bad


def report(cfg, i, out, bad):
    """Prints request `i`'s figures from the ranks' answers; adds its mismatches to `bad`;
    returns (latency in us, whole push's Gbps)."""
    pre = {r: o for (s, r), o in out.items() if s == "prefill"}
    dec = {r: o for (s, r), o in out.items() if s == "decode"}
    st = pre[0]["stats"]
    nbytes = st["request_bytes"]
    # The request is ready once the ranks that send its bytes have saved its last layer
    # (MLA's replicas not chosen by the plan compute too, and send nothing).
    last_saved = max(o["last_saved"] for o in pre.values() if o["sends"])
    landed = max(o["landed"] for o in dec.values())
    streamed = landed - min(o["start"] for o in pre.values())
    bulk = max(o["bulk_landed"] for o in dec.values()) - min(o["bulk_start"] for o in pre.values())
    latency_us = (landed - last_saved) * 1e6
    gbps = nbytes * 8 / bulk / 1e9
    for r, o in sorted(dec.items()):
        for b in o["bad"]:
            bad.append(f"{cfg.shape} TP{cfg.prefill_tp}->TP{cfg.decode_tp} request {i} decode rank {r}: {b}")
    ok = "bytes checked" if not any(o["bad"] for o in dec.values()) else "BYTES DIFFER"
    print(f"  request {i}{' (warm-up)' if i == 0 else ''}: {nbytes / 2**20:.1f} MiB written; "
          f"planned in {pre[0]['plan_us']:.0f} us: {st['transfers']} transfers, {st['runs']} runs "
          f"(a per-block, per-head path: {st['per_block_head']} copies)\n"
          f"    streamed in {streamed * 1e3:.1f} ms, the last layer landed {latency_us:.0f} us after its save; "
          f"whole push {bulk * 1e3:.2f} ms = {gbps:.1f} Gbps; {ok}")
    return latency_us, gbps


def parse():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--tokens", type=int, help="tokens per request (default: 4096 on cuda, 256 on cpu)")
    ap.add_argument("--shape", choices=["llama", "mla", "both"], default="both")
    ap.add_argument("--tp", default="2:4,4:1", help="prefill TP:decode TP pairs, comma-separated")
    ap.add_argument("--requests", type=int, default=3, help="requests per pair (the first warms up)")
    ap.add_argument("--layer-ms", type=float, default=1.0, help="cuda: each layer's compute kernel, in ms")
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args()
    if args.tokens is None:
        args.tokens = 4096 if args.device == "cuda" else 256
    if args.tokens < 1 or args.requests < 1:
        ap.error("--tokens and --requests: at least 1")
    try:
        args.pairs = [tuple(int(x) for x in p.split(":")) for p in args.tp.split(",")]
        assert all(len(p) == 2 and min(p) >= 1 for p in args.pairs)
    except (ValueError, AssertionError):
        ap.error(f"--tp {args.tp!r}: expected pairs like 2:4,4:1")
    return args


def main():
    args = parse()
    shapes = ["llama", "mla"] if args.shape == "both" else [args.shape]
    transport = "auto (cuda-ipc between GPU processes of one host)" if args.device == "cuda" else "tcp"
    bad, checked = [], 0
    for name in shapes:
        shape = SHAPES[name]
        need = -(-args.tokens // shape.block_size)
        for ptp, dtp in args.pairs:
            # Each side's cache a little larger than the request, so that tables scatter.
            cfg = Config(args.device, name, ptp, dtp, args.tokens, need + need // 4 + 3, need + need // 3 + 5,
                         args.layer_ms, args.timeout)
            what = (f"{shape.kv_heads} KV heads of {shape.head_dim}" if shape.backend != "mla"
                    else f"an MLA latent of {shape.head_dim}")
            print(f"{name}: prefill TP{ptp} -> decode TP{dtp}, {shape.layers} layers, {what}, BF16, block "
                  f"{shape.block_size}, {args.tokens} tokens, {args.device} over {transport}")
            bad += run_pair(cfg, args.requests)
            checked += args.requests * dtp
    if bad:
        print("MISMATCH:\n  " + "\n  ".join(bad))
        sys.exit(1)
    print(f"every decode byte checked: {checked} (request, decode rank) caches equal the logical cache's slices")


if __name__ == "__main__":
    main()
