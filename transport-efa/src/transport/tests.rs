//! How operations share provider calls (gathering), seen from inside: which slots lead
//! calls and which ride along. Over libfabric's tcp provider on loopback, which takes four
//! iovecs per side; skipped with a note where it cannot be opened, unless
//! `XFER_REQUIRE_LIBFABRIC=1`.

use super::*;
use fabric_core::testing::{Canaried, Pair, SuiteOptions};

fn opts() -> SuiteOptions {
    SuiteOptions {
        exact_remote_errors: false,
        buffers_unexpected_sends: true,
        enforces_permissions: true,
        timeout: Duration::from_secs(20),
        many: 100,
        alloc: fabric_core::testing::host_alloc,
    }
}

fn maker(gather: usize) -> Option<impl Fn() -> EfaTransport> {
    let cfg = EfaConfig::with_provider("tcp")
        .domain("lo")
        .max_gather(gather);
    match EfaTransport::new(&cfg) {
        Ok(_) => Some(move || EfaTransport::new(&cfg).expect("open endpoint")),
        Err(e) if std::env::var("XFER_REQUIRE_LIBFABRIC").is_ok_and(|v| v == "1") => {
            panic!("libfabric's tcp provider is required (XFER_REQUIRE_LIBFABRIC=1): {e}")
        }
        Err(e) => {
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "skipped: libfabric tcp not usable: {e}");
            None
        }
    }
}

/// The sizes of the calls the provider holds: 1 + followers of each leader, in slot order.
fn calls(t: &EfaTransport) -> Vec<usize> {
    let followers: std::collections::HashSet<usize> = (0..t.ops.in_use())
        .filter_map(|i| match t.ops.get(i) {
            Slot::Active(op) => Some(op.followers.slots().collect::<Vec<_>>()),
            _ => None,
        })
        .flatten()
        .collect();
    (0..t.ops.in_use())
        .filter(|i| !followers.contains(i))
        .filter_map(|i| match t.ops.get(i) {
            Slot::Active(op) if op.posted => Some(1 + op.followers.slots().count()),
            _ => None,
        })
        .collect()
}

const PAGE: u64 = 4096;

/// Asserts that a post was taken (not refused, not answered NoRoom).
fn posted(r: fabric_core::Result<PostOutcome>) {
    assert_eq!(r.expect("post"), PostOutcome::Posted);
}

/// READs of pages `pages` of `src` into the same pages of `dst`, posted on side a.
fn read_pages(
    p: &mut Pair<EfaTransport>,
    dst: &Canaried,
    src: &Canaried,
    pages: std::ops::Range<u64>,
) {
    let peer = p.b_at_a;
    for i in pages {
        let (l, r) = (dst.local(i * PAGE, PAGE), src.remote(i * PAGE, PAGE));
        p.post_a(|t| t.post_read(peer, WorkRequestId(i), l, r));
    }
}

/// A pair whose connection is up (one write made it), so that a flush hands everything
/// over instead of meeting a connection still coming up.
fn connected(make: &dyn Fn() -> EfaTransport) -> Pair<EfaTransport> {
    let mut p = Pair::new(make, opts());
    let src = Canaried::with(opts().alloc, &mut p.a, 64, Access::NONE, 1);
    let dst = Canaried::with(opts().alloc, &mut p.b, 64, Access::REMOTE_WRITE, 0);
    assert_eq!(
        p.write_once(src.local(0, 8), dst.remote(0, 8), None).result,
        Ok(8)
    );
    p
}

