//! KV caches moved between prefill and decode ranks of different shapes through agents:
//! every decode byte of a request equals the slice of prefill's cache, pushed (prefill
//! WRITEs, decode told by notes) and pulled (decode READs, prefill told by notes), over
//! mem and over tcp on loopback; failures name the request.

use std::sync::Arc;
use std::time::Duration;
use xfer::kv::{KvEvent, KvLayout, KvRank, KvRequest, NoteKind, Side};
use xfer::{
    Agent, AgentOptions, ErrorKind, HostBuffer, MemoryRegion, TransportChoice, TransportKind,
};

const T: Duration = Duration::from_secs(60);

mod common;
use common::kv::{Shape, cells, region_lens, shapes, table, value};

fn agent(kind: TransportKind, name: String) -> Agent {
    Agent::new(AgentOptions {
        name: Some(name),
        transport: TransportChoice::Only(kind),
        rails: Some(2),
        pin: xfer::PinMode::Off,
        ..AgentOptions::default()
    })
    .expect("an agent")
}

struct Ends {
    prefill: Vec<(KvRank, Vec<Arc<HostBuffer>>)>,
    decode: Vec<(KvRank, Vec<Arc<HostBuffer>>)>,
}

fn ends(kind: TransportKind, s: &Shape, tag: &str) -> Ends {
    let make = |side: Side, layouts: &[KvLayout]| -> Vec<(KvRank, Vec<Arc<HostBuffer>>)> {
        layouts
            .iter()
            .enumerate()
            .map(|(r, l)| {
                let bufs: Vec<Arc<HostBuffer>> = region_lens(l)
                    .iter()
                    .map(|&n| HostBuffer::new_shared(n as usize).unwrap())
                    .collect();
                let mems: Vec<Arc<dyn MemoryRegion>> = bufs
                    .iter()
                    .map(|b| b.clone() as Arc<dyn MemoryRegion>)
                    .collect();
                let a = agent(kind, format!("{tag}-{side}-{r}"));
                let rank =
                    KvRank::register(a, side, r as u32, mems, s.prefill.clone(), s.decode.clone())
                        .unwrap();
                (rank, bufs)
            })
            .collect()
    };
    let e = Ends {
        prefill: make(Side::Prefill, &s.prefill),
        decode: make(Side::Decode, &s.decode),
    };
    for (p, _) in &e.prefill {
        for (d, _) in &e.decode {
            p.attach(&d.info()).unwrap();
            d.attach(&p.info()).unwrap();
        }
    }
    e
}

fn fill_prefill(e: &Ends, req: &KvRequest) {
    for (r, (rank, bufs)) in e.prefill.iter().enumerate() {
        let l = rank.layout();
        let t = req.table(Side::Prefill, r as u32, e.prefill.len()).unwrap();
        cells(l, t, req.num_tokens, |reg, off, layer, c, token, head| {
            let bytes: Vec<u8> = (0..l.head_bytes)
                .map(|i| value(layer, c, token, head, i))
                .collect();
            bufs[reg].write(off, &bytes).unwrap();
        });
    }
}

fn check_decode(e: &Ends, req: &KvRequest, what: &str) {
    for (r, (rank, bufs)) in e.decode.iter().enumerate() {
        let l = rank.layout();
        let t = req.table(Side::Decode, r as u32, e.decode.len()).unwrap();
        cells(l, t, req.num_tokens, |reg, off, layer, c, token, head| {
            let want: Vec<u8> = (0..l.head_bytes)
                .map(|i| value(layer, c, token, head, i))
                .collect();
            let got = bufs[reg].to_vec(off, l.head_bytes as usize).unwrap();
            assert_eq!(
                got, want,
                "{what}: decode rank {r} layer {layer} comp {c} token {token} head {head}"
            );
        });
    }
}

fn clear_decode(e: &Ends) {
    for (_, bufs) in &e.decode {
        for b in bufs {
            b.fill(0, b.len() as u64, 0).unwrap();
        }
    }
}

