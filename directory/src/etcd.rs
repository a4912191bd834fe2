//! The etcd backend: records under leases renewed by keep-alives, watches from the
//! revision of their listing, re-publishing and re-listing after etcd comes back.

use crate::record::{Record, members_prefix};
use crate::sign::{ClusterToken, Signing};
use crate::track::Tracker;
use crate::{Directory, Error, Event, Listing, Member, Publication, Published, Result, Watch};
use crossbeam_channel::{Sender, TrySendError};
use etcd_client::{
    Client, ConnectOptions, EventType, GetOptions, LeaseKeepAliveStream, LeaseKeeper, PutOptions,
    WatchOptions,
};
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::runtime::Runtime;
use tokio::sync::{mpsc, oneshot};

/// Events a watch holds for a consumer that is slow to read them; past this the watcher
/// waits (etcd holds the rest).
const WATCH_QUEUE: usize = 4096;

/// TLS to etcd (`--cert-file`/`--key-file` on etcd's side): the CA that signed etcd's
/// certificate, and where etcd asks for client certificates (`--client-cert-auth`), this
/// client's certificate and key. PEM files, read at connect.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EtcdTls {
    /// The CA certificate(s) etcd's server certificate must chain to (only these are
    /// trusted, not the system's roots).
    pub ca: PathBuf,
    /// This client's certificate, for etcd's `--client-cert-auth` (with `key`).
    pub cert: Option<PathBuf>,
    /// This client's private key (with `cert`).
    pub key: Option<PathBuf>,
}

/// An etcd user (etcd's `auth enable`): its name and password. Its `Debug` does not show
/// the password.
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdUser {
    /// The user's name.
    pub name: String,
    /// Its password.
    pub password: String,
}

impl std::fmt::Debug for EtcdUser {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdUser")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// How an [`EtcdDirectory`] reaches etcd: timeouts, TLS and user.
#[derive(Clone, Debug)]
pub struct EtcdOptions {
    /// How long the first contact with etcd may take before it is called unreachable.
    pub connect_timeout: Duration,
    /// How long any one call may take.
    pub call_timeout: Duration,
    /// How long publishers and watchers wait between attempts while etcd is away.
    pub retry: Duration,
    /// TLS, with a client certificate where etcd asks for one. `None`: plain HTTP.
    pub tls: Option<EtcdTls>,
    /// The etcd user to authenticate as. `None`: none (etcd without `auth enable`).
    pub user: Option<EtcdUser>,
}

impl Default for EtcdOptions {
    fn default() -> EtcdOptions {
        EtcdOptions {
            connect_timeout: Duration::from_secs(3),
            call_timeout: Duration::from_secs(5),
            retry: Duration::from_millis(250),
            tls: None,
            user: None,
        }
    }
}

/// A directory in etcd (v3 API).
pub struct EtcdDirectory {
    rt: Arc<Runtime>,
    client: Client,
    endpoint: String,
    opts: EtcdOptions,
    signing: Signing,
}

/// What the background tasks need to talk to etcd.
#[derive(Clone)]
struct Conn {
    client: Client,
    endpoint: String,
    opts: EtcdOptions,
    signing: Signing,
}

impl Conn {
    /// `f`, within the call timeout, its error named.
    async fn call<T>(
        &self,
        what: &'static str,
        f: impl Future<Output = std::result::Result<T, etcd_client::Error>>,
    ) -> Result<T> {
        match tokio::time::timeout(self.opts.call_timeout, f).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(source)) => Err(call_error(&self.endpoint, what, &self.opts, source)),
            Err(_) => Err(Error::TimedOut {
                endpoint: self.endpoint.clone(),
                what,
                after: self.opts.call_timeout,
            }),
        }
    }

    async fn list(&self, cluster: &str) -> Result<Listing> {
        let mut kv = self.client.kv_client();
        let prefix = members_prefix(cluster);
        let resp = self
            .call(
                "listing members",
                kv.get(prefix.clone(), Some(GetOptions::new().with_prefix())),
            )
            .await?;
        let mut listing = Listing {
            revision: resp.header().map_or(0, |h| h.revision()),
            ..Listing::default()
        };
        for kv in resp.kvs() {
            let key = String::from_utf8_lossy(kv.key()).into_owned();
            match self.signing.decode(cluster, &key, kv.value()) {
                Ok(record) => listing.members.push(Member {
                    record,
                    revision: kv.mod_revision(),
                }),
                Err(e) => listing.skipped.push((key, e)),
            }
        }
        Ok(listing)
    }

    /// Grants a lease of `ttl` and puts `value` under it; returns the lease.
    async fn put_leased(&self, key: &str, value: &[u8], ttl: Duration) -> Result<i64> {
        let mut lease = self.client.lease_client();
        let secs = ttl.as_secs_f64().ceil().max(1.0) as i64;
        let granted = self
            .call("granting a lease", lease.grant(secs, None))
            .await?;
        let id = granted.id();
        let mut kv = self.client.kv_client();
        self.call(
            "putting the record",
            kv.put(key, value, Some(PutOptions::new().with_lease(id))),
        )
        .await?;
        Ok(id)
    }
}

