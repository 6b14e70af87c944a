//! The sockets of the RPC: TCP, and a Unix socket for clients on the server's
//! host.
//!
//! Why a Unix socket: a request and its answer over loopback TCP cross the TCP
//! stack twice each way; over a Unix socket they are copied between two buffers.
//! On a 2-core VM a 64-byte ping-pong took 6.8 us over loopback TCP and 2.8 us
//! over a Unix socket pair, and a put pays two master round trips.
//!
//! How a client finds it, safely: a server listens on an *abstract* Unix socket
//! (no file; it vanishes with the process) whose name carries 128 random bits,
//! and tells the name only to a client that asks over TCP from the same host
//! (loopback, or the server's own address: `same_host`; `Request::LocalEndpoint`). The name is no secret (processes of the network
//! namespace see it in `/proc/net/unix`), and needs none: nobody can bind it
//! before the server (it cannot be guessed), nor while the server lives; a
//! client dials a name it has just been told by the process holding the TCP port
//! it dialed, so it reaches the process it would have reached over TCP, and no
//! other. A client asks on every new connection (connections are pooled, so
//! rarely): a name told by a server that has since stopped is never reused.
//! Abstract names live in a network namespace, as loopback does: a client in
//! another namespace asking over loopback reaches a server in its own; who may
//! connect is who may connect to loopback TCP (protected mode admits both). With
//! a shared secret the Unix connection runs the same handshake as TCP, the
//! server naming itself by the socket's name. Whatever fails on the way, the
//! client stays on TCP.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::os::linux::net::SocketAddrExt;

use mooncake_transfer::send_no_signal;

/// The prefix of a server's abstract socket name (the rest: 32 random hex digits).
pub(crate) const LOCAL_NAME_PREFIX: &str = "mooncake-rpc-";

/// The abstract Unix socket a server listens on for clients of its host, and its
/// name: `LOCAL_NAME_PREFIX` and 128 random bits.
pub(crate) fn bind_local() -> std::io::Result<(std::os::unix::net::UnixListener, String)> {
    let name = format!("{LOCAL_NAME_PREFIX}{:032x}", rand::random::<u128>());
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
    let listener = std::os::unix::net::UnixListener::bind_addr(&addr)?;
    Ok((listener, name))
}

/// Connects to the abstract Unix socket `name` (one a server told: see the
/// module's comment), refusing any name not of the form a server gives.
pub(crate) fn connect_local(name: &str) -> std::io::Result<std::os::unix::net::UnixStream> {
    let hex = name.strip_prefix(LOCAL_NAME_PREFIX).unwrap_or_default();
    if hex.len() != 32 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("not a local RPC socket: {name:?}")));
    }
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
    std::os::unix::net::UnixStream::connect_addr(&addr)
}

/// The name by which a server proves a shared secret on its Unix socket, and
/// which a client that dialed that socket expects among the names it proves.
pub(crate) fn local_auth_name(name: &str) -> String {
    format!("unix:@{name}")
}

/// A connection: TCP, or a Unix socket (`T`, `U`: the server's `mio` streams, or a
/// client's `std` ones). Writes on the Unix socket never raise `SIGPIPE`
/// ([`send_no_signal`]).
#[derive(Debug)]
pub(crate) enum Stream<T, U> {
    Tcp(T),
    Unix(U),
}

/// A server's connection.
pub(super) type Socket = Stream<mio::net::TcpStream, mio::net::UnixStream>;

/// A client's connection to a server.
pub(crate) type ClientSocket = Stream<std::net::TcpStream, std::os::unix::net::UnixStream>;

impl<T, U> Read for &Stream<T, U>
where
    for<'a> &'a T: Read,
    for<'a> &'a U: Read,
{
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => (&*s).read(buf),
            Stream::Unix(s) => (&*s).read(buf),
        }
    }
}

impl<T, U: AsFd> Write for &Stream<T, U>
where
    for<'a> &'a T: Write,
{
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => (&*s).write(buf),
            Stream::Unix(s) => send_no_signal(s.as_fd(), buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<T: AsFd, U: AsFd> AsFd for Stream<T, U> {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Stream::Tcp(s) => s.as_fd(),
            Stream::Unix(s) => s.as_fd(),
        }
    }
}

