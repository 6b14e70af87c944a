//! The master protocol: a store over RPC behaves like an embedded one, and bad frames
//! are refused without hurting other connections.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use mooncake_core::rpc::wire::{
    decode_body, encode_frame, request_kind_of, FrameHeader, FrameKind, Request, Response, WireError, HEADER_LEN,
    REQUEST_KINDS,
};
use mooncake_core::rpc::{read_frame, RpcHandler, RpcServer, RpcServerConfig};
use mooncake_core::{Error, Master, MasterConfig, ObjectRecord, RecordUpdate, ReplicateConfig, Store};
use proptest::prelude::*;

fn server() -> (Master, RpcServer, String) {
    let master = Master::new(MasterConfig { default_lease: Duration::from_millis(100), ..Default::default() }).unwrap();
    let server = RpcServer::bind("127.0.0.1:0", master.service().clone()).unwrap();
    let addr = server.local_addr().to_string();
    (master, server, addr)
}

#[test]
fn a_store_over_rpc_supports_every_call() {
    let (master, _server, addr) = server();
    let a = Store::builder().master_address(&addr).global_segment_size(4 << 20).build().unwrap();
    let b = Store::builder().master_address(&addr).global_segment_size(4 << 20).build().unwrap();
    let v: Vec<u8> = (0..200_000u32).map(|i| (i % 253) as u8).collect();
    a.put_with("k", &v, &ReplicateConfig::replicas(2)).unwrap();
    assert_eq!(&b.get("k").unwrap()[..], &v[..]);
    assert!(matches!(b.put("k", b"x"), Err(Error::AlreadyExists(_))));
    assert!(matches!(b.get("missing"), Err(Error::NotFound(_))));
    let mut small = [0u8; 10];
    assert!(matches!(b.get_into("k", &mut small), Err(Error::BufferTooSmall { needed: 200_000, capacity: 10 })));
    // A read in flight holds its lease until released.
    a.master().get_replica_list("k").unwrap();
    assert!(matches!(a.remove("k"), Err(Error::HasLease(_))));
    a.master().release_leases(&["k"]).unwrap();
    let res = a.batch_put(&[("x", b"1"), ("y", b"2")], &ReplicateConfig::default());
    assert!(res.iter().all(|r| r.is_ok()));
    let got = b.batch_get(&["x", "y", "z"]);
    assert_eq!(&got[0].as_ref().unwrap()[..], b"1");
    assert!(matches!(got[2], Err(Error::NotFound(_))));
    assert!(a.exists("x").unwrap());
    a.replicate("x", &ReplicateConfig::replicas(2)).unwrap();
    let info = a.master().object_info("x").unwrap();
    assert_eq!(info.replicas.len(), 2);
    let mut keys = a.master().list_keys(100).unwrap();
    keys.sort();
    assert_eq!(keys, ["k", "x", "y"]);
    std::thread::sleep(Duration::from_millis(150));
    assert_eq!(a.remove_all().unwrap(), 3);
    assert_eq!(master.stats().objects, 0);
    assert_eq!(a.stats().master.clients, 2, "stats travel over RPC");
}

#[test]
fn dropping_a_remote_client_unmounts_its_segment() {
    let (master, _server, addr) = server();
    let a = Store::builder().master_address(&addr).global_segment_size(1 << 20).build().unwrap();
    assert_eq!(master.stats().segments, 1);
    drop(a);
    assert_eq!(master.stats().segments, 0);
    assert_eq!(master.stats().clients, 0);
}

#[test]
fn an_unreachable_master_is_reported() {
    // Bind then drop to get a port nobody listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let r = Store::builder().master_address(&format!("127.0.0.1:{port}")).build();
    assert!(matches!(r, Err(Error::MasterUnavailable(_))), "{r:?}");
}

/// Sends raw bytes; returns whether the server closed the connection without answering.
fn closed_after(addr: &str, bytes: &[u8]) -> bool {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = s.write_all(bytes);
    let _ = s.shutdown(std::net::Shutdown::Write);
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).is_ok() && buf.is_empty()
}

fn healthy(addr: &str) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(&encode_frame(FrameKind::Request, 42, &Request::Stats {}).unwrap()).unwrap();
    let (h, body) = read_frame(&mut s, 1 << 20).unwrap();
    assert_eq!(h.request_id, 42);
    let resp: Response = mooncake_core::rpc::wire::decode_body(&body).unwrap();
    assert!(matches!(resp, Response::Stats(_)));
}

#[test]
fn garbage_truncated_and_oversized_frames_close_only_their_connection() {
    let (_master, server, addr) = server();
    let good = encode_frame(FrameKind::Request, 1, &Request::Exists { key: "k".into() }).unwrap();
    // Garbage.
    assert!(closed_after(&addr, b"GET /metrics HTTP/1.1\r\nHost: localhost:50051\r\nAccept: */*\r\n\r\n"));
    healthy(&addr);
    // Truncated: a header announcing more body than sent, then EOF.
    assert!(closed_after(&addr, &good[..good.len() - 1]));
    // Oversized: a header announcing 1 GiB.
    let mut big = FrameHeader { kind: FrameKind::Request, request_id: 1, body_len: 0 }.encode();
    big[16..20].copy_from_slice(&(1u32 << 30).to_le_bytes());
    assert!(closed_after(&addr, &big));
    // Wrong version, wrong kind, body that is not a request.
    let mut v = good.clone();
    v[4] = 99;
    assert!(closed_after(&addr, &v));
    let resp_frame = encode_frame(FrameKind::Response, 1, &Response::Unit).unwrap();
    assert!(closed_after(&addr, &resp_frame));
    let mut junk = FrameHeader { kind: FrameKind::Request, request_id: 1, body_len: 3 }.encode().to_vec();
    junk.extend_from_slice(&[0xff, 0xff, 0xff]);
    assert!(closed_after(&addr, &junk));
    healthy(&addr);
    assert!(server.stats().bad_frames.load(std::sync::atomic::Ordering::Relaxed) >= 5);
}

