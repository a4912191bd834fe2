//! A real etcd for tests: Debian's `etcd` binary (package `etcd-server`, or `XFER_ETCD`)
//! started on free loopback ports with a temporary data directory, stopped when dropped.
//!
//! [`Etcd::start_tls_or_skip`] starts one that speaks TLS only and asks every client for a
//! certificate signed by a given CA (`--client-cert-auth`).
//!
//! When no etcd binary is found, [`Etcd::start_or_skip`] returns `None` (the test reports
//! itself skipped), unless `XFER_REQUIRE_ETCD` is set, as under CI, when it panics.

use crate::{EtcdDirectory, EtcdOptions};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// How long etcd gets to start answering.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// The PEM files of an etcd that speaks TLS to its clients and asks each for a certificate
/// signed by `ca`.
#[derive(Clone, Debug)]
pub struct ServerTls {
    /// The CA client certificates must chain to (`--trusted-ca-file`).
    pub ca: PathBuf,
    /// etcd's certificate, for 127.0.0.1 (`--cert-file`).
    pub cert: PathBuf,
    /// Its key (`--key-file`).
    pub key: PathBuf,
}

/// One etcd server of one member, on loopback.
pub struct Etcd {
    child: Option<Child>,
    bin: PathBuf,
    dir: PathBuf,
    client_port: u16,
    peer_port: u16,
    tls: Option<ServerTls>,
    /// How to tell that it answers.
    client: EtcdOptions,
}

/// The etcd binary to run, if there is one.
fn binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("XFER_ETCD") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("etcd"))
        .find(|p| p.is_file())
}

/// A port free on loopback now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("binding a loopback port")
}

impl Etcd {
    /// Starts etcd, or returns `None` (saying why) when there is no binary and
    /// `XFER_REQUIRE_ETCD` is not set.
    pub fn start_or_skip() -> Option<Etcd> {
        Etcd::start(None, EtcdOptions::default())
    }

    /// Starts an etcd that speaks TLS only, with `tls`'s certificate, and refuses clients
    /// without a certificate signed by `tls.ca`; it is ready once a client with `client`'s
    /// options (its TLS among them) gets an answer. `None` as [`Etcd::start_or_skip`].
    pub fn start_tls_or_skip(tls: ServerTls, client: EtcdOptions) -> Option<Etcd> {
        Etcd::start(Some(tls), client)
    }

    fn start(tls: Option<ServerTls>, client: EtcdOptions) -> Option<Etcd> {
        let Some(bin) = binary() else {
            if std::env::var_os("XFER_REQUIRE_ETCD").is_some() {
                panic!(
                    "XFER_REQUIRE_ETCD is set but no etcd binary is on PATH (Debian: etcd-server)"
                );
            }
            eprintln!("skipped: no etcd on PATH (install Debian's etcd-server, or set XFER_ETCD)");
            return None;
        };
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "xfer-etcd-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("creating etcd's directory");
        let mut e = Etcd {
            child: None,
            bin,
            dir,
            client_port: free_port(),
            peer_port: free_port(),
            tls,
            client,
        };
        e.spawn();
        Some(e)
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// Starts etcd and waits until it answers. A start that fails because a port is taken
    /// is tried again until [`START_TIMEOUT`]: the ports were free when chosen, but while
    /// etcd is down (before a restart) any process's outgoing connection may take one as
    /// its own local port for a moment.
    fn spawn(&mut self) {
        let until = Instant::now() + START_TIMEOUT;
        loop {
            let from = self.log().len();
            self.start_child();
            match self.wait_ready(until) {
                Ok(()) => return,
                Err(_)
                    if Instant::now() < until
                        && self
                            .log()
                            .get(from..)
                            .is_some_and(|l| l.contains("address already in use")) =>
                {
                    // Back off before trying the same ports again.
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(status) => panic!("etcd exited with {status} at start:\n{}", self.log()),
            }
        }
    }

    fn start_child(&mut self) {
        let c = self.endpoint();
        let p = format!("http://127.0.0.1:{}", self.peer_port);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("etcd.log"))
            .expect("opening etcd's log");
        let mut cmd = Command::new(&self.bin);
        if let Some(t) = &self.tls {
            cmd.arg("--cert-file")
                .arg(&t.cert)
                .arg("--key-file")
                .arg(&t.key)
                .arg("--trusted-ca-file")
                .arg(&t.ca)
                .arg("--client-cert-auth");
        }
        let child = cmd
            .args(["--name", "xfer-test", "--data-dir"])
            .arg(self.data())
            .args(["--listen-client-urls", &c, "--advertise-client-urls", &c])
            .args([
                "--listen-peer-urls",
                &p,
                "--initial-advertise-peer-urls",
                &p,
            ])
            .args(["--initial-cluster", &format!("xfer-test={p}")])
            .args(["--logger", "zap", "--log-level", "warn"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("etcd log"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", self.bin.display()));
        self.child = Some(child);
    }

    /// Waits until etcd answers a status call (at the latest by `until`, else panics with
    /// its log); an etcd that exits first is reaped and its status returned.
    fn wait_ready(&mut self, until: Instant) -> Result<(), std::process::ExitStatus> {
        let opts = EtcdOptions {
            connect_timeout: Duration::from_millis(500),
            ..self.client.clone()
        };
        loop {
            if let Some(c) = self.child.as_mut()
                && let Ok(Some(status)) = c.try_wait()
            {
                self.child = None;
                return Err(status);
            }
            if EtcdDirectory::connect(&[self.endpoint()], opts.clone()).is_ok() {
                return Ok(());
            }
            if Instant::now() > until {
                panic!(
                    "etcd did not answer within {START_TIMEOUT:?}:\n{}",
                    self.log()
                );
            }
            // A refused connection fails at once: poll again shortly, not in a busy loop.
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// etcd's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("etcd.log")).unwrap_or_default()
    }

    /// The client endpoint, `http://127.0.0.1:PORT` (`https://` with TLS).
    pub fn endpoint(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }

    /// The directory URL, `etcd://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("etcd://127.0.0.1:{}", self.client_port)
    }

    /// The temporary directory (data and log).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Kills etcd (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts etcd again on the same ports, with its data (`wipe` false) or with none, as
    /// a replacement server that lost everything would be.
    pub fn restart(&mut self, wipe: bool) {
        self.kill();
        if wipe {
            let _ = std::fs::remove_dir_all(self.data());
        }
        self.spawn();
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
