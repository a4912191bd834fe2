//! `xfer` on a machine without libfabric: tcp (and everything but efa) works, and
//! `--transport efa` fails with one line that names where libfabric was looked for and how
//! to install it.
//!
//! The machine is made libfabric-less in a private mount namespace (`unshare --mount`):
//! every `libfabric.so*` the loader knows (ld.so cache, the loaded library's file, AWS's
//! `/opt/amazon/efa`) is covered by a bind mount of `/dev/null` (an empty directory for
//! `/opt/amazon/efa`), so `dlopen` finds nothing it can load. That needs root: elsewhere
//! the test prints `skipped: ...` and passes, unless `XFER_REQUIRE_NETNS=1` (CI sets it) or
//! root, as the namespace tests do.

#[path = "../../transport-tcp/tests/netns/mod.rs"]
mod netns;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Every libfabric file this machine's loader could find.
fn libfabric_files() -> BTreeSet<PathBuf> {
    let mut files = BTreeSet::new();
    if let Ok(out) = Command::new("ldconfig").arg("-p").output() {
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            if let Some((name, path)) = line.split_once("=>")
                && name.trim_start().starts_with("libfabric.so")
                && let Ok(real) = std::fs::canonicalize(path.trim())
            {
                files.insert(real);
            }
        }
    }
    if let Ok(lib) = transport_efa::library()
        && let Some(real) = lib.resolved
    {
        files.insert(PathBuf::from(real));
    }
    files
}

#[test]
fn without_libfabric_tcp_works_and_efa_says_how_to_install_it() {
    if euid() != 0 {
        netns::skip("needs root for a private mount namespace");
        return;
    }
    let mut script = String::from("set -e\n");
    for f in libfabric_files() {
        script.push_str(&format!("mount --bind /dev/null '{}'\n", f.display()));
    }
    if Path::new("/opt/amazon/efa").is_dir() {
        script.push_str("mount -t tmpfs none /opt/amazon/efa\n");
    }
    let xfer = env!("CARGO_BIN_EXE_xfer");
    script.push_str(&format!(
        "'{xfer}' demo --transport tcp --bytes 16MiB --json > \"$OUT/tcp.json\"\n\
         '{xfer}' info > \"$OUT/info.txt\"\n\
         set +e\n\
         '{xfer}' demo --transport efa --provider tcp --bytes 1MiB 2> \"$OUT/efa.err\"\n\
         echo $? > \"$OUT/efa.rc\"\n"
    ));
    let out = tempdir();
    let run = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", &script])
        .env("OUT", &out)
        .env_remove("XFER_LIBFABRIC")
        .env_remove("LD_LIBRARY_PATH")
        .env_remove("RUST_LOG")
        .env("HWLOC_LIBXML_IMPORT", "0")
        .output()
        .expect("unshare runs");
    if !run.status.success() {
        let err = String::from_utf8_lossy(&run.stderr);
        if err.contains("unshare failed") || err.contains("Operation not permitted") {
            netns::skip(&format!("no private mount namespace here: {err}"));
            return;
        }
        panic!("the libfabric-less run failed: {err}");
    }
    let read = |name: &str| std::fs::read_to_string(out.join(name)).unwrap_or_default();

    let tcp: serde_json::Value = serde_json::from_str(&read("tcp.json")).expect("tcp JSON");
    assert_eq!(tcp["verified"], true, "{tcp}");

    let info = read("info.txt");
    assert!(info.contains("libfabric: not loaded"), "{info}");
    assert!(info.contains("libfabric not found"), "{info}");

    let rc = read("efa.rc");
    assert_ne!(rc.trim(), "0", "efa must fail without libfabric");
    let err = read("efa.err");
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line, not {err:?}");
    let line = lines[0];
    assert!(line.contains("libfabric not found"), "{line}");
    assert!(line.contains("libfabric.so.1"), "{line}");
    assert!(
        line.contains("/opt/amazon/efa/lib64/libfabric.so.1"),
        "{line}"
    );
    assert!(line.contains("apt-get install libfabric1"), "{line}");
    assert!(line.contains("XFER_LIBFABRIC"), "{line}");
}

/// The effective user id (root can make mount namespaces).
fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// A fresh directory for the namespace's output files.
fn tempdir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("xfer-no-libfabric-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}
