//! Puts the commit the binary is built from into `xfer --version` ("0.1.0 (a963924)"), so
//! that a figure taken with a binary carried elsewhere names its commit. Outside xfer's own
//! git checkout (or without git) the version is the crate's alone. The build script runs again
//! when HEAD, the branch it points to or the packed refs change.

use std::process::Command;

/// `git` with `args` in this crate's folder: its trimmed output, or `None`.
fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status.success().then_some(())?;
    let s = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (!s.is_empty()).then_some(s)
}

fn main() {
    let version = env!("CARGO_PKG_VERSION");
    println!("cargo:rerun-if-changed=build.rs");
    // Only xfer's own checkout: a copy of the crate inside another repository (vendored)
    // would otherwise report that repository's commit.
    let real = |p: &std::path::Path| std::fs::canonicalize(p).ok();
    let ours = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .and_then(real);
    let top = git(&["rev-parse", "--show-toplevel"]).and_then(|t| real(t.as_ref()));
    if top.is_none() || top != ours {
        println!("cargo:rustc-env=XFER_VERSION={version}");
        return;
    }
    let mut watch = vec!["HEAD".to_string(), "packed-refs".to_string()];
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watch.push(branch);
    }
    for file in watch {
        // Only files that exist: cargo runs a script whose watched path is missing each time.
        if let Some(path) = git(&["rev-parse", "--git-path", &file])
            && std::path::Path::new(&path).exists()
        {
            println!("cargo:rerun-if-changed={path}");
        }
    }
    let full = match git(&["rev-parse", "--short=7", "HEAD"]) {
        Some(commit) => format!("{version} ({commit})"),
        None => version.to_string(),
    };
    println!("cargo:rustc-env=XFER_VERSION={full}");
}
