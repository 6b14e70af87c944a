//! Process limits the binaries raise at start.

/// Raises the soft limit on open descriptors to the hard limit, and returns the new
/// soft limit (`None` if it could not be read or raised).
///
/// A master or storage node holds a descriptor per client connection, per SSD file
/// handle and per shared-memory mapping; the usual soft limit (1024) is far below what
/// a large cluster needs, while the hard limit is typically much higher.
pub fn raise_open_files_limit() -> Option<u64> {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: `lim` is a valid, writable rlimit for the call to fill.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return None;
    }
    if lim.rlim_cur < lim.rlim_max {
        let raised = libc::rlimit { rlim_cur: lim.rlim_max, rlim_max: lim.rlim_max };
        // SAFETY: `raised` is a valid rlimit; the call only reads it.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            return Some(raised.rlim_cur);
        }
        tracing::warn!(soft = lim.rlim_cur, hard = lim.rlim_max, "cannot raise the open-files limit");
    }
    Some(lim.rlim_cur)
}