// gRPC's status codes (a wire standard) under which etcd refuses a call for want of
// authentication or permission (`tonic`, whose `Code` they are, is not named here).
/// gRPC's `INVALID_ARGUMENT`: etcd's no user, or a wrong name or password.
const GRPC_INVALID_ARGUMENT: i32 = 3;
/// gRPC's `PERMISSION_DENIED`: a key outside the user's roles.
const GRPC_PERMISSION_DENIED: i32 = 7;
/// gRPC's `UNAUTHENTICATED`: an invalid or expired token.
const GRPC_UNAUTHENTICATED: i32 = 16;

/// What etcd says, under gRPC's `InvalidArgument`, when a call lacks a user (auth enabled,
/// no token) or a user's name or password is wrong (etcd's `rpctypes.ErrGRPCUserEmpty`,
/// `ErrGRPCAuthFailed`). Its other refusals have their own codes (`PermissionDenied`,
/// `Unauthenticated` for an invalid token).
const ETCD_AUTH_MESSAGES: [&str; 2] = [
    "etcdserver: user name is empty",
    "etcdserver: authentication failed",
];

/// Whether `e` is etcd refusing a call for want of authentication or permission.
fn is_auth_refusal(e: &etcd_client::Error) -> bool {
    let etcd_client::Error::GRpcStatus(status) = e else {
        return false;
    };
    match status.code() as i32 {
        GRPC_PERMISSION_DENIED | GRPC_UNAUTHENTICATED => true,
        GRPC_INVALID_ARGUMENT => ETCD_AUTH_MESSAGES
            .iter()
            .any(|m| status.message().starts_with(m)),
        _ => false,
    }
}

/// A failed call's error: [`Error::Auth`] where etcd refused it for want of authentication
/// or permission, else [`Error::Etcd`].
fn call_error(
    endpoint: &str,
    what: &'static str,
    opts: &EtcdOptions,
    source: etcd_client::Error,
) -> Error {
    if is_auth_refusal(&source) {
        Error::Auth {
            endpoint: endpoint.to_string(),
            what,
            user: opts.user.as_ref().map(|u| u.name.clone()),
            source,
        }
    } else {
        Error::Etcd {
            endpoint: endpoint.to_string(),
            what,
            source,
        }
    }
}

/// Reads a PEM file of the TLS configuration.
fn read_pem(what: &'static str, path: &std::path::Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|source| Error::ConfigFile {
        what,
        path: path.to_path_buf(),
        source,
    })
}

