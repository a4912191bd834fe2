//! The conformance suite on the in-memory transport.
use fabric_core::mem::MemTransport;
use fabric_core::testing::SuiteOptions;

fabric_core::conformance_suite!(MemTransport::new, SuiteOptions::default());
fabric_core::read_conformance_suite!(MemTransport::new, SuiteOptions::default());
