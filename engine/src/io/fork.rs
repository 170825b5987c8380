//! Descriptors a forked child must not keep: closes the child's copies of sockets whose owners
//! (threads of the parent) do not exist in the child.
//!
//! Owns: `close_in_forked_child`, the one place the engine closes a descriptor by number.
//!
//! Never: closes a descriptor in a process that may still use it; it is for the moment right
//! after `fork`, in the child, on descriptors whose owning objects the child never drops.

use std::os::fd::RawFd;

/// Closes `fds` in a child just forked. The caller guarantees that nothing in the child uses
/// or closes them (their owners are the parent's threads, and the objects holding them are
/// leaked in the child, as the Python binding does).
pub(crate) fn close_in_forked_child(fds: &[RawFd]) {
    for &fd in fds {
        #[allow(unsafe_code, reason = "closing a descriptor by number has no safe form in std")]
        // SAFETY: `close` on any number is memory-safe; what it must not do is close a
        // descriptor something in this process still owns and uses. The caller's contract: these
        // are the child's copies of the parent's endpoint sockets, whose owners never run or drop
        // in the child. An error (a number already closed) changes nothing and is ignored.
        let _ = unsafe { libc::close(fd) };
    }
}
