//! The Tcp and Shm transports between engines, through the public API: exact bytes,
//! striping, batches, bounds, and a server that survives garbage.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use mooncake_transfer::{FrameOp, FrameStatus, RequestHeader, ResponseHeader, REQUEST_HEADER_LEN, RESPONSE_HEADER_LEN};
use mooncake_transfer::{
    LocalTransport, RemoteRegion, SharedSecret, ShmTransport, TcpTransport, TransferEngine, TransferError,
    TransferRequest, Transport,
};
use proptest::prelude::*;

fn server(shared: bool) -> TransferEngine {
    TransferEngine::builder().tcp_listen("127.0.0.1:0").shared_memory(shared).build().unwrap()
}

/// A client engine with exactly one transport, so nothing else can serve.
fn client(t: Arc<dyn Transport>) -> TransferEngine {
    TransferEngine::builder().transport(t).build().unwrap()
}

fn bytes(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| seed.wrapping_add((i % 249) as u8) ^ (i >> 16) as u8).collect()
}

fn round_trips(srv: &TransferEngine, cli: &TransferEngine) {
    let seg = srv.register_region(64 << 20).unwrap();
    let target = srv.remote(seg.id());
    for (i, len) in [1usize, 4096, 1 << 20, 16 << 20].into_iter().enumerate() {
        let data = bytes(i as u8, len);
        let offset = 4096 * i as u64 + 3;
        cli.write(&target, offset, &data).unwrap();
        let mut back = vec![0u8; len];
        cli.read(&target, offset, &mut back).unwrap();
        assert!(back == data, "{len} bytes came back different");
        // And the server's own memory holds them.
        let mut local = vec![0u8; len];
        seg.copy_out(offset, &mut local).unwrap();
        assert!(local == data);
    }
}

#[test]
fn tcp_moves_exact_bytes_including_striped_requests() {
    let tcp = Arc::new(TcpTransport::new());
    let (srv, cli) = (server(false), client(tcp.clone()));
    assert!(srv.endpoint().starts_with("127.0.0.1:"));
    round_trips(&srv, &cli);
    let s = tcp.stats();
    assert!(s.bytes_written.load(std::sync::atomic::Ordering::Relaxed) >= 17 << 20);
    assert!(s.bytes_read.load(std::sync::atomic::Ordering::Relaxed) >= 17 << 20);
}

#[test]
fn shm_moves_exact_bytes_without_tcp_data() {
    let shm = Arc::new(ShmTransport::new());
    let (srv, cli) = (server(true), client(shm.clone()));
    assert!(shm.can_reach(srv.endpoint()), "same host, same namespace");
    round_trips(&srv, &cli);
    assert!(shm.stats().bytes_read.load(std::sync::atomic::Ordering::Relaxed) >= 17 << 20);
}

#[test]
fn shm_falls_back_to_tcp_for_regions_that_are_not_shared() {
    let shm = Arc::new(ShmTransport::new());
    let (srv, cli) = (server(false), client(shm));
    round_trips(&srv, &cli);
}

#[test]
fn batches_mix_peers_and_report_each_request() {
    let tcp = Arc::new(TcpTransport::new());
    let (a, b, cli) = (server(false), server(false), client(tcp));
    let (ra, rb) = (a.register_region(1 << 20).unwrap(), b.register_region(1 << 20).unwrap());
    let (ta, tb) = (a.remote(ra.id()), b.remote(rb.id()));
    let blocks: Vec<Vec<u8>> = (0..40).map(|i| bytes(i, 10_000 + i as usize)).collect();
    let mut reqs: Vec<TransferRequest<'_>> = blocks
        .iter()
        .enumerate()
        .map(|(i, blk)| TransferRequest::write(if i % 2 == 0 { &ta } else { &tb }, (i as u64 / 2) * 20_480, blk))
        .collect();
    let bad = vec![0u8; 10];
    reqs.push(TransferRequest::write(&tb, (1 << 20) - 5, &bad));
    let res = cli.transfer(&mut reqs);
    assert!(res[..40].iter().all(|r| r.is_ok()), "{res:?}");
    assert!(matches!(res[40], Err(TransferError::OutOfBounds { .. })));
    let mut backs: Vec<Vec<u8>> = blocks.iter().map(|b| vec![0u8; b.len()]).collect();
    let mut reads: Vec<TransferRequest<'_>> = backs
        .iter_mut()
        .enumerate()
        .map(|(i, b)| TransferRequest::read(if i % 2 == 0 { &ta } else { &tb }, (i as u64 / 2) * 20_480, b))
        .collect();
    assert!(cli.transfer(&mut reads).iter().all(|r| r.is_ok()));
    drop(reads);
    assert_eq!(backs, blocks);
}

