//! The library's figures in the Prometheus text exposition format (version 0.0.4): what
//! `xfer serve --metrics` serves over HTTP, and what a program (or Python's
//! `Engine.metrics()`) can hand to its own exporter ([`Agent::metrics`](crate::Agent::metrics),
//! or [`render`] over [`Sources`] of its choosing).
//!
//! Every figure is read from the library at each call
//! ([`RailGroup::stats`](fabric_core::engine::RailGroup::stats), a server's
//! [`ServeStats`]): nothing is counted twice, and reading costs the running transfers
//! nothing but a few relaxed atomic loads. The exposition is written by `prometheus-client`
//! (the Prometheus project's own Rust client: the format's escaping, `_total` suffixes and
//! histogram buckets are its job), through a `Collector` that turns the snapshots into
//! metric families.
//!
//! Names (labels in braces):
//! - per rail (`group`, `rail`, `nic`): `xfer_rail_bytes_total`, `xfer_rail_ops_total`,
//!   `xfer_rail_reposts_total`, `xfer_rail_errors_total`, `xfer_rail_transfers_total`,
//!   `xfer_rail_ops_in_flight`, `xfer_rail_transfers_active`,
//!   `xfer_rail_notifications_total`; what peers did to it: `xfer_rail_received_bytes_total`,
//!   `xfer_rail_received_writes_total`, `xfer_rail_served_read_bytes_total`,
//!   `xfer_rail_refused_requests_total`, `xfer_rail_checksum_mismatches_total`;
//! - per peer of a rail (`group`, `rail`, `peer`, `address`, `passive`, `state`):
//!   `xfer_peer_connections`, and `xfer_peer_last_error` (1, with the error as label `error`);
//! - per group (`group`): `xfer_transfer_latency_seconds` (histogram), `xfer_registered_bytes`,
//!   `xfer_registered_regions`;
//! - the agent's (no labels): `xfer_reconnects_total`, `xfer_reconnect_failures_total`,
//!   `xfer_stale_descriptors_total`, `xfer_stalls_total` (see [`AgentCounters`]);
//! - a rendezvous server's (see [`Sources::set_serve`]): `xfer_serve_clients`,
//!   `xfer_serve_pending_handshakes`, `xfer_serve_region_bytes`,
//!   `xfer_serve_clients_admitted_total`, `xfer_serve_refusals_total` (`reason`),
//!   `xfer_serve_notifications_total`.

use crate::rendezvous::{Refusal, ServeStats};
use fabric_core::engine::{GroupStats, RailGroup};
use fabric_core::stats::{HistogramSnapshot, LATENCY_BUCKETS};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

/// What an agent counts of its peers' connections (see `docs/connections.md`).
#[derive(Debug, Default)]
pub struct AgentCounters {
    /// Connections to a peer made again: after one broke, or for a peer's new incarnation
    /// ([`Agent::update_peer`](crate::Agent::update_peer)).
    pub reconnects: AtomicU64,
    /// Attempts to connect to a peer again that failed.
    pub reconnect_failures: AtomicU64,
    /// Transfers refused because their remote descriptor belongs to another incarnation of
    /// the peer than the one it is now ([`Error::StaleDescriptor`](crate::Error::StaleDescriptor)).
    pub stale_descriptors: AtomicU64,
    /// Waits that reported a transfer stalled ([`Error::PeerStalled`](crate::Error::PeerStalled)):
    /// no progress for its stall timeout while its peer's connection stood.
    pub stalls: AtomicU64,
}

/// What the endpoint reports: rail groups (held weakly: a group that stops drops out),
/// an agent's own counters and, for `serve`, its clients.
#[derive(Debug, Default)]
pub struct Sources {
    groups: Mutex<Vec<(String, Weak<RailGroup>)>>,
    serve: Mutex<Option<Arc<ServeStats>>>,
    agent: Mutex<Option<Arc<AgentCounters>>>,
}

impl Sources {
    /// Reports an agent's counters of its peers' connections.
    pub fn set_agent(&self, counters: Arc<AgentCounters>) {
        *self.agent.lock().unwrap_or_else(|p| p.into_inner()) = Some(counters);
    }

