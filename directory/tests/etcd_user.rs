//! An etcd user (`EtcdOptions::user`), against a real etcd (Debian's etcd-server, started
//! per test on free loopback ports; `XFER_REQUIRE_ETCD` makes its absence a failure) with
//! authentication enabled here through the etcd client: a `root` user with role `root`, a
//! user `xfer` whose role may read and write the directory's keys (`KEY_ROOT` and below)
//! only, a user `elsewhere` whose role may read and write another prefix only, then
//! `auth enable`.

use directory::record::KEY_ROOT;
use directory::testing::Etcd;
use directory::{
    Directory, DirectoryConfig, Error, EtcdDirectory, EtcdOptions, EtcdUser, Event, Record, Watch,
};
use etcd_client::{Client, Permission};
use fabric_core::MemoryLocation;
use fabric_core::metadata::{AgentInfo, TransportInfo, TransportKind};
use std::time::{Duration, Instant};

const CLUSTER: &str = "auth";
const TTL: Duration = Duration::from_secs(5);
const ROOT_PASSWORD: &str = "root-pw-9f3c";
const XFER_PASSWORD: &str = "xfer-pw-51d7";
const ELSEWHERE_PASSWORD: &str = "elsewhere-pw-c02e";
/// How long the whole set-up of users and roles may take.
const SETUP_TIMEOUT: Duration = Duration::from_secs(20);

/// Sets up the users and roles above on `e` and enables authentication.
fn enable_auth(e: &Etcd) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime for the set-up");
    let setup = async {
        let mut c = Client::connect([e.endpoint()], None).await?;
        c.user_add("root", ROOT_PASSWORD, None).await?;
        c.user_grant_role("root", "root").await?;
        c.role_add("xfer").await?;
        c.role_grant_permission("xfer", Permission::read_write(KEY_ROOT).with_prefix())
            .await?;
        c.user_add("xfer", XFER_PASSWORD, None).await?;
        c.user_grant_role("xfer", "xfer").await?;
        c.role_add("elsewhere").await?;
        c.role_grant_permission(
            "elsewhere",
            Permission::read_write("/elsewhere/").with_prefix(),
        )
        .await?;
        c.user_add("elsewhere", ELSEWHERE_PASSWORD, None).await?;
        c.user_grant_role("elsewhere", "elsewhere").await?;
        c.auth_enable().await?;
        Ok::<_, etcd_client::Error>(())
    };
    match rt.block_on(async { tokio::time::timeout(SETUP_TIMEOUT, setup).await }) {
        Ok(Ok(())) => {}
        Ok(Err(err)) => panic!("enabling etcd's authentication: {err}\n{}", e.log()),
        Err(_) => panic!(
            "enabling etcd's authentication took over {SETUP_TIMEOUT:?}\n{}",
            e.log()
        ),
    }
}

/// etcd with authentication enabled, or `None` where there is no etcd (skipped).
fn start() -> Option<Etcd> {
    let e = Etcd::start_or_skip()?;
    enable_auth(&e);
    Some(e)
}

fn user(name: &str, password: &str) -> EtcdUser {
    EtcdUser {
        name: name.into(),
        password: password.into(),
    }
}

/// Options with short timeouts, as `user` if given.
fn opts(user: Option<EtcdUser>) -> EtcdOptions {
    EtcdOptions {
        connect_timeout: Duration::from_secs(3),
        call_timeout: Duration::from_secs(3),
        user,
        ..EtcdOptions::default()
    }
}

fn record(name: &str) -> Record {
    let mut a = AgentInfo::new(name, "boot-of-this-test", MemoryLocation::Host);
    a.transports = vec![TransportInfo::new(
        TransportKind::Tcp,
        vec![format!("addr-of-{name}").into_bytes()],
    )];
    Record::new(CLUSTER, a)
}

