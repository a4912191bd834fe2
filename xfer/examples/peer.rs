//! One side of a two-process exchange, for agents written in other languages to meet: it
//! offers a 1 MiB region named "inbox", finds its peer, writes its own pattern into the
//! peer's "inbox" with immediate data 1, waits for the peer's immediate data 1 and checks
//! that its own inbox holds the peer's pattern. Prints `ok` and exits 0, or says what
//! failed and exits 1. The Python test `xfer-py/tests/test_interop.py` runs it against a
//! Python engine.
//!
//! ```text
//! peer etcd URL CLUSTER NAME PEER     # publish as NAME, follow CLUSTER until PEER is there
//! peer rendezvous                     # serve; print "listening IP:PORT"; read the peer's
//!                                     # IP:PORT from stdin, rendezvous with it
//! ```
//!
//! Byte `i` of the pattern of `seed` is `(i * 7 + seed) % 251`; this side writes seed 1 and
//! expects seed 2 (`--seeds 2,1` swaps them, for two of these against each other).

use std::io::{BufRead, Write};
use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;
use xfer::rendezvous::{NoService, ServeLimits, ServeStats, Server};
use xfer::{
    Access, Agent, AgentOptions, HostBuffer, MemoryRegion, PinMode, RegionDescriptor, Transfer,
};

const LEN: usize = 1 << 20;
const T: Duration = Duration::from_secs(30);

fn pattern(seed: usize) -> Vec<u8> {
    (0..LEN).map(|i| ((i * 7 + seed) % 251) as u8).collect()
}

fn main() {
    if let Err(e) = run() {
        let mut line = e.to_string();
        let mut cause = e.source();
        while let Some(c) = cause {
            line.push_str(&format!(": {c}"));
            cause = c.source();
        }
        eprintln!("peer: {line}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let (mine, theirs) = match args.iter().position(|a| a == "--seeds") {
        Some(i) if i + 1 < args.len() => {
            let v: Vec<usize> = args[i + 1]
                .split(',')
                .map(str::parse)
                .collect::<Result<_, _>>()?;
            args.drain(i..i + 2);
            match v[..] {
                [a, b] => (a, b),
                _ => return Err("--seeds takes two numbers, MINE,THEIRS".into()),
            }
        }
        _ => (1, 2),
    };
    let name = match args.first().map(String::as_str) {
        Some("etcd") => args.get(3).cloned(),
        _ => None,
    };
    let agent = Agent::new(AgentOptions {
        name,
        pin: PinMode::Off,
        ..AgentOptions::default()
    })?;
    let inbox = HostBuffer::new_shared(LEN)?;
    let ours = agent.register(inbox.clone(), Access::REMOTE_WRITE)?;
    agent.offer("inbox", &ours)?;
    let src = HostBuffer::new_shared(LEN)?;
    src.write_from_host(0, &pattern(mine))?;
    let src = agent.register(src, Access::NONE)?;

    // Whatever finds the peer keeps what it needs alive until the exchange is over.
    let (_kept, peer, theirs_inbox): (Box<dyn std::any::Any>, xfer::Peer, RegionDescriptor) =
        match args.first().map(String::as_str) {
            Some("etcd") if args.len() == 5 => {
                let dir = directory::open(&args[1])?;
                let publication = agent.publish(&*dir, &args[2], Duration::from_secs(10))?;
                let following = agent.follow(&*dir, &args[2])?;
                let c = following.wait_for(&args[4], T)?;
                let region = c.region("inbox")?.clone();
                (Box::new((publication, following)), c.peer, region)
            }
            Some("rendezvous") if args.len() == 1 => {
                let server = Server::start(
                    TcpListener::bind("127.0.0.1:0")?,
                    vec![agent.clone()],
                    ServeLimits::default(),
                    Arc::new(ServeStats::default()),
                    None,
                    Arc::new(NoService),
                )?;
                println!("listening {}", server.local_addr());
                std::io::stdout().flush()?;
                let mut line = String::new();
                std::io::stdin().lock().read_line(&mut line)?;
                let at = line.trim().parse()?;
                let (peer, welcome) = agent.rendezvous(at, None, T)?;
                let region = welcome
                    .regions
                    .get("inbox")
                    .cloned()
                    .ok_or("the peer offers no region named inbox")?;
                (Box::new(server), peer, region)
            }
            _ => {
                return Err(
                    "usage: peer etcd URL CLUSTER NAME PEER | peer rendezvous [--seeds M,T]".into(),
                );
            }
        };
    let t = Transfer::segments(vec![(0, 0, LEN as u64)]).imm(1);
    agent.submit(&peer, &src, &theirs_inbox, t)?.wait(T)?;
    agent.wait_imm(1, 1, T)?;
    if inbox.to_vec(0, LEN)? != pattern(theirs) {
        return Err("the inbox does not hold the peer's pattern".into());
    }
    println!("ok");
    std::io::stdout().flush()?;
    // The peer may still be writing to us or waiting for our write to be acknowledged:
    // stay until it closes our stdin (or says nothing more) before going.
    let mut rest = String::new();
    let _ = std::io::stdin().lock().read_line(&mut rest);
    Ok(())
}