    /// Reports `group` under the label `group=name` while it lives.
    pub fn add_group(&self, name: String, group: &Arc<RailGroup>) {
        let mut g = self.groups.lock().unwrap_or_else(|p| p.into_inner());
        g.retain(|(_, w)| w.strong_count() > 0);
        g.push((name, Arc::downgrade(group)));
    }

    /// Reports the server's clients.
    pub fn set_serve(&self, stats: Arc<ServeStats>) {
        *self.serve.lock().unwrap_or_else(|p| p.into_inner()) = Some(stats);
    }

    fn groups(&self) -> Vec<(String, GroupStats)> {
        let g = self.groups.lock().unwrap_or_else(|p| p.into_inner());
        g.iter()
            .filter_map(|(name, w)| w.upgrade().map(|g| (name.clone(), g.stats())))
            .collect()
    }
}

/// The [`Collector`] that reads [`Sources`] at each scrape.
#[derive(Debug)]
struct Snapshots(Arc<Sources>);

type Labels = Vec<(&'static str, String)>;

/// One metric family: its name, help, type and `(labels, value)` samples.
fn family<M: EncodeMetric>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    kind: MetricType,
    samples: impl IntoIterator<Item = (Labels, M)>,
) -> Result<(), std::fmt::Error> {
    let mut m = enc.encode_descriptor(name, help, None, kind)?;
    for (labels, v) in samples {
        v.encode(m.encode_family(&labels)?)?;
    }
    Ok(())
}

fn counter(v: u64) -> ConstCounter<u64> {
    ConstCounter::new(v)
}

fn gauge(v: u64) -> ConstGauge<i64> {
    ConstGauge::new(i64::try_from(v).unwrap_or(i64::MAX))
}

/// A latency histogram as the exposition wants it: per-bucket counts with upper bounds in
/// seconds (the last one +Inf), the sum in seconds and the count.
struct Latency(HistogramSnapshot);