/// The client's TLS configuration from `tls`'s files.
fn tls_options(tls: &EtcdTls) -> Result<etcd_client::TlsOptions> {
    let ca = etcd_client::Certificate::from_pem(read_pem("CA certificate", &tls.ca)?);
    let mut o = etcd_client::TlsOptions::new().ca_certificate(ca);
    match (&tls.cert, &tls.key) {
        (Some(cert), Some(key)) => {
            o = o.identity(etcd_client::Identity::from_pem(
                read_pem("client certificate", cert)?,
                read_pem("client key", key)?,
            ));
        }
        (None, None) => {}
        _ => {
            return Err(Error::Config(
                "a client certificate needs its key, and a key its certificate",
            ));
        }
    }
    Ok(o)
}

impl EtcdDirectory {
    /// Connects to etcd at `endpoints` (`http://HOST:PORT`; with [`EtcdOptions::tls`],
    /// `https://HOST:PORT`, and `http://` is taken as `https://`), as
    /// [`EtcdOptions::user`] if given, checking that it answers within
    /// `opts.connect_timeout`. The directory is open (no cluster token) until
    /// [`with_token`](EtcdDirectory::with_token).
    ///
    /// A user etcd does not know, or a wrong password, is [`Error::Auth`]. Without a user,
    /// connecting to an etcd with `auth enable` succeeds (etcd answers its status to
    /// anyone) and each call on the directory's keys is then [`Error::Auth`], as is a call
    /// outside the user's roles' permissions.
    pub fn connect(endpoints: &[String], opts: EtcdOptions) -> Result<EtcdDirectory> {
        let tls = opts.tls.as_ref().map(tls_options).transpose()?;
        let endpoints: Vec<String> = match tls {
            Some(_) => endpoints
                .iter()
                .map(|e| match e.strip_prefix("http://") {
                    Some(rest) => format!("https://{rest}"),
                    None => e.clone(),
                })
                .collect(),
            None => endpoints.to_vec(),
        };
        let endpoint = endpoints.join(",");
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("xfer-etcd")
            .enable_all()
            .build()
            .map_err(Error::Runtime)?;
        let unreachable = |source: Box<dyn std::error::Error + Send + Sync>| Error::Unreachable {
            endpoint: endpoint.clone(),
            after: opts.connect_timeout,
            source,
        };
        let connect = async {
            let mut o = ConnectOptions::new()
                .with_connect_timeout(opts.connect_timeout)
                .with_timeout(opts.call_timeout)
                .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2));
            if let Some(tls) = tls {
                o = o.with_tls(tls);
            }
            if let Some(u) = &opts.user {
                o = o.with_user(u.name.clone(), u.password.clone());
            }
            // With a user, connecting authenticates (a wrong password fails here).
            let mut client = Client::connect(&endpoints, Some(o))
                .await
                .map_err(|e| ("connecting and authenticating", e))?;
            client
                .status()
                .await
                .map_err(|e| ("asking for etcd's status", e))?;
            Ok::<_, (&'static str, etcd_client::Error)>(client)
        };
        let client = rt
            .block_on(async { tokio::time::timeout(opts.connect_timeout, connect).await })
            .map_err(|_| unreachable("no answer".into()))?
            .map_err(|(what, e)| {
                if is_auth_refusal(&e) {
                    call_error(&endpoint, what, &opts, e)
                } else {
                    unreachable(Box::new(e))
                }
            })?;
        Ok(EtcdDirectory {
            rt: Arc::new(rt),
            client,
            endpoint,
            opts,
            signing: Signing::default(),
        })
    }

    /// Signs the records it publishes with `token` and reads only records signed with it
    /// (see [`crate::sign`]).
    pub fn with_token(self, token: ClusterToken) -> EtcdDirectory {
        self.with_signing(Signing::new(Some(token), false))
    }

    pub(crate) fn with_signing(mut self, signing: Signing) -> EtcdDirectory {
        self.signing = signing;
        self
    }

    fn conn(&self) -> Conn {
        Conn {
            client: self.client.clone(),
            endpoint: self.endpoint.clone(),
            opts: self.opts.clone(),
            signing: self.signing.clone(),
        }
    }
}

