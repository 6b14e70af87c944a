//! Shared-secret authentication of connections (transfer and master RPC), the
//! refusal a listener sends before closing a connection it will not serve, and the
//! peer rule of protected mode.

use std::io::{Read, Write};
use std::net::{IpAddr, TcpStream};
use std::time::Duration;

use crate::frame::{AUTH_MAGIC, REFUSE_MAGIC};

/// Bytes of the shared-secret challenge: its nonce, and the answer to it.
pub const AUTH_LEN: usize = 32;

/// Longest refusal message read back (longer ones are cut).
const MAX_REFUSAL: usize = 1024;

/// How long either side of the handshake waits for the other.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// A shared secret, as a derived key: optional authentication of connections
/// (transfer and master RPC).
///
/// The handshake, before any request:
///
/// ```text
/// listener -> peer : AUTH_MAGIC, 32-byte random nonce
/// peer -> listener : AUTH_MAGIC, keyed hash of the nonce
/// listener -> peer : verdict byte (1 admitted; 0 wrong secret, then closed)
/// ```
///
/// Both sides send [`AUTH_MAGIC`] at once, so each learns immediately whether the
/// other has a secret: a listener without one answers a peer's `AUTH_MAGIC` with a
/// refusal ([`encode_refusal`]), and a peer without one finds `AUTH_MAGIC` where it
/// expected a response. The answer is the BLAKE3 keyed hash of the nonce under a key
/// derived from the secret: the secret itself never crosses the wire, and a replayed
/// answer is useless against a fresh nonce. The comparison is constant-time.
#[derive(Clone)]
pub struct SharedSecret {
    key: [u8; 32],
}

impl std::fmt::Debug for SharedSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SharedSecret(..)")
    }
}

/// Why the accepting side did not admit a peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AuthFailure {
    /// The peer did not start the handshake: it has no secret.
    NoSecret,
    /// The peer answered the challenge with another secret.
    WrongSecret,
    /// The connection failed or timed out during the handshake.
    Io,
}

impl SharedSecret {
    /// Derives the key from any secret bytes (builders refuse empty secrets before
    /// they get here).
    pub fn new(secret: &[u8]) -> Self {
        Self { key: blake3::derive_key("mooncake-rs 2026 connection secret", secret) }
    }

    /// The answer a peer proving this secret gives to `nonce`.
    pub fn answer(&self, nonce: &[u8; AUTH_LEN]) -> [u8; AUTH_LEN] {
        *blake3::keyed_hash(&self.key, nonce).as_bytes()
    }

    /// Whether `answer` proves this secret for `nonce`, in constant time.
    pub fn verify(&self, nonce: &[u8; AUTH_LEN], answer: &[u8; AUTH_LEN]) -> bool {
        // `blake3::Hash` compares in constant time.
        blake3::keyed_hash(&self.key, nonce) == blake3::Hash::from_bytes(*answer)
    }

    /// Accepting side on a TCP connection: runs the whole handshake under a 5 s
    /// timeout (lifted again when admitted) and sends the verdict.
    pub fn admit(&self, conn: &TcpStream) -> Result<(), AuthFailure> {
        let _ = conn.set_read_timeout(Some(HANDSHAKE_TIMEOUT));
        let mut c = conn;
        let io = |_| AuthFailure::Io;
        let nonce: [u8; AUTH_LEN] = rand::random();
        c.write_all(&[&AUTH_MAGIC[..], &nonce[..]].concat()).map_err(io)?;
        let mut hello = [0u8; 4];
        c.read_exact(&mut hello).map_err(io)?;
        if hello != AUTH_MAGIC {
            return Err(AuthFailure::NoSecret);
        }
        let mut got = [0u8; AUTH_LEN];
        c.read_exact(&mut got).map_err(io)?;
        let ok = self.verify(&nonce, &got);
        c.write_all(&[u8::from(ok)]).map_err(io)?;
        if !ok {
            return Err(AuthFailure::WrongSecret);
        }
        let _ = conn.set_read_timeout(None);
        Ok(())
    }

