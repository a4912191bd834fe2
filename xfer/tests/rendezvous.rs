//! The direct rendezvous between two agents of this process over loopback: the client
//! finds the server's named region by name, writes into it with immediate data, and the
//! server sees every byte; a client without the token is refused before anything happens,
//! and so is a server without it (or one that cannot prove it).

use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;
use xfer::rendezvous::{NoService, ServeLimits, ServeStats};
use xfer::{Access, Agent, AgentOptions, HostBuffer, PinMode, Transfer, TransportKind};

const T: Duration = Duration::from_secs(20);

fn agent() -> Agent {
    Agent::new(AgentOptions {
        pin: PinMode::Off,
        ..AgentOptions::default()
    })
    .expect("an agent")
}

/// A server agent offering a 1 MiB region named "kv", serving on loopback; its address.
fn server(
    token: Option<&str>,
) -> (
    Agent,
    Arc<HostBuffer>,
    std::net::SocketAddr,
    Arc<ServeStats>,
) {
    let a = agent();
    let buf = HostBuffer::new_shared(1 << 20).unwrap();
    let r = a.register(buf.clone(), Access::REMOTE_WRITE).unwrap();
    a.offer("kv", &r).unwrap();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let at = l.local_addr().unwrap();
    let stats = Arc::new(ServeStats::default());
    let (agents, st, tok) = (vec![a.clone()], stats.clone(), token.map(str::to_owned));
    std::thread::spawn(move || {
        let _ = xfer::rendezvous::serve(
            l,
            agents,
            ServeLimits::default(),
            st,
            tok,
            Arc::new(NoService),
        );
    });
    (a, buf, at, stats)
}

#[test]
fn a_client_finds_the_named_region_and_writes_into_it() {
    let (srv, dst, at, stats) = server(Some("s3cret"));
    let c = agent();
    let (peer, welcome) = c.rendezvous(at, Some("s3cret"), T).expect("rendezvous");
    assert_eq!(peer.transport(), TransportKind::Tcp);
    assert_eq!(welcome.transport, TransportKind::Tcp);
    assert_eq!(welcome.agent.name, srv.name());
    let kv = welcome.regions.get("kv").expect("the named region");
    let src = HostBuffer::new_shared(1 << 20).unwrap();
    src.fill(0, 1 << 20, 0x5a).unwrap();
    let s = c.register(src, Access::NONE).unwrap();
    let t = Transfer::pages(&[0, 2, 5], 4096, &[7, 1, 3], 4096, 4096)
        .unwrap()
        .imm(77);
    c.submit(&peer, &s, kv, t).unwrap().wait(T).unwrap();
    srv.wait_imm(77, 1, T).expect("the server is told");
    for p in [7, 1, 3] {
        assert_eq!(
            dst.to_vec(p * 4096, 4096).unwrap(),
            vec![0x5a; 4096],
            "page {p}"
        );
    }
    assert_eq!(
        dst.to_vec(0, 4096).unwrap(),
        vec![0; 4096],
        "page 0 untouched"
    );
    assert_eq!(stats.refusals(xfer::rendezvous::Refusal::Auth), 0);
}

#[test]
fn without_the_token_the_client_is_refused_and_nothing_is_connected() {
    let (_srv, _dst, at, stats) = server(Some("s3cret"));
    let c = agent();
    let e = c.rendezvous(at, Some("guess"), T).unwrap_err();
    assert!(e.to_string().contains("rendezvous"), "{e}");
    let why = format!("{:?}", e);
    assert!(why.contains("authentication failed"), "{why}");
    assert!(c.rendezvous(at, None, T).is_err(), "no token at all");
    assert_eq!(stats.refusals(xfer::rendezvous::Refusal::Auth), 2);
    assert_eq!(stats.admitted.load(std::sync::atomic::Ordering::Relaxed), 0);
}

#[test]
fn a_token_on_one_side_only_is_refused_by_both_with_the_side_that_lacks_it() {
    use xfer::rendezvous::ClientError;
    // A client with a token no longer talks to a server without one.
    let (_srv, _dst, at, stats) = server(None);
    let c = agent();
    match c.rendezvous(at, Some("s3cret"), T).unwrap_err() {
        xfer::Error::Rendezvous(ClientError::ServerHasNoToken { addr }) => assert_eq!(addr, at),
        e => panic!("{e:?}"),
    }
    assert_eq!(stats.refusals(xfer::rendezvous::Refusal::Auth), 1);
    // A client without one is told the server has one (typed), and the server says why.
    let (_srv, _dst, at, stats) = server(Some("s3cret"));
    match c.rendezvous(at, None, T).unwrap_err() {
        xfer::Error::Rendezvous(ClientError::NoTokenHere { addr }) => assert_eq!(addr, at),
        e => panic!("{e:?}"),
    }
    // Another token: the server refuses the hello's proof, and the client says so.
    match c.rendezvous(at, Some("guess"), T).unwrap_err() {
        xfer::Error::Rendezvous(ClientError::AuthRefused { reason, .. }) => {
            assert!(reason.contains("does not prove"), "{reason}")
        }
        e => panic!("{e:?}"),
    }
    assert_eq!(stats.refusals(xfer::rendezvous::Refusal::Auth), 2);
    assert_eq!(stats.admitted.load(std::sync::atomic::Ordering::Relaxed), 0);
}