fn refused_everywhere(t: Arc<dyn Transport>, shared: bool) {
    let srv = server(shared);
    let seg = srv.register_region(8192).unwrap();
    seg.copy_in(0, &[7u8; 8192]).unwrap();
    let cli = client(t);
    let target = srv.remote(seg.id());
    let mut buf = [0u8; 16];
    assert!(matches!(cli.read(&target, 8190, &mut buf), Err(TransferError::OutOfBounds { .. })));
    assert!(matches!(cli.write(&target, 8180, &[1u8; 13]), Err(TransferError::OutOfBounds { .. })));
    assert!(cli.write(&target, u64::MAX - 3, &[1u8; 8]).is_err());
    let ghost = RemoteRegion { endpoint: srv.endpoint().to_owned(), region: 999 };
    assert!(matches!(cli.read(&ghost, 0, &mut buf), Err(TransferError::UnknownRegion { .. })));
    // Nothing changed, and the server still serves.
    let mut all = vec![0u8; 8192];
    cli.read(&target, 0, &mut all).unwrap();
    assert!(all.iter().all(|&b| b == 7));
}

#[test]
fn peers_cannot_touch_bytes_outside_registered_regions() {
    refused_everywhere(Arc::new(TcpTransport::new()), false);
    refused_everywhere(Arc::new(ShmTransport::new()), true);
}

fn send_raw(addr: &str, bytes: &[u8]) -> Vec<u8> {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = s.write_all(bytes);
    let _ = s.shutdown(std::net::Shutdown::Write);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    out
}

#[test]
fn garbage_truncated_and_oversized_frames_close_the_connection_only() {
    let srv = server(false);
    let seg = srv.register_region(4096).unwrap();
    let addr = srv.endpoint().to_owned();
    assert!(send_raw(&addr, &[0xAB; 200]).is_empty(), "garbage gets no answer");
    let read = RequestHeader { op: FrameOp::Read, request_id: 9, region: seg.id(), offset: 0, len: 16 }.encode();
    assert!(send_raw(&addr, &read[..REQUEST_HEADER_LEN - 3]).is_empty(), "truncated header");
    let huge = RequestHeader { op: FrameOp::Write, request_id: 1, region: seg.id(), offset: 0, len: u64::MAX }.encode();
    assert!(send_raw(&addr, &huge).is_empty(), "oversized length");
    let mut unknown = read;
    unknown[5] = 77;
    assert!(send_raw(&addr, &unknown).is_empty(), "unknown op");
    // A write whose payload never comes: the server waits, then the peer hangs up.
    let short = RequestHeader { op: FrameOp::Write, request_id: 2, region: seg.id(), offset: 0, len: 100 }.encode();
    let mut partial = short.to_vec();
    partial.extend_from_slice(&[1u8; 10]);
    assert!(send_raw(&addr, &partial).is_empty());
    // A well-formed read still works.
    let out = send_raw(&addr, &read);
    let h = ResponseHeader::decode(&out, 16).unwrap();
    assert_eq!((h.status, h.request_id, h.len), (FrameStatus::Ok, 9, 16));
    assert_eq!(out.len(), RESPONSE_HEADER_LEN + 16);
    let cli = client(Arc::new(TcpTransport::new()));
    cli.write(&srv.remote(seg.id()), 0, b"still serving").unwrap();
}

#[test]
fn requests_to_a_dropped_engine_fail_cleanly() {
    let srv = server(false);
    let seg = srv.register_region(4096).unwrap();
    let target = srv.remote(seg.id());
    let cli = client(Arc::new(TcpTransport::new()));
    cli.write(&target, 0, b"x").unwrap();
    drop(seg);
    drop(srv);
    std::thread::sleep(Duration::from_millis(50));
    assert!(cli.write(&target, 0, b"x").is_err());
}