#[test]
fn requests_can_be_pipelined() {
    let (_master, _server, addr) = server();
    let mut s = TcpStream::connect(&addr).unwrap();
    let mut frames = Vec::new();
    for id in 0..50u64 {
        frames.extend(encode_frame(FrameKind::Request, id, &Request::Exists { key: format!("k{id}") }).unwrap());
    }
    s.write_all(&frames).unwrap();
    for id in 0..50u64 {
        let (h, body) = read_frame(&mut s, 1 << 20).unwrap();
        assert_eq!(h.request_id, id);
        let resp: Response = mooncake_core::rpc::wire::decode_body(&body).unwrap();
        assert_eq!(resp, Response::Exists(Ok(false)));
    }
}

/// Answers `Exists` inline (by the thread polling the connections) and everything
/// else after handing the polling on; every answer names the request's key and the
/// thread that gave it. `GetReplicaList { key: "slow" }` blocks until `release` is
/// dropped (after saying so on `started`); `Exists` or `GetReplicaList` of `"panic"`
/// panics. `ListKeys { limit }` answers `limit` keys of
/// 1 KiB: a response larger than a socket buffer.
struct WhereAnswered {
    started: Mutex<Option<mpsc::Sender<()>>>,
    release: Mutex<Option<mpsc::Receiver<()>>>,
}

impl WhereAnswered {
    fn new() -> Arc<Self> {
        Arc::new(Self { started: Mutex::new(None), release: Mutex::new(None) })
    }
}

impl RpcHandler for WhereAnswered {
    fn handle(&self, request: Request) -> Response {
        let thread = std::thread::current().id();
        match request {
            Request::Exists { key } | Request::GetReplicaList { key } if key == "panic" => {
                panic!("asked to panic");
            }
            Request::GetReplicaList { key } if key == "slow" => {
                let release = self.release.lock().unwrap().take().unwrap();
                let _ = self.started.lock().unwrap().take().unwrap().send(());
                let _ = release.recv();
                Response::Error(WireError::Other(format!("{key}@{thread:?}")))
            }
            Request::Exists { key } | Request::GetReplicaList { key } => {
                Response::Error(WireError::Other(format!("{key}@{thread:?}")))
            }
            Request::ListKeys { limit } => Response::ListKeys(Ok((0..limit).map(|i| format!("{i:01024}")).collect())),
            _ => Response::Unit,
        }
    }

    fn answers_inline(&self, kind: usize) -> bool {
        REQUEST_KINDS[kind] == "exists"
    }
}

/// The key and the answering thread of a `WhereAnswered` answer.
fn answered(body: &[u8]) -> (String, String) {
    match decode_body::<Response>(body).unwrap() {
        Response::Error(WireError::Other(m)) => {
            let (key, thread) = m.split_once('@').unwrap();
            (key.to_owned(), thread.to_owned())
        }
        other => panic!("unexpected answer {other:?}"),
    }
}

