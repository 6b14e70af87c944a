//! Shared-secret authentication of connections (transfer and master RPC), the
//! refusal a listener sends before closing a connection it will not serve, and the
//! peer rule of protected mode.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use crate::frame::{AUTH_MAGIC, REFUSE_MAGIC};

/// Bytes of the shared-secret challenge: its nonce, and the answer to it.
pub const AUTH_LEN: usize = 32;

/// Longest refusal message read back (longer ones are cut).
const MAX_REFUSAL: usize = 1024;

/// How long either side of the handshake waits for the other.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// A shared secret, as a derived key: optional mutual authentication of connections
/// (transfer, master RPC, SSD loads, record endpoints).
///
/// The handshake, before any request (both sides prove the secret, the listener
/// first):
///
/// ```text
/// listener -> peer : AUTH_MAGIC, nonce_l (32 random bytes)
/// peer -> listener : AUTH_MAGIC, nonce_p (32 random bytes)
/// listener -> peer : len u16, names (UTF-8, '\n'-separated), MAC("listener", nonce_l, nonce_p, names)
/// peer             : checks the MAC and that one of the names is the address it dialed
///                    (as the socket's peer address, or the endpoint string it dialed);
///                    otherwise it closes without proving anything
/// peer -> listener : MAC("peer", nonce_l, nonce_p, names)
/// listener -> peer : verdict byte (1 admitted; 0 wrong secret, then closed)
/// ```
///
/// The MAC is BLAKE3's keyed hash under a key derived from the secret, over a
/// transcript of both nonces, the listener's names and a role tag: the secret never
/// crosses the wire, an answer is useless against fresh nonces, and neither side's
/// proof can be reflected as the other's. *Names* are the addresses the listener
/// knows itself by: the local address of the accepted socket (what a peer that
/// connected directly sees as the peer address), plus any advertised names. So a
/// process that sits between a peer and a real listener (say, behind a rewritten
/// address in etcd) and relays the bytes both ways gets the listener's proof for the
/// listener's own address, which is not the relay's: the peer refuses before it
/// proves anything, and the relay never gets an authenticated session. Both sides
/// send [`AUTH_MAGIC`] first, so each learns at once whether the other has a secret.
/// Comparisons are constant-time.
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
    /// The connection failed or timed out during the handshake (a peer that refuses
    /// this listener's proof closes it here).
    Io,
}

/// Bytes of the peer's hello: [`AUTH_MAGIC`] and its nonce.
pub const AUTH_HELLO_LEN: usize = 4 + AUTH_LEN;

/// Longest list of names a listener proves (longer ones are refused by the peer).
const MAX_NAMES: usize = 1024;

/// Role tags of the two proofs: a proof made by one side is never valid as the other's.
const LISTENER_TAG: &[u8] = b"mooncake-rs auth v2 listener";
const PEER_TAG: &[u8] = b"mooncake-rs auth v2 peer";

/// The accepting side of one handshake, driven by whoever reads the socket (the
/// blocking [`SharedSecret::admit`], or the master's event loop).
#[derive(Clone)]
pub struct Acceptor {
    nonce: [u8; AUTH_LEN],
    peer_nonce: Option<[u8; AUTH_LEN]>,
    names: Vec<u8>,
}

impl std::fmt::Debug for Acceptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Acceptor(..)")
    }
}

impl Acceptor {
    /// A handshake on a connection accepted at `local` (the accepted socket's local
    /// address), also proving `advertised` names; returns it and the greeting to send
    /// at once ([`AUTH_MAGIC`] and the nonce).
    pub fn new(local: Option<SocketAddr>, advertised: &[String]) -> (Self, Vec<u8>) {
        let mut names: Vec<String> = local.map(canonical).into_iter().collect();
        names.extend(advertised.iter().filter(|n| !n.is_empty() && !n.contains('\n')).cloned());
        let mut names = names.join("\n").into_bytes();
        names.truncate(MAX_NAMES);
        let nonce: [u8; AUTH_LEN] = rand::random();
        let greeting = [&AUTH_MAGIC[..], &nonce[..]].concat();
        (Self { nonce, peer_nonce: None, names }, greeting)
    }

