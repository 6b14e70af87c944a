//! Waiting for a peer's answer on a TCP connection: poll briefly, then sleep.
//!
//! A thread that sleeps in a blocking `read` while its request is served pays a
//! wakeup when the answer lands, and on many hosts that wakeup costs as much as
//! the round trip itself (on a 2-core VM, a loopback round trip of 53 us was 19
//! us when the caller polled instead). Request/answer exchanges whose answer
//! usually comes within tens of microseconds (the master's calls, a transfer's
//! first response) therefore poll the socket, without blocking, for a short
//! budget before they sleep. The budget bounds the CPU a waiting thread burns; a
//! slow answer is waited for as before.

use std::io::{ErrorKind, Read};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// How long a waiting thread polls for an answer before it sleeps, unless
/// `MOONCAKE_SPIN_US` says otherwise.
pub const DEFAULT_ANSWER_SPIN: Duration = Duration::from_micros(50);

/// How long a poller spins between two looks before it yields its core instead:
/// an answer that comes within a round trip (5-10 us over a local socket) is
/// caught without a system call, and a longer wait leaves the core to whatever
/// else is runnable (the peer that is to answer, on a host with fewer free cores
/// than polling threads).
pub const SPIN_BEFORE_YIELD: Duration = Duration::from_micros(10);

