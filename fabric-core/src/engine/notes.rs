//! [`Notifications`]: peers' immediate data on a set of engines (a rail group's rails, or
//! every rail of several groups), counted per value so that each waiter takes its own.

use super::rails::WARM_UP_IMM;
use super::{Engine, Event};
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Immediate data arriving on any of a set of engines. Values are counted as they are
/// taken from the engines' event queues, and a waiter takes only its own value's count;
/// warm-up writes ([`WARM_UP_IMM`]) are never reported. Only one `Notifications` should
/// read a given engine's events: two would split them.
pub struct Notifications {
    engines: Vec<Arc<Engine>>,
    stash: Mutex<HashMap<u32, u64>>,
}

impl Notifications {
    /// Notifications of `engines`.
    pub fn new(engines: Vec<Arc<Engine>>) -> Notifications {
        Notifications {
            engines,
            stash: Mutex::new(HashMap::new()),
        }
    }

    /// Waits until `count` transfers carrying immediate value `imm` have landed (on any
    /// engine), or `timeout` passes. Other values seen meanwhile are kept for their own
    /// waiters.
    pub fn wait_imm(&self, imm: u32, count: u64, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            {
                let mut stash = self.stash.lock().unwrap_or_else(|p| p.into_inner());
                let have = stash.get(&imm).copied().unwrap_or(0);
                if have >= count {
                    if have == count {
                        stash.remove(&imm);
                    } else {
                        stash.insert(imm, have - count);
                    }
                    return Ok(());
                }
                for e in &self.engines {
                    while let Ok(ev) = e.events().try_recv() {
                        if let Some(v) = ev.imm().filter(|&v| v != WARM_UP_IMM) {
                            *stash.entry(v).or_default() += 1;
                        }
                    }
                }
                if stash.get(&imm).copied().unwrap_or(0) >= count {
                    continue;
                }
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::TimedOut(timeout, "immediate data"));
            }
            let mut sel = crossbeam_channel::Select::new();
            for e in &self.engines {
                sel.recv(e.events());
            }
            // Wakes on any engine's event; the loop drains it above.
            let _ = sel.ready_timeout(deadline - now);
        }
    }

    /// The next event from any engine (warm-up notifications excepted), waiting at most
    /// `timeout`.
    pub fn next_event(&self, timeout: Duration) -> Result<Event> {
        let deadline = Instant::now() + timeout;
        loop {
            let mut sel = crossbeam_channel::Select::new();
            for e in &self.engines {
                sel.recv(e.events());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let ev = match sel.select_timeout(left) {
                Ok(op) => {
                    let i = op.index();
                    op.recv(self.engines[i].events())
                        .map_err(|_| Error::EngineStopped)?
                }
                Err(_) => return Err(Error::TimedOut(timeout, "an event")),
            };
            if ev.imm() != Some(WARM_UP_IMM) {
                return Ok(ev);
            }
        }
    }
}

impl std::fmt::Debug for Notifications {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Notifications")
            .field("engines", &self.engines.len())
            .finish()
    }
}