impl Directory for EtcdDirectory {
    fn publish(&self, mut record: Record, ttl: Duration) -> Result<Publication> {
        record.ttl_ms = ttl.as_millis() as u64;
        self.signing.seal(&mut record)?;
        let value = record.encode()?;
        let key = record.key();
        let conn = self.conn();
        let lease = self.rt.block_on(conn.put_leased(&key, &value, ttl))?;
        let (tx, rx) = mpsc::channel(4);
        self.rt
            .spawn(keep_published(conn, key.clone(), value, ttl, lease, rx));
        Ok(Publication::new(
            key.clone(),
            Box::new(EtcdPublished {
                key: key.clone(),
                rt: self.rt.clone(),
                cmds: tx,
                call_timeout: self.opts.call_timeout,
                endpoint: self.endpoint.clone(),
                signing: self.signing.clone(),
            }),
        ))
    }

    fn lookup(&self, cluster: &str, name: &str) -> Result<Option<Member>> {
        crate::record::check_name("member", name)?;
        let key = crate::record::member_key(cluster, name);
        let conn = self.conn();
        let resp = self.rt.block_on(async {
            let mut kv = conn.client.kv_client();
            conn.call("looking up a member", kv.get(key.clone(), None))
                .await
        })?;
        match resp.kvs().first() {
            None => Ok(None),
            Some(kv) => Ok(Some(Member {
                record: self.signing.decode(cluster, &key, kv.value())?,
                revision: kv.mod_revision(),
            })),
        }
    }

    fn members(&self, cluster: &str) -> Result<Listing> {
        crate::record::check_name("cluster", cluster)?;
        self.rt.block_on(self.conn().list(cluster))
    }

    fn watch(&self, cluster: &str) -> Result<Watch> {
        crate::record::check_name("cluster", cluster)?;
        let conn = self.conn();
        // The first listing is taken here, so that an unreachable etcd is this call's error
        // and the watch covers every change after the moment it returns.
        let listing = self.rt.block_on(conn.list(cluster))?;
        let (tx, rx) = crossbeam_channel::bounded(WATCH_QUEUE);
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        self.rt.spawn(watch_members(
            conn,
            cluster.to_string(),
            listing,
            tx,
            stop_rx,
        ));
        Ok(Watch::new(rx, Box::new(stop_tx)))
    }

    fn endpoint(&self) -> String {
        let hosts = self.endpoint.replace("https://", "").replace("http://", "");
        match self.opts.tls {
            Some(_) => format!("etcd://{hosts} (tls)"),
            None => format!("etcd://{hosts}"),
        }
    }

    fn signed(&self) -> bool {
        self.signing.signed()
    }

    fn refused_records(&self) -> u64 {
        self.signing.refused()
    }
}

/// Commands to a publication's task.
enum Cmd {
    Update(Vec<u8>, oneshot::Sender<Result<()>>),
    Withdraw(oneshot::Sender<Result<()>>),
    Abandon,
}

/// The caller's end of a publication's task.
struct EtcdPublished {
    key: String,
    rt: Arc<Runtime>,
    cmds: mpsc::Sender<Cmd>,
    call_timeout: Duration,
    endpoint: String,
    signing: Signing,
}

impl EtcdPublished {
    fn ask(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<()>>) -> Cmd,
        what: &'static str,
    ) -> Result<()> {
        let (tx, rx) = oneshot::channel();
        let timeout = self.call_timeout * 2;
        let endpoint = self.endpoint.clone();
        let cmds = self.cmds.clone();
        // The task ends only once the record was withdrawn or abandoned.
        let ended = || Error::Withdrawn(self.key.clone());
        self.rt.block_on(async move {
            cmds.send(make(tx)).await.map_err(|_| ended())?;
            match tokio::time::timeout(timeout, rx).await {
                Ok(Ok(r)) => r,
                Ok(Err(_)) => Err(ended()),
                Err(_) => Err(Error::TimedOut {
                    endpoint,
                    what,
                    after: timeout,
                }),
            }
        })
    }
}