proptest! {
    #[test]
    fn request_headers_round_trip(id in any::<u64>(), region in any::<u64>(), offset in any::<u64>(), len in 0u64..=1 << 30, op in 1u8..=2) {
        let op = if op == 1 { FrameOp::Read } else { FrameOp::Write };
        let h = RequestHeader { op, request_id: id, region, offset, len };
        prop_assert_eq!(RequestHeader::decode(&h.encode()).unwrap(), h);
    }

    #[test]
    fn arbitrary_bytes_never_panic_the_decoders(b in proptest::collection::vec(any::<u8>(), 0..64)) {
        let _ = RequestHeader::decode(&b);
        let _ = ResponseHeader::decode(&b, u64::MAX);
    }
}

#[test]
fn a_shared_secret_is_required_when_set() {
    use mooncake_transfer::SharedSecret;
    let srv = TransferEngine::builder().tcp_listen("127.0.0.1:0").shared_secret(b"s3cret").build().unwrap();
    let seg = srv.register_region(4096).unwrap();
    let target = srv.remote(seg.id());
    let good = client(Arc::new(TcpTransport::with_secret(SharedSecret::new(b"s3cret"))));
    good.write(&target, 0, b"authenticated").unwrap();
    let wrong = client(Arc::new(TcpTransport::with_secret(SharedSecret::new(b"guess"))));
    assert!(wrong.write(&target, 0, b"intruder").is_err());
    let none = client(Arc::new(TcpTransport::new()));
    let mut buf = [0u8; 13];
    assert!(none.read(&target, 0, &mut buf).is_err());
    good.read(&target, 0, &mut buf).unwrap();
    assert_eq!(&buf, b"authenticated", "refused peers changed nothing");
}

#[test]
fn a_restarted_peer_on_the_same_port_never_serves_stale_region_ids() {
    let shm = Arc::new(ShmTransport::new());
    let cli = client(shm);
    let first = server(true);
    let endpoint = first.endpoint().to_owned();
    let old = first.register_region(4096).unwrap();
    let old_target = first.remote(old.id());
    cli.write(&old_target, 0, b"before restart").unwrap();
    drop(old);
    drop(first);
    std::thread::sleep(Duration::from_millis(100));
    // The "restarted" process binds the same address and registers a region again.
    let again = TransferEngine::builder().tcp_listen(&endpoint).shared_memory(true).build().unwrap();
    assert_eq!(again.endpoint(), endpoint);
    let new = again.register_region(4096).unwrap();
    assert_ne!(new.id(), old_target.region, "region ids must differ across restarts");
    // The stale id fails cleanly instead of reaching the old (cached) mapping.
    let mut buf = [0u8; 14];
    let stale = cli.read(&old_target, 0, &mut buf);
    assert!(stale.is_err() || buf != *b"before restart", "a stale mapping served old bytes");
    cli.write(&again.remote(new.id()), 0, b"after restart!").unwrap();
    let mut back = [0u8; 14];
    new.copy_out(0, &mut back).unwrap();
    assert_eq!(&back, b"after restart!");
}

#[test]
fn a_batch_of_many_small_requests_to_one_peer_is_pipelined_exactly() {
    let tcp = Arc::new(TcpTransport::new());
    let (srv, cli) = (server(false), client(tcp.clone()));
    let seg = srv.register_region(8 << 20).unwrap();
    let target = srv.remote(seg.id());
    // 1000 requests: more than one pipelining window, mixed sizes.
    let blocks: Vec<Vec<u8>> = (0..1000).map(|i| bytes(i as u8, 1 + (i * 37) % 4096)).collect();
    let mut writes: Vec<TransferRequest<'_>> =
        blocks.iter().enumerate().map(|(i, b)| TransferRequest::write(&target, i as u64 * 4096, b)).collect();
    assert!(cli.transfer(&mut writes).iter().all(|r| r.is_ok()));
    let mut backs: Vec<Vec<u8>> = blocks.iter().map(|b| vec![0u8; b.len()]).collect();
    let mut reads: Vec<TransferRequest<'_>> =
        backs.iter_mut().enumerate().map(|(i, b)| TransferRequest::read(&target, i as u64 * 4096, b)).collect();
    assert!(cli.transfer(&mut reads).iter().all(|r| r.is_ok()));
    drop(reads);
    assert_eq!(backs, blocks);
    let s = tcp.stats().snapshot("tcp");
    let total: u64 = blocks.iter().map(|b| b.len() as u64).sum();
    assert_eq!((s.bytes_written, s.bytes_read, s.errors), (total, total, 0));
}