/// The pause between two looks of a poller that began polling at `since`: a
/// spin-loop hint during the first [`SPIN_BEFORE_YIELD`], then a yield of the core
/// (`sched_yield`: at once back where no other thread waits for this core).
///
/// Why yield: on a host with fewer cores than polling threads (a 2-core VM: a
/// client waiting for its master, the master waiting for a node, the node's server
/// polling for its next request) a thread that only spins keeps the core its peer
/// needs to answer until the scheduler's next tick; measured there, a `put_end`
/// that waits for a node's record took 22-29 us at p50 and 88 us at p90 spinning,
/// 20 / 23 us yielding.
pub fn poll_pause(since: Instant) {
    if since.elapsed() < SPIN_BEFORE_YIELD {
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
}

/// The polling budget of this process: `MOONCAKE_SPIN_US` (microseconds; `0`
/// never polls: every wait sleeps at once), else [`DEFAULT_ANSWER_SPIN`]. Read
/// once; a value that is not a number is ignored with a warning.
pub fn answer_spin() -> Duration {
    static SPIN: OnceLock<Duration> = OnceLock::new();
    *SPIN.get_or_init(|| spin_from_env("MOONCAKE_SPIN_US", DEFAULT_ANSWER_SPIN))
}

/// A polling budget from the environment variable `var` (microseconds, at most
/// one second; `0` never polls), else `default`; a value that is not a number is
/// ignored with a warning. For the caller to read once.
pub fn spin_from_env(var: &str, default: Duration) -> Duration {
    match std::env::var(var) {
        Ok(v) => match v.trim().parse::<u64>() {
            Ok(us) => Duration::from_micros(us.min(1_000_000)),
            Err(_) => {
                tracing::warn!(value = v, var, "not a number of microseconds; using the default");
                default
            }
        },
        Err(_) => default,
    }
}

/// Reads into `buf` whatever arrives on `stream` within `budget`: polls the
/// socket (`poll` with a zero timeout, which never blocks and, unlike a
/// non-blocking `read`, does not take the socket's lock that the sender's
/// delivery needs) until it is readable, then reads what is there. Returns the
/// bytes read: `0` when nothing came in time, or the peer closed the connection
/// (the caller's blocking read tells which). Errors are the socket's.
pub fn read_polling<S: AsFd>(stream: &S, buf: &mut [u8], budget: Duration) -> std::io::Result<usize>
where
    for<'a> &'a S: Read,
{
    if budget.is_zero() || buf.is_empty() {
        return Ok(0);
    }
    let start = Instant::now();
    loop {
        if readable_now(stream.as_fd())? {
            let mut reader = stream;
            loop {
                match reader.read(buf) {
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    other => return other,
                }
            }
        }
        if start.elapsed() >= budget {
            return Ok(0);
        }
        poll_pause(start);
    }
}

/// Writes what a socket takes at once of `buf` (`send` with `MSG_NOSIGNAL`): a
/// write to a peer that closed is an `EPIPE` error, never a `SIGPIPE` that kills a
/// host process which did not ignore it (a Unix socket's `write` raises it on
/// toolchains before Rust 1.88; TCP's never does).
pub fn send_no_signal(fd: BorrowedFd<'_>, buf: &[u8]) -> std::io::Result<usize> {
    loop {
        // SAFETY: a descriptor the borrow keeps open, and `buf`'s live bytes for
        // its length; `send` only reads them.
        let n = unsafe { libc::send(fd.as_raw_fd(), buf.as_ptr().cast(), buf.len(), libc::MSG_NOSIGNAL) };
        match usize::try_from(n) {
            Ok(n) => return Ok(n),
            Err(_) => {
                let e = std::io::Error::last_os_error();
                if e.kind() != ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
}

/// Whether a read of `fd` would return at once (bytes, the end, or an error;
/// for a pidfd: its process exited), asked without waiting.
pub(crate) fn readable_now(fd: BorrowedFd<'_>) -> std::io::Result<bool> {
    let mut fd = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid `pollfd` of a descriptor the borrow keeps open, a count of
    // one, and a zero timeout: `poll` only writes `revents` and never blocks.
    let ready = unsafe { libc::poll(&mut fd, 1, 0) };
    if ready < 0 {
        let e = std::io::Error::last_os_error();
        return if e.kind() == ErrorKind::Interrupted { Ok(false) } else { Err(e) };
    }
    Ok(ready > 0)
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::net::{TcpListener, TcpStream};

    use super::*;

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (a, b)
    }

    /// What is there is read; nothing there returns 0 after about the budget;
    /// either way the stream stays blocking (a read with a timeout then times
    /// out instead of failing with WouldBlock at once).
    #[test]
    fn polls_for_the_budget_then_leaves_the_stream_blocking() {
        let (a, mut b) = pair();
        let mut buf = [0u8; 16];
        let start = Instant::now();
        assert_eq!(read_polling(&a, &mut buf, Duration::from_millis(20)).unwrap(), 0);
        assert!(start.elapsed() >= Duration::from_millis(20), "polled for the budget");
        b.write_all(b"answer").unwrap();
        let mut n = 0;
        while n == 0 {
            n = read_polling(&a, &mut buf, Duration::from_millis(200)).unwrap();
        }
        assert_eq!(&buf[..n], &b"answer"[..n]);
        a.set_read_timeout(Some(Duration::from_millis(30))).unwrap();
        let err = (&a).read(&mut buf).unwrap_err();
        assert!(matches!(err.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut), "{err:?}");
        let start = Instant::now();
        let _ = (&a).read(&mut buf);
        assert!(start.elapsed() >= Duration::from_millis(25), "a blocking read waited for its timeout");
    }

    /// A zero budget reads nothing and never touches the socket's mode.
    #[test]
    fn a_zero_budget_never_polls() {
        let (a, mut b) = pair();
        b.write_all(b"x").unwrap();
        std::thread::sleep(Duration::from_millis(20));
        let mut buf = [0u8; 4];
        assert_eq!(read_polling(&a, &mut buf, Duration::ZERO).unwrap(), 0);
        assert_eq!((&a).read(&mut buf).unwrap(), 1);
    }

    /// A closed connection reads 0 at once (the caller's blocking read then sees
    /// the end), not after the budget.
    #[test]
    fn a_closed_connection_returns_at_once() {
        let (a, b) = pair();
        drop(b);
        let mut buf = [0u8; 4];
        let start = Instant::now();
        assert_eq!(read_polling(&a, &mut buf, Duration::from_secs(5)).unwrap(), 0);
        assert!(start.elapsed() < Duration::from_secs(1));
    }
}
