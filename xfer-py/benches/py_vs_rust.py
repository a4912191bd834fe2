"""Python against Rust, on the same transfers in the same run (a benchmark, not a test).

1. Throughput: `write_pages` of 1000 random pages of 64 KiB between two tcp agents of
   this process (regions of 256 MiB), 4 transfers in flight, against `xfer demo` with the
   same workload (`--transport tcp --pages 1000 --page-size 64KiB --depth 4`).
2. Per-call overhead: one-page writes (4 KiB), one at a time, each timed from the Python
   call to its completion (`write(...).wait()`), against the same loop through the Rust
   API (`examples/one_page_rust.rs`: `Agent::submit` + `wait` on agents built from the same
   options as the Python agents), over tcp and over the in-process mem transport (no
   network: the engine's and the binding's own cost). Every side runs its workers unpinned
   (`xfer demo --pin off`, `pin="off"`), so that they compare like for like. `xfer demo --latency` is not the reference here:
   its transfers carry immediate data and it times the target's event too.

Each figure is the median of --runs runs (>= 3), alternating Rust and Python runs.

    cargo build --release -p xfer-cli && cargo build --release -p xfer-py --example one_page_rust
    python xfer-py/benches/py_vs_rust.py --xfer target/release/xfer \
        --rust-one-page target/release/examples/one_page_rust

Build the package with a release profile first (`pip install ./xfer-py`, or
`maturin develop --release`): a debug build measures the debug build.
"""

import argparse
import json
import statistics
import subprocess
import time

import numpy as np

import xfer

PAGE = 64 << 10


def demo(xfer_bin, transport, *args):
    out = subprocess.run(
        [xfer_bin, "demo", "--transport", transport, "--pin", "off", "--json", *args],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def find(obj, key):
    """The first value of `key` anywhere in a JSON object."""
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        obj = list(obj.values())
    if isinstance(obj, list):
        for v in obj:
            r = find(v, key)
            if r is not None:
                return r
    return None


class Pair:
    """Two tcp agents of this process and a region on each."""

    def __init__(self, region, transport="tcp", rails=1):
        self.a = xfer.Agent(transport=transport, rails=rails, pin="off")
        self.b = xfer.Agent(transport=transport, rails=rails, pin="off")
        self.peer = self.a.connect(self.b.info)
        self.src = np.random.default_rng(1).integers(0, 256, region, dtype=np.uint8)
        self.dst = np.zeros(region, dtype=np.uint8)
        self.rs = self.a.register(self.src, remote_write=False)
        self.rd = self.b.register(self.dst)
        self.desc = self.rd.descriptor

    def close(self):
        self.a.close()
        self.b.close()


def py_throughput(pair, total, pages=1000, depth=4, seed=1):
    region_pages = pair.src.nbytes // PAGE
    rng = np.random.default_rng(seed)
    n = max(1, total // (pages * PAGE))
    plans = [
        (rng.choice(region_pages, pages, replace=False), rng.choice(region_pages, pages, replace=False))
        for _ in range(min(n, 64))
    ]
    # Warm-up: one transfer.
    sp, dp = plans[0]
    pair.a.write_pages(pair.peer, pair.rs, pair.desc, sp, dp, PAGE).wait(timeout=60)
    inflight = []
    moved = 0
    t0 = time.perf_counter()
    for i in range(n):
        if len(inflight) >= depth:
            moved += inflight.pop(0).wait(timeout=60)
        sp, dp = plans[i % len(plans)]
        inflight.append(pair.a.write_pages(pair.peer, pair.rs, pair.desc, sp, dp, PAGE))
    for h in inflight:
        moved += h.wait(timeout=60)
    secs = time.perf_counter() - t0
    return moved * 8 / secs / 1e9


def py_latency(pair, samples, page=4096):
    write = pair.a.write
    segs = [(0, 0, page)]
    for _ in range(200):  # warm-up
        write(pair.peer, pair.rs, pair.desc, segs).wait(timeout=10)
    times = []
    for _ in range(samples):
        t0 = time.perf_counter_ns()
        write(pair.peer, pair.rs, pair.desc, segs).wait(timeout=10)
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--xfer", default="target/release/xfer", help="the xfer binary")
    ap.add_argument("--rust-one-page", default="target/release/examples/one_page_rust",
                    help="the Rust per-call loop (examples/one_page_rust.rs)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--bytes", type=int, default=4 << 30, help="bytes per throughput run")
    ap.add_argument("--samples", type=int, default=20000, help="one-page writes per latency run")
    args = ap.parse_args()
    region = 256 << 20
    gb = f"{args.bytes // (1 << 20)}MiB"
    rust_gbps, py_gbps = [], []
    rust_us = {"tcp": [], "mem": []}
    py_us = {"tcp": [], "mem": []}
    pairs = {"tcp": Pair(region, "tcp"), "mem": Pair(1 << 20, "mem")}
    try:
        for r in range(max(3, args.runs)):
            j = demo(args.xfer, "tcp", "--pages", "1000", "--page-size", "64KiB", "--depth", "4",
                     "--bytes", gb, "--region-size", "256MiB", "--no-verify", "--seed", str(r + 1))
            rust_gbps.append(find(j, "gbps"))
            py_gbps.append(py_throughput(pairs["tcp"], args.bytes, seed=r + 1))
            for t in ("tcp", "mem"):
                out = subprocess.run([args.rust_one_page, t, str(args.samples)], check=True,
                                     capture_output=True, text=True).stdout
                rust_us[t].append(json.loads(out.strip().splitlines()[-1])["p50_us"])
                py_us[t].append(py_latency(pairs[t], args.samples))
            print(
                f"run {r + 1}: tcp throughput rust {rust_gbps[-1]:.2f} Gbps, python {py_gbps[-1]:.2f} Gbps; "
                f"one-page write p50 tcp rust {rust_us['tcp'][-1]:.1f} us, python {py_us['tcp'][-1]:.1f} us; "
                f"mem rust {rust_us['mem'][-1]:.1f} us, python {py_us['mem'][-1]:.1f} us",
                flush=True,
            )
    finally:
        for p in pairs.values():
            p.close()
    rg, pg = statistics.median(rust_gbps), statistics.median(py_gbps)
    lat = {
        t: {
            "rust_api": statistics.median(rust_us[t]),
            "python": statistics.median(py_us[t]),
            "overhead_us": statistics.median(py_us[t]) - statistics.median(rust_us[t]),
        }
        for t in rust_us
    }
    print(
        json.dumps(
            {
                "throughput_gbps_tcp": {"rust_demo": rg, "python": pg, "ratio": pg / rg},
                "one_page_write_p50_us": lat,
                "runs": len(rust_gbps),
                "targets": {"ratio_min": 0.95, "overhead_max_us": 5.0},
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
