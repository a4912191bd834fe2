//! The backend conformance suite on the TCP transport, over loopback.

use fabric_core::testing::SuiteOptions;
use transport_tcp::{TcpConfig, TcpTransport};

fn make() -> TcpTransport {
    TcpTransport::new(TcpConfig::default()).expect("listen on 127.0.0.1")
}

fabric_core::conformance_suite!(make, SuiteOptions::default());
fabric_core::read_conformance_suite!(make, SuiteOptions::default());

mod four_rails {
    use super::*;
    fn make4() -> TcpTransport {
        TcpTransport::new(TcpConfig {
            rails: 4,
            ..TcpConfig::default()
        })
        .expect("listen")
    }
    fabric_core::conformance_suite!(make4, SuiteOptions::default());
    fabric_core::read_conformance_suite!(make4, SuiteOptions::default());
}
