//! The master's TCP server: every connection polled by one thread at a time, each
//! request answered by the thread that read it (each connection's requests in order).

use std::net::SocketAddr;
use std::sync::Arc;

use mooncake_transfer::SharedSecret;

use crate::error::{Error, Result};
use crate::master::{master_calls, MasterApi, MasterService};
use crate::rpc::convert::{Arg, Lend};
use crate::rpc::handler::{RpcHandler, RpcServerConfig, RpcServerStats};
use crate::rpc::threads::ServerThreads;
use crate::rpc::wire::WireReturn;

use super::wire::{Request, Response, WireError, DEFAULT_MAX_FRAME};

/// Serves a [`MasterService`] over TCP.
///
/// A pool of threads serves every connection (an idle one costs a socket and a few
/// hundred bytes): one polls them all while the others answer the requests it handed
/// on, each writing its response itself (leader/follower). Request bodies are
/// read into memory as their bytes arrive, within [`RpcServerConfig::max_frame`] per
/// connection and [`RpcServerConfig::memory_budget`] over all of them: a header
/// reserves its body's share of the budget but takes no memory. A connection that
/// has not completed its hello within [`RpcServerConfig::hello_timeout`] is closed;
/// connections beyond [`RpcServerConfig::max_connections`], and (in protected mode)
/// non-loopback clients of a server without a secret, are refused with a message.
///
/// ```
/// use mooncake_core::{Master, MasterConfig, Store};
/// use mooncake_core::rpc::RpcServer;
///
/// let master = Master::new(MasterConfig::default())?;
/// let server = RpcServer::bind("127.0.0.1:0", master.service().clone())?;
/// let addr = server.local_addr().to_string();
/// let store = Store::builder().master_address(&addr).global_segment_size(1 << 20).build()?;
/// store.put("k", b"over tcp")?;
/// assert_eq!(master.stats().objects, 1);
/// # Ok::<(), mooncake_core::Error>(())
/// ```
pub struct RpcServer {
    addr: SocketAddr,
    stats: Arc<RpcServerStats>,
    threads: Option<ServerThreads>,
}

impl std::fmt::Debug for RpcServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RpcServer").field("addr", &self.addr).finish()
    }
}

impl RpcServer {
    /// Binds `addr` and starts serving `service` on background threads, with the
    /// default [`RpcServerConfig`]: no secret, so loopback clients only.
    pub fn bind(addr: &str, service: Arc<MasterService>) -> Result<Self> {
        Self::bind_with_limit(addr, service, DEFAULT_MAX_FRAME)
    }

    /// [`bind`](Self::bind) with a custom largest frame body.
    pub fn bind_with_limit(addr: &str, service: Arc<MasterService>, max_frame: u32) -> Result<Self> {
        Self::bind_with(addr, service, max_frame, None)
    }

    /// [`bind`](Self::bind) with a largest frame body and, optionally, a shared secret
    /// every client must prove before its first request.
    pub fn bind_with(
        addr: &str,
        service: Arc<MasterService>,
        max_frame: u32,
        secret: Option<SharedSecret>,
    ) -> Result<Self> {
        Self::serve(addr, service, max_frame, secret)
    }

    /// Serves any [`RpcHandler`] (the master, or a storage node answering loads from
    /// its SSD) with the same framing, limits and authentication.
    #[cfg_attr(feature = "fuzzing", visibility::make(pub))]
    pub(crate) fn serve(
        addr: &str,
        service: Arc<dyn RpcHandler>,
        max_frame: u32,
        secret: Option<SharedSecret>,
    ) -> Result<Self> {
        Self::serve_with(addr, service, RpcServerConfig { max_frame, secret, ..RpcServerConfig::default() })
    }

    /// Serves `service` with every limit and access rule of `config`.
    #[cfg_attr(feature = "fuzzing", visibility::make(pub))]
    pub(crate) fn serve_with(addr: &str, service: Arc<dyn RpcHandler>, config: RpcServerConfig) -> Result<Self> {
        let listener = std::net::TcpListener::bind(addr)
            .map_err(|e| Error::InvalidArgument(format!("cannot listen on {addr}: {e}")))?;
        let local = listener.local_addr().map_err(|e| Error::InvalidArgument(e.to_string()))?;
        let stats = Arc::new(RpcServerStats::default());
        let threads = ServerThreads::start(listener, service, config, stats.clone())
            .map_err(|e| Error::InvalidArgument(format!("cannot start the RPC server: {e}")))?;
        tracing::info!(%local, "RPC listening");
        Ok(Self { addr: local, stats, threads: Some(threads) })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Counters.
    pub fn stats(&self) -> &Arc<RpcServerStats> {
        &self.stats
    }
}

impl Drop for RpcServer {
    /// Stops and joins the server's threads, and closes the listener (the address is
    /// free again when this returns) and every open connection.
    fn drop(&mut self) {
        drop(self.threads.take());
    }
}

impl RpcHandler for MasterService {
    fn handle(&self, request: Request) -> Response {
        dispatch(self, request)
    }

    fn has_work_after_answer(&self) -> bool {
        self.has_records_to_send()
    }