impl EncodeMetric for Latency {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::MetricEncoder,
    ) -> Result<(), std::fmt::Error> {
        let buckets: Vec<(f64, u64)> = (0..LATENCY_BUCKETS)
            .map(|i| {
                let le =
                    HistogramSnapshot::upper_bound(i).map_or(f64::INFINITY, |d| d.as_secs_f64());
                (le, self.0.buckets[i])
            })
            .collect();
        encoder.encode_histogram::<NoLabelSet>(
            self.0.sum.as_secs_f64(),
            self.0.count,
            &buckets,
            None,
        )
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

impl Collector for Snapshots {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let groups = self.0.groups();
        // (labels of a rail, its figures), for every rail of every group.
        let rails: Vec<(Labels, &fabric_core::engine::EngineStats)> = groups
            .iter()
            .flat_map(|(name, g)| {
                g.rails.iter().enumerate().map(move |(i, r)| {
                    let nic = g.nics.get(i).cloned().flatten().unwrap_or_default();
                    (
                        vec![
                            ("group", name.clone()),
                            ("rail", i.to_string()),
                            ("nic", nic),
                        ],
                        r,
                    )
                })
            })
            .collect();
        type Field = fn(&fabric_core::engine::EngineStats) -> u64;
        let counters: [(&str, &str, Field); 6] = [
            (
                "xfer_rail_bytes",
                "Bytes of operations this rail initiated that completed (WRITEs placed at the peer, READs placed here).",
                |r| r.counters.bytes,
            ),
            ("xfer_rail_ops", "Operations this rail posted.", |r| {
                r.counters.ops
            }),
            (
                "xfer_rail_reposts",
                "Posts the transport refused for lack of room, posted again later.",
                |r| r.counters.reposts,
            ),
            ("xfer_rail_errors", "Operations that failed.", |r| {
                r.counters.errors
            }),
            (
                "xfer_rail_transfers",
                "Transfers (chunks of a group's transfers) this rail finished, either way.",
                |r| r.counters.transfers,
            ),
            (
                "xfer_rail_notifications",
                "Peers' immediate data that arrived on this rail (counted, never dropped).",
                |r| r.counters.notifications,
            ),
        ];
        for (name, help, f) in counters {
            family(
                &mut enc,
                name,
                help,
                MetricType::Counter,
                rails.iter().map(|(l, r)| (l.clone(), counter(f(r)))),
            )?;
        }
        let gauges: [(&str, &str, Field); 2] = [
            (
                "xfer_rail_ops_in_flight",
                "Operations posted and not completed.",
                |r| r.counters.in_flight,
            ),
            (
                "xfer_rail_transfers_active",
                "Transfers under way on this rail.",
                |r| r.counters.active,
            ),
        ];
        for (name, help, f) in gauges {
            family(
                &mut enc,
                name,
                help,
                MetricType::Gauge,
                rails.iter().map(|(l, r)| (l.clone(), gauge(f(r)))),
            )?;
        }
        type TField = fn(&fabric_core::stats::TransportSnapshot) -> u64;
        let target: [(&str, &str, TField); 5] = [
            (
                "xfer_rail_received_bytes",
                "Bytes peers' one-sided WRITEs placed in this rail's registered regions.",
                |t| t.received_bytes,
            ),
            (
                "xfer_rail_received_writes",
                "Peers' WRITEs placed here.",
                |t| t.received_writes,
            ),
            (
                "xfer_rail_served_read_bytes",
                "Bytes sent from our regions to answer peers' READs.",
                |t| t.served_read_bytes,
            ),
            (
                "xfer_rail_refused_requests",
                "Peers' requests refused before they touched memory (key, bounds, permission, checksum).",
                |t| t.refused_requests,
            ),
            (
                "xfer_rail_checksum_mismatches",
                "Peers' WRITEs whose checksum did not match: refused, nothing placed.",
                |t| t.checksum_mismatches,
            ),
        ];
        for (name, help, f) in target {
            family(
                &mut enc,
                name,
                help,
                MetricType::Counter,
                rails
                    .iter()
                    .filter_map(|(l, r)| r.transport.as_ref().map(|t| (l.clone(), counter(f(t))))),
            )?;
        }
        // Peers: one sample per peer of each rail.
        let peers: Vec<(Labels, &fabric_core::stats::PeerStatus)> = rails
            .iter()
            .flat_map(|(l, r)| {
                r.transport.iter().flat_map(move |t| {
                    t.peers.iter().map(move |p| {
                        let mut labels = l[..2].to_vec();
                        labels.push(("peer", p.peer.0.to_string()));
                        labels.push(("address", p.address.clone()));
                        labels.push(("passive", p.passive.to_string()));
                        labels.push(("state", p.state.name().to_owned()));
                        (labels, p)
                    })
                })
            })
            .collect();
        family(
            &mut enc,
            "xfer_peer_connections",
            "Open connections of each peer of a rail, labelled with its state (connecting, connected, closed).",
            MetricType::Gauge,
            peers
                .iter()
                .map(|(l, p)| (l.clone(), gauge(p.connections as u64))),
        )?;
        family(
            &mut enc,
            "xfer_peer_last_error",
            "1 for each peer whose last connection to fail failed, with the error as label.",
            MetricType::Gauge,
            peers.iter().filter_map(|(l, p)| {
                p.last_error.as_ref().map(|e| {
                    let mut labels = l.clone();
                    labels.push(("error", e.clone()));
                    (labels, gauge(1))
                })
            }),
        )?;
        // Per group.
        let group_labels = |name: &String| vec![("group", name.clone())];
        family(
            &mut enc,
            "xfer_transfer_latency_seconds",
            "Latency of the group's successful transfers, submit to completion.",
            MetricType::Histogram,
            groups
                .iter()
                .map(|(name, g)| (group_labels(name), Latency(g.latency))),
        )?;
        // The same memory is registered on every rail: the first rail says it.
        family(
            &mut enc,
            "xfer_registered_bytes",
            "Bytes of the regions registered on the group.",
            MetricType::Gauge,
            groups.iter().map(|(name, g)| {
                let b = g.rails.first().map_or(0, |r| r.registered_bytes);
                (group_labels(name), gauge(b))
            }),
        )?;
        family(
            &mut enc,
            "xfer_registered_regions",
            "Regions registered on the group.",
            MetricType::Gauge,
            groups.iter().map(|(name, g)| {
                let n = g.rails.first().map_or(0, |r| r.registered_regions);
                (group_labels(name), gauge(n as u64))
            }),
        )?;
        let agent = self
            .0
            .agent
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if let Some(a) = agent {
            let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
            for (name, help, v) in [
                (
                    "xfer_reconnects",
                    "Connections to a peer made again (after one broke, or for a peer's new incarnation).",
                    load(&a.reconnects),
                ),
                (
                    "xfer_reconnect_failures",
                    "Attempts to connect to a peer again that failed.",
                    load(&a.reconnect_failures),
                ),
                (
                    "xfer_stale_descriptors",
                    "Transfers refused: their remote descriptor is of an earlier incarnation of the peer.",
                    load(&a.stale_descriptors),
                ),
                (
                    "xfer_stalls",
                    "Waits that reported a transfer stalled: no progress for its stall timeout while its peer's connection stood.",
                    load(&a.stalls),
                ),
            ] {
                family(
                    &mut enc,
                    name,
                    help,
                    MetricType::Counter,
                    [(Vec::new(), counter(v))],
                )?;
            }
        }
        let serve = self
            .0
            .serve
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if let Some(s) = serve {
            let none = Vec::new;
            family(
                &mut enc,
                "xfer_serve_clients",
                "Clients served now.",
                MetricType::Gauge,
                [(none(), gauge(s.clients.load(Ordering::Relaxed) as u64))],
            )?;
            family(
                &mut enc,
                "xfer_serve_pending_handshakes",
                "Connections waiting for their hello now (they hold no client's place).",
                MetricType::Gauge,
                [(none(), gauge(s.pending.load(Ordering::Relaxed) as u64))],
            )?;
            family(
                &mut enc,
                "xfer_serve_region_bytes",
                "Bytes the clients' regions hold now.",
                MetricType::Gauge,
                [(none(), gauge(s.region_bytes.load(Ordering::Relaxed)))],
            )?;
            family(
                &mut enc,
                "xfer_serve_clients_admitted",
                "Clients admitted since the server started.",
                MetricType::Counter,
                [(none(), counter(s.admitted.load(Ordering::Relaxed)))],
            )?;
            family(
                &mut enc,
                "xfer_serve_refusals",
                "Clients (or their requests) refused, by reason.",
                MetricType::Counter,
                Refusal::ALL.iter().map(|&r| {
                    (
                        vec![("reason", r.name().to_owned())],
                        counter(s.refusals(r)),
                    )
                }),
            )?;
            let arrived: u64 = groups.iter().map(|(_, g)| g.counters().notifications).sum();
            family(
                &mut enc,
                "xfer_serve_notifications",
                "Peers' immediate data that arrived at the server (counted per sender and \
                 value, never dropped).",
                MetricType::Counter,
                [(none(), counter(arrived))],
            )?;
        }
        Ok(())
    }
}

/// The exposition of everything `sources` reports now.
pub fn render(sources: &Arc<Sources>) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Snapshots(sources.clone())));
    let mut out = String::new();
    // Writing into a String fails only if a collector does, and ours do not.
    if let Err(e) = prometheus_client::encoding::prometheus_text::encode(&mut out, &registry) {
        tracing::warn!(error = %e, "metrics: encoding failed");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exposition_names_every_family_even_with_nothing_to_report() {
        let sources = Arc::new(Sources::default());
        sources.set_serve(Arc::new(ServeStats::default()));
        let text = render(&sources);
        for name in [
            "# TYPE xfer_rail_bytes_total counter",
            "# TYPE xfer_transfer_latency_seconds histogram",
            "# TYPE xfer_serve_clients gauge",
            "# TYPE xfer_serve_pending_handshakes gauge",
            "xfer_serve_refusals_total{reason=\"hello_timeout\"} 0",
            "xfer_serve_notifications_total 0",
        ] {
            assert!(text.contains(name), "no {name:?} in\n{text}");
        }
    }
}
