//! The token from a file (`--auth-token-file`, `XFER_AUTH_TOKEN_FILE`) and
//! `--require-auth`: a server and a bench that share a token file talk; without it the
//! bench is refused; an unreadable file, both a token and a file, or a server beyond
//! loopback without a token under `--require-auth` fail to start, saying why.

mod common;

use common::{Server, serve_on_loopback, xfer};
use std::io::Write;
use std::path::PathBuf;

/// A file of this test's own holding `contents`.
fn token_file(name: &str, contents: &[u8]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("xfer-cli-auth-file-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::File::create(&path)
        .unwrap()
        .write_all(contents)
        .unwrap();
    path
}

fn bench(peer: &str) -> std::process::Command {
    let mut c = xfer();
    c.args([
        "bench",
        "--peer",
        peer,
        "--page-size",
        "4KiB",
        "--pages",
        "16",
        "--bytes",
        "1MiB",
        "--region-size",
        "8MiB",
        "--pin",
        "off",
        "--json",
    ])
    .env_remove("XFER_AUTH_TOKEN")
    .env_remove("XFER_AUTH_TOKEN_FILE");
    c
}

#[test]
fn a_server_and_a_bench_that_share_a_token_file_talk_and_others_are_refused() {
    let file = token_file("shared", b"t0ken\n");
    let mut serve = serve_on_loopback("8MiB", &["--auth-token-file", file.to_str().unwrap()]);
    serve
        .env_remove("XFER_AUTH_TOKEN")
        .env_remove("XFER_AUTH_TOKEN_FILE");
    let server = Server::spawn(serve);
    let out = bench(&server.peer)
        .env("XFER_AUTH_TOKEN_FILE", &file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "bench with the token file: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The same token by value (the file's newline trimmed) passes too.
    let out = bench(&server.peer)
        .args(["--auth-token", "t0ken"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = bench(&server.peer).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("authentication failed"), "{err}");
    assert!(
        !err.contains("t0ken"),
        "the token must never be printed: {err}"
    );
}

#[test]
fn bad_token_files_and_unprotected_listeners_under_require_auth_fail_to_start() {
    let missing = std::env::temp_dir().join("xfer-cli-auth-file-no-such-file");
    let out = bench("xfer://127.0.0.1:9")
        .args(["--auth-token-file", missing.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot read the auth token file"), "{err}");

    let empty = token_file("empty", b"\n");
    let out = bench("xfer://127.0.0.1:9")
        .args(["--auth-token-file", empty.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("is empty"), "{err}");

    let out = bench("xfer://127.0.0.1:9")
        .args([
            "--auth-token",
            "a",
            "--auth-token-file",
            empty.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "a usage error");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot be used with"), "{err}");

    let out = xfer()
        .args([
            "serve",
            "--listen",
            "0.0.0.0:0",
            "--region-size",
            "1MiB",
            "--pin",
            "off",
            "--require-auth",
        ])
        .env_remove("XFER_AUTH_TOKEN")
        .env_remove("XFER_AUTH_TOKEN_FILE")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not loopback"), "{err}");
}