#[test]
fn the_server_answers_pipelined_requests_in_order_on_one_connection() {
    let srv = server(false);
    let seg = srv.register_region(4096).unwrap();
    seg.copy_in(0, b"abcdefgh").unwrap();
    let mut wire = Vec::new();
    wire.extend_from_slice(
        &RequestHeader { op: FrameOp::Read, request_id: 1, region: seg.id(), offset: 0, len: 4 }.encode(),
    );
    // A refused write (unknown region): its payload is skipped, the stream stays in sync.
    wire.extend_from_slice(
        &RequestHeader { op: FrameOp::Write, request_id: 2, region: 424242, offset: 0, len: 5 }.encode(),
    );
    wire.extend_from_slice(b"XXXXX");
    // An out-of-bounds write: refused before one byte is stored.
    wire.extend_from_slice(
        &RequestHeader { op: FrameOp::Write, request_id: 3, region: seg.id(), offset: 4094, len: 5 }.encode(),
    );
    wire.extend_from_slice(b"YYYYY");
    wire.extend_from_slice(
        &RequestHeader { op: FrameOp::Write, request_id: 4, region: seg.id(), offset: 4, len: 2 }.encode(),
    );
    wire.extend_from_slice(b"ZZ");
    wire.extend_from_slice(
        &RequestHeader { op: FrameOp::Read, request_id: 5, region: seg.id(), offset: 2, len: 6 }.encode(),
    );
    let out = send_raw(srv.endpoint(), &wire);
    let mut at = 0;
    let mut next = |max: u64| {
        let h = ResponseHeader::decode(&out[at..], max).unwrap();
        at += RESPONSE_HEADER_LEN;
        let body = out[at..at + h.len as usize].to_vec();
        at += h.len as usize;
        (h.status, h.request_id, body)
    };
    assert_eq!(next(4), (FrameStatus::Ok, 1, b"abcd".to_vec()));
    assert_eq!(next(0), (FrameStatus::UnknownRegion, 2, vec![]));
    assert_eq!(next(0), (FrameStatus::OutOfBounds, 3, vec![]));
    assert_eq!(next(0), (FrameStatus::Ok, 4, vec![]));
    assert_eq!(next(6), (FrameStatus::Ok, 5, b"cdZZgh".to_vec()));
    let mut tail = [0u8; 2];
    seg.copy_out(4094, &mut tail).unwrap();
    assert_eq!(tail, [0, 0], "the refused write stored nothing");
}

#[test]
fn reads_and_large_writes_interleaved_in_one_batch_complete() {
    // A pipeline that sent write payloads after reads could block both ends on full
    // socket buffers; windows are cut so it cannot.
    let (srv, cli) = (server(false), client(Arc::new(TcpTransport::new())));
    let seg = srv.register_region(96 << 20).unwrap();
    let target = srv.remote(seg.id());
    let src: Vec<Vec<u8>> = (0..24).map(|i| bytes(i, 2 << 20)).collect();
    for (i, s) in src.iter().enumerate() {
        seg.copy_in(i as u64 * (2 << 20), s).unwrap();
    }
    let mut dst: Vec<Vec<u8>> = (0..24).map(|_| vec![0u8; 2 << 20]).collect();
    let mut reqs = Vec::new();
    for (i, (d, s)) in dst.iter_mut().zip(&src).enumerate() {
        reqs.push(TransferRequest::read(&target, i as u64 * (2 << 20), d));
        reqs.push(TransferRequest::write(&target, (48 << 20) + i as u64 * (2 << 20), s));
    }
    assert!(cli.transfer(&mut reqs).iter().all(|r| r.is_ok()));
    drop(reqs);
    assert_eq!(dst, src);
    let mut back = vec![0u8; 2 << 20];
    seg.copy_out((48 << 20) + 5 * (2 << 20), &mut back).unwrap();
    assert!(back == src[5]);
}

