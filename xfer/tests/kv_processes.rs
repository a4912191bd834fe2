//! KV requests between processes over tcp: one decode rank fed by two prefill instances
//! (each its own process), pulled and pushed; every byte checked; and a prefill process
//! killed in the middle of its request fails that request only, named, while the other
//! instance's request lands.
//!
//! Its own harness (`harness = false`): run with `XFER_KV_PREFILL=<seed>`, this binary is a
//! prefill instance (TP 1): it fills its cache from the seed, prints its rank's info as a
//! JSON line, pushes requests it reads from stdin (`push <id> <attach-json-hex>`, the
//! decode rank's info) and exits at end of input.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;
use xfer::kv::{KvLayout, KvModel, KvRank, KvRankInfo, KvRequest, Regions, Side};
use xfer::{
    Agent, AgentOptions, ErrorKind, HostBuffer, MemoryRegion, TransportChoice, TransportKind,
};

const T: Duration = Duration::from_secs(60);
const BLOCKS: u32 = 64;
const BLOCK: u32 = 16;

fn model() -> KvModel {
    KvModel::new(4, 8, 64, 2)
}

fn layout() -> KvLayout {
    KvLayout::vllm_flash_attn(&model(), 0..8, BLOCKS, BLOCK, Regions::Packed).unwrap()
}

fn agent(name: &str) -> Agent {
    Agent::new(AgentOptions {
        name: Some(name.into()),
        transport: TransportChoice::Only(TransportKind::Tcp),
        rails: Some(2),
        pin: xfer::PinMode::Off,
        ..AgentOptions::default()
    })
    .unwrap()
}

fn cache_len(l: &KvLayout) -> usize {
    (0..l.num_layers)
        .flat_map(|layer| (0..l.components).map(move |c| (layer, c)))
        .map(|(layer, c)| l.extent(layer, c).unwrap())
        .max()
        .unwrap() as usize
}

/// Prefill instance `seed`'s cache byte at `at`.
fn byte(seed: u64, at: u64) -> u8 {
    ((at.wrapping_mul(0x9e37_79b9) >> 7) ^ seed.wrapping_mul(77)) as u8
}

fn prefill(seed: u64) {
    let l = layout();
    let mem = HostBuffer::new_shared(cache_len(&l)).unwrap();
    mem.fill_with(|at, chunk| {
        for (i, b) in chunk.iter_mut().enumerate() {
            *b = byte(seed, at + i as u64);
        }
    });
    let rank = KvRank::register(
        agent(&format!("prefill-{seed}")),
        Side::Prefill,
        0,
        vec![mem as Arc<dyn MemoryRegion>],
        vec![l.clone()],
        vec![l],
    )
    .unwrap();
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", serde_json::to_string(&rank.info()).unwrap()).unwrap();
    out.flush().unwrap();
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let mut parts = line.splitn(3, ' ');
        let (_, id, info) = (parts.next(), parts.next().unwrap(), parts.next().unwrap());
        let info: KvRankInfo = serde_json::from_str(info).unwrap();
        rank.attach(&info).unwrap();
        let req = request(seed);
        let plan = rank.plan(&req).unwrap();
        let ok = rank
            .push(id.as_bytes(), &plan, None)
            .and_then(|t| t.wait(T));
        writeln!(out, "{}", if ok.is_ok() { "pushed" } else { "failed" }).unwrap();
        out.flush().unwrap();
    }
}

/// Instance `seed`'s request: 200 tokens from its blocks `seed*16..` into decode blocks
/// `seed*20..` in reverse.
fn request(seed: u64) -> KvRequest {
    let s = seed as u32;
    KvRequest::new(
        200,
        (0..13).map(|b| (b * 3 + s) % BLOCKS).collect(),
        (0..13).rev().map(|b| s * 20 + b).collect(),
    )
}

struct Instance {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<std::process::ChildStdout>,
    info: KvRankInfo,
}