impl<T: AsFd, U: AsFd> AsRawFd for Stream<T, U> {
    fn as_raw_fd(&self) -> RawFd {
        self.as_fd().as_raw_fd()
    }
}

impl<T, U> Stream<T, U> {
    /// Whether this is the Unix socket.
    #[cfg(test)]
    pub(crate) fn is_local(&self) -> bool {
        matches!(self, Stream::Unix(_))
    }
}

impl Socket {
    /// Stops writing (what the peer sends is still read).
    pub(super) fn shutdown_write(&self) {
        let _ = match self {
            Stream::Tcp(s) => s.shutdown(std::net::Shutdown::Write),
            Stream::Unix(s) => s.shutdown(std::net::Shutdown::Write),
        };
    }
}

/// Whether a TCP connection from `local` to `peer` stays on this host (and in its
/// network namespace): the peer is a loopback address, or an address of this
/// host's own (the kernel carries such a connection over loopback, and a remote
/// host cannot complete a handshake from an address of this one: the answer to
/// its SYN would stay here).
pub(crate) fn same_host(local: IpAddr, peer: IpAddr) -> bool {
    let peer = peer.to_canonical();
    peer.is_loopback() || peer == local.to_canonical()
}

/// Who a server's connection is with: a TCP peer (and whether it is on this
/// host: [`same_host`]), or a process of its host on its Unix socket.
#[derive(Clone, Copy, Debug)]
pub(super) enum Peer {
    Tcp { addr: SocketAddr, same_host: bool },
    Local,
}

impl Peer {
    /// A TCP peer at `addr` of a connection accepted at `local`.
    pub(super) fn tcp(addr: SocketAddr, local: Option<SocketAddr>) -> Self {
        let same = local.is_some_and(|l| same_host(l.ip(), addr.ip()));
        Peer::Tcp { addr, same_host: same || addr.ip().to_canonical().is_loopback() }
    }

    /// The peer's address, for the protected-mode rule (`None`: a process of
    /// this host on the Unix socket).
    pub(super) fn ip(&self) -> Option<IpAddr> {
        match self {
            Peer::Tcp { addr, .. } => Some(addr.ip()),
            Peer::Local => None,
        }
    }

    /// Whether the peer dialed over TCP from this host: the only peers told the
    /// server's Unix socket.
    pub(super) fn is_same_host_tcp(&self) -> bool {
        matches!(self, Peer::Tcp { same_host: true, .. })
    }
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Peer::Tcp { addr, .. } => write!(f, "{addr}"),
            Peer::Local => f.write_str("a local process (Unix socket)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bound name has the form clients accept, two binds never share one, and a
    /// client reaches the listener by it; a name of another form is refused
    /// before any connect (a client never dials a name it was not given in the
    /// server's form).
    #[test]
    fn a_local_socket_is_reached_by_its_random_name_only() {
        let (a, name_a) = bind_local().unwrap();
        let (_b, name_b) = bind_local().unwrap();
        assert_ne!(name_a, name_b);
        assert!(name_a.starts_with(LOCAL_NAME_PREFIX) && name_a.len() == LOCAL_NAME_PREFIX.len() + 32);
        let mut c = connect_local(&name_a).unwrap();
        let (mut s, _) = a.accept().unwrap();
        c.write_all(b"ping").unwrap();
        let mut got = [0u8; 4];
        s.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"ping");
        for bad in ["", "mooncake-rpc-", "mooncake-rpc-xyz", "other-0123456789abcdef0123456789abcdef"] {
            let e = connect_local(bad).unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{bad:?}");
        }
        // A name nobody holds (the form is right): refused by the system.
        let free = format!("{LOCAL_NAME_PREFIX}{:032x}", 7u128);
        assert!(connect_local(&free).is_err());
    }

