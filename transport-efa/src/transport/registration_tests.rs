//! Registrations seen from inside, over libfabric's software providers on loopback (which
//! let the application choose keys): requested keys are random and never taken, and a
//! registration whose close fails keeps its memory. Skipped with a note where a provider
//! cannot be opened, unless `XFER_REQUIRE_LIBFABRIC=1`.

use super::*;
use crate::fi::close_fault;
use fabric_core::HostBuffer;

fn required() -> bool {
    std::env::var("XFER_REQUIRE_LIBFABRIC").is_ok_and(|v| v == "1")
}

/// An endpoint of `provider` on loopback, or `None` (said) where it cannot be opened.
fn open(provider: &str) -> Option<EfaTransport> {
    match EfaTransport::new(&EfaConfig::with_provider(provider).domain("lo")) {
        Ok(t) => Some(t),
        Err(e) if required() => {
            panic!("libfabric's {provider} provider is required (XFER_REQUIRE_LIBFABRIC=1): {e}")
        }
        Err(e) => {
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "skipped: libfabric {provider} not usable: {e}"
            );
            None
        }
    }
}

fn region() -> Arc<dyn MemoryRegion> {
    HostBuffer::new_shared(4096).expect("host buffer")
}

/// Keys of many registrations are distinct, never 0, within the provider's key size, and
/// not a sequence: a counter (1, 2, 3...) would have let whoever reaches the endpoint
/// guess every region's key.
#[test]
fn requested_keys_are_random_distinct_and_within_the_key_size() {
    for provider in ["tcp", "sockets"] {
        let Some(mut t) = open(provider) else {
            continue;
        };
        assert!(
            !t.policy.provider_keys,
            "{provider} lets the application choose keys (no FI_MR_PROV_KEY)"
        );
        let width = t.info.mr_key_size;
        let regions: Vec<_> = (0..64).map(|_| region()).collect();
        let mut keys: Vec<u64> = regions
            .iter()
            .map(|m| {
                t.register(m.clone(), Access::REMOTE_WRITE)
                    .unwrap()
                    .remote
                    .key
                    .0
            })
            .collect();
        keys.sort_unstable();
        keys.dedup();
        assert_eq!(keys.len(), 64, "{provider}: keys repeat: {keys:x?}");
        assert!(!keys.contains(&0), "{provider}: key 0");
        if (1..8).contains(&width) {
            assert!(
                keys.iter().all(|&k| k >> (8 * width) == 0),
                "{provider}: {keys:x?}"
            );
        }
        if width == 0 || width >= 8 {
            // 64 random 64-bit keys: two within 64 of each other has odds below 2^-44.
            let steps = keys.windows(2).filter(|w| w[1] - w[0] <= 64).count();
            assert_eq!(steps, 0, "{provider}: keys close together: {keys:x?}");
        }
        // 64 random keys of 2 bytes or more all below 2^(8 * width - 8): odds below 2^-512.
        let top = 1u64 << (8 * width.clamp(2, 8) - 8);
        assert!(
            keys.iter().any(|&k| k >= top),
            "{provider}: small keys only: {keys:x?}"
        );
    }
}

/// A drawn key that a live registration holds is drawn again, whether this side knows it
/// is taken (its set of keys in use) or only the provider does (-FI_ENOKEY).
#[test]
fn a_taken_key_is_drawn_again() {
    let Some(mut t) = open("tcp") else { return };
    let (k1, k2, k3) = (
        0x1234_5678_9abc_def1,
        0x0fed_cba9_8765_4321,
        0x5555_aaaa_5555_aaaa,
    );
    let script = |keys: Vec<u64>| {
        let mut keys = keys.into_iter();
        move || keys.next().expect("the test scripted enough keys")
    };
    let a = t
        .register_with(region(), Access::REMOTE_WRITE, &mut script(vec![k1]))
        .unwrap();
    assert_eq!(a.remote.key.0, k1);
    // Known taken here: never offered to the provider.
    let b = t
        .register_with(region(), Access::REMOTE_WRITE, &mut script(vec![k1, k2]))
        .unwrap();
    assert_eq!(b.remote.key.0, k2);
    // Taken only in the provider's map (as if another registration of the domain held it):
    // the provider refuses it, and the next key is drawn.
    t.keys_in_use.remove(&k1);
    let c = t
        .register_with(region(), Access::REMOTE_WRITE, &mut script(vec![k1, k3]))
        .unwrap();
    assert_eq!(c.remote.key.0, k3);
    // A key is free again once its registration is gone.
    t.deregister(b.local).unwrap();
    let d = t
        .register_with(region(), Access::REMOTE_WRITE, &mut script(vec![k2]))
        .unwrap();
    assert_eq!(d.remote.key.0, k2);
    // Every draw taken: a typed error, not a loop.
    let e = t
        .register_with(region(), Access::REMOTE_WRITE, &mut || k2)
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::Backend {
                call: "fi_mr_regattr",
                ..
            }
        ),
        "{e}"
    );
}

/// A registration whose `fi_close` fails may still be open, so its memory must outlive it:
/// after deregistration the memory is still there (a weak reference upgrades), and it is
/// counted. Without a failure the same steps free it.
#[test]
fn a_registration_whose_close_fails_keeps_its_memory() {
    let Some(mut t) = open("tcp") else { return };
    let freed = region();
    let weak = Arc::downgrade(&freed);
    let r = t.register(freed, Access::REMOTE_WRITE).unwrap();
    t.deregister(r.local).unwrap();
    assert!(
        weak.upgrade().is_none(),
        "a closed registration lets its memory go"
    );

    let kept = region();
    let weak = Arc::downgrade(&kept);
    let r = t.register(kept, Access::REMOTE_WRITE).unwrap();
    let leaked = crate::leaked_registrations();
    close_fault::fail_next(sys::FI_EBUSY);
    t.deregister(r.local).unwrap();
    assert!(
        weak.upgrade().is_some(),
        "memory freed although its registration may still be open"
    );
    assert!(crate::leaked_registrations() > leaked);
}
