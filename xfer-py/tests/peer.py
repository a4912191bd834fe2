"""The other process of the two-process tests: registers a buffer, prints its agent's
info and the buffer's descriptor as one JSON line, then follows commands read from stdin,
one JSON line each:

  {"expect": {"imm": I, "count": N, "pages": [...], "page_size": S, "seed": K}}
      waits for N transfers with immediate I, checks that page pages[i] of the buffer
      holds page i of pattern(seed), and prints {"ok": true} or {"ok": false, "why": ...}
  {"filled": {"imm": I, "value": V}}
      waits for one transfer with immediate I, then at once reads the buffer on a CUDA
      stream of its own and prints {"filled": N}: how many bytes hold V
  {"exit": true}
"""

import argparse
import json
import sys

import numpy as np

import xfer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--transport", default="tcp")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--bytes", type=int, default=1 << 20)
    ap.add_argument("--provider", default=None)
    args = ap.parse_args()
    extra = {"provider": args.provider} if args.provider else {}
    if args.device == "cuda":
        import torch  # noqa: PLC0415

        buf = torch.zeros(args.bytes, dtype=torch.uint8, device="cuda:0")
        agent = xfer.Agent(transport=args.transport, memory="cuda", gpu=0, timeout=5.0, **extra)
    else:
        buf = np.zeros(args.bytes, dtype=np.uint8)
        agent = xfer.Agent(transport=args.transport, timeout=5.0, **extra)
    reg = agent.register(buf)
    print(json.dumps({"info": agent.info.hex(), "descriptor": reg.descriptor.hex()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("exit"):
            break
        if "filled" in cmd:
            print(json.dumps({"filled": filled(agent, buf, **cmd["filled"])}), flush=True)
            continue
        e = cmd["expect"]
        try:
            agent.wait_imm(e["imm"], count=e["count"], timeout=30)
        except xfer.Error as err:
            print(json.dumps({"ok": False, "why": f"{type(err).__name__}: {err}"}), flush=True)
            continue
        size = e["page_size"]
        got = buf.cpu().numpy() if args.device == "cuda" else buf
        want = np.random.default_rng(e["seed"]).integers(0, 256, size * len(e["pages"]), dtype=np.uint8)
        bad = [
            i
            for i, p in enumerate(e["pages"])
            if not np.array_equal(got[p * size : (p + 1) * size], want[i * size : (i + 1) * size])
        ]
        print(json.dumps({"ok": not bad, "why": f"pages differ: {bad[:8]}"}), flush=True)
    reg.close()
    agent.close()


def filled(agent, buf, imm, value):
    """Bytes of `buf` (a CUDA tensor) holding `value`, read on a stream of this process's
    own right after the transfer with immediate `imm` was reported."""
    import torch  # noqa: PLC0415

    agent.wait_imm(imm, timeout=30)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        count = int((buf == value).sum().item())
    return count


if __name__ == "__main__":
    main()
