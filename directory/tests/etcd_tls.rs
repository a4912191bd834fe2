//! etcd over TLS with client certificates, against a real etcd (Debian's etcd-server,
//! started per test on free loopback ports; `XFER_REQUIRE_ETCD` makes its absence a
//! failure) that speaks TLS only and asks every client for a certificate signed by its CA
//! (`--client-cert-auth`). The certificates are made here, at test time: a CA, etcd's
//! certificate for 127.0.0.1, a client's, and a second CA with a client of its own.

use directory::testing::{Etcd, ServerTls};
use directory::{DirectoryConfig, Error, EtcdDirectory, EtcdOptions, EtcdTls, Record};
use fabric_core::MemoryLocation;
use fabric_core::metadata::{AgentInfo, TransportInfo, TransportKind};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use std::path::PathBuf;
use std::time::Duration;

const CLUSTER: &str = "tls";

/// A directory of PEM files made for one test, removed on drop.
struct Certs {
    dir: PathBuf,
}

impl Certs {
    fn new(tag: &str) -> Certs {
        let dir = std::env::temp_dir().join(format!("xfer-etcd-tls-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let c = Certs { dir };
        let ca = c.ca("ca", "xfer test CA");
        let rogue = c.ca("rogue-ca", "another CA");
        c.leaf(&ca, "server", ExtendedKeyUsagePurpose::ServerAuth);
        c.leaf(&ca, "client", ExtendedKeyUsagePurpose::ClientAuth);
        c.leaf(&rogue, "rogue-client", ExtendedKeyUsagePurpose::ClientAuth);
        c
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    fn write(&self, name: &str, pem: &str) {
        std::fs::write(self.path(name), pem).unwrap();
    }

    /// A self-signed CA, written as NAME.pem.
    fn ca(&self, name: &str, cn: &str) -> CertifiedIssuer<'static, KeyPair> {
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name.push(DnType::CommonName, cn);
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca = CertifiedIssuer::self_signed(p, KeyPair::generate().unwrap()).unwrap();
        self.write(&format!("{name}.pem"), &ca.pem());
        ca
    }

    /// A certificate for 127.0.0.1 and localhost signed by `ca`, written as NAME.pem and
    /// NAME-key.pem.
    fn leaf(
        &self,
        ca: &CertifiedIssuer<'static, KeyPair>,
        name: &str,
        usage: ExtendedKeyUsagePurpose,
    ) {
        let key = KeyPair::generate().unwrap();
        let mut p =
            CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()]).unwrap();
        p.distinguished_name.push(DnType::CommonName, name);
        p.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        p.extended_key_usages = vec![usage];
        let cert = p.signed_by(&key, ca).unwrap();
        self.write(&format!("{name}.pem"), &cert.pem());
        self.write(&format!("{name}-key.pem"), &key.serialize_pem());
    }

    fn server(&self) -> ServerTls {
        ServerTls {
            ca: self.path("ca.pem"),
            cert: self.path("server.pem"),
            key: self.path("server-key.pem"),
        }
    }

    /// Client options trusting `ca`, with the client certificate `client` if any.
    fn client(&self, ca: &str, client: Option<&str>) -> EtcdOptions {
        EtcdOptions {
            connect_timeout: Duration::from_secs(3),
            tls: Some(EtcdTls {
                ca: self.path(&format!("{ca}.pem")),
                cert: client.map(|c| self.path(&format!("{c}.pem"))),
                key: client.map(|c| self.path(&format!("{c}-key.pem"))),
            }),
            ..EtcdOptions::default()
        }
    }
}

impl Drop for Certs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn start(certs: &Certs) -> Option<Etcd> {
    Etcd::start_tls_or_skip(certs.server(), certs.client("ca", Some("client")))
}

fn record(name: &str) -> Record {
    let mut a = AgentInfo::new(name, "boot-of-this-test", MemoryLocation::Host);
    a.transports = vec![TransportInfo::new(TransportKind::Tcp, vec![vec![1, 2, 3]])];
    Record::new(CLUSTER, a)
}