    /// The peer's hello ([`AUTH_HELLO_LEN`] bytes): the listener's proof to send, or
    /// [`AuthFailure::NoSecret`] if the peer did not start the handshake.
    pub fn on_hello(&mut self, secret: &SharedSecret, hello: &[u8; AUTH_HELLO_LEN]) -> Result<Vec<u8>, AuthFailure> {
        if hello[..4] != AUTH_MAGIC {
            return Err(AuthFailure::NoSecret);
        }
        let mut peer = [0u8; AUTH_LEN];
        peer.copy_from_slice(&hello[4..]);
        self.peer_nonce = Some(peer);
        let proof = secret.mac(LISTENER_TAG, &self.nonce, &peer, &self.names);
        let mut out = Vec::with_capacity(2 + self.names.len() + AUTH_LEN);
        out.extend_from_slice(&(self.names.len() as u16).to_le_bytes());
        out.extend_from_slice(&self.names);
        out.extend_from_slice(&proof);
        Ok(out)
    }

    /// Whether the peer's proof ([`AUTH_LEN`] bytes, after its hello) is right; the
    /// verdict byte to send is `u8::from` it.
    pub fn on_proof(&self, secret: &SharedSecret, proof: &[u8; AUTH_LEN]) -> bool {
        let Some(peer) = &self.peer_nonce else { return false };
        // `blake3::Hash` compares in constant time.
        blake3::Hash::from_bytes(secret.mac(PEER_TAG, &self.nonce, peer, &self.names))
            == blake3::Hash::from_bytes(*proof)
    }
}

/// An address as both sides of a connection write it (IPv4-mapped IPv6 as IPv4).
fn canonical(a: SocketAddr) -> String {
    SocketAddr::new(a.ip().to_canonical(), a.port()).to_string()
}

impl SharedSecret {
    /// Derives the key from any secret bytes (builders refuse empty secrets before
    /// they get here).
    pub fn new(secret: &[u8]) -> Self {
        Self { key: blake3::derive_key("mooncake-rs 2026 connection secret", secret) }
    }

    /// The keyed hash of `nonce` under the secret's key: a digest for comparing
    /// secrets without revealing them (the handshake uses its own transcripts).
    pub fn answer(&self, nonce: &[u8; AUTH_LEN]) -> [u8; AUTH_LEN] {
        *blake3::keyed_hash(&self.key, nonce).as_bytes()
    }