/// A fake rendezvous server that greets `greeting_auth` and welcomes any hello with a
/// well-formed reply (its agent one of this process) whose proof is `proof(client
/// nonce)`; what the client's rendezvous gave.
fn against_fake_server(greeting_auth: bool, proof: Prover) -> Result<(), xfer::Error> {
    use std::io::{BufRead, BufReader, Write};
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let at = l.local_addr().unwrap();
    let me = agent();
    let info = serde_json::to_value(me.info()).unwrap();
    let fake = std::thread::spawn(move || {
        let (mut conn, _) = l.accept().unwrap();
        let nonce = transport_tcp::auth::Nonce::new().unwrap();
        let greeting = serde_json::json!({
            "op": "challenge", "version": xfer::rendezvous::VERSION,
            "nonce": nonce.to_hex(), "auth": greeting_auth,
        });
        writeln!(conn, "{greeting}").unwrap();
        let mut line = String::new();
        BufReader::new(conn.try_clone().unwrap())
            .read_line(&mut line)
            .unwrap();
        let hello: serde_json::Value = serde_json::from_str(&line).unwrap();
        let theirs: transport_tcp::auth::Nonce = hello["nonce"].as_str().unwrap().parse().unwrap();
        let mut reply = serde_json::json!({
            "ok": true, "agent": info, "transport": "tcp", "regions": {},
        });
        if let Some(p) = proof(&theirs) {
            reply["proof"] = p.into();
        }
        writeln!(conn, "{reply}").unwrap();
        conn
    });
    let c = agent();
    let r = c.rendezvous(at, Some("s3cret"), T).map(|_| ());
    drop(fake.join().unwrap());
    r
}

#[test]
fn a_server_that_does_not_prove_the_token_is_refused_by_the_client() {
    use transport_tcp::auth;
    use xfer::rendezvous::{ClientError, PROOF_CONTEXT};
    let cases: [(&str, Prover); 4] = [
        ("no proof", |_| None),
        ("another token's", |n| {
            Some(hex_of(&auth::tag("guess", PROOF_CONTEXT, n)))
        }),
        ("another nonce's (a replay)", |_| {
            Some(hex_of(&auth::tag(
                "s3cret",
                PROOF_CONTEXT,
                &auth::Nonce::new().unwrap(),
            )))
        }),
        ("the hello's context", |n| {
            Some(hex_of(&auth::tag(
                "s3cret",
                xfer::rendezvous::AUTH_CONTEXT,
                n,
            )))
        }),
    ];
    for (what, proof) in cases {
        match against_fake_server(true, proof) {
            Err(xfer::Error::Rendezvous(ClientError::ServerAuthFailed { .. })) => {}
            r => panic!("{what}: {r:?}"),
        }
    }
    // A greeting that says the server has no token: refused before any tag is sent.
    match against_fake_server(false, |_| None) {
        Err(xfer::Error::Rendezvous(ClientError::ServerHasNoToken { .. })) => {}
        r => panic!("{r:?}"),
    }
    // The right proof is taken (the client goes on to connect to the fake's agent).
    against_fake_server(true, |n| {
        Some(hex_of(&auth::tag("s3cret", PROOF_CONTEXT, n)))
    })
    .expect("a welcome that proves the token");
}

/// What a fake server answers a client's nonce with.
type Prover = fn(&transport_tcp::auth::Nonce) -> Option<String>;

fn hex_of(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn agents_with_no_transport_in_common_are_told_so() {
    let (_srv, _dst, at, stats) = server(None);
    let mem_only = Agent::new(AgentOptions {
        transport: xfer::TransportChoice::Only(TransportKind::Mem),
        pin: PinMode::Off,
        ..AgentOptions::default()
    })
    .unwrap();
    let e = mem_only.rendezvous(at, None, T).unwrap_err();
    let why = format!("{e:?}");
    assert!(why.contains("no transport in common"), "{why}");
    assert_eq!(stats.refusals(xfer::rendezvous::Refusal::BadRequest), 1);
}

#[test]
fn an_agent_says_which_host_and_network_namespace_it_runs_in() {
    let a = agent();
    let ns = std::fs::read_link("/proc/self/ns/net").expect("Linux names its namespaces");
    assert_eq!(a.info().net_namespace, ns.to_string_lossy());
    assert!(!a.info().boot_id.is_empty());
    let b = agent();
    assert!(a.info().same_net_namespace(b.info()));
    let (_srv, _dst, at, _stats) = server(None);
    let (_peer, welcome) = a.rendezvous(at, None, T).expect("rendezvous");
    assert_eq!(
        welcome.agent.net_namespace,
        a.info().net_namespace,
        "the server's record carries it across"
    );
}

#[test]
fn a_started_server_serves_until_stopped_and_then_its_port_is_closed() {
    let a = agent();
    let buf = HostBuffer::new_shared(4096).unwrap();
    let r = a.register(buf.clone(), Access::REMOTE_WRITE).unwrap();
    a.offer("kv", &r).unwrap();
    let srv = xfer::rendezvous::Server::start(
        TcpListener::bind("127.0.0.1:0").unwrap(),
        vec![a.clone()],
        ServeLimits::default(),
        Arc::new(ServeStats::default()),
        None,
        Arc::new(NoService),
    )
    .expect("started");
    let at = srv.local_addr();
    let c = agent();
    let (_peer, welcome) = c.rendezvous(at, None, T).expect("served");
    assert!(welcome.regions.contains_key("kv"));
    srv.stop().expect("stopped cleanly");
    let e = std::net::TcpStream::connect_timeout(&at, T).expect_err("nobody listens any more");
    assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused, "{e}");
}
