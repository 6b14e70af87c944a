//! Issue 21, finding 4: one request must not crash a server. A 64 MiB frame of
//! one-byte keys grew the master from 5 MB to 7.4 GB and aborted it: decoding
//! allocated about 118 times the bytes received. Now every request is decoded
//! within a budget of what it allocates (`rpc::budget`): the real master and a real
//! storage node (its record endpoint and SSD load server) answer such frames with an
//! error, keep their connection open, stay within a bounded resident size, and go
//! on serving. The servers run under an address-space limit, so that a regression
//! fails the test instead of exhausting the machine.

mod support;

use std::net::TcpStream;
use std::path::Path;
use std::time::Duration;

use mooncake_core::rpc::wire::{Request, Response, WireError, DEFAULT_MAX_FRAME};
use mooncake_core::{ObjectRecord, RecordUpdate, ReplicateConfig};
use support::{bin, listening_ports, payload, repeated_body, rpc_exchange, unique_dir, Proc, RssWatch};

/// Most a server may grow while it is attacked (it holds the frames it reads: up
/// to four of 64 MiB at once here).
const MAX_GROWTH: u64 = 512 << 20;

/// The address space a server may use: far above what it needs, far below what the
/// attack took (7.4 GB), so that a regression aborts the server, not the machine.
const ADDRESS_SPACE: &str = "--as=4294967296";

/// A request body of `n` copies of one element in the sequence of `with_one`.
fn body(empty: Request, with_one: Request, n: usize) -> Vec<u8> {
    repeated_body(&empty, &with_one, n)
}

/// As many elements of `element_len` wire bytes as fit a 64 MiB frame (less room
/// for the rest of the message).
fn fill(element_len: usize) -> usize {
    (DEFAULT_MAX_FRAME as usize - 64) / element_len
}

/// The amplifying requests to a master: each a whole 64 MiB frame of the cheapest
/// elements its kind holds, and one within the item bound but over the byte bound.
fn master_attacks() -> Vec<(&'static str, Vec<u8>)> {
    let record = ObjectRecord { key: String::new(), offset: 0, len: 0, checksum: 0, generation: 0 };
    let region =
        || mooncake_core::rpc::wire::WireRegion(mooncake_transfer::RemoteRegion { endpoint: String::new(), region: 0 });
    let remount =
        |records: Vec<ObjectRecord>| Request::RemountSegment { client: 0, region: region(), capacity: 0, records };
    let put_start = |preferred_segments: Vec<String>| Request::PutStart {
        client: 0,
        key: "k".into(),
        len: 1,
        cfg: ReplicateConfig { preferred_segments, ..ReplicateConfig::default() },
    };
    vec![
        (
            "batch_exists, 64 MiB of one-byte keys",
            body(Request::BatchExists { keys: vec![] }, Request::BatchExists { keys: vec!["k".into()] }, fill(2)),
        ),
        ("remount_segment, 64 MiB of empty records", body(remount(vec![]), remount(vec![record]), fill(5))),
        (
            "put_start, 64 MiB of one-byte preferred segments",
            body(put_start(vec![]), put_start(vec!["s".into()]), fill(2)),
        ),
        (
            "batch_put_start, 64 MiB of one-byte keys",
            body(
                Request::BatchPutStart { client: 0, items: vec![], cfg: ReplicateConfig::default() },
                Request::BatchPutStart { client: 0, items: vec![("k".into(), 1)], cfg: ReplicateConfig::default() },
                fill(3),
            ),
        ),
        (
            "batch_exists, 2 Mi less one one-byte keys (within the item bound, over the byte bound)",
            body(Request::BatchExists { keys: vec![] }, Request::BatchExists { keys: vec!["k".into()] }, (2 << 20) - 1),
        ),
    ]
}

/// The refusal a request over its budget gets.
fn assert_refused(what: &str, answer: Result<Response, String>) {
    match answer {
        Ok(Response::Error(WireError::InvalidArgument(m))) => {
            assert!(m.contains("decoding budget"), "{what}: {m}");
        }
        other => panic!("{what}: {other:?}"),
    }
}

/// Starts `program` with `args` under the address-space limit.
fn limited(program: &Path, args: &[&str]) -> Proc {
    Proc::spawn(&["prlimit", ADDRESS_SPACE, "--"], program, args)
}

