//! The progress line, in the reference program's spirit, drawn by `indicatif` on stderr
//! when it is a terminal (never in JSON mode):
//! `[5s] WRITE  67% 4.3 GiB/6.4 GiB, ops=70000, bw=18.2 Gbps, 0.35 Mpps`.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::time::Duration;

/// The progress line of a run.
pub struct Progress {
    bar: ProgressBar,
    /// The rails' NICs when there are several (per-NIC rates join the line).
    nics: Vec<String>,
    /// The last rates line, to which the per-NIC rates are added.
    rates: String,
}

impl Progress {
    /// A progress line on stderr (drawn only on a terminal); `quiet` turns it off.
    pub fn new(quiet: bool) -> Progress {
        let bar = if quiet {
            ProgressBar::hidden()
        } else {
            ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr())
        };
        let style = ProgressStyle::with_template(
            "[{elapsed}] WRITE {percent:>3}% {binary_bytes}/{binary_total_bytes}, {msg}",
        )
        .expect("the template is valid");
        bar.set_style(style);
        Progress {
            bar,
            nics: Vec::new(),
            rates: String::new(),
        }
    }

    /// Names the run's operation (`write`, `read`) at the head of the line.
    pub fn label(self, op: &str) -> Progress {
        let template = format!(
            "[{{elapsed}}] {} {{percent:>3}}% {{binary_bytes}}/{{binary_total_bytes}}, {{msg}}",
            op.to_uppercase()
        );
        if let Ok(style) = ProgressStyle::with_template(&template) {
            self.bar.set_style(style);
        }
        self
    }

    pub(crate) fn start(&mut self, total: u64) {
        self.bar.set_length(total.max(1));
        self.bar.set_position(0);
        self.bar.reset_elapsed();
    }

    pub(crate) fn update(&mut self, t: Duration, bytes: u64, ops: u64) {
        self.bar.set_position(bytes);
        self.rates = rates(t, bytes, ops);
        self.bar.set_message(self.rates.clone());
    }

    /// Shows per-NIC rates from now on when `group`'s rails run on more than one NIC.
    pub(crate) fn per_nic(&mut self, group: &fabric_core::engine::RailGroup) {
        let mut names: Vec<String> = group.rail_nics().iter().flatten().cloned().collect();
        names.sort();
        names.dedup();
        if names.len() > 1 {
            self.nics = names;
        }
    }

    /// Adds each NIC's rate since `before` (the rails' counters at the start) to the line.
    pub(crate) fn update_nics(
        &mut self,
        group: &fabric_core::engine::RailGroup,
        before: &[fabric_core::engine::CounterSnapshot],
        t: Duration,
    ) {
        if self.nics.is_empty() || self.bar.is_hidden() {
            return;
        }
        let s = t.as_secs_f64().max(1e-9);
        let mut per: Vec<(String, u64)> = self.nics.iter().map(|n| (n.clone(), 0)).collect();
        for ((c, b), nic) in group
            .rail_counters()
            .iter()
            .zip(before)
            .zip(group.rail_nics())
        {
            if let Some(slot) = per.iter_mut().find(|(n, _)| Some(n) == nic.as_ref()) {
                slot.1 += c.bytes - b.bytes;
            }
        }
        let nics: Vec<String> = per
            .iter()
            .map(|(n, b)| format!("{n} {:.1}", *b as f64 * 8.0 / s / 1e9))
            .collect();
        self.bar
            .set_message(format!("{} [{} Gbps]", self.rates, nics.join(", ")));
    }

    pub(crate) fn finish(&mut self, t: Duration, bytes: u64, ops: u64) {
        self.update(t, bytes, ops);
        self.bar.finish();
        // The line stays; what follows (the summary, on stdout) starts below it.
        if !self.bar.is_hidden() {
            eprintln!();
        }
    }
}

/// `ops=.., bw=.. Gbps, .. Mpps` after `t`.
fn rates(t: Duration, bytes: u64, ops: u64) -> String {
    let s = t.as_secs_f64().max(1e-9);
    format!(
        "ops={ops}, bw={:.1} Gbps, {:.2} Mpps",
        bytes as f64 * 8.0 / s / 1e9,
        ops as f64 / s / 1e6
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_are_in_gbps_and_mpps() {
        assert_eq!(
            rates(Duration::from_secs(2), 5_000_000_000, 1_000_000),
            "ops=1000000, bw=20.0 Gbps, 0.50 Mpps"
        );
    }
}