fn serve(handler: Arc<WhereAnswered>, config: RpcServerConfig) -> (RpcServer, TcpStream) {
    let server = RpcServer::serve_with("127.0.0.1:0", handler, config).unwrap();
    let s = TcpStream::connect(server.local_addr()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    (server, s)
}

fn ask(s: &mut TcpStream, id: u64, req: &Request) -> (String, String) {
    s.write_all(&encode_frame(FrameKind::Request, id, req).unwrap()).unwrap();
    let (h, body) = read_frame(s, 1 << 20).unwrap();
    assert_eq!(h.request_id, id);
    answered(&body)
}

#[test]
fn pipelined_requests_are_answered_in_order_and_inline_ones_by_the_polling_thread() {
    let (server, mut s) = serve(WhereAnswered::new(), RpcServerConfig::default());
    // Inline requests only: the thread polling answers them all, never handing on.
    let mut frames = Vec::new();
    for id in 0..40u64 {
        frames.extend(encode_frame(FrameKind::Request, id, &Request::Exists { key: format!("k{id}") }).unwrap());
    }
    s.write_all(&frames).unwrap();
    let mut threads = std::collections::HashSet::new();
    for id in 0..40u64 {
        let (h, body) = read_frame(&mut s, 1 << 20).unwrap();
        assert_eq!(h.request_id, id);
        let (key, thread) = answered(&body);
        assert_eq!(key, format!("k{id}"));
        threads.insert(thread);
    }
    assert_eq!(threads.len(), 1, "inline answers came from {threads:?}");
    // Inline and handed-on requests mixed: still one at a time, in order.
    let mut frames = Vec::new();
    for id in 40..100u64 {
        let key = format!("k{id}");
        let req = if id % 3 == 0 { Request::GetReplicaList { key } } else { Request::Exists { key } };
        frames.extend(encode_frame(FrameKind::Request, id, &req).unwrap());
    }
    s.write_all(&frames).unwrap();
    for id in 40..100u64 {
        let (h, body) = read_frame(&mut s, 1 << 20).unwrap();
        assert_eq!((h.request_id, answered(&body).0), (id, format!("k{id}")));
    }
    assert_eq!(server.stats().requests.load(std::sync::atomic::Ordering::Relaxed), 100);
}

#[test]
fn a_request_that_blocks_holds_up_no_other_connection() {
    let handler = WhereAnswered::new();
    let (started_tx, started) = mpsc::channel();
    let (release, release_rx) = mpsc::channel::<()>();
    *handler.started.lock().unwrap() = Some(started_tx);
    *handler.release.lock().unwrap() = Some(release_rx);
    // Two threads kept: the one answering "slow" blocks; another must take over.
    let config = RpcServerConfig { workers: 2, ..RpcServerConfig::default() };
    let (server, mut slow) = serve(handler, config);
    // Dropped before the server if the test fails, so that the server's drop does not
    // wait for the blocked request forever.
    let release = release;
    slow.write_all(&encode_frame(FrameKind::Request, 1, &Request::GetReplicaList { key: "slow".into() }).unwrap())
        .unwrap();
    started.recv_timeout(Duration::from_secs(20)).unwrap();
    let mut other = TcpStream::connect(server.local_addr()).unwrap();
    other.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    for id in 0..20u64 {
        let key = format!("fast{id}");
        let req = if id % 2 == 0 {
            Request::GetReplicaList { key: key.clone() }
        } else {
            Request::Exists { key: key.clone() }
        };
        assert_eq!(ask(&mut other, id, &req).0, key);
    }
    // All that while, "slow" was still being answered.
    slow.set_nonblocking(true).unwrap();
    let mut byte = [0u8; 1];
    assert_eq!(slow.peek(&mut byte).unwrap_err().kind(), std::io::ErrorKind::WouldBlock);
    slow.set_nonblocking(false).unwrap();
    drop(release);
    let (h, body) = read_frame(&mut slow, 1 << 20).unwrap();
    assert_eq!((h.request_id, answered(&body).0), (1, "slow".to_owned()));
    // And the connection goes on.
    assert_eq!(ask(&mut slow, 2, &Request::Exists { key: "after".into() }).0, "after");
}

#[test]
fn a_server_with_a_single_thread_still_answers_every_connection() {
    let config = RpcServerConfig { workers: 1, max_workers: 1, ..RpcServerConfig::default() };
    let (server, mut a) = serve(WhereAnswered::new(), config);
    let mut b = TcpStream::connect(server.local_addr()).unwrap();
    b.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    for id in 0..20u64 {
        let s = if id % 2 == 0 { &mut a } else { &mut b };
        let key = format!("k{id}");
        assert_eq!(ask(s, id, &Request::GetReplicaList { key: key.clone() }).0, key);
        assert_eq!(ask(s, id + 100, &Request::Exists { key: key.clone() }).0, key);
    }
}

#[test]
fn a_response_larger_than_the_socket_takes_is_written_whole_and_in_order() {
    let (_server, mut s) = serve(WhereAnswered::new(), RpcServerConfig::default());
    // 8 MiB answers: the answering thread's write fills the socket and the polling
    // thread writes the rest as the client reads; an inline answer queued behind them
    // waits its turn.
    let mut frames = Vec::new();
    for id in 0..3u64 {
        frames.extend(encode_frame(FrameKind::Request, id, &Request::ListKeys { limit: 8192 }).unwrap());
    }
    frames.extend(encode_frame(FrameKind::Request, 3, &Request::Exists { key: "after".into() }).unwrap());
    s.write_all(&frames).unwrap();
    // Let the socket buffers fill before reading anything.
    std::thread::sleep(Duration::from_millis(300));
    for id in 0..3u64 {
        let (h, body) = read_frame(&mut s, 64 << 20).unwrap();
        assert_eq!(h.request_id, id);
        match decode_body::<Response>(&body).unwrap() {
            Response::ListKeys(Ok(keys)) => {
                assert_eq!(keys.len(), 8192);
                assert!(keys.iter().enumerate().all(|(i, k)| *k == format!("{i:01024}")));
            }
            other => panic!("unexpected answer {other:?}"),
        }
    }
    let (h, body) = read_frame(&mut s, 1 << 20).unwrap();
    assert_eq!((h.request_id, answered(&body).0), (3, "after".to_owned()));
}

proptest! {
    /// The kind the event loop reads from a body's first bytes is the kind the body
    /// decodes as, for every body that decodes.
    #[test]
    fn the_kind_read_from_a_body_is_the_kind_it_decodes_as(
        bytes in proptest::collection::vec(any::<u8>(), 0..64),
        records in proptest::collection::vec((any::<u64>(), "[a-z]{1,8}", any::<u64>()), 0..4),
    ) {
        if let Ok(req) = decode_body::<Request>(&bytes) {
            prop_assert_eq!(request_kind_of(&bytes), Some(req.kind_index()));
        }
        let updates = records
            .into_iter()
            .map(|(segment, key, offset)| RecordUpdate::Added {
                segment,
                record: ObjectRecord { key, offset, len: 1, checksum: 2, generation: 3 },
            })
            .collect();
        let frame = encode_frame(FrameKind::Request, 1, &Request::ApplyRecords { updates }).unwrap();
        prop_assert_eq!(request_kind_of(&frame[HEADER_LEN..]), Some(Request::APPLY_RECORDS_KIND));
        prop_assert_eq!(REQUEST_KINDS[Request::APPLY_RECORDS_KIND], "apply_records");
    }

    #[test]
    fn arbitrary_bytes_never_panic_the_decoder(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = mooncake_core::rpc::wire::decode_request_frame(&bytes, 1 << 20);
    }

    #[test]
    fn frames_round_trip(id in any::<u64>(), key in "[a-z/0-9]{1,64}", len in 1u64..1 << 32, replicas in 1usize..8) {
        let req = Request::PutStart { client: 7, key, len, cfg: ReplicateConfig::replicas(replicas) };
        let frame = encode_frame(FrameKind::Request, id, &req).unwrap();
        let (h, back) = mooncake_core::rpc::wire::decode_request_frame(&frame, 1 << 20).unwrap();
        prop_assert_eq!(h.request_id, id);
        prop_assert_eq!(h.body_len as usize, frame.len() - HEADER_LEN);
        prop_assert_eq!(back, req);
    }
}

/// The wire format is pinned: any change to a message's layout changes these bytes.
/// When that happens on purpose, bump `wire::VERSION` (peers of different versions
/// must refuse each other, not misread each other) and update the checksum here.
#[test]
fn wire_format_changes_bump_the_version() {
    use mooncake_core::rpc::wire::WireRegion;
    use mooncake_core::{MemoryReplica, ObjectRecord, RecordUpdate, ReplicaList};
    use mooncake_transfer::RemoteRegion;
    let reqs = [
        Request::RegisterClient {},
        Request::PutStart { client: 7, key: "k".into(), len: 4096, cfg: ReplicateConfig::replicas(2) },
        Request::PutStartSummed {
            client: 7,
            key: "k".into(),
            len: 4096,
            checksum: 0xdead_beef,
            cfg: ReplicateConfig::replicas(2),
        },
        Request::PutDeclare { client: 7, key: "k".into(), checksum: 0xdead_beef },
        Request::GetReplicaList { key: "k".into() },
        Request::NotifyOffloadSuccess { client: 7, items: vec![("k".into(), 1, 2, 3)] },
        Request::RemountSegment {
            client: 1,
            region: WireRegion(RemoteRegion { endpoint: "h:1".into(), region: 2 }),
            capacity: 3,
            records: vec![ObjectRecord { key: "k".into(), offset: 64, len: 5, checksum: 6, generation: 7 }],
        },
        Request::DrainSegment { segment: "h:1#2".into(), grace_ms: 30_000 },
        Request::LocalEndpoint {},
        Request::PutBind { client: 7, placement: 3, key: "k".into(), checksum: 6, ahead: true },
        Request::ListKeysAfter { after: "k".into(), limit: 3 },
        Request::Reconnected {},
        Request::RestoreTombstones { client: 7, items: vec![("k".into(), 11)] },
        Request::DrainReport {
            client: 7,
            progress: mooncake_core::DrainProgress {
                node: "h:1".into(),
                started: true,
                objects_total: 3,
                objects_copied: 2,
                objects_left: 1,
                ..Default::default()
            },
        },
    ];
    let resps = [
        Response::GetReplicaList(Ok(ReplicaList {
            len: 5,
            checksum: 6,
            replicas: vec![MemoryReplica { segment: 1, offset: 2, len: 5 }],
            lease: Duration::from_millis(5000),
            disk: Some(9),
        })),
        Response::Heartbeat(Ok(vec![
            RecordUpdate::Removed { segment: 1, key: "k".into(), offset: 64, generation: 8 },
            RecordUpdate::Discard { key: "k".into(), generation: 9 },
            RecordUpdate::Drain { grace_ms: 30_000, generation: 10 },
            RecordUpdate::Tombstone { key: "k".into(), generation: 11 },
        ])),
        Response::Error(mooncake_core::rpc::wire::WireError::NotFound("k".into())),
        Response::LocalEndpoint(Some("mooncake-rpc-00000000000000000000000000000001".into())),
        Response::PutBind(Ok(Some(mooncake_core::HeldPlacement {
            id: 4,
            replicas: vec![MemoryReplica { segment: 1, offset: 2, len: 5 }],
            held_for_ms: 500,
        }))),
        Response::ListKeysAfter(Ok(vec!["l".into(), "m".into()])),
    ];
    let mut all = Vec::new();
    for r in &reqs {
        all.extend(encode_frame(FrameKind::Request, 1, r).unwrap());
    }
    for r in &resps {
        all.extend(encode_frame(FrameKind::Response, 1, r).unwrap());
    }
    let sum = all.iter().fold(0u32, |h, &b| h.wrapping_mul(31).wrapping_add(b as u32));
    assert_eq!(
        (mooncake_core::rpc::wire::VERSION, sum),
        (19, 1839936069),
        "the wire format changed: bump wire::VERSION and update this pin"
    );
}

#[test]
fn a_long_lived_client_keeps_working_across_a_master_restart() {
    let first =
        Master::new(MasterConfig { client_ttl: Duration::from_millis(800), track_records: true, ..Default::default() })
            .unwrap();
    let server = RpcServer::bind("127.0.0.1:0", first.service().clone()).unwrap();
    let addr = server.local_addr().to_string();
    let nodes: Vec<Store> =
        (0..2).map(|_| Store::builder().master_address(&addr).global_segment_size(4 << 20).build().unwrap()).collect();
    let client = Store::builder().master_address(&addr).global_segment_size(0).build().unwrap();
    let value = |i: u8| vec![i; 50_000];
    for i in 0..10u8 {
        client.put(&format!("k{i}"), &value(i)).unwrap();
        assert_eq!(client.get(&format!("k{i}")).unwrap()[..], value(i)[..]);
    }
    let old_segments: Vec<u64> = nodes.iter().map(|n| n.segment_id().unwrap()).collect();
    // Nodes learn their records with heartbeats (every 200 ms at this TTL).
    std::thread::sleep(Duration::from_millis(700));
    drop(server);
    drop(first);
    let second =
        Master::new(MasterConfig { client_ttl: Duration::from_millis(800), track_records: true, ..Default::default() })
            .unwrap();
    let _server = RpcServer::bind(&addr, second.service().clone()).unwrap();
    let start = std::time::Instant::now();
    while second.stats().objects < 10 {
        assert!(start.elapsed() < Duration::from_secs(20), "nodes did not re-register: {:?}", second.stats());
        std::thread::sleep(Duration::from_millis(50));
    }
    for (n, old) in nodes.iter().zip(&old_segments) {
        assert_ne!(n.segment_id().unwrap(), *old, "segment ids of the new master are new");
    }
    // The client's cached routes are by segment id: they must not mislead it.
    for i in 0..10u8 {
        assert_eq!(client.get(&format!("k{i}")).unwrap()[..], value(i)[..], "k{i}");
    }
    for i in 10..20u8 {
        client.put(&format!("k{i}"), &value(i)).unwrap();
    }
    for i in 0..20u8 {
        assert_eq!(client.get(&format!("k{i}")).unwrap()[..], value(i)[..], "k{i}");
    }
}

/// A handler that panics (a bug) costs the client an error answer, not its
/// connection, and the server its thread: with one thread, the next requests, on
/// that connection and on another, are answered. Inline (`exists`) and on a thread.
#[test]
fn a_handler_that_panics_answers_an_error_and_the_server_goes_on() {
    let config = RpcServerConfig { workers: 1, max_workers: 1, ..RpcServerConfig::default() };
    let (server, mut a) = serve(WhereAnswered::new(), config);
    let asks = [Request::GetReplicaList { key: "panic".into() }, Request::Exists { key: "panic".into() }];
    for (id, req) in asks.iter().enumerate() {
        a.write_all(&encode_frame(FrameKind::Request, id as u64, req).unwrap()).unwrap();
        let (h, body) = read_frame(&mut a, 1 << 20).unwrap();
        assert_eq!(h.request_id, id as u64);
        match decode_body::<Response>(&body).unwrap() {
            Response::Error(WireError::Other(m)) => assert!(m.contains("internal error"), "{req:?}: {m}"),
            other => panic!("{req:?}: {other:?}"),
        }
        assert_eq!(ask(&mut a, 10 + id as u64, &Request::GetReplicaList { key: "after".into() }).0, "after");
    }
    let mut b = TcpStream::connect(server.local_addr()).unwrap();
    b.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    assert_eq!(ask(&mut b, 1, &Request::GetReplicaList { key: "other".into() }).0, "other");
    assert_eq!(server.stats().handler_panics.load(std::sync::atomic::Ordering::Relaxed), 2);
}

/// A `batch_exists` of `n` keys of 1 KiB (about `n` KiB on the wire).
fn big_request(n: usize) -> Vec<u8> {
    let keys = (0..n).map(|i| format!("{i:01024}")).collect();
    encode_frame(FrameKind::Request, 7, &Request::BatchExists { keys }).unwrap()
}

/// A peer that stops halfway through a frame does not keep the memory budget from
/// the others: after the frame timeout its connection is closed and its bytes go
/// back, so a request that waited for budget is answered. A peer that sends its
/// frame slowly, but steadily, is not cut off while its frame is within its deadline
/// (the frame timeout plus its length at `min_frame_rate`), however many frame
/// timeouts that is.
#[test]
fn a_connection_that_stops_halfway_through_a_frame_is_closed_and_its_budget_freed() {
    let master = Master::new(MasterConfig::default()).unwrap();
    let config = RpcServerConfig {
        memory_budget: 4 << 20,
        frame_timeout: Duration::from_millis(300),
        // 80 KiB get 0.3 s + 10 s.
        min_frame_rate: 8 << 10,
        ..RpcServerConfig::default()
    };
    let server = RpcServer::serve_with("127.0.0.1:0", master.service().clone(), config).unwrap();
    let addr = server.local_addr();
    let answered = |s: &mut TcpStream| {
        let (h, body) = read_frame(s, 1 << 20).unwrap();
        assert_eq!(h.request_id, 7);
        match decode_body::<Response>(&body).unwrap() {
            Response::BatchExists(found) => assert!(!found.is_empty() && found.iter().all(|f| matches!(f, Ok(false)))),
            other => panic!("{other:?}"),
        }
    };

    // A request, answered (the connection is past its hello), then three quarters
    // of the budget, then silence.
    let stalled_frame = big_request(3 * 1024);
    let mut stalled = TcpStream::connect(addr).unwrap();
    stalled.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    stalled.write_all(&big_request(1)).unwrap();
    answered(&mut stalled);
    stalled.write_all(&stalled_frame[..stalled_frame.len() - 10]).unwrap();
    // Wait until the server holds those bytes (reserved from the header on).
    let held = || server.stats().buffered_bytes.load(std::sync::atomic::Ordering::Relaxed);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while held() < 3 << 20 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(held() >= 3 << 20, "the server held {} bytes", held());
    // Needs half the budget: waits for the stalled bytes to go.
    let mut waiting = TcpStream::connect(addr).unwrap();
    waiting.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    waiting.write_all(&big_request(2 * 1024)).unwrap();
    answered(&mut waiting);
    let mut rest = Vec::new();
    assert_eq!(stalled.read_to_end(&mut rest).map(|_| rest.len()).unwrap_or(0), 0, "the stalled peer was answered");
    assert_eq!(server.stats().frame_timeouts.load(std::sync::atomic::Ordering::Relaxed), 1);

    // A frame sent 4 KiB every 60 ms: 1.2 s in all, four frame timeouts.
    let slow_frame = big_request(80);
    let mut slow = TcpStream::connect(addr).unwrap();
    slow.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    for piece in slow_frame.chunks(4096) {
        slow.write_all(piece).unwrap();
        std::thread::sleep(Duration::from_millis(60));
    }
    answered(&mut slow);
    assert_eq!(server.stats().frame_timeouts.load(std::sync::atomic::Ordering::Relaxed), 1);
    assert_eq!(server.stats().buffered_bytes.load(std::sync::atomic::Ordering::Relaxed), 0);
}

/// Waits until the server reserves no byte of request bodies.
fn budget_comes_back(server: &RpcServer) {
    let held = || server.stats().buffered_bytes.load(std::sync::atomic::Ordering::Relaxed);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while held() != 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(held(), 0, "the budget did not come back");
}

/// Frames that together need more than the memory budget, sent at once, are all
/// answered: a frame reserves its whole body before reading any of it, so the
/// first finishes and gives its bytes back to the second. (Before, each read what
/// budget was left: both held part of their frame, neither could finish, and the
/// server never answered again.)
#[test]
fn frames_larger_together_than_the_memory_budget_are_all_answered() {
    let master = Master::new(MasterConfig::default()).unwrap();
    let config =
        RpcServerConfig { memory_budget: 4 << 20, frame_timeout: Duration::from_secs(5), ..RpcServerConfig::default() };
    let server = RpcServer::serve_with("127.0.0.1:0", master.service().clone(), config).unwrap();
    let addr = server.local_addr();
    // 3 MiB each: two do not fit in 4 MiB at once.
    let frame = big_request(3 * 1024);
    assert!(frame.len() > 3 << 20);
    let clients: Vec<_> = (0..2)
        .map(|_| {
            let frame = frame.clone();
            std::thread::spawn(move || {
                let mut s = TcpStream::connect(addr).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
                // Past the hello, so that no hello timeout ends the wait.
                s.write_all(&big_request(1)).unwrap();
                read_frame(&mut s, 1 << 20).unwrap();
                let (head, tail) = frame.split_at(5 << 19);
                s.write_all(head).unwrap();
                std::thread::sleep(Duration::from_millis(200));
                s.write_all(tail).unwrap();
                let (h, body) = read_frame(&mut s, 1 << 20).expect("a request waiting for budget was never answered");
                assert_eq!(h.request_id, 7);
                match decode_body::<Response>(&body).unwrap() {
                    Response::BatchExists(found) => assert_eq!(found.len(), 3 * 1024),
                    other => panic!("{other:?}"),
                }
            })
        })
        .collect();
    for c in clients {
        c.join().unwrap();
    }
    budget_comes_back(&server);
    assert_eq!(server.stats().frame_timeouts.load(std::sync::atomic::Ordering::Relaxed), 0);
}

/// A frame larger than the whole memory budget (the largest frame may be) is read
/// once nothing else is reserved, rather than waiting forever.
#[test]
fn a_frame_larger_than_the_whole_budget_is_answered() {
    let master = Master::new(MasterConfig::default()).unwrap();
    let config = RpcServerConfig { memory_budget: 1 << 20, ..RpcServerConfig::default() };
    let server = RpcServer::serve_with("127.0.0.1:0", master.service().clone(), config).unwrap();
    let mut s = TcpStream::connect(server.local_addr()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.write_all(&big_request(3 * 1024)).unwrap();
    let (h, body) = read_frame(&mut s, 1 << 20).expect("a frame over the budget was never answered");
    assert_eq!(h.request_id, 7);
    assert!(matches!(decode_body::<Response>(&body).unwrap(), Response::BatchExists(found) if found.len() == 3 * 1024));
    budget_comes_back(&server);
}

/// Frames waiting for budget get it in the order they came: a smaller frame that
/// would fit does not overtake a large one waiting before it (a stream of them
/// could otherwise keep the large one waiting forever). Small requests (64 KiB at
/// most) neither wait nor hold anyone up.
#[test]
fn a_frame_waiting_for_budget_is_not_overtaken_by_a_later_smaller_one() {
    let master = Master::new(MasterConfig::default()).unwrap();
    let config =
        RpcServerConfig { memory_budget: 4 << 20, frame_timeout: Duration::from_secs(5), ..RpcServerConfig::default() };
    let server = RpcServer::serve_with("127.0.0.1:0", master.service().clone(), config).unwrap();
    let addr = server.local_addr();
    // Three connections past their hello (a hello waiting for budget would time out).
    let [mut a, mut b, mut c] = [(); 3].map(|_| {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        s.write_all(&big_request(1)).unwrap();
        read_frame(&mut s, 1 << 20).unwrap();
        s
    });
    let answered = |s: &mut TcpStream, keys: usize| {
        let (h, body) = read_frame(s, 1 << 20).unwrap();
        assert_eq!(h.request_id, 7);
        match decode_body::<Response>(&body).unwrap() {
            Response::BatchExists(found) => assert_eq!(found.len(), keys),
            other => panic!("{other:?}"),
        }
    };
    // `a` holds 3 of the 4 MiB, part of its frame sent.
    let frame = big_request(3 * 1024);
    a.write_all(&frame[..5 << 19]).unwrap();
    let held = || server.stats().buffered_bytes.load(std::sync::atomic::Ordering::Relaxed);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while held() < 3 << 20 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    // `b` needs 3 MiB too: it waits.
    let b_frame = frame.clone();
    let b_sends = std::thread::spawn(move || {
        b.write_all(&b_frame).unwrap();
        b
    });
    std::thread::sleep(Duration::from_millis(300));
    // `c` needs 100 KiB, which would fit, but `b` came first: it waits as well.
    c.write_all(&big_request(100)).unwrap();
    c.set_read_timeout(Some(Duration::from_millis(700))).unwrap();
    let mut byte = [0u8; 1];
    let overtook = c.peek(&mut byte);
    assert!(overtook.is_err(), "a later, smaller frame was answered first: {overtook:?}");
    // Small requests (64 KiB at most) wait for no budget, on a new connection too.
    healthy(&addr.to_string());
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    // `a` finishes: `b`, then `c`, get their budget.
    a.write_all(&frame[5 << 19..]).unwrap();
    answered(&mut a, 3 * 1024);
    let mut b = b_sends.join().unwrap();
    answered(&mut b, 3 * 1024);
    answered(&mut c, 100);
    budget_comes_back(&server);
}

/// A peer that sends its frame a little at a time, never stalling for the frame
/// timeout, is still closed once the frame is past its deadline (the frame timeout
/// plus its length at `min_frame_rate`): it cannot hold its share of the budget
/// forever.
#[test]
fn a_frame_trickled_past_its_deadline_is_closed() {
    let master = Master::new(MasterConfig::default()).unwrap();
    let config = RpcServerConfig {
        memory_budget: 4 << 20,
        frame_timeout: Duration::from_millis(300),
        // About 256 KiB: a deadline of 0.3 s + 0.25 s.
        min_frame_rate: 1 << 20,
        ..RpcServerConfig::default()
    };
    let server = RpcServer::serve_with("127.0.0.1:0", master.service().clone(), config).unwrap();
    let mut s = TcpStream::connect(server.local_addr()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.write_all(&big_request(1)).unwrap();
    read_frame(&mut s, 1 << 20).unwrap();
    // 4 KiB every 100 ms: the whole frame would take 6.4 s.
    let frame = big_request(256);
    let mut writer = s.try_clone().unwrap();
    let start = std::time::Instant::now();
    let trickle = std::thread::spawn(move || {
        for piece in frame.chunks(4096) {
            if writer.write_all(piece).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    let mut answer = Vec::new();
    let _ = s.read_to_end(&mut answer);
    let closed_after = start.elapsed();
    assert!(answer.is_empty(), "the trickled frame was answered after {closed_after:?}");
    assert!(closed_after < Duration::from_secs(4), "closed only after {closed_after:?}");
    trickle.join().unwrap();
    assert_eq!(server.stats().frame_timeouts.load(std::sync::atomic::Ordering::Relaxed), 1);
    budget_comes_back(&server);
    healthy(&server.local_addr().to_string());
}

/// A client that sends a request and never reads its (large) answer is closed after
/// the frame timeout, and the answer's memory goes with it, instead of being kept
/// while the server waits for the client forever.
#[test]
fn a_client_that_never_reads_its_answer_is_closed_after_the_frame_timeout() {
    let config = RpcServerConfig { frame_timeout: Duration::from_millis(300), ..RpcServerConfig::default() };
    let (server, mut s) = serve(WhereAnswered::new(), config);
    // 32 MiB of answer: more than the socket buffers on both sides take.
    s.write_all(&encode_frame(FrameKind::Request, 1, &Request::ListKeys { limit: 32 << 10 }).unwrap()).unwrap();
    let timeouts = || server.stats().frame_timeouts.load(std::sync::atomic::Ordering::Relaxed);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while timeouts() == 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(timeouts(), 1, "a client that does not read keeps its answer in the server");
    // What the sockets took of the answer, then the end: not the whole answer.
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    assert!(got.len() < 32 << 20, "{}", got.len());
    assert_eq!(server.stats().open_connections.load(std::sync::atomic::Ordering::Relaxed), 0);
}

/// `ListKeys` with no real limit answers what fits in a frame, capped at
/// `MAX_LISTED_KEYS`, instead of every key (an answer over a frame reached no client).
#[test]
fn list_keys_answers_no_more_than_fits_in_a_frame() {
    let master = Master::new(MasterConfig::default()).unwrap();
    let c = master.register_client().unwrap().client;
    let region = mooncake_transfer::RemoteRegion { endpoint: "local://n".into(), region: 1 };
    master.mount_segment(c, &region, 1 << 30).unwrap();
    // 16.5 Ki keys of 4 KiB: about 68 MB of keys, over a 64 MiB frame.
    let n = 33 << 9;
    for i in 0..n {
        let key = format!("{i:04096}");
        master.put_start(c, &key, 64, &ReplicateConfig::default()).unwrap();
        master.put_end(c, &key, 0).unwrap();
    }
    let server = RpcServer::bind("127.0.0.1:0", master.service().clone()).unwrap();
    let store =
        Store::builder().master_address(&server.local_addr().to_string()).global_segment_size(0).build().unwrap();
    let keys = store.master().list_keys(usize::MAX).unwrap();
    assert!(keys.len() < n && keys.len() > 16_000, "{}", keys.len());
    assert!(keys.len() <= mooncake_core::rpc::MAX_LISTED_KEYS);
    let listed = keys.iter().map(|k| k.len() + 2).sum::<usize>();
    assert!(listed <= mooncake_core::rpc::LIST_KEYS_MAX_BYTES, "{listed}");
    let distinct: std::collections::HashSet<_> = keys.iter().collect();
    assert_eq!(distinct.len(), keys.len());
    assert!(keys.iter().all(|k| k.len() == 4096 && k.parse::<usize>().is_ok_and(|i| i < n)));
    // A limit within the cap is a limit.
    assert_eq!(store.master().list_keys(10).unwrap().len(), 10);
    // Every key, in pages cut to a frame: none skipped, none twice, sorted.
    let all = store.master().all_keys().unwrap();
    let want: Vec<String> = (0..n).map(|i| format!("{i:04096}")).collect();
    assert!(all == want, "{} keys listed of {n}", all.len());
    // A page after a key starts past it, and a page past the last key is empty.
    let page = store.master().list_keys_after(&want[100], 3).unwrap();
    assert_eq!(page, want[101..104]);
    assert!(store.master().list_keys_after(&want[n - 1], usize::MAX).unwrap().is_empty());
}

/// A master daemon's calls, in the order they arrived: the real master answers them.
struct Logged {
    master: Master,
    calls: Mutex<Vec<&'static str>>,
    /// The client registered last.
    client: Mutex<Option<u64>>,
}

impl RpcHandler for Logged {
    fn handle(&self, request: Request) -> Response {
        self.calls.lock().unwrap().push(REQUEST_KINDS[request.kind_index()]);
        let response = mooncake_core::rpc::dispatch(&**self.master.service(), request);
        if let Response::RegisterClient(Ok(reg)) = &response {
            *self.client.lock().unwrap() = Some(reg.client);
        }
        response
    }
}

/// A node tells the master where its records go before its segment is mounted (and
/// again before it is re-mounted after the master forgot it): from the first put
/// placed there, the master has an endpoint to wait for, so no put on the segment
/// is acknowledged before the node holds its record. (Before, the segment was
/// mounted first, then the SSD tier opened, and only then the endpoint announced:
/// puts in between were acknowledged with the record only queued for a heartbeat.)
#[test]
fn a_node_announces_its_record_endpoint_before_its_segment_takes_puts() {
    let master = Master::new(MasterConfig { client_ttl: Duration::from_secs(2), ..Default::default() }).unwrap();
    let logged = Arc::new(Logged { master, calls: Mutex::new(Vec::new()), client: Mutex::new(None) });
    let server = RpcServer::serve_with("127.0.0.1:0", logged.clone(), RpcServerConfig::default()).unwrap();
    let addr = server.local_addr().to_string();
    let node = Store::builder().master_address(&addr).global_segment_size(1 << 20).build().unwrap();
    let order = |calls: &[&str], first: &str, then: &str| {
        let at = |name: &str| calls.iter().position(|c| *c == name).unwrap_or_else(|| panic!("no {name}: {calls:?}"));
        assert!(at(first) < at(then), "{first} after {then}: {calls:?}");
    };
    order(&logged.calls.lock().unwrap(), "mount_records", "mount_segment");
    node.put("k", b"v").unwrap();

    // The master forgets the node: it registers again and re-mounts its segment.
    let client = logged.client.lock().unwrap().expect("the node is registered");
    logged.calls.lock().unwrap().clear();
    logged.master.service().unregister_client(client).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !logged.calls.lock().unwrap().contains(&"remount_segment") {
        assert!(std::time::Instant::now() < deadline, "no re-mount: {:?}", logged.calls.lock().unwrap());
        std::thread::sleep(Duration::from_millis(20));
    }
    let calls = logged.calls.lock().unwrap().clone();
    order(&calls, "register_client", "mount_records");
    order(&calls, "mount_records", "remount_segment");
    // The node serves puts on its new segment.
    node.put("k2", b"v2").unwrap();
    assert_eq!(&node.get("k2").unwrap()[..], b"v2");
}

/// A master that answers every call but refuses `mount_records`.
struct RefusesRecords(Master);

impl RpcHandler for RefusesRecords {
    fn handle(&self, request: Request) -> Response {
        if REQUEST_KINDS[request.kind_index()] == "mount_records" {
            let refused = Error::InvalidArgument("this master does not take record endpoints".into());
            return Response::MountRecords(Err(refused.into()));
        }
        mooncake_core::rpc::dispatch(&**self.0.service(), request)
    }
}

/// A node whose record endpoint the master cannot take goes on with heartbeat
/// delivery, and counts it (`StoreStats::record_mount_failures`), once per join.
#[test]
fn a_failed_record_mount_is_counted() {
    let master = Master::new(MasterConfig::default()).unwrap();
    let server =
        RpcServer::serve_with("127.0.0.1:0", Arc::new(RefusesRecords(master)), RpcServerConfig::default()).unwrap();
    let node =
        Store::builder().master_address(&server.local_addr().to_string()).global_segment_size(1 << 20).build().unwrap();
    assert_eq!(node.stats().record_mount_failures, 1);
    node.put("k", b"v").unwrap();
    assert_eq!(&node.get("k").unwrap()[..], b"v");
}

/// A client's watch connection says at once that its master went away (a stopped
/// server closes every connection), and nothing while the master runs: what wakes a
/// storage node's heartbeat after a master restart.
#[test]
fn a_master_going_away_is_seen_at_once_on_the_watch_connection() {
    use mooncake_core::rpc::RpcMasterClient;
    use mooncake_core::MasterApi;
    use std::time::Instant;
    let master = Master::new(MasterConfig::default()).unwrap();
    let server = RpcServer::serve_with("127.0.0.1:0", master.service().clone(), RpcServerConfig::default()).unwrap();
    let client = RpcMasterClient::connect(&server.local_addr().to_string()).unwrap().announce_reconnects();
    let quiet = Instant::now();
    assert!(!client.await_hangup(Duration::from_millis(300)), "a running master hung up");
    assert!(quiet.elapsed() >= Duration::from_millis(250), "returned after {:?}", quiet.elapsed());
    let watcher = std::thread::spawn(move || {
        let start = Instant::now();
        (client.await_hangup(Duration::from_secs(60)), start.elapsed(), client)
    });
    std::thread::sleep(Duration::from_millis(300));
    drop(server);
    let (hung_up, waited, client) = watcher.join().unwrap();
    assert!(hung_up, "the master's exit was not seen");
    assert!(waited < Duration::from_secs(20), "seen only after {waited:?} (the wait was 60 s)");
    // Nothing listens any more: quiet again (a dial every 20 ms), never a hang-up.
    assert!(!client.await_hangup(Duration::from_millis(100)));
}
