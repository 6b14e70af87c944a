//! Optional shared-secret authentication of connections (transfer and master RPC).

use std::io::{Read, Write};

/// Bytes of the shared-secret challenge: its nonce, and the answer to it.
pub const AUTH_LEN: usize = 32;

/// A shared secret, as a derived key: optional authentication of connections
/// (transfer and master RPC).
///
/// The accepting side sends a 32-byte random nonce; the connecting side answers with
/// the BLAKE3 keyed hash of the nonce under a key derived from the secret. The
/// secret itself never crosses the wire, and a replayed answer is useless against a
/// fresh nonce. The comparison is constant-time.
#[derive(Clone)]
pub struct SharedSecret {
    key: [u8; 32],
}

impl std::fmt::Debug for SharedSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SharedSecret(..)")
    }
}

impl SharedSecret {
    /// Derives the key from any secret bytes.
    pub fn new(secret: &[u8]) -> Self {
        Self { key: blake3::derive_key("mooncake-rs 2026 connection secret", secret) }
    }

    fn answer(&self, nonce: &[u8; AUTH_LEN]) -> blake3::Hash {
        blake3::keyed_hash(&self.key, nonce)
    }

    /// Accepting side: challenge the peer; `Ok(true)` if it proved the secret.
    pub fn challenge(&self, conn: &mut (impl Read + Write)) -> std::io::Result<bool> {
        let nonce: [u8; AUTH_LEN] = rand::random();
        conn.write_all(&nonce)?;
        conn.flush()?;
        let mut got = [0u8; AUTH_LEN];
        conn.read_exact(&mut got)?;
        // `blake3::Hash` compares in constant time.
        Ok(self.answer(&nonce) == blake3::Hash::from_bytes(got))
    }

    /// Connecting side: answer the peer's challenge.
    pub fn respond(&self, conn: &mut (impl Read + Write)) -> std::io::Result<()> {
        let mut nonce = [0u8; AUTH_LEN];
        conn.read_exact(&mut nonce)?;
        conn.write_all(self.answer(&nonce).as_bytes())?;
        conn.flush()
    }
}

impl SharedSecret {
    /// Accepting side on a TCP connection: challenges the peer under a 5 s timeout;
    /// `true` if it proved the secret (the timeout is lifted again).
    pub fn admit(&self, conn: &std::net::TcpStream) -> bool {
        let _ = conn.set_read_timeout(Some(std::time::Duration::from_secs(5)));
        let mut c = conn;
        let ok = self.challenge(&mut c).unwrap_or(false);
        let _ = conn.set_read_timeout(None);
        ok
    }
}
