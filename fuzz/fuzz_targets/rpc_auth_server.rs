//! The master RPC server's side of the shared-secret handshake, as its event loop
//! reads a client's bytes (in whatever pieces they arrive), on a real server over
//! loopback: with a secret (the client's hello and proof) and without one (a client
//! that proves a secret, or frames). Never a panic or a hang (the server closes the
//! connection once the client has closed its side), and never an admission without
//! the secret: what the server sends is its proof and at most a verdict of 0.
#![no_main]

use std::io::Read;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use mooncake_core::rpc::wire::{Request, Response};
use mooncake_core::rpc::{RpcHandler, RpcServer, RpcServerConfig};
use mooncake_transfer::{SharedSecret, AUTH_HELLO_LEN, AUTH_LEN, AUTH_MAGIC, REFUSE_MAGIC};

#[path = "common/loopback.rs"]
mod loopback;

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
    let mut c = loopback::connect(server.local_addr(), Duration::from_secs(20));
    if with_secret {
        let mut greeting = [0u8; AUTH_HELLO_LEN];
        c.read_exact(&mut greeting).expect("the server's greeting");
        assert_eq!(greeting[..4], AUTH_MAGIC);
    }
    // In pieces of 1 to 127 bytes, so that the server sees partial hellos and proofs.
    loopback::send_in_pieces(&c, data, usize::from(how >> 1));
    let (answer, whole) = loopback::finish(c);
    if !whole {
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