#[test]
fn a_half_sent_frame_on_one_connection_does_not_stall_others() {
    let srv = server(false);
    let seg = srv.register_region(4096).unwrap();
    let mut stuck = TcpStream::connect(srv.endpoint()).unwrap();
    stuck.write_all(&[b'M', b'C', b'T', b'X', 2]).unwrap();
    let cli = client(Arc::new(TcpTransport::new()));
    cli.write(&srv.remote(seg.id()), 0, b"served meanwhile").unwrap();
    // A bad version on the stuck connection closes it.
    let rest = RequestHeader { op: FrameOp::Read, request_id: 1, region: seg.id(), offset: 0, len: 4 }.encode();
    let mut bad = rest;
    bad[4] = 99;
    let mut s = TcpStream::connect(srv.endpoint()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(&bad).unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    assert!(out.is_empty(), "unknown version gets no answer");
    drop(stuck);
    let mut buf = [0u8; 16];
    cli.read(&srv.remote(seg.id()), 0, &mut buf).unwrap();
    assert_eq!(&buf, b"served meanwhile");
}

#[test]
fn unregistered_regions_and_dropped_engines_are_unreachable_over_shm() {
    let shm = Arc::new(ShmTransport::new());
    let cli = client(shm.clone());
    let srv = server(true);
    let (a, b) = (srv.register_region(4096).unwrap(), srv.register_region(4096).unwrap());
    assert!(a.is_shared());
    let (ta, tb) = (srv.remote(a.id()), srv.remote(b.id()));
    cli.write(&ta, 0, b"mapped").unwrap();
    cli.write(&tb, 0, b"mapped").unwrap();
    let mapped = shm.stats().snapshot("shm").bytes_written;
    assert_eq!(mapped, 12, "both went through the mapping");
    // The owner keeps its `Arc`, but peers must stop using their cached mapping.
    assert!(srv.unregister_region(a.id()));
    assert!(!a.is_shared());
    let mut buf = [0u8; 6];
    assert!(matches!(cli.read(&ta, 0, &mut buf), Err(TransferError::UnknownRegion { .. })));
    assert!(cli.write(&ta, 0, b"ghost!").is_err());
    let mut mine = [0u8; 6];
    a.copy_out(0, &mut mine).unwrap();
    assert_eq!(&mine, b"mapped", "nothing written after unregistering");
    // Dropping the engine revokes the rest.
    cli.read(&tb, 0, &mut buf).unwrap();
    drop(srv);
    assert!(!b.is_shared());
    assert!(cli.read(&tb, 0, &mut buf).is_err());
    b.copy_out(0, &mut mine).unwrap();
    assert_eq!(&mine, b"mapped");
}

#[test]
fn unregistered_regions_are_unreachable_over_tcp() {
    let (srv, cli) = (server(false), client(Arc::new(TcpTransport::new())));
    let seg = srv.register_region(4096).unwrap();
    let target = srv.remote(seg.id());
    cli.write(&target, 0, b"x").unwrap();
    assert!(srv.unregister_region(seg.id()));
    assert!(matches!(cli.write(&target, 0, b"y"), Err(TransferError::UnknownRegion { .. })));
}

#[test]
fn wrong_or_missing_secrets_are_auth_errors() {
    use mooncake_transfer::SharedSecret;
    let srv = TransferEngine::builder().tcp_listen("127.0.0.1:0").shared_secret(b"k").build().unwrap();
    let seg = srv.register_region(4096).unwrap();
    let target = srv.remote(seg.id());
    let mut buf = [0u8; 4];
    let wrong = client(Arc::new(TcpTransport::with_secret(SharedSecret::new(b"not k"))));
    assert!(matches!(wrong.read(&target, 0, &mut buf), Err(TransferError::Auth(_))));
    let none = client(Arc::new(TcpTransport::new()));
    assert!(matches!(none.read(&target, 0, &mut buf), Err(TransferError::Auth(_))));
    let good = client(Arc::new(ShmTransport::with_secret(SharedSecret::new(b"k"))));
    good.write(&target, 0, b"shm!").unwrap();
}

#[test]
fn listen_addresses_and_advertised_hosts() {
    let addr: std::net::SocketAddr = "127.0.0.1:0".parse().unwrap();
    let srv = TransferEngine::builder().tcp_listen(addr).advertise_host("localhost").build().unwrap();
    assert!(srv.endpoint().starts_with("localhost:"), "{}", srv.endpoint());
    let seg = srv.register_region(4096).unwrap();
    let cli = client(Arc::new(TcpTransport::new()));
    cli.write(&srv.remote(seg.id()), 0, b"via name").unwrap();
    assert!(TransferEngine::builder().tcp_listen("not an address").build().is_err());
}

proptest! {
    #[test]
    fn response_headers_round_trip(id in any::<u64>(), len in any::<u64>(), status in 0u8..4) {
        let status = [FrameStatus::Ok, FrameStatus::OutOfBounds, FrameStatus::UnknownRegion, FrameStatus::Refused][status as usize];
        let h = ResponseHeader { status, request_id: id, len };
        prop_assert_eq!(ResponseHeader::decode(&h.encode(), u64::MAX).unwrap(), h);
        if len > 0 {
            prop_assert!(ResponseHeader::decode(&h.encode(), len - 1).is_err());
        }
    }

    #[test]
    fn mutated_request_headers_decode_only_to_what_they_encode(
        id in any::<u64>(), len in 0u64..=1 << 30, at in 0usize..REQUEST_HEADER_LEN, byte in any::<u8>(),
    ) {
        let mut b = RequestHeader { op: FrameOp::Write, request_id: id, region: 1, offset: 2, len }.encode();
        b[at] = byte;
        if let Ok(h) = mooncake_transfer::decode_frame_header(&b) {
            prop_assert_eq!(h.encode(), b);
            prop_assert!(h.len <= mooncake_transfer::MAX_REQUEST_BYTES);
        }
    }
}

/// A TCP read with an `on_landed` hook is told of every range of its buffer once
/// (for a transfer without retries), in pieces of at most 256 KiB, each holding its
/// final bytes when told of; a write with a hook is told of nothing.
#[test]
fn tcp_tells_of_each_range_of_a_read_once_it_landed() {
    let (srv, cli) = (server(false), client(Arc::new(TcpTransport::new())));
    let seg = srv.register_region(8 << 20).unwrap();
    let target = srv.remote(seg.id());
    let data = bytes(7, (5 << 20) + 12_345);
    cli.write(&target, 3, &data).unwrap();
    let mut back = vec![0u8; data.len()];
    let base = back.as_mut_ptr() as usize;
    let told = std::sync::Mutex::new(Vec::new());
    let hook = |at: u64, len: usize| {
        // SAFETY: the range lies in `back` and was written by this thread (the hook
        // runs on the connection that received it, right after), which does not
        // write it again.
        let landed = unsafe { std::slice::from_raw_parts((base + at as usize) as *const u8, len) };
        let exact = landed == &data[at as usize..at as usize + len];
        told.lock().unwrap().push((at, len, exact));
    };
    let done = cli.transfer(&mut [TransferRequest::read(&target, 3, &mut back).on_landed(&hook)]);
    assert!(done.into_iter().all(|r| r.is_ok()));
    assert!(back == data);
    let mut told = told.into_inner().unwrap();
    told.sort_unstable();
    let mut next = 0u64;
    for &(at, len, exact) in &told {
        assert_eq!(at, next, "ranges told of tile the buffer once");
        assert!(len > 0 && len <= 256 << 10, "{len} bytes told of at once");
        assert!(exact, "the range at {at} did not hold its bytes when told of");
        next += len as u64;
    }
    assert_eq!(next, data.len() as u64);
    let never = |_: u64, _: usize| panic!("a write is told of nothing");
    let mut reqs = [TransferRequest::write(&target, 0, &data).on_landed(&never)];
    assert!(cli.transfer(&mut reqs).into_iter().all(|r| r.is_ok()));
}

/// A peer that accepts connections and never reads from them (a paused or wedged
/// process): a write to it fails once the socket stays full for the transport's I/O
/// timeout, instead of blocking the caller (and every lane of its transfer) for as
/// long as the peer stays so.
#[test]
fn a_peer_that_stops_reading_fails_a_write_instead_of_hanging_it() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = listener.local_addr().unwrap().to_string();
    let held = std::thread::spawn(move || {
        // Keep every connection open, unread, until the test ends.
        listener.set_nonblocking(true).unwrap();
        let mut conns = Vec::new();
        let start = std::time::Instant::now();
        while start.elapsed() < Duration::from_secs(30) {
            match listener.accept() {
                Ok((c, _)) => conns.push(c),
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
    });
    let cli = client(Arc::new(TcpTransport::new().with_io_timeout(Duration::from_millis(300))));
    let target = RemoteRegion { endpoint, region: 1 };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let data = vec![7u8; 64 << 20];
        let _ = tx.send(cli.write(&target, 0, &data));
    });
    let res = rx.recv_timeout(Duration::from_secs(20)).expect("the write hung on a peer that never reads");
    assert!(res.is_err(), "{res:?}");
    drop(held);
}