    /// The token HTTP clients of a master's `/metrics`, `/status` and `/drain` send as
    /// `Authorization: Bearer <token>` (64 hex digits): a keyed hash of a label of
    /// its own, so a scrape configuration or a sniffed request gives nothing that
    /// proves the secret on any other listener. `mooncake-client metrics-token`
    /// prints it.
    pub fn http_token(&self) -> String {
        let h = self.mac(b"mooncake-rs http bearer token", &[0; AUTH_LEN], &[0; AUTH_LEN], b"");
        h.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The keyed hash of one side's transcript.
    fn mac(&self, tag: &[u8], listener: &[u8; AUTH_LEN], peer: &[u8; AUTH_LEN], names: &[u8]) -> [u8; AUTH_LEN] {
        let mut h = blake3::Hasher::new_keyed(&self.key);
        for part in [tag, listener, peer, names] {
            h.update(&(part.len() as u64).to_le_bytes());
            h.update(part);
        }
        *h.finalize().as_bytes()
    }

    /// Accepting side on a TCP connection: runs the whole handshake under a 5 s
    /// timeout (lifted again when admitted) and sends the verdict. `advertised`:
    /// names the listener proves besides the socket's local address.
    pub fn admit(&self, conn: &TcpStream, advertised: &[String]) -> Result<(), AuthFailure> {
        let _ = conn.set_read_timeout(Some(HANDSHAKE_TIMEOUT));
        let _ = conn.set_write_timeout(Some(HANDSHAKE_TIMEOUT));
        let mut c = conn;
        let io = |_| AuthFailure::Io;
        let (mut acceptor, greeting) = Acceptor::new(conn.local_addr().ok(), advertised);
        c.write_all(&greeting).map_err(io)?;
        let mut hello = [0u8; AUTH_HELLO_LEN];
        c.read_exact(&mut hello[..4]).map_err(io)?;
        if hello[..4] != AUTH_MAGIC {
            return Err(AuthFailure::NoSecret);
        }
        c.read_exact(&mut hello[4..]).map_err(io)?;
        let proof = acceptor.on_hello(self, &hello)?;
        c.write_all(&proof).map_err(io)?;
        let mut got = [0u8; AUTH_LEN];
        c.read_exact(&mut got).map_err(io)?;
        let ok = acceptor.on_proof(self, &got);
        c.write_all(&[u8::from(ok)]).map_err(io)?;
        if !ok {
            return Err(AuthFailure::WrongSecret);
        }
        let _ = conn.set_read_timeout(None);
        let _ = conn.set_write_timeout(None);
        Ok(())
    }

    /// Connecting side on a TCP connection to the listener dialed as `peer` (an
    /// endpoint string, also named in errors): checks the listener's proof first, then
    /// proves the secret. The error is one line naming the problem: the listener has
    /// no secret, proved it for another address (a relay), refused this one, or
    /// refused the connection.
    pub fn prove(&self, conn: &TcpStream, peer: &str) -> Result<(), String> {
        let old = conn.read_timeout().ok().flatten();
        let _ = conn.set_read_timeout(Some(HANDSHAKE_TIMEOUT));
        let dialed = conn.peer_addr().ok().map(canonical);
        let proved = self.prove_over(conn, dialed.as_deref(), peer);
        let _ = conn.set_read_timeout(old);
        proved
    }

    /// [`prove`](Self::prove) on a Unix socket connection to the listener dialed
    /// as `peer` (the name the listener proves the secret for on that socket).
    pub fn prove_unix(&self, conn: &UnixStream, peer: &str) -> Result<(), String> {
        let old = conn.read_timeout().ok().flatten();
        let _ = conn.set_read_timeout(Some(HANDSHAKE_TIMEOUT));
        let proved = self.prove_over(NoSignal(conn), None, peer);
        let _ = conn.set_read_timeout(old);
        proved
    }

    /// [`prove`](Self::prove) over any stream (the fuzz targets feed it a listener's
    /// bytes); `dialed` as the socket's peer address would be.
    #[cfg(feature = "fuzzing")]
    pub fn prove_over_stream(&self, c: impl Read + Write, dialed: Option<&str>, peer: &str) -> Result<(), String> {
        self.prove_over(c, dialed, peer)
    }

    /// The connecting side's handshake over `c` (its read timeout set), to the
    /// listener dialed as `peer`, also known as `dialed` (the socket's peer
    /// address).
    fn prove_over(&self, mut c: impl Read + Write, dialed: Option<&str>, peer: &str) -> Result<(), String> {
        let io = |e: std::io::Error| format!("{peer}: authentication failed: {e}");
        let nonce: [u8; AUTH_LEN] = rand::random();
        c.write_all(&[&AUTH_MAGIC[..], &nonce[..]].concat()).map_err(io)?;
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
        let mut listener = [0u8; AUTH_LEN];
        c.read_exact(&mut listener).map_err(io)?;
        let mut len = [0u8; 2];
        c.read_exact(&mut len).map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => {
                format!(
                    "{peer} closed the connection instead of proving the secret (an older version, or another secret)"
                )
            }
            _ => io(e),
        })?;
        let len = usize::from(u16::from_le_bytes(len));
        if len > MAX_NAMES {
            return Err(format!("{peer}: authentication failed: {len} bytes of listener names"));
        }
        let mut names = vec![0u8; len];
        c.read_exact(&mut names).map_err(io)?;
        let mut proof = [0u8; AUTH_LEN];
        c.read_exact(&mut proof).map_err(io)?;
        let expected = self.mac(LISTENER_TAG, &listener, &nonce, &names);
        if blake3::Hash::from_bytes(expected) != blake3::Hash::from_bytes(proof) {
            return Err(format!("{peer}: wrong secret: the listener proved another shared secret (or is an impostor)"));
        }
        let names_str = String::from_utf8_lossy(&names);
        if !names_str.split('\n').any(|n| n == peer || Some(n) == dialed) {
            return Err(format!(
                "{peer} proved the shared secret for another listener ({}): refusing a relay",
                names_str.replace('\n', ", ")
            ));
        }
        c.write_all(&self.mac(PEER_TAG, &listener, &nonce, &names)).map_err(io)?;
        let mut verdict = [0u8; 1];
        c.read_exact(&mut verdict).map_err(io)?;
        if verdict[0] != 1 {
            return Err(format!("{peer} refused the shared secret: wrong secret"));
        }
        Ok(())
    }
}

/// A Unix socket whose writes never raise `SIGPIPE` ([`send_no_signal`]).
///
/// [`send_no_signal`]: crate::send_no_signal
struct NoSignal<'a>(&'a UnixStream);