/// The next event within `within`, or a panic naming what was awaited.
fn next(w: &Watch, within: Duration, what: &str) -> Event {
    match w.next(within) {
        Ok(Some(e)) => e,
        Ok(None) => panic!("no event within {within:?} while waiting for {what}"),
        Err(e) => panic!("watch failed while waiting for {what}: {e}"),
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

/// Checks that `r` failed as an authentication refusal of a call made as `as_user`, with
/// the client's error as its source and a message that says so; returns the message.
fn assert_auth<T>(r: directory::Result<T>, as_user: Option<&str>, call: &str) -> String {
    let err = match r {
        Ok(_) => panic!("{call} succeeded where etcd should have refused it"),
        Err(err) => err,
    };
    let msg = chain(&err);
    eprintln!("{call}: {msg}");
    match &err {
        Error::Auth { user, .. } => assert_eq!(user.as_deref(), as_user, "{msg}"),
        _ => panic!("{call}: expected Error::Auth, got {msg} ({err:?})"),
    }
    assert!(
        std::error::Error::source(&err)
            .and_then(|s| s.downcast_ref::<etcd_client::Error>())
            .is_some(),
        "{call}: the client's error is the source: {err:?}"
    );
    assert!(
        err.to_string()
            .contains("authentication required or refused"),
        "{call}: {msg}"
    );
    for secret in [ROOT_PASSWORD, XFER_PASSWORD, ELSEWHERE_PASSWORD] {
        assert!(!msg.contains(secret), "{call}: a password in {msg}");
    }
    msg
}

#[test]
fn the_user_publishes_and_another_authenticated_directory_looks_up_and_watches() {
    let Some(e) = start() else {
        return;
    };
    // The watcher through the URL, as a member opens it; the publisher directly.
    let config = DirectoryConfig {
        etcd: opts(Some(user("xfer", XFER_PASSWORD))),
        ..DirectoryConfig::default()
    };
    let watcher = directory::open_with(&e.url(), &config).expect("the xfer user connects");
    let publisher =
        EtcdDirectory::connect(&[e.endpoint()], opts(Some(user("xfer", XFER_PASSWORD))))
            .expect("the xfer user connects");

    let w = watcher.watch(CLUSTER).expect("the xfer user watches");
    let mut p = publisher
        .publish(record("a"), TTL)
        .expect("the xfer user publishes");
    match next(&w, TTL, "a's join") {
        Event::Joined(m) => assert_eq!(m.record.name(), "a"),
        other => panic!("expected a's join, got {other:?}"),
    }
    let found = watcher
        .lookup(CLUSTER, "a")
        .expect("the xfer user looks up")
        .expect("a is published");
    assert_eq!(
        found
            .record
            .agent
            .transport(TransportKind::Tcp)
            .unwrap()
            .rails,
        vec![b"addr-of-a".to_vec()]
    );
    let names: Vec<String> = watcher
        .members(CLUSTER)
        .unwrap()
        .members
        .iter()
        .map(|m| m.record.name().to_string())
        .collect();
    assert_eq!(names, ["a"]);

    // An update and a withdrawal (the lease's revocation) are allowed too.
    let mut changed = found.record.clone();
    changed.agent.transports[0].nics = vec!["eth1".into()];
    p.update(&changed).expect("the xfer user updates");
    match next(&w, TTL, "a's update") {
        Event::Updated { new, .. } => assert_eq!(new.record.agent.transports[0].nics, ["eth1"]),
        other => panic!("expected a's update, got {other:?}"),
    }
    p.withdraw().expect("the xfer user withdraws");
    assert!(matches!(next(&w, TTL, "a's leave"), Event::Left(m) if m.record.name() == "a"));
    assert!(watcher.lookup(CLUSTER, "a").unwrap().is_none());
}

#[test]
fn without_a_user_every_call_is_refused_as_authentication_within_the_timeouts() {
    let Some(e) = start() else {
        return;
    };
    let o = opts(None);
    let bound = o.connect_timeout + 4 * o.call_timeout;
    let t = Instant::now();
    // etcd answers its status to anyone: connecting succeeds, each call is refused.
    let d = EtcdDirectory::connect(&[e.endpoint()], o).expect("etcd answers its status");
    let msg = assert_auth(d.publish(record("a"), TTL), None, "publish");
    assert!(msg.contains("no etcd user given"), "{msg}");
    assert_auth(d.lookup(CLUSTER, "a"), None, "lookup");
    assert_auth(d.members(CLUSTER), None, "members");
    assert_auth(d.watch(CLUSTER), None, "watch");
    assert!(t.elapsed() < bound, "took {:?}", t.elapsed());
}

#[test]
fn a_wrong_password_or_an_unknown_user_is_refused_as_authentication() {
    let Some(e) = start() else {
        return;
    };
    let o = opts(Some(user("xfer", "not-the-password")));
    let bound = o.connect_timeout;
    let t = Instant::now();
    let msg = assert_auth(
        EtcdDirectory::connect(&[e.endpoint()], o),
        Some("xfer"),
        "connect with a wrong password",
    );
    assert!(msg.contains("as etcd user \"xfer\""), "{msg}");
    assert!(!msg.contains("not-the-password"), "{msg}");
    assert!(t.elapsed() < bound, "took {:?}", t.elapsed());

    // Through the URL as well.
    let config = DirectoryConfig {
        etcd: opts(Some(user("nobody", XFER_PASSWORD))),
        ..DirectoryConfig::default()
    };
    assert_auth(
        directory::open_with(&e.url(), &config),
        Some("nobody"),
        "open as an unknown user",
    );
}

#[test]
fn a_user_without_permission_on_the_directory_keys_is_refused() {
    let Some(e) = start() else {
        return;
    };
    // Its password is right: it connects, but its role covers another prefix only.
    let d = EtcdDirectory::connect(
        &[e.endpoint()],
        opts(Some(user("elsewhere", ELSEWHERE_PASSWORD))),
    )
    .expect("the elsewhere user authenticates");
    // etcd knows the user (it sent its token) and denies it the keys.
    for msg in [
        assert_auth(
            d.publish(record("a"), TTL),
            Some("elsewhere"),
            "publish outside its role",
        ),
        assert_auth(
            d.members(CLUSTER),
            Some("elsewhere"),
            "members outside its role",
        ),
    ] {
        assert!(msg.contains("permission denied"), "{msg}");
    }
}

#[test]
fn the_password_is_never_in_debug_output() {
    let secret = "s3cret-Pa55word";
    let u = user("xfer", secret);
    let shown = format!("{u:?}");
    assert!(!shown.contains(secret), "{shown}");
    assert!(shown.contains("xfer"), "the name is shown: {shown}");
    let o = opts(Some(u));
    let shown = format!("{o:?} {o:#?}");
    assert!(!shown.contains(secret), "{shown}");
    let config = DirectoryConfig {
        etcd: o,
        ..DirectoryConfig::default()
    };
    let shown = format!("{config:?} {config:#?}");
    assert!(!shown.contains(secret), "{shown}");
}