/// A peer's region that is gone (its engine dropped, as when the node exits) is no
/// longer held mapped once another region is mapped, even if no one asks for the
/// gone one again: each mapping holds its segment's memory.
#[test]
fn mappings_of_gone_regions_are_dropped_when_another_is_mapped() {
    let shm = Arc::new(ShmTransport::new());
    let cli = client(shm.clone());
    let (gone, stays) = (server(true), server(true));
    let a = gone.register_region(1 << 20).unwrap();
    let b = stays.register_region(1 << 20).unwrap();
    cli.write(&gone.remote(a.id()), 0, b"a").unwrap();
    cli.write(&stays.remote(b.id()), 0, b"b").unwrap();
    assert_eq!(shm.mapped_regions(), 2);
    drop(gone);
    let c = stays.register_region(1 << 20).unwrap();
    cli.write(&stays.remote(c.id()), 0, b"c").unwrap();
    assert_eq!(shm.mapped_regions(), 2, "the gone region is still mapped");
    let mut back = [0u8; 1];
    cli.read(&stays.remote(b.id()), 0, &mut back).unwrap();
    assert_eq!(&back, b"b");
    drop(a);
}

/// A peer that could not answer the same-host question (not listening yet) is asked
/// again later, not judged to be on another host for good: once it serves, its
/// regions are mapped.
#[test]
fn shm_asks_again_a_peer_that_could_not_answer() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let endpoint = format!("127.0.0.1:{port}");
    let shm = Arc::new(ShmTransport::new());
    assert!(!shm.can_reach(&endpoint), "nobody listens there yet");
    let srv = TransferEngine::builder().tcp_listen(&endpoint).shared_memory(true).build().unwrap();
    assert_eq!(srv.endpoint(), endpoint);
    assert!(shm.can_reach(&endpoint), "the same host, once it answers");
}

