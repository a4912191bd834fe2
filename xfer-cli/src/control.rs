//! The control channel of `xfer serve`: JSON lines over TCP, out of band of the data path.
//!
//! ```text
//! client: {"op":"hello","version":1,"transport":"tcp"}
//! server: {"ok":true,"transport":"tcp","address":"tcp://127.0.0.1:40123","region":{"addr":0,"len":1073741824,"key":...}}
//! client: {"op":"verify","seed":1,"page_size":65536,"pages":[3,17,...]}
//! server: {"ok":true,"checked":1000,"mismatches":0,"first_mismatch":null}
//! ```
//! Each control connection gets a region of its own, deregistered when it closes.

use crate::backend::{BackendArgs, MemoryKind, TransportKind};
use crate::placement::CorePin;
use crate::workload;
use fabric_core::engine::{GroupRegistration, RailGroup, RemoteDescriptor};
use fabric_core::{Access, MemoryRegion};
use serde::{Deserialize, Serialize};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

/// Protocol version.
pub const VERSION: u32 = 1;
/// Longest request line accepted.
const MAX_LINE: u64 = 64 << 20;

/// A client request.
#[derive(Serialize, Deserialize, Debug)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Ask for a region.
    Hello {
        /// Protocol version.
        version: u32,
        /// The transport the client asks for (`auto`: the server picks).
        transport: String,
        /// The client's memory ("host" or "cuda"), for `auto`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        memory: Option<String>,
        /// The client's host (boot id), for `auto`: cuda-ipc needs the same host.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        host_id: Option<String>,
        /// Which of the server's workers (`serve --per-gpu`: position in its --gpus) to
        /// write to; the first when absent.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        worker: Option<u32>,
        /// Hex digest of the client's shared token (never the token), if it has one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        auth: Option<String>,
    },
    /// Check written pages against the pattern.
    Verify {
        /// Pattern seed.
        seed: u64,
        /// Page size.
        page_size: u64,
        /// Written pages.
        pages: Vec<u64>,
    },
}

/// The answer to `hello`.
#[derive(Serialize, Deserialize, Debug)]
pub struct HelloReply {
    /// The transport both sides use (the server's pick when the client asked `auto`).
    pub transport: String,
    /// Where the server's region lives ("host" or "cuda").
    pub memory: String,
    /// The data address of each of its rails (text for tcp, `hex:` for binary addresses).
    pub addresses: Vec<String>,
    /// The region the client may write, one key per rail.
    pub region: RemoteDescriptor,
}

/// The answer to `verify`.
#[derive(Serialize, Deserialize, Debug)]
pub struct VerifyReply {
    /// Pages checked.
    pub checked: u64,
    /// Pages that differ.
    pub mismatches: u64,
    /// The first page that differs.
    pub first_mismatch: Option<u64>,
}

#[derive(Serialize, Deserialize, Debug)]
struct Envelope<T> {
    ok: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    #[serde(flatten)]
    body: Option<T>,
}

/// Parses `xfer://HOST:PORT` into a socket address.
pub fn parse_peer(s: &str) -> Result<SocketAddr, String> {
    let rest = s
        .strip_prefix("xfer://")
        .ok_or_else(|| format!("malformed peer address {s:?}: expected xfer://HOST:PORT"))?;
    let rest = rest.trim_end_matches('/');
    rest.to_socket_addrs()
        .map_err(|e| format!("malformed peer address {s:?}: {e}"))?
        .next()
        .ok_or_else(|| format!("peer address {s:?} resolves to nothing"))
}