impl Instance {
    fn start(seed: u64) -> Instance {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .env("XFER_KV_PREFILL", seed.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut l = String::new();
        stdout.read_line(&mut l).unwrap();
        let info = serde_json::from_str(&l).unwrap();
        Instance {
            child,
            stdin,
            stdout,
            info,
        }
    }

    fn signal(&self, sig: &str) {
        let ok = Command::new("sh")
            .args(["-c", &format!("kill -{sig} {}", self.child.id())])
            .status()
            .unwrap()
            .success();
        assert!(ok);
    }

    fn push(&mut self, id: &str, decode: &KvRankInfo) -> String {
        let info = serde_json::to_string(decode).unwrap();
        writeln!(self.stdin, "push {id} {info}").unwrap();
        self.stdin.flush().unwrap();
        let mut l = String::new();
        self.stdout.read_line(&mut l).unwrap();
        l.trim().to_owned()
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Decode's bytes of `req` equal prefill instance `seed`'s.
fn landed(l: &KvLayout, dst: &HostBuffer, req: &KvRequest, seed: u64) -> bool {
    let (pt, dt) = (&req.prefill_blocks[0], &req.decode_blocks[0]);
    (0..l.num_layers).all(|layer| {
        (0..l.components).all(|c| {
            let place = l.place(layer, c).unwrap();
            (0..req.num_tokens).all(|t| {
                let at = |b: u32| {
                    place.offset + b as u64 * l.block_stride + (t % BLOCK as u64) * l.token_stride
                };
                let (p, d) = (at(pt[(t / 16) as usize]), at(dt[(t / 16) as usize]));
                let row = l.head_bytes * 8;
                let got = dst.to_vec(d, row as usize).unwrap();
                got.iter()
                    .enumerate()
                    .all(|(i, &x)| x == byte(seed, p + i as u64))
            })
        })
    })
}

fn main() {
    if let Ok(seed) = std::env::var("XFER_KV_PREFILL") {
        prefill(seed.parse().unwrap());
        return;
    }
    let l = layout();
    let mem = HostBuffer::new_shared(cache_len(&l)).unwrap();
    let decode = agent("decode");
    let region = decode
        .register(mem.clone(), KvRank::access(Side::Decode))
        .unwrap();
    let (mut a, mut b) = (Instance::start(1), Instance::start(2));
    // One decode rank per prefill instance, over one agent and one cache.
    let rank_of = |i: &Instance| {
        let r = KvRank::new(
            decode.clone(),
            Side::Decode,
            0,
            vec![region.clone()],
            vec![l.clone()],
            vec![l.clone()],
        )
        .unwrap();
        r.attach(&i.info).unwrap();
        r
    };
    let (from_a, from_b) = (rank_of(&a), rank_of(&b));

    // Push: each instance writes its request; decode learns each from the notes.
    assert_eq!(a.push("push-a", &from_a.info()), "pushed");
    assert_eq!(b.push("push-b", &from_b.info()), "pushed");
    from_a.wait(b"push-a", T).unwrap();
    from_b.wait(b"push-b", T).unwrap();
    assert!(landed(&l, &mem, &request(1), 1), "push-a's bytes");
    assert!(landed(&l, &mem, &request(2), 2), "push-b's bytes");

    // Pull, with instance a killed in the middle of its request.
    mem.fill(0, mem.len() as u64, 0).unwrap();
    let (ra, rb) = (request(1), request(2));
    a.signal("STOP");
    let pull_a = from_a.pull(b"pull-a", &from_a.plan(&ra).unwrap()).unwrap();
    let pull_b = from_b.pull(b"pull-b", &from_b.plan(&rb).unwrap()).unwrap();
    a.signal("KILL");
    let e = pull_a.wait(T).expect_err("instance a died mid-request");
    assert!(e.to_string().contains("\"pull-a\""), "{e}");
    assert_eq!(e.kind(), ErrorKind::PeerUnreachable, "{e}");
    assert!(
        pull_a.is_finished(),
        "reported once nothing can write into its blocks"
    );
    pull_b
        .wait(T)
        .expect("the other instance's request is untouched");
    assert!(landed(&l, &mem, &rb, 2), "pull-b's bytes");
    b.stdin.flush().unwrap();
    println!("kv_processes: push from two prefill processes and a killed one's pull: passed");
}
