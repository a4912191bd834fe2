//! What the `xfer` binary's test files share: the binary as a quiet command, a running
//! `xfer serve`, its log, and a reader of the Prometheus text its `--metrics` endpoint serves.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The `xfer` binary under test, with no `RUST_LOG` from the caller and hwloc reading the
/// machine itself (no XML import).
pub fn xfer() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_xfer"));
    c.env_remove("RUST_LOG").env("HWLOC_LIBXML_IMPORT", "0");
    c
}

/// `xfer serve` on a loopback port with regions of `region`, 2 rails, no pinning and
/// `--metrics` on a loopback port, then `extra` (the limits a test is about).
pub fn serve_on_loopback(region: &str, extra: &[&str]) -> Command {
    let mut c = xfer();
    c.args([
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--region-size",
        region,
        "--rails",
        "2",
        "--pin",
        "off",
        "--metrics",
        "127.0.0.1:0",
    ])
    .args(extra);
    c
}

/// A running `xfer serve`, killed on drop.
pub struct Server {
    child: Child,
    /// Its control address, `xfer://HOST:PORT`.
    pub peer: String,
    /// The bench command it printed, less the leading `xfer`.
    pub bench: Vec<String>,
    /// Its stderr lines so far, when spawned with [`Server::spawn_logged`].
    log: Option<Arc<Mutex<Vec<String>>>>,
}

impl Server {
    /// Starts `serve` (a command that runs `xfer serve ...`) and reads the line it prints
    /// once its control socket listens: `xfer bench --peer xfer://...`.
    pub fn spawn(serve: Command) -> Server {
        Self::launch(serve, false)
    }

    /// As [`spawn`](Self::spawn), its stderr read by a thread into [`log`](Self::log)
    /// (so that the server never blocks on a full pipe).
    pub fn spawn_logged(serve: Command) -> Server {
        Self::launch(serve, true)
    }