    /// Only a TCP peer on the server's host (loopback, or the server's own
    /// address) is told the Unix socket's name.
    #[test]
    fn only_tcp_peers_of_the_same_host_are_told_the_name() {
        let local: SocketAddr = "10.1.2.3:50051".parse().unwrap();
        let tcp = |a: &str| Peer::tcp(a.parse().unwrap(), Some(local));
        assert!(tcp("127.0.0.1:5").is_same_host_tcp());
        assert!(tcp("[::1]:5").is_same_host_tcp());
        assert!(tcp("[::ffff:127.0.0.1]:5").is_same_host_tcp());
        assert!(tcp("10.1.2.3:5").is_same_host_tcp(), "the server's own address");
        assert!(tcp("[::ffff:10.1.2.3]:5").is_same_host_tcp());
        assert!(!tcp("10.1.2.4:5").is_same_host_tcp());
        assert!(!tcp("[::ffff:10.9.2.3]:5").is_same_host_tcp());
        assert!(!Peer::tcp("10.1.2.3:5".parse().unwrap(), None).is_same_host_tcp(), "no local address known");
        assert!(!Peer::Local.is_same_host_tcp());
        assert!(same_host("192.168.0.7".parse().unwrap(), "::ffff:192.168.0.7".parse().unwrap()));
        assert!(!same_host("192.168.0.7".parse().unwrap(), "192.168.0.8".parse().unwrap()));
    }

    mod served {
        use std::io::{Read, Write};
        use std::sync::atomic::Ordering;
        use std::sync::Arc;

        use mooncake_transfer::SharedSecret;

        use crate::master::{Master, MasterApi};
        use crate::rpc::handler::{RpcHandler, RpcServerConfig};
        use crate::rpc::wire::{decode_body, encode_frame, FrameHeader, FrameKind, Request, Response, HEADER_LEN};
        use crate::rpc::{RpcMasterClient, RpcServer};
        use crate::MasterConfig;

        fn server(local_socket: bool, secret: Option<SharedSecret>) -> (Master, RpcServer) {
            let master = Master::new(MasterConfig::default()).unwrap();
            let handler: Arc<dyn RpcHandler> = master.service().clone();
            let config = RpcServerConfig { local_socket, secret, ..RpcServerConfig::default() };
            let server = RpcServer::serve_with("127.0.0.1:0", handler, config).unwrap();
            (master, server)
        }

        /// One request on `s`, its answer.
        fn call_raw(mut s: impl Read + Write, req: &Request) -> std::io::Result<Response> {
            s.write_all(&encode_frame(FrameKind::Request, 9, req).unwrap())?;
            let mut head = [0u8; HEADER_LEN];
            s.read_exact(&mut head)?;
            let invalid = |e: String| std::io::Error::new(std::io::ErrorKind::InvalidData, e);
            let h = FrameHeader::decode(&head, 1 << 20).map_err(|e| invalid(format!("{e:?}")))?;
            let mut body = vec![0u8; h.body_len as usize];
            s.read_exact(&mut body)?;
            decode_body(&body).map_err(|e| invalid(e.to_string()))
        }

        /// A client of a server on its host asks over loopback TCP once, then calls
        /// over the Unix socket; the calls are the master's (its objects change).
        #[test]
        fn a_client_on_the_servers_host_calls_over_its_unix_socket() {
            let (master, server) = server(true, None);
            let client = RpcMasterClient::connect(&server.local_addr().to_string()).unwrap();
            assert_eq!(client.pooled_are_local(), vec![true]);
            let me = client.register_client().unwrap();
            assert!(!client.exists("k").unwrap());
            // This master's incarnation, and both calls counted by this server.
            assert_eq!(master.service().register_client().unwrap().incarnation, me.incarnation);
            assert_eq!(server.stats().requests.load(Ordering::Relaxed), 2);
            // Asked over TCP, then once on the socket (to know it was admitted).
            let asked = server.stats().ops_by_kind[Request::LOCAL_ENDPOINT_KIND].load(Ordering::Relaxed);
            assert_eq!(asked, 2);
            assert_eq!(client.pooled_are_local(), vec![true]);
        }