impl Published for EtcdPublished {
    fn update(&mut self, record: &Record) -> Result<()> {
        if record.key() != self.key {
            return Err(Error::Record(crate::RecordError::OtherName(
                record.agent.name.clone(),
            )));
        }
        let mut record = record.clone();
        self.signing.seal(&mut record)?;
        let value = record.encode()?;
        self.ask(|tx| Cmd::Update(value, tx), "updating the record")
    }

    fn withdraw(&mut self) -> Result<()> {
        self.ask(Cmd::Withdraw, "withdrawing the record")
    }

    fn abandon(&mut self) {
        let _ = self.cmds.try_send(Cmd::Abandon);
    }
}

/// A lease's keep-alive stream, opened lazily.
type KeepAlive = Option<(LeaseKeeper, LeaseKeepAliveStream)>;

/// Keeps `key` published: renews its lease every third of `ttl`; when a renewal fails
/// (etcd restarted, or lost its data and with it the lease), publishes again under a new
/// lease, retrying until it succeeds or is told to stop.
async fn keep_published(
    conn: Conn,
    key: String,
    mut value: Vec<u8>,
    ttl: Duration,
    mut lease: i64,
    mut cmds: mpsc::Receiver<Cmd>,
) {
    let every = (ttl / 3).max(Duration::from_millis(100));
    let mut alive: KeepAlive = None;
    // Whether the record is known to be in etcd now.
    let mut healthy = true;
    let mut next = tokio::time::Instant::now() + every;
    loop {
        let wait = if healthy {
            next
        } else {
            tokio::time::Instant::now() + conn.opts.retry
        };
        tokio::select! {
            cmd = cmds.recv() => match cmd {
                Some(Cmd::Update(v, reply)) => {
                    let mut kv = conn.client.kv_client();
                    let r = conn
                        .call("updating the record", kv.put(key.clone(), v.clone(), Some(PutOptions::new().with_lease(lease))))
                        .await
                        .map(|_| ());
                    if r.is_ok() {
                        value = v;
                    }
                    let _ = reply.send(r);
                }
                Some(Cmd::Withdraw(reply)) => {
                    let mut l = conn.client.lease_client();
                    let r = conn.call("withdrawing the record", l.revoke(lease)).await.map(|_| ());
                    let _ = reply.send(r);
                    return;
                }
                Some(Cmd::Abandon) | None => return,
            },
            _ = tokio::time::sleep_until(wait) => {
                next = tokio::time::Instant::now() + every;
                healthy = if healthy {
                    renew(&conn, lease, &mut alive).await
                } else {
                    false
                };
                if !healthy {
                    alive = None;
                    match conn.put_leased(&key, &value, ttl).await {
                        Ok(l) => {
                            tracing::info!(key, "re-published after losing the lease");
                            lease = l;
                            healthy = true;
                        }
                        Err(e) => tracing::debug!(key, error = %e, "re-publishing failed; retrying"),
                    }
                }
            }
        }
    }
}

/// One keep-alive of `lease`; false if the lease is gone or etcd did not answer.
async fn renew(conn: &Conn, lease: i64, alive: &mut KeepAlive) -> bool {
    if alive.is_none() {
        let mut l = conn.client.lease_client();
        match conn.call("opening a keep-alive", l.keep_alive(lease)).await {
            Ok(pair) => *alive = Some(pair),
            Err(e) => {
                tracing::debug!(lease, error = %e, "keep-alive stream failed");
                return false;
            }
        }
    }
    let Some((keeper, stream)) = alive.as_mut() else {
        return false;
    };
    let once = async {
        keeper.keep_alive().await?;
        stream.message().await
    };
    match tokio::time::timeout(conn.opts.call_timeout, once).await {
        Ok(Ok(Some(resp))) if resp.ttl() > 0 => true,
        Ok(Ok(_)) => {
            tracing::debug!(lease, "lease expired or unknown");
            false
        }
        Ok(Err(e)) => {
            tracing::debug!(lease, error = %e, "keep-alive failed");
            false
        }
        Err(_) => false,
    }
}