    fn launch(mut serve: Command, logged: bool) -> Server {
        let mut child = serve
            .stdout(Stdio::piped())
            .stderr(if logged {
                Stdio::piped()
            } else {
                Stdio::inherit()
            })
            .spawn()
            .expect("xfer serve starts");
        let log = child.stderr.take().map(|err| {
            let lines = Arc::new(Mutex::new(Vec::new()));
            let l2 = lines.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(err).lines().map_while(Result::ok) {
                    l2.lock().unwrap().push(line);
                }
            });
            lines
        });
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
        Server {
            child,
            peer,
            bench,
            log,
        }
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether it still runs.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Its stderr lines so far (spawned with [`spawn_logged`](Self::spawn_logged)).
    pub fn log(&self) -> Vec<String> {
        self.log
            .as_ref()
            .expect("spawned with spawn_logged")
            .lock()
            .unwrap()
            .clone()
    }

    /// The first stderr line that `pick` maps to something, waiting for it up to `within`.
    pub fn wait_log<T>(&self, within: Duration, mut pick: impl FnMut(&str) -> Option<T>) -> T {
        let deadline = Instant::now() + within;
        loop {
            if let Some(t) = self.log().iter().find_map(|l| pick(l)) {
                return t;
            }
            assert!(
                Instant::now() < deadline,
                "no such line in the server's log within {within:?}: {:?}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The metrics URL it printed (`serve --metrics`).
    pub fn metrics_url(&self) -> String {
        self.wait_log(Duration::from_secs(10), |l| {
            l.strip_prefix("xfer: metrics on ").map(str::to_owned)
        })
    }

    /// The control address, for raw connections.
    pub fn control_addr(&self) -> std::net::SocketAddr {
        self.peer
            .strip_prefix("xfer://")
            .expect("xfer:// address")
            .parse()
            .expect("control address")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One scrape of a Prometheus text exposition: every sample, by its name with labels
/// (`name{a="b"}`) exactly as the text has it.
#[derive(Debug, Default)]
pub struct Scrape {
    /// Samples by series.
    pub samples: BTreeMap<String, f64>,
    /// The whole text.
    pub text: String,
}

impl Scrape {
    /// Fetches `url` with a real HTTP client (ureq), within 10 s; checks the status and
    /// the content type of Prometheus text.
    pub fn fetch(url: &str) -> Scrape {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(Duration::from_secs(10)))
            .build()
            .into();
        let mut resp = agent
            .get(url)
            .call()
            .unwrap_or_else(|e| panic!("GET {url}: {e}"));
        assert_eq!(resp.status(), 200, "GET {url}");
        let kind = resp
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        assert!(kind.starts_with("text/plain; version=0.0.4"), "{kind}");
        let text = resp.body_mut().read_to_string().expect("a text body");
        Scrape::parse(text)
    }

    /// Reads exposition text.
    pub fn parse(text: String) -> Scrape {
        let mut samples = BTreeMap::new();
        for line in text.lines() {
            if line.starts_with('#') || line.trim().is_empty() {
                continue;
            }
            let (series, value) = line
                .rsplit_once(' ')
                .unwrap_or_else(|| panic!("malformed sample line {line:?}"));
            let value: f64 = value
                .parse()
                .unwrap_or_else(|e| panic!("malformed value in {line:?}: {e}"));
            samples.insert(series.to_owned(), value);
        }
        Scrape { samples, text }
    }

    /// The sum of the samples of metric `name` whose labels contain every `a="b"` of
    /// `labels`.
    pub fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.samples
            .iter()
            .filter(|(series, _)| {
                let (n, rest) = series.split_once('{').unwrap_or((series, ""));
                n == name
                    && labels
                        .iter()
                        .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")))
            })
            .map(|(_, v)| v)
            .sum()
    }
}

/// The control protocol's hello (version 3) without a token, as one line: a client agent
/// (its `AgentInfo`, metadata version 2) that offers tcp on one rail (`tcp://127.0.0.1:9`, in hex; the server
/// never connects to it).
pub const HELLO: &str = concat!(
    "{\"op\":\"hello\",\"version\":3,\"agent\":{\"version\":2,\"name\":\"test-client\",",
    "\"instance\":1,\"boot_id\":\"\",\"hostname\":\"\",\"memory\":\"Host\",\"transports\":",
    "[{\"kind\":\"tcp\",\"provider\":null,\"rails\":[\"7463703a2f2f3132372e302e302e313a39\"],",
    "\"nics\":[]}],\"control\":null}}\n"
);

/// A raw control connection to `addr` that has read the server's greeting (its first line,
/// read a byte at a time so that nothing after it is consumed); returns the connection and
/// the greeting's nonce (hex).
pub fn greeted(addr: std::net::SocketAddr) -> (std::net::TcpStream, String) {
    use std::io::Read;
    let mut s = std::net::TcpStream::connect(addr).expect("connect to the control port");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("read timeout");
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while byte[0] != b'\n' {
        s.read_exact(&mut byte).expect("the server's greeting");
        line.push(byte[0]);
    }
    let v: serde_json::Value = serde_json::from_slice(&line).expect("a JSON greeting");
    assert_eq!(v["op"], "challenge", "{v}");
    let nonce = v["nonce"].as_str().expect("a nonce").to_owned();
    (s, nonce)
}

/// A raw control connection to `addr` whose hello (without a token) was sent.
pub fn said_hello(addr: std::net::SocketAddr) -> std::net::TcpStream {
    use std::io::Write;
    let (mut s, _) = greeted(addr);
    s.write_all(HELLO.as_bytes()).expect("hello");
    s
}

/// A raw stream to a `sink` or `echo` listener of `serve`, past its authentication without
/// a token (`xfer::layers::raw_auth`): the server's mode byte and 16-byte nonce read,
/// our mode (0), 32 zero bytes of tag and a nonce of ours sent, the server's 32-byte
/// answer read.
pub fn raw_stream(at: std::net::SocketAddr) -> std::net::TcpStream {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(at).expect("connect to the raw listener");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("read timeout");
    let mut greeting = [0u8; 1 + 16];
    s.read_exact(&mut greeting)
        .expect("the stream's mode and nonce");
    assert_eq!(greeting[0], 0, "a server without a token");
    s.write_all(&[0u8; 1 + 32 + 16]).expect("the answer");
    let mut proof = [0u8; 32];
    s.read_exact(&mut proof).expect("the server's answer");
    s
}
