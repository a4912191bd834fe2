//! The shm endpoints of this process, for the one combination that must be refused:
//! libfabric's shm with GPU memory (FI_HMEM) between two endpoints of one process.
//!
//! There, shm takes a path that loses writes into device memory: on the H200 with
//! libfabric 2.6, writes reported completion with the bytes not there, and the first host to
//! device write crashed the process (SIGSEGV); 1.17 hung. Between two processes, as shm is
//! meant to be used, the same writes land. So `add_peer` of an shm endpoint that lives in
//! this process, when either side registers GPU memory, fails with the reason and the way
//! out, instead of moving nothing.

use std::sync::Mutex;

/// Addresses of this process's open shm endpoints, and whether each has FI_HMEM on.
static OPEN: Mutex<Vec<(Vec<u8>, bool)>> = Mutex::new(Vec::new());

fn open() -> std::sync::MutexGuard<'static, Vec<(Vec<u8>, bool)>> {
    OPEN.lock().unwrap_or_else(|p| p.into_inner())
}

/// An shm endpoint of this process, listed while it lives.
#[derive(Debug)]
pub(crate) struct LocalEndpoint {
    address: Vec<u8>,
}

impl LocalEndpoint {
    /// Lists the endpoint at `address` (its wire address) with its FI_HMEM setting.
    pub(crate) fn list(address: Vec<u8>, hmem: bool) -> LocalEndpoint {
        open().push((address.clone(), hmem));
        LocalEndpoint { address }
    }
}

impl Drop for LocalEndpoint {
    fn drop(&mut self) {
        let mut open = open();
        if let Some(i) = open.iter().position(|(a, _)| *a == self.address) {
            open.swap_remove(i);
        }
    }
}

/// Whether the endpoint at `address` is one of this process's, and if so whether it has
/// FI_HMEM on.
pub(crate) fn hmem_of(address: &[u8]) -> Option<bool> {
    open()
        .iter()
        .find(|(a, _)| a.as_slice() == address)
        .map(|&(_, hmem)| hmem)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_listed_while_they_live() {
        let a = LocalEndpoint::list(b"efa1 test endpoint a".to_vec(), true);
        let b = LocalEndpoint::list(b"efa1 test endpoint b".to_vec(), false);
        assert_eq!(hmem_of(b"efa1 test endpoint a"), Some(true));
        assert_eq!(hmem_of(b"efa1 test endpoint b"), Some(false));
        assert_eq!(hmem_of(b"efa1 another process"), None);
        drop(a);
        assert_eq!(
            hmem_of(b"efa1 test endpoint a"),
            None,
            "gone with its endpoint"
        );
        assert_eq!(hmem_of(b"efa1 test endpoint b"), Some(false));
        drop(b);
        assert_eq!(hmem_of(b"efa1 test endpoint b"), None);
    }
}