/// Serves clients until the process is stopped.
///
/// Each client's region is allocated by its control thread, which first prefers the memory
/// node of `pin` (the serving worker's) when it is set.
pub fn serve(
    listener: TcpListener,
    groups: Vec<ServedGroup>,
    region_size: u64,
    backend: BackendArgs,
    pin: Option<CorePin>,
) -> std::io::Result<()> {
    for conn in listener.incoming() {
        let conn = match conn {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                continue;
            }
        };
        let groups = groups.clone();
        let backend = backend.clone();
        std::thread::spawn(move || {
            if let Some(p) = pin {
                p.prefer_memory_here("xfer-control");
            }
            let from = conn.peer_addr().ok();
            if let Err(e) = client(conn, &groups, region_size, &backend) {
                tracing::info!(?from, error = %e, "control connection ended");
            }
        });
    }
    Ok(())
}

fn reply<T: Serialize>(w: &mut TcpStream, r: Result<T, String>) -> std::io::Result<()> {
    let env = match r {
        Ok(b) => Envelope {
            ok: true,
            error: None,
            body: Some(b),
        },
        Err(e) => Envelope {
            ok: false,
            error: Some(e),
            body: None,
        },
    };
    let mut line = serde_json::to_vec(&env).map_err(std::io::Error::other)?;
    line.push(b'\n');
    w.write_all(&line)
}