#[test]
fn reads_of_one_region_go_out_four_to_a_call_and_each_completes_with_its_bytes() {
    let Some(make) = maker(4) else { return };
    let mut p = connected(&make);
    assert_eq!(p.a.gather, 4, "tcp takes 4 iovecs per side");
    let dst = Canaried::with(opts().alloc, &mut p.a, 10 * PAGE, Access::LOCAL_WRITE, 0);
    let src = Canaried::with(opts().alloc, &mut p.b, 10 * PAGE, Access::REMOTE_READ, 0);
    let data: Vec<u8> = (0..10 * PAGE).map(|i| (i * 7 + i / 4096) as u8).collect();
    src.write(0, &data);
    let peer = p.b_at_a;
    // Pages in reverse order on one side: a call's iovecs pair up page by page.
    for i in 0..10u64 {
        let (l, r) = (dst.local(i * PAGE, PAGE), src.remote((9 - i) * PAGE, PAGE));
        posted(p.a.post_read(peer, WorkRequestId(i), l, r));
    }
    assert_eq!(
        calls(&p.a),
        Vec::<usize>::new(),
        "nothing goes out before a poll"
    );
    p.a.flush_backlogs();
    assert_eq!(calls(&p.a), [4, 4, 2]);
    let done = p.take_a(10, "ten reads");
    let mut ids: Vec<u64> = done.iter().map(|c| c.wr_id.0).collect();
    ids.sort();
    assert_eq!(ids, (0..10).collect::<Vec<_>>(), "each read completes once");
    assert!(done.iter().all(|c| c.result == Ok(PAGE)), "{done:?}");
    for i in 0..10u64 {
        let want = &data[((9 - i) * PAGE) as usize..((10 - i) * PAGE) as usize];
        assert!(dst.read(i * PAGE, PAGE as usize) == want, "page {i}");
    }
    dst.assert_canaries();
    assert_eq!(p.a.ops.in_use(), 0, "every slot is free again");
}

#[test]
fn calls_never_mix_directions_regions_or_immediate_data() {
    let Some(make) = maker(4) else { return };
    let mut p = connected(&make);
    let peer = p.b_at_a;
    let local = Canaried::with(opts().alloc, &mut p.a, 8 * PAGE, Access::LOCAL_WRITE, 1);
    let one = Canaried::with(opts().alloc, &mut p.b, 8 * PAGE, Access::ALL, 2);
    let two = Canaried::with(opts().alloc, &mut p.b, 8 * PAGE, Access::ALL, 3);
    let (l, r1, r2) = (
        |i: u64| local.local(i * PAGE, PAGE),
        |i: u64| one.remote(i * PAGE, PAGE),
        |i: u64| two.remote(i * PAGE, PAGE),
    );
    let t = &mut p.a;
    let w = |i| WorkRequestId(i);
    posted(t.post_write(peer, w(0), l(0), r1(0), None));
    posted(t.post_write(peer, w(1), l(1), r1(1), None));
    posted(t.post_read(peer, w(2), l(2), r1(2))); // direction changes
    posted(t.post_read(peer, w(3), l(3), r2(3))); // region changes
    posted(t.post_read(peer, w(4), l(4), r2(4)));
    posted(t.post_write(peer, w(5), l(5), r2(5), Some(9))); // immediate data: alone
    posted(t.post_write(peer, w(6), l(6), r2(6), None));
    t.flush_backlogs();
    assert_eq!(calls(&p.a), [2, 1, 2, 1, 1]);
    let done = p.take_a(7, "seven operations");
    assert!(done.iter().all(|c| c.result == Ok(PAGE)), "{done:?}");
    p.take_b(1, "the immediate value");
}

