//! A client of a real server on loopback, as the server targets drive it: connect,
//! write the input in pieces, close our side, read the answer to its end. Each
//! target is its own crate root, so each includes this file (`#[path]`).

use std::io::{ErrorKind, Read};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::os::fd::AsFd;
use std::time::Duration;

use mooncake_transfer::send_no_signal;

/// Connects to `addr`; reads and writes give up after `timeout` (far past what the
/// server takes to answer or close: [`finish`] calls a read past it a hang).
pub fn connect(addr: impl ToSocketAddrs + Copy, timeout: Duration) -> TcpStream {
    let c = loop {
        match TcpStream::connect(addr) {
            Ok(c) => break c,
            // Ports in TIME_WAIT run out under a fast loop: wait for some.
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    };
    c.set_read_timeout(Some(timeout)).unwrap();
    c.set_write_timeout(Some(timeout)).unwrap();
    let _ = c.set_nodelay(true);
    c
}

/// Writes `data` in writes of `piece` bytes (so that the server sees partial
/// messages), up to the first that fails (the server answered, or refused, and
/// closed before the end).
pub fn send_in_pieces(c: &TcpStream, data: &[u8], piece: usize) {
    for chunk in data.chunks(piece.max(1)) {
        let mut sent = 0;
        while sent < chunk.len() {
            match send_no_signal(c.as_fd(), &chunk[sent..]) {
                Ok(n) => sent += n,
                Err(_) => return,
            }
        }
    }
}

/// Closes our side and reads the server's answer to its end: the bytes, and whether
/// they are all it sent (not when it reset the connection, closing with bytes of
/// ours unread, which may cost some of the answer). Panics if the server neither
/// answers nor closes within the timeout: a closed client's connection kept open.
pub fn finish(mut c: TcpStream) -> (Vec<u8>, bool) {
    let _ = c.shutdown(Shutdown::Write);
    let mut answer = Vec::new();
    let whole = match c.read_to_end(&mut answer) {
        Ok(_) => true,
        Err(e) => {
            assert!(
                !matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
                "the server neither answered nor closed a closed client's connection"
            );
            false
        }
    };
    (answer, whole)
}