/// The path for a client that asked `asked`, among the server's `offered` ones.
pub fn choose(
    asked: &str,
    client_memory: Option<&str>,
    same_host: bool,
    server_memory: MemoryKind,
    offered: &[TransportKind],
) -> Result<TransportKind, String> {
    let names = || {
        offered
            .iter()
            .map(|k| k.name())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let want = TransportKind::from_name(asked).ok_or_else(|| {
        format!(
            "unknown transport {asked:?} (this server offers {})",
            names()
        )
    })?;
    let pick = match want {
        TransportKind::Auto => {
            let both_gpu = server_memory == MemoryKind::Cuda && client_memory == Some("cuda");
            let k = TransportKind::Auto.resolve(both_gpu, same_host);
            if offered.contains(&k) {
                k
            } else {
                TransportKind::Tcp
            }
        }
        k => k,
    };
    if offered.contains(&pick) {
        Ok(pick)
    } else {
        Err(format!(
            "this server offers {}, not {} (start it with --transport {})",
            names(),
            pick.name(),
            pick.name()
        ))
    }
}

/// One group of rails a server runs: its transport, and the worker (position in the
/// server's --gpus) whose memory it serves.
#[derive(Clone)]
pub struct ServedGroup {
    /// Its transport.
    pub kind: TransportKind,
    /// The worker: regions for clients of this group live on `--gpus[worker]`.
    pub worker: usize,
    /// The rails.
    pub group: Arc<RailGroup>,
}

fn client(
    conn: TcpStream,
    groups: &[ServedGroup],
    region_size: u64,
    backend: &BackendArgs,
) -> std::io::Result<()> {
    let workers = groups.iter().map(|g| g.worker + 1).max().unwrap_or(1);
    let mut chosen: Option<(TransportKind, usize, &RailGroup)> = None;
    let mut w = conn.try_clone()?;
    let mut r = BufReader::new(conn);
    let mut region: Option<(Arc<dyn MemoryRegion>, GroupRegistration)> = None;
    let result = (|| loop {
        let mut line = String::new();
        let n = (&mut r).take(MAX_LINE).read_line(&mut line)?;
        if n == 0 {
            return Ok(());
        }
        if !line.ends_with('\n') {
            reply::<()>(&mut w, Err("request line too long or truncated".into()))?;
            return Ok(());
        }
        let req: Request = match serde_json::from_str(&line) {
            Ok(r) => r,
            Err(e) => {
                reply::<()>(&mut w, Err(format!("malformed request: {e}")))?;
                return Ok(());
            }
        };
        match req {
            Request::Hello {
                version,
                transport,
                memory,
                host_id,
                worker,
                auth,
            } => {
                let slot = worker.unwrap_or(0) as usize;
                if slot >= workers {
                    reply::<()>(
                        &mut w,
                        Err(format!(
                            "this server runs {workers} worker(s); worker {slot} does not exist \
                             (start it with --per-gpu and more --gpus)"
                        )),
                    )?;
                    return Ok(());
                }
                let offered: Vec<TransportKind> = groups
                    .iter()
                    .filter(|g| g.worker == slot)
                    .map(|g| g.kind)
                    .collect();
                if let Some(want) = &backend.auth_token
                    && auth.as_deref()
                        != Some(hex::encode(transport_tcp::auth_digest(want)).as_str())
                {
                    reply::<()>(
                        &mut w,
                        Err("authentication failed: no or wrong --auth-token".into()),
                    )?;
                    return Ok(());
                }
                if version != VERSION {
                    reply::<()>(
                        &mut w,
                        Err(format!(
                            "protocol version {version} not supported (server speaks {VERSION})"
                        )),
                    )?;
                    return Ok(());
                }
                let same_host = host_id.is_some()
                    && host_id.as_deref() == transport_cuda_ipc::boot_id().ok().as_deref();
                let kind = match choose(
                    &transport,
                    memory.as_deref(),
                    same_host,
                    backend.memory,
                    &offered,
                ) {
                    Ok(k) => k,
                    Err(e) => {
                        reply::<()>(&mut w, Err(e))?;
                        return Ok(());
                    }
                };
                if chosen.is_some_and(|(k, s, _)| k != kind || s != slot) {
                    reply::<()>(&mut w, Err("a second hello asked for another path".into()))?;
                    return Ok(());
                }
                let Some(served) = groups.iter().find(|g| g.kind == kind && g.worker == slot)
                else {
                    reply::<()>(&mut w, Err("internal: chosen path not served".into()))?;
                    return Ok(());
                };
                let group = &*served.group;
                chosen = Some((kind, slot, group));
                if region.is_none() {
                    let buf = match backend.alloc(region_size, slot) {
                        Ok(b) => b,
                        Err(e) => {
                            reply::<()>(&mut w, Err(format!("cannot allocate the region: {e}")))?;
                            return Ok(());
                        }
                    };
                    let reg = group
                        .register(buf.clone(), Access::REMOTE_WRITE)
                        .map_err(std::io::Error::other)?;
                    region = Some((buf, reg));
                }
                let reg = &region.as_ref().expect("just set").1;
                let addresses = group
                    .addresses()
                    .iter()
                    .map(|a| crate::address_to_text(a))
                    .collect();
                reply(
                    &mut w,
                    Ok(HelloReply {
                        transport: kind.name().into(),
                        memory: backend.memory.name().into(),
                        addresses,
                        region: reg.remote.clone(),
                    }),
                )?;
            }
            Request::Verify {
                seed,
                page_size,
                pages,
            } => {
                let Some((buf, _)) = &region else {
                    reply::<()>(&mut w, Err("verify before hello".into()))?;
                    continue;
                };
                if page_size == 0
                    || !page_size.is_multiple_of(8)
                    || pages
                        .iter()
                        .any(|p| p.saturating_add(1).saturating_mul(page_size) > region_size)
                {
                    reply::<()>(&mut w, Err("verify: page outside the region".into()))?;
                    continue;
                }
                let r2 = workload::verify_pages(&**buf, page_size, seed, &pages)
                    .map(|(mismatches, first_mismatch)| VerifyReply {
                        checked: pages.len() as u64,
                        mismatches,
                        first_mismatch,
                    })
                    .map_err(|e| e.to_string());
                reply(&mut w, r2)?;
            }
        }
    })();
    if let (Some((_, reg)), Some((_, _, group))) = (region, chosen)
        && let Err(e) = group.deregister(&reg)
    {
        tracing::warn!(error = %e, "deregister failed");
    }
    result
}

/// A client of the control channel.
pub struct ControlClient {
    w: TcpStream,
    r: BufReader<TcpStream>,
}

impl ControlClient {
    /// Connects with a timeout.
    pub fn connect(addr: SocketAddr, timeout: Duration) -> Result<ControlClient, String> {
        let s = TcpStream::connect_timeout(&addr, timeout)
            .map_err(|e| format!("cannot reach peer {addr}: {e}"))?;
        s.set_read_timeout(Some(Duration::from_secs(120)))
            .map_err(|e| e.to_string())?;
        let r = BufReader::new(s.try_clone().map_err(|e| e.to_string())?);
        Ok(ControlClient { w: s, r })
    }

    fn call<T: for<'de> Deserialize<'de>>(&mut self, req: &Request) -> Result<T, String> {
        let mut line = serde_json::to_vec(req).map_err(|e| e.to_string())?;
        line.push(b'\n');
        self.w
            .write_all(&line)
            .map_err(|e| format!("peer closed the control connection: {e}"))?;
        let mut resp = String::new();
        let n = (&mut self.r)
            .take(MAX_LINE)
            .read_line(&mut resp)
            .map_err(|e| format!("control connection: {e}"))?;
        if n == 0 {
            return Err("peer closed the control connection".into());
        }
        let env: Envelope<T> =
            serde_json::from_str(&resp).map_err(|e| format!("malformed reply from peer: {e}"))?;
        match (env.ok, env.body) {
            (true, Some(b)) => Ok(b),
            _ => Err(format!(
                "peer refused: {}",
                env.error.unwrap_or_else(|| "no reason given".into())
            )),
        }
    }

    /// Asks for a region.
    pub fn hello(
        &mut self,
        transport: &str,
        memory: &str,
        worker: Option<u32>,
        token: Option<&str>,
    ) -> Result<HelloReply, String> {
        self.call(&Request::Hello {
            version: VERSION,
            transport: transport.into(),
            memory: Some(memory.into()),
            host_id: transport_cuda_ipc::boot_id().ok(),
            worker,
            auth: token.map(|t| hex::encode(transport_tcp::auth_digest(t))),
        })
    }

    /// Asks the server to check written pages.
    pub fn verify(
        &mut self,
        seed: u64,
        page_size: u64,
        pages: Vec<u64>,
    ) -> Result<VerifyReply, String> {
        self.call(&Request::Verify {
            seed,
            page_size,
            pages,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOTH: [TransportKind; 2] = [TransportKind::Tcp, TransportKind::CudaIpc];

    #[test]
    fn auto_picks_cuda_ipc_only_for_gpu_memory_on_one_host_with_cuda() {
        let cuda = gpu_mem::driver_present();
        let k = choose("auto", Some("cuda"), true, MemoryKind::Cuda, &BOTH).unwrap();
        let want = if cuda {
            TransportKind::CudaIpc
        } else {
            TransportKind::Tcp
        };
        assert_eq!(k, want);
        for (mem, same, server) in [
            (Some("host"), true, MemoryKind::Cuda),
            (Some("cuda"), false, MemoryKind::Cuda),
            (Some("cuda"), true, MemoryKind::Host),
            (None, true, MemoryKind::Cuda),
        ] {
            assert_eq!(
                choose("auto", mem, same, server, &BOTH).unwrap(),
                TransportKind::Tcp,
                "{mem:?} {same} {server:?}"
            );
        }
        // A server that offers only tcp answers auto with tcp, whatever the client holds.
        assert_eq!(
            choose(
                "auto",
                Some("cuda"),
                true,
                MemoryKind::Cuda,
                &[TransportKind::Tcp]
            )
            .unwrap(),
            TransportKind::Tcp
        );
    }

    #[test]
    fn explicit_paths_must_be_offered_and_unknown_names_are_refused() {
        assert_eq!(
            choose("cuda-ipc", None, false, MemoryKind::Cuda, &BOTH).unwrap(),
            TransportKind::CudaIpc
        );
        let e = choose("efa", None, true, MemoryKind::Host, &BOTH).unwrap_err();
        assert!(e.contains("offers tcp, cuda-ipc, not efa"), "{e}");
        let e = choose("carrier-pigeon", None, true, MemoryKind::Host, &BOTH).unwrap_err();
        assert!(e.contains("unknown transport"), "{e}");
    }
}
