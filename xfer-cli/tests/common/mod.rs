//! What the `xfer` binary's test files share: a running `xfer serve`.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

/// A running `xfer serve`, killed on drop.
pub struct Server {
    child: Child,
    /// Its control address, `xfer://HOST:PORT`.
    pub peer: String,
    /// The bench command it printed, less the leading `xfer`.
    pub bench: Vec<String>,
}

impl Server {
    /// Starts `serve` (a command that runs `xfer serve ...`) and reads the line it prints
    /// once its control socket listens: `xfer bench --peer xfer://...`.
    pub fn spawn(mut serve: Command) -> Server {
        let mut child = serve
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("xfer serve starts");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("read the serve line");
        let bench: Vec<String> = line
            .trim()
            .strip_prefix("xfer ")
            .filter(|rest| rest.starts_with("bench --peer "))
            .unwrap_or_else(|| panic!("unexpected first line of xfer serve: {line:?}"))
            .split_whitespace()
            .map(str::to_owned)
            .collect();
        let peer = bench[2].clone();
        assert!(peer.starts_with("xfer://"), "{peer}");
        Server { child, peer, bench }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
