//! The agent's token from a file (`AgentOptions::auth_token_file`), and what an agent
//! without a token does when it listens beyond loopback: a warning, or with
//! `require_auth` a typed refusal to start.

use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use xfer::{
    Access, Agent, AgentOptions, AuthTokenError, Error, HostBuffer, PinMode, Transfer,
    TransportChoice, TransportKind,
};

const T: Duration = Duration::from_secs(20);

fn options() -> AgentOptions {
    AgentOptions {
        transport: TransportChoice::Only(TransportKind::Tcp),
        pin: PinMode::Off,
        ..AgentOptions::default()
    }
}

/// A file of this test's own holding `contents`.
fn token_file(name: &str, contents: &[u8]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("xfer-auth-options-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::File::create(&path)
        .unwrap()
        .write_all(contents)
        .unwrap();
    path
}

/// Writes 4 KiB from `src_agent` into a region of `dst_agent`; the result.
fn write_between(src_agent: &Agent, dst_agent: &Agent) -> xfer::Result<()> {
    let dst = HostBuffer::new_shared(4096).unwrap();
    let d = dst_agent.register(dst, Access::REMOTE_WRITE)?;
    let src = HostBuffer::new_shared(4096).unwrap();
    src.fill(0, 4096, 0x3c).unwrap();
    let s = src_agent.register(src, Access::NONE)?;
    let peer = src_agent.connect(dst_agent.info())?;
    let t = Transfer::pages(&[0], 4096, &[0], 4096, 4096)?;
    src_agent.submit(&peer, &s, d.descriptor(), t)?.wait(T)?;
    Ok(())
}

#[test]
fn a_token_from_a_file_is_the_token_with_its_final_newline_trimmed() {
    for (name, contents) in [
        ("lf", &b"s3cret\n"[..]),
        ("crlf", b"s3cret\r\n"),
        ("bare", b"s3cret"),
    ] {
        let from_file = Agent::new(AgentOptions {
            auth_token_file: Some(token_file(name, contents)),
            ..options()
        })
        .expect("an agent with its token from a file");
        let with_token = Agent::new(AgentOptions {
            auth_token: Some("s3cret".into()),
            ..options()
        })
        .unwrap();
        write_between(&with_token, &from_file).expect("the same token");
        // Without the token, refused: the file's token is in force.
        let without = Agent::new(options()).unwrap();
        assert!(
            write_between(&without, &from_file).is_err(),
            "{name}: a peer without the token got in"
        );
    }
}

#[test]
fn unreadable_empty_or_doubled_tokens_are_refused_with_typed_errors() {
    let missing = std::env::temp_dir().join("xfer-auth-options-no-such-file");
    match Agent::new(AgentOptions {
        auth_token_file: Some(missing.clone()),
        ..options()
    }) {
        Err(Error::AuthToken(AuthTokenError::Unreadable { path, source })) => {
            assert_eq!(path, missing);
            assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
        }
        r => panic!("{:?}", r.err()),
    }
    for (name, contents) in [("empty", &b""[..]), ("newline", b"\n")] {
        let path = token_file(name, contents);
        match Agent::new(AgentOptions {
            auth_token_file: Some(path.clone()),
            ..options()
        }) {
            Err(Error::AuthToken(AuthTokenError::Empty { path: p })) => assert_eq!(p, path),
            r => panic!("{name}: {:?}", r.err()),
        }
    }
    let Err(e) = Agent::new(AgentOptions {
        auth_token: Some("s3cret".into()),
        auth_token_file: Some(token_file("both", b"s3cret")),
        ..options()
    }) else {
        panic!("both a token and a file were taken");
    };
    assert!(matches!(e, Error::AuthToken(AuthTokenError::Both)), "{e:?}");
    assert_eq!(e.kind(), xfer::ErrorKind::InvalidInput);
    // The file's contents never appear in an error.
    let e = xfer::read_token_file(&token_file("nonutf8", &[0xff, 0xfe])).unwrap_err();
    assert!(matches!(e, AuthTokenError::NotUtf8 { .. }), "{e:?}");
}

#[test]
fn require_auth_refuses_to_start_an_agent_without_a_token_beyond_loopback() {
    let exposed = || AgentOptions {
        listen: "0.0.0.0".parse().unwrap(),
        require_auth: true,
        ..options()
    };
    match Agent::new(exposed()) {
        Err(Error::AuthToken(AuthTokenError::Required { what, address })) => {
            assert_eq!(what, "tcp rail 0");
            // Every interface, or the NIC the placement plan chose there.
            let at: std::net::SocketAddr = address.parse().unwrap();
            assert!(!at.ip().is_loopback(), "{address}");
        }
        r => panic!("{:?}", r.err()),
    }
    // A rendezvous address beyond loopback counts too.
    match Agent::new(AgentOptions {
        control: Some("192.0.2.1:7471".into()),
        require_auth: true,
        ..options()
    }) {
        Err(Error::AuthToken(AuthTokenError::Required { what, address })) => {
            assert_eq!(
                (what.as_str(), address.as_str()),
                ("the rendezvous", "192.0.2.1:7471")
            );
        }
        r => panic!("{:?}", r.err()),
    }
    // With a token (or a file's), or on loopback only, it starts.
    Agent::new(AgentOptions {
        auth_token: Some("s3cret".into()),
        ..exposed()
    })
    .expect("with a token");
    Agent::new(AgentOptions {
        auth_token_file: Some(token_file("required", b"s3cret\n")),
        ..exposed()
    })
    .expect("with a token from a file");
    Agent::new(AgentOptions {
        require_auth: true,
        control: Some("127.0.0.1:7471".into()),
        ..options()
    })
    .expect("on loopback");
}

/// What `f` logged at WARN or above, as text.
fn warnings(f: impl FnOnce()) -> String {
    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<u8>>>);
    impl Write for Sink {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let sink = Sink::default();
    let writer = sink.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    tracing::subscriber::with_default(subscriber, f);
    String::from_utf8(sink.0.lock().unwrap().clone()).unwrap()
}

#[test]
fn an_agent_without_a_token_beyond_loopback_says_so_once() {
    let said = warnings(|| {
        Agent::new(AgentOptions {
            listen: "0.0.0.0".parse().unwrap(),
            ..options()
        })
        .expect("it starts");
    });
    assert_eq!(said.matches("without an auth token").count(), 1, "{said}");
    assert!(said.contains("listeners=tcp rail 0 "), "{said}");
    // On loopback, or with a token: nothing said.
    let quiet = warnings(|| {
        Agent::new(options()).unwrap();
        Agent::new(AgentOptions {
            listen: "0.0.0.0".parse().unwrap(),
            auth_token: Some("s3cret".into()),
            ..options()
        })
        .unwrap();
    });
    assert!(!quiet.contains("without an auth token"), "{quiet}");
}
