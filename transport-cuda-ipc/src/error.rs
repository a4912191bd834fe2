//! Why a control connection is closed: its socket failed or the peer closed it
//! ([`ConnError`]). It does not leave the crate as such: the pending operations of the
//! connection's peer fail with
//! [`OpError::PeerUnreachable`](fabric_core::OpError::PeerUnreachable), whose reason is the
//! error with its sources ([`fabric_core::error::report`]).

/// Why a connection's socket is gone.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ConnError {
    /// `read` returned end of stream.
    #[error("the peer closed the connection")]
    PeerClosed,
    /// `read` failed.
    #[error("read failed")]
    Read(#[source] std::io::Error),
    /// `write` took no byte.
    #[error("the peer stopped reading")]
    StoppedReading,
    /// `write` failed.
    #[error("write failed")]
    Write(#[source] std::io::Error),
}

#[cfg(test)]
mod tests {
    use super::*;
    use fabric_core::error::report;

    /// What a peer's failed operations give as their reason: the same words as when these
    /// were strings, the OS error after the call that failed.
    #[test]
    fn reasons_read_as_sentences_with_their_cause() {
        let os = || std::io::Error::from_raw_os_error(libc::EPIPE);
        assert_eq!(
            report(&ConnError::Write(os())),
            format!("write failed: {}", os())
        );
        assert_eq!(
            report(&ConnError::Read(os())),
            format!("read failed: {}", os())
        );
        assert_eq!(
            report(&ConnError::PeerClosed),
            "the peer closed the connection"
        );
    }
}