/// A region its engine registered read-only (an SSD tier's staging buffer): a peer
/// holding the shared secret reads it over every transport, and its writes (one
/// piece or striped) are refused as `ReadOnly`, touching nothing; the connection
/// that carried a refused write goes on serving.
#[test]
fn read_only_regions_are_read_but_never_written_by_peers() {
    let srv = TransferEngine::builder()
        .tcp_listen("127.0.0.1:0")
        .shared_memory(true)
        .shared_secret(b"cluster secret")
        .build()
        .unwrap();
    let staging = srv.register_read_only_region(4 << 20).unwrap();
    assert!(!staging.peers_may_write());
    let data = bytes(7, 8192);
    staging.copy_in(4096, &data).unwrap();
    let target = srv.remote(staging.id());
    let writable = srv.register_region(1 << 20).unwrap();
    let secret = SharedSecret::new(b"cluster secret");
    let transports: [(&str, Arc<dyn Transport>); 3] = [
        ("tcp", Arc::new(TcpTransport::with_secret(secret.clone()))),
        ("shm", Arc::new(ShmTransport::with_secret(secret.clone()))),
        ("local", Arc::new(LocalTransport)),
    ];
    for (name, t) in transports {
        let cli = client(t.clone());
        let mut back = vec![0u8; 8192];
        cli.read(&target, 4096, &mut back).unwrap();
        assert!(back == data, "{name}: read");
        for len in [1usize, 4096, 3 << 20] {
            let err = cli.write(&target, 0, &vec![9u8; len]).unwrap_err();
            assert_eq!(err, TransferError::ReadOnly { region: staging.id() }, "{name}: {len}-byte write");
        }
        let mut reqs =
            [TransferRequest::write(&target, 4096, &[1u8; 100]), TransferRequest::read(&target, 4096, &mut back)];
        let results = cli.transfer(&mut reqs);
        assert_eq!(results[0], Err(TransferError::ReadOnly { region: staging.id() }), "{name}");
        assert_eq!(results[1], Ok(()), "{name}: a read in the same batch");
        assert!(back == data, "{name}: read after refused writes");
        let mut mem = vec![0u8; 4 << 20];
        staging.copy_out(0, &mut mem).unwrap();
        assert!(mem[..4096].iter().all(|&b| b == 0) && mem[4096..4096 + 8192] == data[..], "{name}: memory untouched");
        assert!(mem[4096 + 8192..].iter().all(|&b| b == 0), "{name}: memory untouched");
        // Other regions of the same engine are still written.
        cli.write(&srv.remote(writable.id()), 0, b"still writable").unwrap();
        match t.map_region(&target) {
            Some(Ok(map)) => assert!(!map.is_writable(), "{name}: mapped read-only"),
            Some(Err(e)) => panic!("{name}: {e}"),
            None => assert_eq!(name, "tcp"),
        }
    }
}