    /// Connecting side on a TCP connection: proves the secret to the listener at
    /// `peer` (named in errors). The error is one line naming the problem: the
    /// listener has no secret, refused this one, or refused the connection.
    pub fn prove(&self, conn: &TcpStream, peer: &str) -> Result<(), String> {
        let old = conn.read_timeout().ok().flatten();
        let _ = conn.set_read_timeout(Some(HANDSHAKE_TIMEOUT));
        let mut c = conn;
        let io = |e: std::io::Error| format!("{peer}: authentication failed: {e}");
        c.write_all(&AUTH_MAGIC).map_err(io)?;
        let mut first = [0u8; 4];
        c.read_exact(&mut first).map_err(|e| match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                format!("{peer} did not start the shared-secret handshake (it may not be a mooncake listener)")
            }
            _ => io(e),
        })?;
        if first == REFUSE_MAGIC {
            return Err(format!("{peer} refused the connection: {}", decode_refusal(&[], c)));
        }
        if first != AUTH_MAGIC {
            return Err(format!("{peer} does not ask for a shared secret"));
        }
        let mut nonce = [0u8; AUTH_LEN];
        c.read_exact(&mut nonce).map_err(io)?;
        c.write_all(&self.answer(&nonce)).map_err(io)?;
        let mut verdict = [0u8; 1];
        c.read_exact(&mut verdict).map_err(io)?;
        if verdict[0] != 1 {
            return Err(format!("{peer} refused the shared secret: wrong secret"));
        }
        let _ = conn.set_read_timeout(old);
        Ok(())
    }
}

/// The refusal a listener sends before closing a connection it will not serve:
/// [`REFUSE_MAGIC`], a little-endian `u16` length, and a UTF-8 message.
pub fn encode_refusal(message: &str) -> Vec<u8> {
    let msg = &message.as_bytes()[..message.len().min(MAX_REFUSAL)];
    let mut out = Vec::with_capacity(6 + msg.len());
    out.extend_from_slice(&REFUSE_MAGIC);
    out.extend_from_slice(&(msg.len() as u16).to_le_bytes());
    out.extend_from_slice(msg);
    out
}

/// The message of a refusal whose [`REFUSE_MAGIC`] was already read: `read` holds
/// the bytes already read after the magic, `rest` the connection.
pub fn decode_refusal(read: &[u8], rest: impl Read) -> String {
    let mut r = read.chain(rest);
    let mut len = [0u8; 2];
    if r.read_exact(&mut len).is_err() {
        return "refused".into();
    }
    let len = usize::from(u16::from_le_bytes(len)).min(MAX_REFUSAL);
    let mut msg = Vec::with_capacity(len);
    let _ = r.take(len as u64).read_to_end(&mut msg);
    String::from_utf8_lossy(&msg).into_owned()
}

/// Protected mode: whether a listener admits a peer at `peer`. A listener with a
/// shared secret, or started insecure on purpose, admits anyone (the secret decides);
/// otherwise only loopback peers, as an unprotected listener is open to whoever
/// reaches it.
pub fn admits_peer(peer: IpAddr, has_secret: bool, insecure: bool) -> bool {
    has_secret || insecure || peer.to_canonical().is_loopback()
}

/// The refusal a protected listener sends to a peer it does not admit.
pub const PROTECTED_MODE_REFUSAL: &str = "protected mode: this listener has no shared secret and accepts loopback \
     peers only; set MOONCAKE_SECRET on every process (or start it with --insecure)";

/// Reads up to `buf.len()` bytes; returns how many arrived before the end of the
/// stream (an error only for a failure other than the end).
pub fn read_up_to(mut r: impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn protected_mode_admits_loopback_peers_only() {
        let v4 = |s: &str| s.parse::<IpAddr>().unwrap();
        for lo in ["127.0.0.1", "127.1.2.3", "::1", "::ffff:127.0.0.1"] {
            assert!(admits_peer(v4(lo), false, false), "{lo}");
        }
        for remote in ["10.0.0.1", "192.168.1.2", "::ffff:10.0.0.1", "fe80::1", "0.0.0.0"] {
            assert!(!admits_peer(v4(remote), false, false), "{remote}");
            assert!(admits_peer(v4(remote), true, false), "{remote} with a secret");
            assert!(admits_peer(v4(remote), false, true), "{remote} insecure");
        }
    }

    #[test]
    fn refusals_round_trip_and_survive_truncation() {
        let r = encode_refusal("too many connections");
        assert_eq!(&r[..4], &REFUSE_MAGIC);
        assert_eq!(decode_refusal(&r[4..7], &r[7..]), "too many connections");
        assert_eq!(decode_refusal(&r[4..5], &[][..]), "refused");
        assert_eq!(decode_refusal(&r[4..9], &[][..]), "too");
    }
}