#[test]
fn a_bad_key_fails_every_operation_of_its_call_and_no_other() {
    let Some(make) = maker(4) else { return };
    let mut p = connected(&make);
    let peer = p.b_at_a;
    let dst = Canaried::with(opts().alloc, &mut p.a, 8 * PAGE, Access::LOCAL_WRITE, 0);
    let src = Canaried::with(opts().alloc, &mut p.b, 8 * PAGE, Access::REMOTE_READ, 5);
    let mut bad = src.remote(0, PAGE);
    bad.region.key = fabric_core::RemoteKey(bad.region.key.0 ^ 0x5a5a_0000);
    for i in 0..3u64 {
        let mut r = bad;
        r.offset = i * PAGE;
        posted(p.a.post_read(peer, WorkRequestId(i), dst.local(i * PAGE, PAGE), r));
    }
    p.a.flush_backlogs();
    assert_eq!(calls(&p.a), [3]);
    let done = p.take_a(3, "three failed reads");
    assert!(done.iter().all(|c| c.result.is_err()), "{done:?}");
    dst.assert_canaries();
    assert_eq!(dst.read(0, 3 * PAGE as usize), vec![0; 3 * PAGE as usize]);
    // The connection comes back (tcp drops it after a failure at the target) and reads
    // of the good key in one call work.
    read_pages(&mut p, &dst, &src, 3..7);
    let done = p.take_a(4, "four good reads");
    assert!(done.iter().all(|c| c.result == Ok(PAGE)), "{done:?}");
    assert_eq!(
        dst.read(3 * PAGE, 4 * PAGE as usize),
        vec![5; 4 * PAGE as usize]
    );
}

#[test]
fn with_max_gather_one_each_operation_goes_alone_as_it_is_posted() {
    let Some(make) = maker(1) else { return };
    let mut p = connected(&make);
    assert_eq!(p.a.gather, 1);
    let dst = Canaried::with(opts().alloc, &mut p.a, 4 * PAGE, Access::LOCAL_WRITE, 0);
    let src = Canaried::with(opts().alloc, &mut p.b, 4 * PAGE, Access::REMOTE_READ, 8);
    read_pages(&mut p, &dst, &src, 0..4);
    let held = calls(&p.a);
    assert!(held.iter().all(|&n| n == 1), "{held:?}");
    let done = p.take_a(4, "four reads");
    assert!(done.iter().all(|c| c.result == Ok(PAGE)), "{done:?}");
}

#[test]
fn the_gather_limit_is_the_smallest_of_the_asked_the_cap_and_the_providers() {
    assert_eq!(gather_limit(4, 4, 1), 1, "efa: one remote iovec");
    assert_eq!(gather_limit(4, 4, 4), 4);
    assert_eq!(gather_limit(16, 8, 8), crate::ops::MAX_GATHER);
    assert_eq!(gather_limit(0, 4, 4), 1);
    assert_eq!(gather_limit(2, 4, 4), 2);
}

/// Over shm, which lands a peer's writes only inside the target's own progress and gives
/// the target no completion for them, the target counts them (FI_RMA_EVENT): that count is
/// how an idle target sees writes arriving and polls instead of napping (`wait`).
#[test]
fn an_shm_target_counts_the_writes_it_is_given() {
    let cfg = EfaConfig::with_provider("shm");
    let make = match EfaTransport::new(&cfg) {
        Ok(_) => move || EfaTransport::new(&cfg).expect("open endpoint"),
        Err(e) if std::env::var("XFER_REQUIRE_LIBFABRIC").is_ok_and(|v| v == "1") => {
            panic!("libfabric's shm provider is required (XFER_REQUIRE_LIBFABRIC=1): {e}")
        }
        Err(e) => {
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "skipped: libfabric shm not usable: {e}");
            return;
        }
    };
    let mut p = Pair::new(&make, opts());
    assert_eq!(
        p.b.remote_writes_counted(),
        Some(0),
        "shm offers FI_RMA_EVENT"
    );
    let src = Canaried::with(opts().alloc, &mut p.a, 8 * PAGE, Access::NONE, 1);
    let dst = Canaried::with(opts().alloc, &mut p.b, 8 * PAGE, Access::REMOTE_WRITE, 0);
    for i in 0..5 {
        let (l, r) = (src.local(i * PAGE, PAGE), dst.remote(i * PAGE, PAGE));
        assert_eq!(p.write_once(l, r, None).result, Ok(PAGE));
    }
    assert_eq!(p.b.remote_writes_counted(), Some(5));
    assert_eq!(
        p.a.remote_writes_counted(),
        Some(0),
        "a was written nothing"
    );
    dst.assert_canaries();
}
