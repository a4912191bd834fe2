"""xfer.Directory: agents publish themselves and their regions, peers find them by name
and write to them; watches report joins and leaves. Runs against a directory file, and
against a real etcd when Debian's etcd is on PATH (required under XFER_REQUIRE_ETCD=1)."""

import time

import numpy as np
import pytest

import xfer

from conftest import free_port, pattern


@pytest.fixture(params=["file", "etcd"])
def url(request, tmp_path):
    if request.param == "file":
        return f"file://{tmp_path / 'members.json'}"
    return request.getfixturevalue("etcd_url")


def test_members_find_each_other_by_name_and_write(url):
    d = xfer.Directory(url, cluster="kv")
    with xfer.Agent(transport="tcp") as a, xfer.Agent(transport="tcp") as b:
        dst = np.zeros(1 << 20, dtype=np.uint8)
        rd = b.register(dst)
        w = d.watch()
        pub = d.publish("decode-0", b, regions={"kv": rd}, ttl=5)
        kind, m = w.next(timeout=10)
        assert (kind, m["name"]) == ("joined", "decode-0")
        found = d.lookup("decode-0")
        assert found["transport"] == "tcp" and found["regions"]["kv"] == rd.descriptor
        assert [x["name"] for x in d.members()] == ["decode-0"]
        assert d.lookup("nobody") is None
        src = pattern(1 << 20, 3)
        rs = a.register(src, remote_write=False)
        p = a.connect(found["address"])
        a.write_pages(p, rs, found["regions"]["kv"], [0, 1], [1, 0], 512 << 10).wait(10)
        assert (dst[: 512 << 10] == src[512 << 10:]).all()
        pub.withdraw()
        kind, m = w.next(timeout=10)
        assert (kind, m["name"]) == ("left", "decode-0")
        assert d.lookup("decode-0") is None


def test_bad_urls_and_an_unreachable_etcd_raise_directory_error():
    with pytest.raises(xfer.DirectoryError, match="expected etcd://"):
        xfer.Directory("http://x")
    port = free_port()
    t = time.monotonic()
    with pytest.raises(xfer.DirectoryError, match=f"127.0.0.1:{port}.*unreachable"):
        xfer.Directory(f"etcd://127.0.0.1:{port}")
    assert time.monotonic() - t < 10
    with pytest.raises(xfer.DirectoryError, match="cluster name"):
        xfer.Directory("file:///tmp/x.json", cluster="a/b")
