"""Weight sync of a real model's parameter layout: trainers at tensor parallelism 2 push to
inference replicas at tensor parallelism 4 and 1, then a new replica joins and pulls.

The model's tensors are generated from a published config (Llama-3-8B by default, or
Qwen2.5-7B; nothing is downloaded), in BF16. Trainers hold Hugging Face's tensors split the
Megatron way (q, k, v, gate, up and the vocabulary along rows, o and down along columns,
norms whole). Inference ranks hold vLLM's parameters: each layer's ``qkv_proj`` packs its
part of q, k and v (and ``gate_up_proj`` its part of gate and up) in one tensor, exactly as
vLLM loads them. Every rank runs in a process of its own, with its own agent; the
receivers are driven in the call order of vLLM's weight-transfer engine
(``init_transfer_engine``, ``start_weight_update``, ``update_weights``,
``finish_weight_update``). Every receiver checks every byte of every version it gets
(element ``g`` of tensor ``t`` at version ``v`` is a hash of the three).

    python weights_llama.py                               # Llama-3-8B, numpy, tcp
    python weights_llama.py --device cuda                 # torch on the GPU (cuda-ipc on one host)
    python weights_llama.py --device cuda --transport tcp --rails 8
    python weights_llama.py --model qwen2.5-7b --layers 4 # fewer layers: less memory

Real dimensions need about 3 copies of the model (16 GB each for Llama-3-8B) in host or
GPU memory, plus the joiner's. Prints each version's push time and rate; exits non-zero if
any byte differs or any part of any update fails.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time

import numpy as np

import xfer
from xfer.weights import LayoutBuilder, Plan, WeightReceiver, WeightSender, split, whole

CONFIGS = {
    # config.json of meta-llama/Meta-Llama-3-8B
    "llama3-8b": dict(hidden=4096, inter=14336, layers=32, heads=32, kv_heads=8, head_dim=128, vocab=128256, qkv_bias=False),
    # config.json of Qwen/Qwen2.5-7B
    "qwen2.5-7b": dict(hidden=3584, inter=18944, layers=28, heads=28, kv_heads=4, head_dim=128, vocab=152064, qkv_bias=True),
    # for tests: every kind of tensor, tiny
    "tiny": dict(hidden=64, inter=96, layers=2, heads=4, kv_heads=4, head_dim=16, vocab=256, qkv_bias=True),
}

TRAIN_TP = 2
GROUPS = [4, 1]  # the inference replicas' tensor parallelism


def hf_tensors(cfg):
    """(name, shape, tensor-parallel dim or None) of every tensor, Hugging Face names."""
    h, hd = cfg["hidden"], cfg["head_dim"]
    q, kv = cfg["heads"] * hd, cfg["kv_heads"] * hd
    out = [("model.embed_tokens.weight", (cfg["vocab"], h), 0)]
    for i in range(cfg["layers"]):
        p = f"model.layers.{i}"
        out += [
            (f"{p}.input_layernorm.weight", (h,), None),
            (f"{p}.self_attn.q_proj.weight", (q, h), 0),
            (f"{p}.self_attn.k_proj.weight", (kv, h), 0),
            (f"{p}.self_attn.v_proj.weight", (kv, h), 0),
        ]
        if cfg["qkv_bias"]:
            out += [(f"{p}.self_attn.{x}_proj.bias", (n,), 0) for x, n in (("q", q), ("k", kv), ("v", kv))]
        out += [
            (f"{p}.self_attn.o_proj.weight", (h, q), 1),
            (f"{p}.post_attention_layernorm.weight", (h,), None),
            (f"{p}.mlp.gate_proj.weight", (cfg["inter"], h), 0),
            (f"{p}.mlp.up_proj.weight", (cfg["inter"], h), 0),
            (f"{p}.mlp.down_proj.weight", (h, cfg["inter"]), 1),
        ]
    out += [("model.norm.weight", (h,), None), ("lm_head.weight", (cfg["vocab"], h), 0)]
    return out


def part(shape, dim, tp, rank):
    return whole(shape) if dim is None else split(shape, dim, tp, rank)


def box_elems(box):
    n = 1
    for s, e in box:
        n *= e - s
    return n


def trainer_parts(cfg, rank):
    """Megatron TP=2: one local tensor per HF tensor, holding its part."""
    return [(name, [(name, shape, part(shape, dim, TRAIN_TP, rank))]) for name, shape, dim in hf_tensors(cfg)]


def vllm_parts(cfg, tp, rank):
    """vLLM at tensor parallelism ``tp``: its parameters, each with the HF parts it packs."""
    by = {name: (shape, dim) for name, shape, dim in hf_tensors(cfg)}

    def p(name):
        shape, dim = by[name]
        return (name, shape, part(shape, dim, tp, rank))

    out = [("model.embed_tokens.weight", [p("model.embed_tokens.weight")])]
    for i in range(cfg["layers"]):
        a = f"model.layers.{i}"
        out.append((f"{a}.input_layernorm.weight", [p(f"{a}.input_layernorm.weight")]))
        out.append((f"{a}.self_attn.qkv_proj.weight", [p(f"{a}.self_attn.{x}_proj.weight") for x in "qkv"]))
        if cfg["qkv_bias"]:
            out.append((f"{a}.self_attn.qkv_proj.bias", [p(f"{a}.self_attn.{x}_proj.bias") for x in "qkv"]))
        out.append((f"{a}.self_attn.o_proj.weight", [p(f"{a}.self_attn.o_proj.weight")]))
        out.append((f"{a}.post_attention_layernorm.weight", [p(f"{a}.post_attention_layernorm.weight")]))
        out.append((f"{a}.mlp.gate_up_proj.weight", [p(f"{a}.mlp.gate_proj.weight"), p(f"{a}.mlp.up_proj.weight")]))
        out.append((f"{a}.mlp.down_proj.weight", [p(f"{a}.mlp.down_proj.weight")]))
    out += [("model.norm.weight", [p("model.norm.weight")]), ("lm_head.weight", [p("lm_head.weight")])]
    return out


# ---- the values: element g of tensor t at version v, 16 bits, the same in numpy and torch


def tensor_id(name):
    h = 2166136261
    for b in name.encode():
        h = ((h ^ b) * 16777619) & 0xFFFFFFFF
    return h


def values(xp, g, t, version):
    """16-bit values of elements ``g`` (int64 indices) of tensor ``t`` at ``version``, as
    int64, by operations that never leave int64 (numpy and torch agree)."""
    h1 = ((g & 0x7FFFFFFF) * 0x9E3779B1) & 0xFFFFFFFF
    h2 = ((g >> 31) * 0x85EBCA77) & 0xFFFFFFFF
    h = h1 ^ h2 ^ t ^ (version * 0x2545F491 & 0xFFFFFFFF)
    h = ((h ^ (h >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
    h = h ^ (h >> 16)
    return h & 0xFFFF


class Memory:
    """Tensors on the host (numpy, uint16 for BF16's bytes) or a GPU (torch.bfloat16)."""

    def __init__(self, device, gpu=0):
        self.device = device
        if device == "cuda":
            import torch  # noqa: PLC0415

            self.torch = torch
            self.dev = torch.device(f"cuda:{gpu}")

    def empty(self, n):
        if self.device == "cuda":
            return self.torch.zeros(n, dtype=self.torch.bfloat16, device=self.dev)
        return np.zeros(n, dtype=np.uint16)

    def words(self, buf, start, stop):
        """The elements start..stop of a local tensor as 16-bit integers (a view)."""
        if self.device == "cuda":
            return buf[start:stop].view(self.torch.int16)
        return buf[start:stop]

    def expected(self, shape, holding, t, version):
        """The values of a part, in its storage order, as the words' type."""
        if self.device == "cuda":
            xp, ar = self.torch, lambda a, b: self.torch.arange(a, b, dtype=self.torch.int64, device=self.dev)
        else:
            xp, ar = np, lambda a, b: np.arange(a, b, dtype=np.int64)
        g = ar(0, 1)
        g = g * 0
        for d, (s, e) in enumerate(holding):
            g = (g.reshape(-1, 1) * shape[d] + ar(s, e).reshape(1, -1)).reshape(-1)
        v = values(xp, g, t, version)
        if self.device == "cuda":
            return (((v + 32768) & 0xFFFF) - 32768).to(self.torch.int16)
        return v.astype(np.uint16)

    def fill(self, parts, buf, version):
        for name, shape, sub, at, n in blocks(parts):
            self.words(buf, at, at + n)[:] = self.expected(shape, sub, tensor_id(name), version)

    def check(self, parts, buf, version):
        for name, shape, sub, at, n in blocks(parts):
            want = self.expected(shape, sub, tensor_id(name), version)
            got = self.words(buf, at, at + n)
            same = bool(self.torch.equal(got, want)) if self.device == "cuda" else bool(np.array_equal(got, want))
            if not same:
                return f"{name}: elements {sub} differ"
        return None

    def nbytes(self, buf):
        return buf.numel() * 2 if self.device == "cuda" else buf.nbytes


BLOCK = 1 << 24  # elements generated at once (bounds the temporaries)


def blocks(parts):
    """Each part of a local tensor cut along its first dimension into boxes of at most
    about BLOCK elements: (tensor, shape, box, first element in the local tensor, elements)."""
    at = 0
    for name, shape, holding in parts:
        if not holding:
            yield name, shape, holding, at, 1
            at += 1
            continue
        row = box_elems(holding[1:])
        step = max(1, BLOCK // max(row, 1))
        s0, e0 = holding[0]
        for s in range(s0, e0, step):
            sub = [(s, min(e0, s + step))] + list(holding[1:])
            n = box_elems(sub)
            yield name, shape, sub, at, n
            at += n


def build(mem, parts):
    b = LayoutBuilder()
    bufs = []
    for name, ps in parts:
        buf = mem.empty(sum(box_elems(h) for _, _, h in ps))
        b.add(name, buf, ps)
        bufs.append((ps, buf))
    return b, bufs


def layouts(cfg):
    """Every rank's layout (as every process computes them, identically)."""
    mem = Layout0()
    src = [build(mem, trainer_parts(cfg, r))[0].layout for r in range(TRAIN_TP)]
    dst = [build(mem, vllm_parts(cfg, tp, r))[0].layout for tp in GROUPS for r in range(tp)]
    return src, dst


class Layout0(Memory):
    """Zero-length stand-ins: layouts only need shapes."""

    def __init__(self):
        self.device = "cpu"

    def empty(self, n):
        return np.lib.stride_tricks.as_strided(np.zeros(1, dtype=np.uint16), shape=(n,), strides=(0,))


def make_agent(args, gpu):
    memory = "cuda" if args.device == "cuda" else "host"
    return xfer.Agent(transport=args.transport, memory=memory, gpu=gpu, rails=args.rails, timeout=30.0)


def trainer(args, conn, rank):
    cfg = config(args)
    mem = Memory(args.device)
    src, dst = layouts(cfg)
    b, bufs = build(mem, trainer_parts(cfg, rank))
    plan = Plan(src, dst)
    e = make_agent(args, 0)
    sender = WeightSender(e, plan, rank, b)
    conn.send(("info", sender.info()))
    while True:
        cmd, arg = conn.recv()
        if cmd == "attach":
            for r in arg:
                sender.attach(r)
            conn.send(("ok", None))
        elif cmd == "push":
            sender.begin_update()
            for ps, buf in bufs:
                mem.fill(ps, buf, arg)
            t = time.monotonic()
            failed = sender.send_weights(arg)
            s = time.monotonic() - t
            redone = {}
            if failed:
                # Each failed alone; redo them alone (the agent connects again by itself
                # where a connection broke; a receiver that restarted would be attached
                # again with its new info instead).
                again = sender.send_weights(arg, destinations=sorted(failed))
                redone = {d: repr(x) for d, x in again.items()}
            conn.send(("pushed", {"s": s, "failed": {d: repr(x) for d, x in failed.items()}, "still_failed": redone}))
        else:
            break
    e.close()


def receiver(args, conn, tp, rank, plan_rank):
    cfg = config(args)
    mem = Memory(args.device)
    b, bufs = build(mem, vllm_parts(cfg, tp, rank))
    e = make_agent(args, 0)
    r = WeightReceiver(e, b, sources=TRAIN_TP, rank=plan_rank)
    conn.send(("info", r.info()))
    while True:
        cmd, arg = conn.recv()
        if cmd == "init":
            r.init_transfer_engine(arg)
            conn.send(("ok", None))
        elif cmd == "update":
            r.start_weight_update()
            t = time.monotonic()
            try:
                r.update_weights(arg)
            except xfer.Error as err:
                conn.send(("updated", {"ok": False, "why": f"{type(err).__name__}: {err}"}))
                continue
            v = r.finish_weight_update()
            s = time.monotonic() - t
            bad = next((why for ps, buf in bufs if (why := mem.check(ps, buf, v))), None)
            conn.send(("updated", {"ok": bad is None, "why": bad, "version": v, "s": s, "bytes": sum(mem.nbytes(x) for _, x in bufs)}))
        else:
            break
    r.shutdown()
    e.close()


def config(args):
    cfg = dict(CONFIGS[args.model])
    if args.layers is not None:
        cfg["layers"] = args.layers
    return cfg


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(CONFIGS), default="llama3-8b")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the config's")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--transport", default="auto", help="auto (cuda-ipc between GPU processes of one host, tcp otherwise), tcp, cuda-ipc")
    ap.add_argument("--rails", type=int, default=None)
    ap.add_argument("--versions", type=int, default=2)
    return ap.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    cfg = config(args)
    src, dst = layouts(cfg)
    plan = Plan(src, dst)
    print(
        f"{args.model}, {cfg['layers']} layers: {plan.bytes / 1e9:.2f} GB to move, {plan.segments} segments; "
        f"trainers TP={TRAIN_TP} -> replicas TP={GROUPS}, {args.device} memory, transport {args.transport}",
        flush=True,
    )
    ctx = mp.get_context("spawn")
    procs, conns = [], []

    def start(target, *a):
        mine, theirs = ctx.Pipe()
        p = ctx.Process(target=target, args=(args, theirs, *a))
        p.start()
        procs.append(p)
        conns.append(mine)
        return mine

    trainers = [start(trainer, r) for r in range(TRAIN_TP)]
    receivers = []
    rank = 0
    for tp in GROUPS:
        for r in range(tp):
            receivers.append(start(receiver, tp, r, rank))
            rank += 1
    ok = True
    try:
        t_infos = [c.recv()[1] for c in trainers]
        r_infos = [c.recv()[1] for c in receivers]
        for c in trainers:
            c.send(("attach", r_infos))
            c.recv()
        for c in receivers:
            c.send(("init", {}))
            c.recv()
        for v in range(1, args.versions + 1):
            for c in receivers:
                c.send(("update", {"version": v}))
            for c in trainers:
                c.send(("push", v))
            pushed = [c.recv()[1] for c in trainers]
            updated = [c.recv()[1] for c in receivers]
            s = max(p["s"] for p in pushed)
            good = all(not p["still_failed"] for p in pushed) and all(u["ok"] for u in updated)
            for i, p in enumerate(pushed):
                for d, why in p["failed"].items():
                    print(f"version {v}: trainer {i} -> receiver {d} failed alone ({why}); redone: {d not in p['still_failed']}", flush=True)
            ok &= good
            print(f"version {v}: pushed in {s:.3f} s ({plan.bytes * 8 / s / 1e9:.2f} Gbps), every byte of {len(updated)} receivers checked: {good}", flush=True)
            if not good:
                print({"pushed": pushed, "updated": updated}, file=sys.stderr)
        # A new replica (TP=1) joins and pulls the current version: the trainers do nothing.
        joiner = start(receiver, 1, 0, None)
        joiner.recv()
        joiner.send(("init", {"sources": t_infos}))
        joiner.recv()
        joiner.send(("update", {"version": None, "mode": "pull"}))
        u = joiner.recv()[1]
        ok &= u["ok"] and u["version"] == args.versions
        print(f"a joiner pulled version {u.get('version')} in {u.get('s', 0):.3f} s, every byte checked: {u['ok']} {u.get('why') or ''}", flush=True)
    finally:
        for c in conns:
            try:
                c.send(("exit", None))
            except (BrokenPipeError, OSError):
                pass
        for p in procs:
            p.join(timeout=60)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
