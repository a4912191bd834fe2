"""The other process of test_kv.py's tests over tcp: every rank of one side of a case of
kvcases.py, each with an Agent of its own. Prints {"infos": [hex, ...]} (its ranks'
Rank.info), then follows commands read from stdin, one JSON line each, answering
{"ok": true} or {"ok": false, "why": ...}:

  {"attach": [hex, ...]}                      attaches every rank to the other side's
  {"fill": {"seed": S}}                       prefill: writes the request's logical cache
  {"push": {"id": ID, "seed": S}}             prefill: pushes the request layer by layer
                                              and waits for its transfers
  {"landed": {"id": ID, "seed": S}}           decode: waits for the request, checks bytes
  {"pull": {"id": ID, "seed": S}}             decode: pulls, waits, checks bytes
  {"read": {"id": ID, "seed": S}}             prefill: waits until the readers are done
  {"exit": true}
"""

import argparse
import json
import sys

import kvcases

import xfer
from xfer import kv


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", required=True)
    ap.add_argument("--side", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--transport", default="tcp")
    args = ap.parse_args()
    pre, dec = kvcases.layouts(args.case, "prefill"), kvcases.layouts(args.case, "decode")
    caches = kvcases.side_caches(args.case, args.side, args.device)
    extra = {"memory": "cuda"} if args.device != "cpu" else {}
    agents, ranks = [], []
    for r, c in enumerate(caches):
        e = xfer.Agent(transport=args.transport, timeout=3.0, name=f"{args.side}-{r}", **extra)
        agents.append(e)
        ranks.append(kv.Rank(e, args.side, r, c.cache().regions, pre, dec))
    print(json.dumps({"infos": [r.info().hex() for r in ranks]}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("exit"):
            break
        try:
            why = run(cmd, args, caches, ranks)
        except xfer.Error as e:
            why = f"{type(e).__name__}: {e}"
        print(json.dumps({"ok": why is None, "why": why}), flush=True)
    for e in agents:
        e.close()


def run(cmd, args, caches, ranks):
    if "attach" in cmd:
        for r in ranks:
            for i in cmd["attach"]:
                r.attach(bytes.fromhex(i))
        return None
    (what, a), = cmd.items()
    n, pt, dt = kvcases.request(args.case, a["seed"])
    logical = kvcases.logical_cache(args.case, n, a["seed"])
    req = kv.Request(n, pt, dt)
    if what == "fill":
        for c in caches:
            c.put(c.phys, pt, n, logical)
            c.upload()
        return None
    if what == "push":
        ts = []
        for r in ranks:
            p = r.plan(req)
            t = r.push_layer(a["id"], p, 0)
            for layer in range(1, r.layers):
                t.extend(r.push_layer(a["id"], p, layer))
            ts.append(t)
        for t in ts:
            t.wait(30)
        return None
    if what == "read":
        for r in ranks:
            if r.plan(req).sends(r.rank):
                r.wait(a["id"], 30)
        return None
    if what == "pull":
        for c in caches:  # what a push left must not pass for the pull's bytes
            for arr in c.phys:
                arr[...] = 0
            c.upload()
        ts = [r.pull(a["id"], r.plan(req)) for r in ranks]
        for t in ts:
            t.wait(30)
    elif what == "landed":
        for r in ranks:
            r.wait(a["id"], 30)
    bad = [f"rank {i}: {w}" for i, c in enumerate(caches) if (w := kvcases.decode_matches(c, dt, n, logical))]
    return "; ".join(bad) or None


if __name__ == "__main__":
    main()
