//! Shared workloads for the benches.
