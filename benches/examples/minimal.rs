// Two engines over TCP on loopback: write three scattered pages with immediate data.
use fabric_core::engine::{Engine, EngineConfig, Transfer};
use fabric_core::plan::Segment;
use fabric_core::{Access, HostBuffer};
use std::time::Duration;
use transport_tcp::{TcpConfig, TcpTransport};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    const PAGE: u64 = 4096;
    // Each engine is a worker thread that owns one transport (here TCP on 127.0.0.1).
    let tcp = || {
        TcpTransport::new(TcpConfig {
            rails: 2,
            ..TcpConfig::default()
        })
    };
    let sender = Engine::spawn(tcp, EngineConfig::default())?;
    let receiver = Engine::spawn(tcp, EngineConfig::default())?;

    // Register memory: the source needs no remote access, the target allows remote writes.
    let src = HostBuffer::new_shared(16 * PAGE as usize)?;
    src.fill_with(|off, chunk| chunk.fill((off / PAGE) as u8 + 1));
    let dst = HostBuffer::new_shared(16 * PAGE as usize)?;
    let s = sender.register(src.clone(), Access::NONE)?;
    let d = receiver.register(dst.clone(), Access::REMOTE_WRITE)?;
    // `d.remote` is serde: real programs ship it, and the address, to the sender.
    let peer = sender.add_peer(&receiver.address())?;

    // Pages 1, 7 and 12 of the source land at the same pages of the target.
    let mut t = Transfer::new(peer).imm(42);
    for page in [1, 7, 12] {
        t = t.segment(Segment {
            src: s.local,
            src_offset: page * PAGE,
            dst: d.remote,
            dst_offset: page * PAGE,
            len: PAGE,
        });
    }
    let stats = sender.submit(t)?.wait(Duration::from_secs(10))?;
    // The receiver learns that every byte has landed from the immediate value.
    let event = receiver.next_event(Duration::from_secs(10))?;

    assert_eq!(stats.bytes, 3 * PAGE);
    assert_eq!(event.imm(), Some(42));
    for page in [1, 7, 12] {
        assert_eq!(
            dst.to_vec(page * PAGE, PAGE as usize)?,
            src.to_vec(page * PAGE, PAGE as usize)?
        );
    }
    assert_eq!(dst.to_vec(0, PAGE as usize)?, vec![0; PAGE as usize]);
    println!(
        "moved {} bytes in {} writes; imm {:?}",
        stats.bytes,
        stats.ops,
        event.imm()
    );
    Ok(())
}