    fn work_after_answer(&self) {
        self.send_records_after_answer();
    }
}

/// Most keys one `ListKeys` answers over RPC, whatever limit it asks for: a request
/// of a dozen bytes must not have the master copy out every key it holds. With the
/// answer also kept within a frame ([`LIST_KEYS_MAX_BYTES`]), a client can always
/// decode it (at most about 490 MB charged, within
/// [`DecodeLimits::RESPONSE`](crate::rpc::budget::DecodeLimits::RESPONSE)).
pub const MAX_LISTED_KEYS: usize = 2 << 20;

/// Most bytes of keys, as encoded, in one `ListKeys` answer over RPC: what fits in a
/// frame a client reads (64 MiB, `DEFAULT_MAX_FRAME`) with room for the rest of
/// the answer. Keys past it are left out (an answer over it could not be sent at all).
pub const LIST_KEYS_MAX_BYTES: usize = DEFAULT_MAX_FRAME as usize - 64;

/// How many of `keys`, from the first, fit in `max_bytes` as encoded (each key's
/// bytes after its length, a LEB128 varint).
fn keys_that_fit(keys: &[String], max_bytes: usize) -> usize {
    let mut bytes = 0usize;
    for (i, key) in keys.iter().enumerate() {
        bytes += varint_len(key.len()) + key.len();
        if bytes > max_bytes {
            return i;
        }
    }
    keys.len()
}

/// Bytes of `n` as a LEB128 varint (how postcard writes lengths).
fn varint_len(n: usize) -> usize {
    (usize::BITS - n.leading_zeros()).div_ceil(7).max(1) as usize
}

/// Answers one request with a master: the server's dispatch over any
/// [`MasterApi`] (the service itself, or anything that wraps one). A `ListKeys` or
/// `ListKeysAfter` answers at most [`MAX_LISTED_KEYS`] keys, and only as many as fit
/// in a frame ([`LIST_KEYS_MAX_BYTES`]).
#[cfg_attr(feature = "fuzzing", visibility::make(pub))]
pub(crate) fn dispatch(api: &dyn MasterApi, request: Request) -> Response {
    let request = match request {
        Request::ListKeys { limit } => Request::ListKeys { limit: limit.min(MAX_LISTED_KEYS) },
        Request::ListKeysAfter { after, limit } => Request::ListKeysAfter { after, limit: limit.min(MAX_LISTED_KEYS) },
        other => other,
    };
    macro_rules! dispatch_calls {
        ($( $(#[$doc:meta])* $variant:ident => fn $name:ident ( $( $arg:ident : $ty:ty => $wire:ty ),* $(,)? ) -> $ret:ty
        => $route:ident $( ( $($how:tt)* ) )? $( + $hook:ident )?; )*) => {
            match request {
                $(
                    Request::$variant { $($arg),* } => {
                        $( let $arg = Lend::lend(&$arg); )*
                        Response::$variant(WireReturn::into_wire(api.$name($( Arg::arg(&$arg) ),*)))
                    }
                )*
                Request::BatchGetOffloadObject { .. }
                | Request::ReleaseOffloadBuffer { .. }
                | Request::ApplyRecords { .. } => Response::Error(WireError::InvalidArgument(
                    "this is a master: storage-node requests are served by storage nodes".into(),
                )),
                // Answered by the server's connection loop, never by a handler.
                Request::LocalEndpoint { .. } => Response::LocalEndpoint(None),
            }
        };
    }
    let mut response = master_calls!(dispatch_calls);
    // A page of `ListKeysAfter` is sorted: cutting its tail skips nothing (the next
    // page starts there).
    if let Response::ListKeys(Ok(keys)) | Response::ListKeysAfter(Ok(keys)) = &mut response {
        keys.truncate(keys_that_fit(keys, LIST_KEYS_MAX_BYTES));
    }
    response
}

/// Reads one frame body of at most `max` bytes (helper for tests and tools; a
/// blocking reader that trusts its peer).
#[cfg(feature = "fuzzing")]
pub fn read_frame(
    r: &mut impl std::io::Read,
    max: u32,
) -> std::result::Result<crate::rpc::frame_reader::RawFrame, crate::rpc::wire::FrameError> {
    use crate::rpc::wire::{FrameError, FrameHeader, HEADER_LEN};
    let mut header = [0u8; HEADER_LEN];
    r.read_exact(&mut header).map_err(|e| FrameError::Truncated(e.to_string()))?;
    let h = FrameHeader::decode(&header, max)?;
    let mut body = vec![0u8; h.body_len as usize];
    r.read_exact(&mut body).map_err(|e| FrameError::Truncated(e.to_string()))?;
    Ok((h, body))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::rpc::wire::{encode_frame, FrameKind, HEADER_LEN};

    /// The keys' share of their encoding: all of it but the count of keys.
    fn encoded(keys: &[String]) -> usize {
        postcard::to_allocvec(keys).unwrap().len() - varint_len(keys.len())
    }

    proptest! {
        /// The keys kept are the most, from the first, whose encoding fits the bound.
        #[test]
        fn the_keys_kept_are_the_most_that_fit_as_encoded(
            lens in proptest::collection::vec(0usize..300, 0..40),
            max in 0usize..4000,
        ) {
            let keys: Vec<String> = lens.iter().map(|&n| "k".repeat(n)).collect();
            let n = keys_that_fit(&keys, max);
            prop_assert!(encoded(&keys[..n]) <= max);
            if n < keys.len() {
                prop_assert!(encoded(&keys[..=n]) > max);
            }
        }
    }

    #[test]
    fn an_answer_of_the_keys_that_fit_fits_in_a_frame() {
        // 16 Ki keys of 4 KiB: just over a frame.
        let keys: Vec<String> = (0..16 << 10).map(|i| format!("{i:04096}")).collect();
        let n = keys_that_fit(&keys, LIST_KEYS_MAX_BYTES);
        assert!(n < keys.len() && n > 16_000, "{n}");
        let frame = encode_frame(FrameKind::Response, 1, &Response::ListKeys(Ok(keys[..n].to_vec()))).unwrap();
        assert!(frame.len() - HEADER_LEN <= DEFAULT_MAX_FRAME as usize, "{}", frame.len());
    }
}
