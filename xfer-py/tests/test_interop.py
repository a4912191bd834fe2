"""A Python agent and a Rust agent (the `xfer` crate's `peer` example) in two processes
meet by name through a real etcd, and through the direct rendezvous without one; each
writes its pattern into the other's region named "inbox" with immediate data 1, and each
checks what landed in its own.

The Rust side is XFER_PEER_BIN, or built here with cargo (`cargo build -p xfer --example
peer`); without either the test is skipped, and fails under CI=true."""

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import xfer

ROOT = Path(__file__).resolve().parents[2]
LEN = 1 << 20
T = 30.0


def pattern(seed):
    """Byte i is (i * 7 + seed) % 251, as the Rust peer computes it."""
    return ((np.arange(LEN, dtype=np.int64) * 7 + seed) % 251).astype(np.uint8)


@pytest.fixture(scope="module")
def peer_bin():
    exe = os.environ.get("XFER_PEER_BIN")
    if exe:
        return exe
    cargo = shutil.which("cargo")
    if cargo is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true but neither XFER_PEER_BIN nor cargo is there")
        pytest.skip("needs the Rust peer: set XFER_PEER_BIN or put cargo on PATH")
    subprocess.run([cargo, "build", "-q", "-p", "xfer", "--example", "peer"], cwd=ROOT,
                   check=True)
    return str(ROOT / "target" / "debug" / "examples" / "peer")


def start(peer_bin, *args):
    return subprocess.Popen([peer_bin, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def why(rust):
    """What the Rust side said on stderr, once it is stopped."""
    rust.kill()
    return rust.stderr.read()


def finish(rust):
    """Waits for the Rust side's "ok", then lets it go; fails with its stderr otherwise."""
    line = rust.stdout.readline().strip()
    rust.stdin.close()
    err = rust.stderr.read()
    code = rust.wait(timeout=T)
    assert (line, code) == ("ok", 0), f"the Rust peer said {line!r}, exit {code}: {err}"


def exchange(agent, peer, theirs_inbox, inbox):
    """Writes our pattern (seed 2) into the peer's inbox with imm 1, waits for its imm 1,
    and checks that ours holds its pattern (seed 1)."""
    src = pattern(2)
    rs = agent.register(src, remote_write=False)
    agent.write(peer, rs, theirs_inbox, [(0, 0, LEN)], imm=1).wait(T)
    agent.wait_imm(1, timeout=T)
    assert (inbox == pattern(1)).all(), "the Rust peer's bytes in our inbox"


def test_python_and_rust_meet_through_etcd_and_write_both_ways(peer_bin, etcd_url):
    d = xfer.Directory(etcd_url, cluster="interop")
    with xfer.Agent(timeout=10.0) as e:
        inbox = np.zeros(LEN, dtype=np.uint8)
        reg = e.register(inbox)
        pub = d.publish("py-0", e, regions={"inbox": reg}, ttl=10)
        rust = start(peer_bin, "etcd", etcd_url, "interop", "rust-0", "py-0")
        try:
            w = d.watch()
            found = None
            while found is None:
                ev = w.next(timeout=T)
                assert ev is not None, "the Rust peer never joined: " + why(rust)
                if ev[0] == "joined" and ev[1]["name"] == "rust-0":
                    found = ev[1]
            peer = e.connect(found["address"])
            assert peer.transport == "tcp"
            exchange(e, peer, found["regions"]["inbox"], inbox)
            finish(rust)
        finally:
            rust.kill()
            pub.withdraw()


def test_python_and_rust_meet_through_the_rendezvous_and_write_both_ways(peer_bin):
    with xfer.Agent(timeout=10.0) as e:
        inbox = np.zeros(LEN, dtype=np.uint8)
        reg = e.register(inbox)  # offered while it is open
        e.offer("inbox", reg)
        server = e.serve("127.0.0.1:0")
        rust = start(peer_bin, "rendezvous")
        try:
            line = rust.stdout.readline().split()
            assert line[:1] == ["listening"], f"{line}: {why(rust)}"
            rust.stdin.write(server.address + "\n")
            rust.stdin.flush()
            peer, regions = e.rendezvous(line[1], timeout=T)
            assert peer.transport == "tcp" and set(regions) == {"inbox"}
            exchange(e, peer, regions["inbox"], inbox)
            finish(rust)
        finally:
            rust.kill()
        server.stop()
        with pytest.raises(xfer.InvalidArgument, match="HOST:PORT"):
            e.rendezvous("no port here")