impl Read for NoSignal<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.0.read(buf)
    }
}

impl Write for NoSignal<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        crate::send_no_signal(std::os::fd::AsFd::as_fd(self.0), buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
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

    /// A listener on loopback that admits one connection with `secret`; its verdict.
    fn listen_once(secret: SharedSecret) -> (std::net::SocketAddr, std::thread::JoinHandle<Result<(), AuthFailure>>) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (c, _) = l.accept().unwrap();
            secret.admit(&c, &[])
        });
        (addr, t)
    }

    #[test]
    fn both_sides_prove_the_secret() {
        let (addr, t) = listen_once(SharedSecret::new(b"k"));
        let c = TcpStream::connect(addr).unwrap();
        SharedSecret::new(b"k").prove(&c, &addr.to_string()).unwrap();
        assert_eq!(t.join().unwrap(), Ok(()));

        // A listener with another secret cannot prove it: the peer refuses it before
        // proving anything, so the listener learns nothing it could use.
        let (addr, t) = listen_once(SharedSecret::new(b"not k"));
        let c = TcpStream::connect(addr).unwrap();
        let e = SharedSecret::new(b"k").prove(&c, &addr.to_string()).unwrap_err();
        assert!(e.contains("wrong secret: the listener proved another"), "{e}");
        drop(c);
        assert_eq!(t.join().unwrap(), Err(AuthFailure::Io));
    }

    #[test]
    fn a_relay_between_peer_and_listener_is_refused() {
        let secret = SharedSecret::new(b"k");
        let (real, t) = listen_once(secret.clone());
        // The relay: accepts the peer, dials the real listener, copies bytes both ways.
        let relay = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let relay_addr = relay.local_addr().unwrap();
        let r = std::thread::spawn(move || {
            let (down, _) = relay.accept().unwrap();
            let up = TcpStream::connect(real).unwrap();
            let (mut d2, mut u2) = (down.try_clone().unwrap(), up.try_clone().unwrap());
            let a = std::thread::spawn(move || {
                let _ = std::io::copy(&mut d2, &mut u2);
                let _ = u2.shutdown(std::net::Shutdown::Write);
            });
            let _ = std::io::copy(&mut &up, &mut &down);
            let _ = down.shutdown(std::net::Shutdown::Both);
            let _ = a.join();
        });
        let c = TcpStream::connect(relay_addr).unwrap();
        let e = secret.prove(&c, &relay_addr.to_string()).unwrap_err();
        assert!(e.contains("refusing a relay"), "{e}");
        assert!(e.contains(&real.to_string()), "names the real listener: {e}");
        drop(c);
        assert_eq!(t.join().unwrap(), Err(AuthFailure::Io), "the listener never got a proof");
        r.join().unwrap();
    }

    #[test]
    fn proofs_are_bound_to_role_nonces_and_names() {
        let s = SharedSecret::new(b"k");
        let (mut acc, greeting) = Acceptor::new(Some("127.0.0.1:7".parse().unwrap()), &["m:7".into()]);
        let listener: [u8; AUTH_LEN] = greeting[4..].try_into().unwrap();
        let peer = [9u8; AUTH_LEN];
        let hello: [u8; AUTH_HELLO_LEN] = [&AUTH_MAGIC[..], &peer].concat().try_into().unwrap();
        let out = acc.on_hello(&s, &hello).unwrap();
        let names = b"127.0.0.1:7\nm:7";
        assert_eq!(&out[2..2 + names.len()], names);
        let listener_proof: [u8; AUTH_LEN] = out[2 + names.len()..].try_into().unwrap();
        // The listener's own proof, reflected back, is no peer proof.
        assert!(!acc.on_proof(&s, &listener_proof));
        assert!(acc.on_proof(&s, &s.mac(PEER_TAG, &listener, &peer, names)));
        assert!(!acc.on_proof(&s, &s.mac(PEER_TAG, &listener, &[8; AUTH_LEN], names)), "another peer nonce");
        assert!(!acc.on_proof(&s, &s.mac(PEER_TAG, &listener, &peer, b"127.0.0.1:8")), "other names");
        assert!(!acc.on_proof(&SharedSecret::new(b"j"), &s.mac(PEER_TAG, &listener, &peer, names)));
        let mut no_magic = hello;
        no_magic[0] = b'X';
        assert_eq!(Acceptor::new(None, &[]).0.on_hello(&s, &no_magic), Err(AuthFailure::NoSecret));
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
