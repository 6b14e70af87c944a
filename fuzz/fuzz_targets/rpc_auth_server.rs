//! The master RPC server's side of the shared-secret handshake, as its event loop
//! reads a client's bytes (in whatever pieces they arrive), on a real server over
//! loopback: with a secret (the client's hello and proof) and without one (a client
//! that proves a secret, or frames). Never a panic or a hang (the server closes the
//! connection once the client has closed its side), and never an admission without
//! the secret: what the server sends is its proof and at most a verdict of 0.
#![no_main]

use std::io::Read;
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsFd;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use mooncake_core::rpc::wire::{Request, Response};
use mooncake_core::rpc::{RpcHandler, RpcServer, RpcServerConfig};
use mooncake_transfer::{send_no_signal, SharedSecret, AUTH_HELLO_LEN, AUTH_LEN, AUTH_MAGIC, REFUSE_MAGIC};

/// Answers every request with `Unit`.
struct Unit;

impl RpcHandler for Unit {
    fn handle(&self, _: Request) -> Response {
        Response::Unit
    }
}

/// One server with a secret, one without.
static SERVERS: LazyLock<[RpcServer; 2]> = LazyLock::new(|| {
    let serve = |secret: Option<SharedSecret>| {
        let config = RpcServerConfig { secret, max_frame: 1 << 20, ..RpcServerConfig::default() };
        RpcServer::serve_with("127.0.0.1:0", Arc::new(Unit), config).expect("an RPC server on loopback")
    };
    [serve(Some(SharedSecret::new(b"fuzz secret"))), serve(None)]
});

fuzz_target!(|data: &[u8]| {
    let Some((&how, data)) = data.split_first() else { return };
    let with_secret = how & 1 == 0;
    let server = &SERVERS[usize::from(!with_secret)];
    let mut c = loop {
        match TcpStream::connect(server.local_addr()) {
            Ok(c) => break c,
            // Ports in TIME_WAIT run out under a fast loop: wait for some.
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    };
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let _ = c.set_nodelay(true);
    if with_secret {
        let mut greeting = [0u8; AUTH_HELLO_LEN];
        c.read_exact(&mut greeting).expect("the server's greeting");
        assert_eq!(greeting[..4], AUTH_MAGIC);
    }
    // In pieces of 1 to 127 bytes, so that the server sees partial hellos and proofs.
    let piece = usize::from(how >> 1).max(1);
    for chunk in data.chunks(piece) {
        let mut sent = 0;
        while sent < chunk.len() {
            match send_no_signal(c.as_fd(), &chunk[sent..]) {
                Ok(n) => sent += n,
                Err(_) => break,
            }
        }
        if sent < chunk.len() {
            break;
        }
    }
    let _ = c.shutdown(Shutdown::Write);
    let mut answer = Vec::new();
    if let Err(e) = c.read_to_end(&mut answer) {
        assert!(
            !matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut),
            "the server kept a closed client's connection open"
        );
        return;
    }
    if !with_secret {
        return;
    }
    // The listener's proof: names' length, names, MAC; then at most a verdict.
    if answer.starts_with(&REFUSE_MAGIC) || answer.is_empty() {
        return;
    }
    assert!(data.len() >= AUTH_HELLO_LEN && data[..4] == AUTH_MAGIC, "a proof for a hello that was not one");
    let names = usize::from(u16::from_le_bytes([answer[0], answer[1]]));
    let proof = 2 + names + AUTH_LEN;
    assert!(answer.len() <= proof + 1, "the server answered after the handshake: {} bytes", answer.len());
    if answer.len() == proof + 1 {
        assert_eq!(answer[proof], 0, "a client without the secret was admitted");
    }
});