/// Hands `events` to the consumer, waiting while its queue is full; false once it is gone.
async fn deliver(tx: &Sender<Event>, events: Vec<Event>) -> bool {
    for mut e in events {
        loop {
            match tx.try_send(e) {
                Ok(()) => break,
                Err(TrySendError::Full(back)) => {
                    e = back;
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                Err(TrySendError::Disconnected(_)) => return false,
            }
        }
    }
    true
}

/// A cluster's watch: the first listing as joins, then etcd's events from the listing's
/// revision on; after the stream breaks, a new listing (members not in it get their TTL
/// to reappear) and a watch from its revision.
async fn watch_members(
    conn: Conn,
    cluster: String,
    first: Listing,
    tx: Sender<Event>,
    mut stop: oneshot::Receiver<()>,
) {
    let mut t = Tracker::new(conn.signing.clone());
    let mut revision = first.revision;
    if !deliver(&tx, t.listing(first, false, Instant::now())).await {
        return;
    }
    let prefix = members_prefix(&cluster);
    let tick = Duration::from_millis(100);
    loop {
        // One watch stream, until it breaks.
        let mut w = conn.client.watch_client();
        let opts = WatchOptions::new()
            .with_prefix()
            .with_start_revision(revision + 1);
        match conn
            .call("opening a watch", w.watch(prefix.clone(), Some(opts)))
            .await
        {
            Ok(mut stream) => loop {
                tokio::select! {
                    _ = &mut stop => return,
                    _ = tokio::time::sleep(tick) => {
                        if !deliver(&tx, t.expire(Instant::now())).await {
                            return;
                        }
                    }
                    msg = stream.message() => match msg {
                        Ok(Some(resp)) => {
                            if resp.canceled() {
                                tracing::debug!(reason = resp.cancel_reason(), compacted = resp.compact_revision(), "watch canceled; re-listing");
                                break;
                            }
                            let mut out = Vec::new();
                            for ev in resp.events() {
                                let Some(kv) = ev.kv() else { continue };
                                let key = String::from_utf8_lossy(kv.key()).into_owned();
                                revision = revision.max(kv.mod_revision());
                                out.extend(match ev.event_type() {
                                    EventType::Put => t.put(&cluster, &key, kv.value(), kv.mod_revision()),
                                    EventType::Delete => t.delete(&cluster, &key),
                                });
                            }
                            if let Some(h) = resp.header() {
                                revision = revision.max(h.revision());
                            }
                            if !deliver(&tx, out).await {
                                return;
                            }
                        }
                        Ok(None) => break,
                        Err(e) => {
                            tracing::debug!(error = %e, "watch stream broke; re-listing");
                            break;
                        }
                    }
                }
            },
            Err(e) => tracing::debug!(error = %e, "opening the watch failed; retrying"),
        }
        // Re-list until etcd answers; members gone from it get their grace meanwhile.
        loop {
            tokio::select! {
                _ = &mut stop => return,
                _ = tokio::time::sleep(conn.opts.retry) => {}
            }
            if !deliver(&tx, t.expire(Instant::now())).await {
                return;
            }
            match conn.list(&cluster).await {
                Ok(listing) => {
                    revision = listing.revision;
                    if !deliver(&tx, t.listing(listing, true, Instant::now())).await {
                        return;
                    }
                    break;
                }
                Err(e) => tracing::debug!(error = %e, "re-listing failed; retrying"),
            }
        }
    }
}