/// A normal client's round trip through the master (stored on the node).
fn put_and_get(master: &str, dir: &Path, key: &str) {
    let data = payload(7, 100_000);
    let file = dir.join(key);
    std::fs::write(&file, &data).unwrap();
    let run = |args: &[&str]| {
        let out = std::process::Command::new(bin("mooncake-client")).args(args).output().unwrap();
        assert!(out.status.success(), "mooncake-client {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    run(&["put", "--master", master, key, file.to_str().unwrap()]);
    let back = dir.join(format!("{key}.out"));
    run(&["get", "--master", master, key, back.to_str().unwrap()]);
    assert!(std::fs::read(&back).unwrap() == data, "{key} read back different bytes");
}

#[test]
fn amplifying_frames_get_an_error_and_the_master_stays_small_and_serves() {
    let mut master = limited(&bin("mooncake-master"), &["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"]);
    let addr = master.first_line.rsplit(' ').next().unwrap().to_owned();
    let metrics = master.next_addr();
    let _node = Proc::spawn(
        &[],
        &bin("mooncake-client"),
        &["serve", "--master", &addr, "--listen", "127.0.0.1:0", "--segment-size", "16MiB"],
    );
    let dir = unique_dir("trust-frames");
    let pid = master.child.id();
    let before = support::rss(pid);
    let watch = RssWatch::start(pid);

    // One connection: every attack is refused with an error, and the connection
    // goes on (the next request on it is answered).
    let attacks = master_attacks();
    let mut s = TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    for (i, (what, body)) in attacks.iter().enumerate() {
        assert!(body.len() <= DEFAULT_MAX_FRAME as usize, "{what}: {} bytes", body.len());
        assert_refused(what, rpc_exchange(&mut s, 2 * i as u64, body));
        let stats = postcard::to_allocvec(&Request::Stats {}).unwrap();
        match rpc_exchange(&mut s, 2 * i as u64 + 1, &stats) {
            Ok(Response::Stats(Ok(_))) => {}
            other => panic!("after {what}: {other:?}"),
        }
    }

    // Four at once, on four connections.
    let batch = &attacks[0].1;
    std::thread::scope(|scope| {
        let senders: Vec<_> = (0..4u64)
            .map(|i| {
                let addr = &addr;
                scope.spawn(move || {
                    let mut s = TcpStream::connect(addr).unwrap();
                    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
                    rpc_exchange(&mut s, i, batch)
                })
            })
            .collect();
        for sender in senders {
            assert_refused("batch_exists, four at once", sender.join().unwrap());
        }
    });

    let most = watch.most();
    assert_eq!(master.child.try_wait().unwrap(), None, "the master died");
    assert!(most < before + MAX_GROWTH, "the master grew from {} MiB to {} MiB", before >> 20, most >> 20);
    eprintln!("master: {} MiB before, at most {} MiB while attacked", before >> 20, most >> 20);

    // A normal client still works, and the refusals are counted.
    put_and_get(&addr, &dir, "after-the-attack");
    let text = support::http_get(&metrics, "/metrics");
    let refused: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("mooncake_rpc_over_budget_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no over-budget counter in {text}"));
    assert_eq!(refused, attacks.len() as u64 + 4);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_storage_node_refuses_amplifying_frames_and_keeps_serving() {
    let master = Proc::spawn(&[], &bin("mooncake-master"), &["--listen", "127.0.0.1:0"]);
    let addr = master.first_line.rsplit(' ').next().unwrap().to_owned();
    let dir = unique_dir("trust-frames-node");
    let ssd = dir.join("ssd");
    let node = limited(
        &bin("mooncake-client"),
        &[
            "serve",
            "--master",
            &addr,
            "--listen",
            "127.0.0.1:0",
            "--segment-size",
            "16MiB",
            "--ssd-dir",
            ssd.to_str().unwrap(),
            "--ssd-capacity",
            "64MiB",
        ],
    );
    assert!(node.first_line.starts_with("mooncake-client serving segment"), "{}", node.first_line);
    let pid = node.child.id();
    // The node's framed-RPC listeners (its record endpoint and its SSD load
    // server): those that answer a request frame with a response frame.
    let stats = postcard::to_allocvec(&Request::Stats {}).unwrap();
    let rpc_ports: Vec<u16> = listening_ports(pid)
        .into_iter()
        .filter(|port| {
            let Ok(mut s) = TcpStream::connect(("127.0.0.1", *port)) else { return false };
            // The transfer listener waits for the rest of its 40-byte header.
            s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
            rpc_exchange(&mut s, 1, &stats).is_ok()
        })
        .collect();
    // The record endpoint answers only the master that holds the node's record key
    // (`trust_auth.rs`): a peer without it never gets to send a frame there, so the
    // load server is the framed listener left to attack (an `ApplyRecords` within the
    // key is budgeted like any request: `decode_budget.rs`).
    assert!(!rpc_ports.is_empty(), "the load server, among {:?}", listening_ports(pid));

    let removed = |key: &str| RecordUpdate::Removed { segment: 0, key: key.into(), offset: 0, generation: 0 };
    let attacks = [
        (
            "batch_get_offload_object, 64 MiB of one-byte keys",
            body(
                Request::BatchGetOffloadObject { keys: vec![] },
                Request::BatchGetOffloadObject { keys: vec!["k".into()] },
                fill(2),
            ),
        ),
        (
            "apply_records, 64 MiB of empty removals",
            body(
                Request::ApplyRecords { updates: vec![] },
                Request::ApplyRecords { updates: vec![removed("")] },
                fill(5),
            ),
        ),
    ];
    let before = support::rss(pid);
    let watch = RssWatch::start(pid);
    for port in &rpc_ports {
        let mut s = TcpStream::connect(("127.0.0.1", *port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        for (i, (what, body)) in attacks.iter().enumerate() {
            // Refused with an error answer; a listener that does not serve this kind
            // of request may also close the connection after refusing it.
            match rpc_exchange(&mut s, i as u64, body) {
                Ok(Response::Error(_)) => {}
                Err(_) => s = TcpStream::connect(("127.0.0.1", *port)).unwrap(),
                Ok(other) => panic!("port {port}, {what}: {other:?}"),
            }
            s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        }
    }
    let most = watch.most();
    assert!(support::rss(pid) > 0, "the node died");
    assert!(most < before + MAX_GROWTH, "the node grew from {} MiB to {} MiB", before >> 20, most >> 20);
    eprintln!("node: {} MiB before, at most {} MiB while attacked", before >> 20, most >> 20);

    // The node still stores and serves objects.
    put_and_get(&addr, &dir, "after-the-node-attack");
    drop((node, master));
    let _ = std::fs::remove_dir_all(dir);
}

/// Fields no well-behaved client sends, each of which crashed a master thread
/// before (a replica count that overflowed the placement's reservation, a segment
/// smaller than one allocation unit): now each is an `InvalidArgument` answer, the
/// connection goes on, and a normal client still works.
#[test]
fn hostile_fields_get_an_error_and_the_master_goes_on() {
    let master = Proc::spawn(&[], &bin("mooncake-master"), &["--listen", "127.0.0.1:0"]);
    let addr = master.first_line.rsplit(' ').next().unwrap().to_owned();
    // A storage node, so that there is a segment to place on.
    let _node = Proc::spawn(
        &[],
        &bin("mooncake-client"),
        &["serve", "--master", &addr, "--listen", "127.0.0.1:0", "--segment-size", "16MiB"],
    );
    let dir = unique_dir("trust-fields");
    put_and_get(&addr, &dir, "before");

    let mut s = TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let ask = |s: &mut TcpStream, id: u64, req: &Request| {
        rpc_exchange(s, id, &postcard::to_allocvec(req).unwrap()).unwrap_or_else(|e| panic!("{req:?}: {e}"))
    };
    let client = match ask(&mut s, 1, &Request::RegisterClient {}) {
        Response::RegisterClient(Ok(reg)) => reg.client,
        other => panic!("register: {other:?}"),
    };
    let region = mooncake_core::rpc::wire::WireRegion(mooncake_transfer::RemoteRegion {
        endpoint: "127.0.0.1:1".into(),
        region: 1,
    });
    let hostile = [
        Request::PutStart {
            client,
            key: "k".into(),
            len: 4096,
            cfg: ReplicateConfig { replica_num: usize::MAX, ..ReplicateConfig::default() },
        },
        Request::BatchPutStart {
            client,
            items: vec![("k".into(), 4096)],
            cfg: ReplicateConfig { replica_num: 1 << 40, ..ReplicateConfig::default() },
        },
        Request::MountSegment { client, region: region.clone(), capacity: 1 },
        Request::MountSegment { client, region, capacity: 63 },
    ];
    for (i, req) in hostile.iter().enumerate() {
        let answer = format!("{:?}", ask(&mut s, 10 + i as u64, req));
        assert!(answer.contains("InvalidArgument"), "{req:?}: {answer}");
        match ask(&mut s, 100 + i as u64, &Request::Stats {}) {
            Response::Stats(Ok(_)) => {}
            other => panic!("after {req:?}: {other:?}"),
        }
    }
    put_and_get(&addr, &dir, "after");
    let _ = std::fs::remove_dir_all(dir);
}
