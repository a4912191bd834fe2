#!/usr/bin/env python3
"""Runs a command and samples every thread of it from /proc every 10 ms; prints the
command's last 3000 characters of output, then per thread that ran at least 50 ms: its
name, when it was first and last seen, its run time and run-queue delay
(/proc/PID/task/TID/schedstat; where the kernel accounts interrupt time apart, softirq
work done on a thread's core is missing from its run time and shows as delay), voluntary
and involuntary context switches, and the CPUs it was last seen on (samples each).

    scripts/thread-cpu.py target/release/xfer demo --transport tcp --page-size 64KiB \
        --rails 1 --bytes 16GiB --baseline

Threads of `xfer demo`: the engine's rails are named `xfer-<transport>-<worker>-<rail>`
(one per end); the raw streams of `--baseline` are unnamed (`xfer`), a writer and a reader
per stream, one phase after another (contiguous, cache-hot, pages). A writer is the thread of
a pair that seldom sleeps (few voluntary switches)."""
import os, subprocess, sys, time, collections
p = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE)
t0 = time.monotonic()
th = {}
def sample():
    now = time.monotonic() - t0
    try:
        tids = os.listdir(f"/proc/{p.pid}/task")
    except FileNotFoundError:
        return
    for tid in tids:
        d = f"/proc/{p.pid}/task/{tid}"
        try:
            comm = open(d + "/comm").read().strip()
            ss = list(map(int, open(d + "/schedstat").read().split()))
            st = open(d + "/stat").read()
            cpu = int(st[st.rindex(")") + 2:].split()[36])
            vol = nvol = 0
            for l in open(d + "/status"):
                if l.startswith("voluntary_ctxt_switches"): vol = int(l.split()[1])
                if l.startswith("nonvoluntary_ctxt_switches"): nvol = int(l.split()[1])
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
        e = th.setdefault(tid, {"comm": comm, "first": now, "cpus": collections.Counter()})
        e.update(comm=comm, last=now, run=ss[0], wait=ss[1], vol=vol, nvol=nvol)
        e["cpus"][cpu] += 1
while p.poll() is None:
    sample()
    time.sleep(0.01)
out = p.stdout.read().decode()
sys.stdout.write(out[-3000:])
for tid, e in sorted(th.items(), key=lambda kv: kv[1]["first"]):
    life = e["last"] - e["first"]
    if e["run"] < 50e6:
        continue
    cpus = ",".join(f"{c}:{n}" for c, n in e["cpus"].most_common(4))
    print(f"tid {tid:>7} {e['comm']:<16} {e['first']:6.2f}-{e['last']:6.2f}s run {e['run']/1e9:6.3f}s "
          f"({e['run']/1e9/max(life,1e-9):4.0%}) delay {e['wait']/1e9:5.3f}s vol {e['vol']:>7} nvol {e['nvol']:>6} cpus {cpus}")
sys.exit(p.returncode)