        /// A server at its connection limit refuses the Unix connection a client
        /// opens beside its TCP one: the client stays on TCP and its calls work,
        /// with a secret or without.
        #[test]
        fn at_the_connection_limit_a_client_stays_on_tcp() {
            for secret in [None, Some(SharedSecret::new(b"s3cret"))] {
                let master = Master::new(MasterConfig::default()).unwrap();
                let handler: Arc<dyn RpcHandler> = master.service().clone();
                let config =
                    RpcServerConfig { max_connections: 1, secret: secret.clone(), ..RpcServerConfig::default() };
                let server = RpcServer::serve_with("127.0.0.1:0", handler, config).unwrap();
                let client = RpcMasterClient::connect_with(&server.local_addr().to_string(), secret.clone()).unwrap();
                assert_eq!(client.pooled_are_local(), vec![false], "secret: {}", secret.is_some());
                assert!(!client.exists("k").unwrap());
                assert!(server.stats().refused_connections.load(Ordering::Relaxed) >= 1);
            }
        }

        /// A client dialing the server at this host's own (non-loopback) address
        /// moves to the Unix socket too. Skipped where the host has no such address.
        #[test]
        fn a_client_dialing_this_hosts_own_address_moves_too() {
            let probe = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
            let own = probe.connect("10.255.255.255:9").ok().and_then(|()| probe.local_addr().ok()).map(|a| a.ip());
            let Some(own) = own.filter(|ip| !ip.is_loopback() && !ip.is_unspecified()) else {
                eprintln!("note: skipping: this host has no non-loopback address");
                return;
            };
            let master = Master::new(MasterConfig::default()).unwrap();
            let handler: Arc<dyn RpcHandler> = master.service().clone();
            let config = RpcServerConfig { insecure: true, ..RpcServerConfig::default() };
            let server = RpcServer::serve_with("0.0.0.0:0", handler, config).unwrap();
            let addr = std::net::SocketAddr::new(own, server.local_addr().port()).to_string();
            let client = RpcMasterClient::connect(&addr).unwrap();
            assert_eq!(client.pooled_are_local(), vec![true], "dialed {addr}");
            assert!(!client.exists("k").unwrap());
        }

        /// A server without the socket tells no name, and its clients stay on TCP.
        #[test]
        fn a_server_without_a_unix_socket_keeps_its_clients_on_tcp() {
            let (_master, server) = server(false, None);
            let client = RpcMasterClient::connect(&server.local_addr().to_string()).unwrap();
            assert_eq!(client.pooled_are_local(), vec![false]);
            assert!(!client.exists("k").unwrap());
            let s = std::net::TcpStream::connect(server.local_addr()).unwrap();
            assert_eq!(call_raw(&s, &Request::LocalEndpoint {}).unwrap(), Response::LocalEndpoint(None));
        }

        /// With a shared secret the Unix socket runs the same handshake: a client
        /// with the secret calls over it; a connection that does not prove the
        /// secret there gets no answer to a request, however it learned the name.
        #[test]
        fn with_a_secret_the_unix_socket_asks_for_it_too() {
            let secret = SharedSecret::new(b"s3cret");
            let (_master, server) = server(true, Some(secret.clone()));
            let addr = server.local_addr().to_string();
            let client = RpcMasterClient::connect_with(&addr, Some(secret.clone())).unwrap();
            assert_eq!(client.pooled_are_local(), vec![true]);
            assert!(!client.exists("k").unwrap());
            // The name, asked over TCP after proving the secret.
            let tcp = std::net::TcpStream::connect(server.local_addr()).unwrap();
            secret.prove(&tcp, &addr).unwrap();
            let Response::LocalEndpoint(Some(name)) = call_raw(&tcp, &Request::LocalEndpoint {}).unwrap() else {
                panic!("no name told over loopback TCP")
            };
            // No proof on the Unix socket: the request is not answered.
            let u = super::super::connect_local(&name).unwrap();
            u.set_read_timeout(Some(std::time::Duration::from_secs(10))).unwrap();
            let got = call_raw(&u, &Request::Exists { key: "k".into() });
            assert!(!matches!(got, Ok(Response::Exists(_))), "answered without the secret: {got:?}");
            // Another secret is refused there too.
            let u = super::super::connect_local(&name).unwrap();
            let wrong = SharedSecret::new(b"other");
            assert!(wrong.prove_unix(&u, &super::super::local_auth_name(&name)).is_err());
        }
    }
}
