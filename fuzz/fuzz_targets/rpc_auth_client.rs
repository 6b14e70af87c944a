//! The shared-secret handshake (master RPC and transfer connections alike) on a
//! peer's arbitrary bytes: the connecting side reading a listener's greeting, names
//! and proof, and the accepting side's checks of a peer's hello and proof. Never a
//! panic, and never an admission without the secret (the nonces are fresh, so no
//! input can carry a valid proof): the connecting side never sends its own proof to
//! a listener that did not prove the secret.
#![no_main]

use std::io::{Cursor, Read, Write};

use libfuzzer_sys::fuzz_target;
use mooncake_transfer::{Acceptor, AuthFailure, SharedSecret, AUTH_HELLO_LEN, AUTH_LEN, AUTH_MAGIC};

/// A listener that sends `from` and records what it is sent.
struct Listener<'a> {
    from: Cursor<&'a [u8]>,
    sent: Vec<u8>,
}

impl Read for Listener<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.from.read(buf)
    }
}

impl Write for Listener<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.sent.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fuzz_target!(|data: &[u8]| {
    let secret = SharedSecret::new(b"fuzz secret");

    // Connecting side.
    let mut listener = Listener { from: Cursor::new(data), sent: Vec::new() };
    let proved = secret.prove_over_stream(&mut listener, Some("127.0.0.1:7"), "master:7");
    let e = proved.expect_err("a listener's bytes proved a secret without knowing it");
    // Messages quote at most the listener's names (1 KiB) and a refusal (1 KiB).
    assert!(e.len() < 8 << 10, "{} bytes of error", e.len());
    assert_eq!(listener.sent.len(), AUTH_HELLO_LEN, "the peer sent more than its hello");

    // Accepting side.
    let (mut acceptor, greeting) = Acceptor::new(None, &["master:7".to_string()]);
    assert_eq!(greeting.len(), AUTH_HELLO_LEN);
    let Some(hello) = data.get(..AUTH_HELLO_LEN) else { return };
    match acceptor.on_hello(&secret, hello.try_into().unwrap()) {
        Ok(proof) => {
            assert_eq!(hello[..4], AUTH_MAGIC);
            assert!(proof.len() <= 2 + 1024 + AUTH_LEN, "{} bytes of proof", proof.len());
            if let Some(answer) = data.get(AUTH_HELLO_LEN..AUTH_HELLO_LEN + AUTH_LEN) {
                assert!(!acceptor.on_proof(&secret, answer.try_into().unwrap()), "a forged proof was accepted");
            }
        }
        Err(failure) => assert_eq!(failure, AuthFailure::NoSecret),
    }
});