/// The error of connecting with `opts`, which must fail.
fn refused(e: &Etcd, opts: EtcdOptions) -> Error {
    match EtcdDirectory::connect(&[e.endpoint()], opts) {
        Ok(_) => panic!("connected where it should have been refused"),
        Err(err) => {
            eprintln!("refused: {}", chain(&err));
            err
        }
    }
}

/// An error and its sources, for messages.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s += &format!(": {c}");
        cur = c.source();
    }
    s
}

#[test]
fn the_right_client_certificate_connects_publishes_and_watches() {
    let certs = Certs::new("ok");
    let Some(e) = start(&certs) else {
        return;
    };
    // Through the URL, as a member opens it: etcd:// with TLS in the configuration, and a
    // cluster token on top.
    let config = DirectoryConfig {
        token: Some("token".into()),
        etcd: certs.client("ca", Some("client")),
        ..DirectoryConfig::default()
    };
    let d = directory::open_with(&e.url(), &config).unwrap();
    assert!(d.endpoint().contains("(tls)"), "{}", d.endpoint());
    let _p = d.publish(record("a"), Duration::from_secs(5)).unwrap();
    let w = d.watch(CLUSTER).unwrap();
    match w.next(Duration::from_secs(10)).unwrap() {
        Some(directory::Event::Joined(m)) => assert_eq!(m.record.name(), "a"),
        other => panic!("expected a's join, got {other:?}"),
    }
    let found = d.lookup(CLUSTER, "a").unwrap().expect("a is published");
    assert!(found.record.signature.is_some());
}

#[test]
fn without_a_client_certificate_etcd_refuses() {
    let certs = Certs::new("none");
    let Some(e) = start(&certs) else {
        return;
    };
    let err = refused(&e, certs.client("ca", None));
    assert!(matches!(err, Error::Unreachable { .. }), "{err}");
    assert!(
        std::error::Error::source(&err)
            .and_then(|s| s.downcast_ref::<etcd_client::Error>())
            .is_some(),
        "the client's error is the source: {err:?}"
    );
}

#[test]
fn a_client_certificate_of_another_ca_is_refused() {
    let certs = Certs::new("rogue");
    let Some(e) = start(&certs) else {
        return;
    };
    let err = refused(&e, certs.client("ca", Some("rogue-client")));
    assert!(matches!(err, Error::Unreachable { .. }), "{err}");
}

#[test]
fn a_server_whose_certificate_we_do_not_trust_is_refused() {
    let certs = Certs::new("untrusted");
    let Some(e) = start(&certs) else {
        return;
    };
    // The client trusts another CA than the one that signed etcd's certificate.
    let err = refused(&e, certs.client("rogue-ca", Some("client")));
    assert!(matches!(err, Error::Unreachable { .. }), "{err}");
    assert!(chain(&err).contains("UnknownIssuer"), "{}", chain(&err));
}

#[test]
fn plain_http_to_a_tls_etcd_is_refused() {
    let certs = Certs::new("plain");
    let Some(e) = start(&certs) else {
        return;
    };
    let plain = e.endpoint().replace("https://", "http://");
    let err = EtcdDirectory::connect(
        &[plain],
        EtcdOptions {
            connect_timeout: Duration::from_secs(3),
            ..EtcdOptions::default()
        },
    )
    .err()
    .expect("plain http is refused");
    assert!(matches!(err, Error::Unreachable { .. }), "{err}");
}

#[test]
fn missing_or_half_given_certificate_files_are_named() {
    let certs = Certs::new("files");
    let mut o = certs.client("ca", Some("client"));
    o.tls.as_mut().unwrap().ca = certs.path("no-such-ca.pem");
    let err = EtcdDirectory::connect(&["https://127.0.0.1:1".into()], o)
        .err()
        .unwrap();
    assert!(
        matches!(&err, Error::ConfigFile { what: "CA certificate", path, .. } if path.ends_with("no-such-ca.pem")),
        "{err}"
    );
    let mut o = certs.client("ca", Some("client"));
    o.tls.as_mut().unwrap().key = None;
    let err = EtcdDirectory::connect(&["https://127.0.0.1:1".into()], o)
        .err()
        .unwrap();
    assert!(matches!(err, Error::Config(_)), "{err}");
}
