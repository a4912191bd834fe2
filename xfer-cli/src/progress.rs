//! The progress line, in the reference program's spirit:
//! `[5.398s] WRITE: 100%, ops=.., bytes=.., bw=18.2Gbps, 0.35Mpps`.

use std::io::{IsTerminal, Write};
use std::time::Duration;

/// Prints a progress line on stderr when it is a terminal (never in JSON mode).
pub struct Progress {
    enabled: bool,
    total: u64,
    last: Duration,
}

impl Progress {
    /// A progress printer; `quiet` turns it off.
    pub fn new(quiet: bool) -> Progress {
        Progress {
            enabled: !quiet && std::io::stderr().is_terminal(),
            total: 0,
            last: Duration::ZERO,
        }
    }

    pub(crate) fn start(&mut self, total: u64) {
        self.total = total.max(1);
        self.last = Duration::ZERO;
    }

    fn line(&self, t: Duration, bytes: u64, ops: u64) -> String {
        let s = t.as_secs_f64().max(1e-9);
        format!(
            "[{:.3}s] WRITE: {:>3}%, ops={}, bytes={}, bw={:.1}Gbps, {:.2}Mpps",
            s,
            (bytes * 100 / self.total).min(100),
            ops,
            bytes,
            bytes as f64 * 8.0 / s / 1e9,
            ops as f64 / s / 1e6
        )
    }

    pub(crate) fn update(&mut self, t: Duration, bytes: u64, ops: u64) {
        if self.enabled && t >= self.last + Duration::from_millis(200) {
            self.last = t;
            eprint!("\r{}", self.line(t, bytes, ops));
            let _ = std::io::stderr().flush();
        }
    }

    pub(crate) fn finish(&mut self, t: Duration, bytes: u64, ops: u64) {
        if self.enabled {
            eprintln!("\r{}", self.line(t, bytes, ops));
        }
    }
}