fn every_shape(kind: TransportKind) {
    for (i, s) in shapes().iter().enumerate() {
        let e = ends(kind, s, &format!("kv{i}"));
        let pb = s.prefill[0].num_blocks;
        let db = s.decode[0].num_blocks;
        let p_bs = s.prefill[0].block_size as u64;
        let d_bs = s.decode[0].block_size as u64;
        let tokens = (pb as u64 * p_bs).min(db as u64 * d_bs) - 3;
        let req = KvRequest::new(
            tokens,
            table(tokens.div_ceil(p_bs) as usize, pb, 11 + i as u64),
            table(tokens.div_ceil(d_bs) as usize, db, 29 + i as u64),
        );
        fill_prefill(&e, &req);

        // Push, layer by layer: decode learns each request from the notes.
        let id = format!("push-{i}");
        let plan = e.prefill[0].0.plan(&req).unwrap();
        let mut sends = Vec::new();
        for (p, _) in &e.prefill {
            let mut t = p.push_layer(id.as_bytes(), &plan, 0, None).unwrap();
            for layer in 1..p.layers() {
                t.extend(p.push_layer(id.as_bytes(), &plan, layer, None).unwrap());
            }
            sends.push(t);
        }
        for (d, _) in &e.decode {
            d.wait(id.as_bytes(), T)
                .unwrap_or_else(|e| panic!("{}: {e}", s.name));
            let events = d.poll().unwrap();
            assert!(events.contains(&KvEvent::Request {
                kind: NoteKind::Landed,
                request: id.clone().into_bytes()
            }));
        }
        for t in &sends {
            t.wait(T).unwrap();
        }
        check_decode(&e, &req, &format!("{} push", s.name));

        // Pull: decode reads; prefill learns that every reader is done.
        clear_decode(&e);
        let id = format!("pull-{i}");
        let reads: Vec<_> = e
            .decode
            .iter()
            .map(|(d, _)| d.pull(id.as_bytes(), &d.plan(&req).unwrap()).unwrap())
            .collect();
        for r in &reads {
            r.wait(T).unwrap_or_else(|e| panic!("{}: {e:?}", s.name));
        }
        check_decode(&e, &req, &format!("{} pull", s.name));
        for (p, _) in &e.prefill {
            if plan.pairs_from(p.info().rank).next().is_some() {
                p.wait(id.as_bytes(), T).unwrap();
            }
        }
    }
}

#[test]
fn every_shape_over_mem() {
    every_shape(TransportKind::Mem);
}

#[test]
fn every_shape_over_tcp() {
    every_shape(TransportKind::Tcp);
}

#[test]
fn a_layer_is_known_as_it_lands_and_errors_name_the_request() {
    let s = &shapes()[0];
    let e = ends(TransportKind::Mem, s, "layers");
    let req = KvRequest::new(40, table(5, 24, 3), table(10, 40, 4));
    fill_prefill(&e, &req);
    let plan = e.prefill[0].0.plan(&req).unwrap();
    for (p, _) in &e.prefill {
        p.push_layer(b"r1", &plan, 1, None)
            .unwrap()
            .wait(T)
            .unwrap();
    }
    let d = &e.decode[2].0;
    d.wait_layer(b"r1", 1, T).unwrap();
    let err = d.wait(b"r1", Duration::from_millis(20)).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::TimedOut);
    assert!(
        err.to_string().contains("\"r1\"") && err.to_string().contains("1 of 3"),
        "{err}"
    );
    // Wrong calls are refused with what to do.
    assert_eq!(
        d.push(b"r1", &plan, None).unwrap_err().kind(),
        ErrorKind::InvalidInput
    );
    let e2 = e.prefill[0]
        .0
        .push_layer(b"r1", &plan, 9, None)
        .unwrap_err();
    assert!(e2.to_string().contains("layer 9"), "{e2}");
    assert_eq!(
        e.prefill[0]
            .0
            .push_layer(b"", &plan, 0, None)
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidInput
    );
    // A decode rank that went away fails the requests sent to it, named.
    let (gone, _) = e.decode.into_iter().next().unwrap();
    drop(gone);
    let err = e.prefill[0]
        .0
        .push(b"r2", &plan, None)
        .and_then(|t| t.wait(T))
        .unwrap_err();
    assert!(err.to_string().contains("\"r2\""), "{err}");
}
