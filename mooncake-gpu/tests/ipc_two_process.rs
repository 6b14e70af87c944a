//! The seed design's one-hop path between processes: an owner process holds a
//! device heap and a `NanoKvCache`, reserves a KV block and exports the heap
//! (CUDA IPC); a producer process opens the heap and pushes the block's pages
//! straight into it through the `WritePlan` (kernel copy + device-side publish);
//! a third process opens it too and reads the block with the device-side reader
//! protocol. Every byte is checked, in the reader and in the owner.
//!
//! Same-process CUDA IPC is refused by the driver, so this is the only way to
//! run it. The processes are this test executable run again with a role in
//! `MOONCAKE_GPU_IPC_ROLE`. Skipped, with a message, without a GPU and NVRTC.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mooncake_gpu::{
    cuda_available, nvrtc_available, CacheConfig, CudaDeviceHeap, IpcHeapHandle, KeyId, NanoKvCache, ObjMeta, WritePlan,
};

const ROLE: &str = "MOONCAKE_GPU_IPC_ROLE";
const TEST: &str = "one_hop_write_into_a_peer_heap_across_processes";
const KEY: &str = "layer3/prefix-77";
/// Not a whole number of pages: the tail page is clamped.
const LEN: usize = (1 << 20) + 12_345;
const PAGE: u32 = 64 << 10;
/// How long any one process may take.
const LIMIT: Duration = Duration::from_secs(60);

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i.wrapping_mul(131) ^ (i >> 9)) as u8).collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2).map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex")).collect()
}

fn nums(s: &str) -> Vec<u64> {
    s.split_whitespace().map(|x| x.parse().expect("number")).collect()
}

fn plan_line(p: &WritePlan) -> String {
    let v: [u64; 14] = [
        p.key_hash,
        p.key_fp_hi,
        p.key_len.into(),
        p.dst_rank.into(),
        p.slot.into(),
        p.header_ptr,
        p.payload_ptr,
        p.payload_offset,
        p.page_bytes.into(),
        p.n_pages.into(),
        p.last_page_bytes.into(),
        p.bytes_total,
        p.epoch.into(),
        p.reserved_at_ns,
    ];
    v.iter().map(u64::to_string).collect::<Vec<_>>().join(" ")
}

fn parse_plan(s: &str) -> WritePlan {
    let v = nums(s);
    let n = |i: usize| u32::try_from(v[i]).expect("u32");
    WritePlan {
        key_hash: v[0],
        key_fp_hi: v[1],
        key_len: n(2),
        dst_rank: n(3),
        slot: n(4),
        header_ptr: v[5],
        payload_ptr: v[6],
        payload_offset: v[7],
        page_bytes: n(8),
        n_pages: n(9),
        last_page_bytes: n(10),
        bytes_total: v[11],
        epoch: n(12),
        reserved_at_ns: v[13],
    }
}

fn meta_line(m: &ObjMeta) -> String {
    let v: [u64; 11] = [
        m.key_hash,
        m.owner_rank.into(),
        m.slot.into(),
        m.header_ptr,
        m.payload_ptr,
        m.payload_offset,
        m.bytes_total,
        m.page_bytes.into(),
        m.n_pages.into(),
        m.last_page_bytes.into(),
        m.epoch.into(),
    ];
    v.iter().map(u64::to_string).collect::<Vec<_>>().join(" ")
}

fn parse_meta(s: &str) -> ObjMeta {
    let v = nums(s);
    let n = |i: usize| u32::try_from(v[i]).expect("u32");
    ObjMeta {
        key_hash: v[0],
        owner_rank: n(1),
        slot: n(2),
        header_ptr: v[3],
        payload_ptr: v[4],
        payload_offset: v[5],
        bytes_total: v[6],
        page_bytes: n(7),
        n_pages: n(8),
        last_page_bytes: n(9),
        epoch: n(10),
    }
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} not set"))
}

/// The owner: heap, cache, reservation, export; then the checks after the
/// producer's publish. Talks through stdin/stdout lines prefixed `IPC:`.
fn owner() {
    let heap = Arc::new(CudaDeviceHeap::new(0, 64, 16 << 20).expect("owner heap"));
    let cache = NanoKvCache::new(heap.clone(), CacheConfig { page_size: PAGE, ..Default::default() }).expect("cache");
    let plan = cache.open_for_write(KEY, LEN as u64).expect("reservation");
    let handle = heap.export_ipc().expect("export");
    println!("IPC:handle {}", hex(&handle.to_bytes()));
    println!("IPC:plan {}", plan_line(&plan));
    let mut lines = std::io::stdin().lock().lines();
    assert_eq!(lines.next().expect("a line").expect("stdin"), "published");
    // Published by the producer's kernel in another process: READY here.
    let meta = cache.get_location(KEY).expect("READY after the producer's publish");
    assert_eq!((meta.bytes_total, meta.epoch), (LEN as u64, plan.epoch));
    assert!(cache.get(KEY).expect("owner read") == pattern(LEN), "the owner reads other bytes");
    println!("IPC:meta {}", meta_line(&meta));
    assert_eq!(lines.next().expect("a line").expect("stdin"), "done");
    println!("IPC:owner-ok");
}

/// The producer: opens the owner's heap, pushes the pages through the plan
/// and publishes on the device.
fn producer() {
    let handle = IpcHeapHandle::from_bytes(&unhex(&env("MOONCAKE_GPU_IPC_HANDLE"))).expect("handle");
    let heap = CudaDeviceHeap::open_ipc(0, &handle).expect("open_ipc in the producer");
    let plan = parse_plan(&env("MOONCAKE_GPU_IPC_PLAN"));
    // The push kernel reads whole pages from the source: room for all of them.
    let whole = plan.n_pages as usize * plan.page_bytes as usize;
    let src = heap.alloc_buffer(whole).expect("source buffer");
    let mut data = pattern(LEN);
    data.resize(whole, 0);
    src.upload(&data).expect("upload");
    heap.push_from_device(&plan, src.ptr(), 0, plan.n_pages, true, plan.reserved_at_ns + 1).expect("push + publish");
    println!("IPC:producer-ok");
}

/// The reader: opens the owner's heap and reads the block with the device
/// reader protocol into its own device memory.
fn reader() {
    let handle = IpcHeapHandle::from_bytes(&unhex(&env("MOONCAKE_GPU_IPC_HANDLE"))).expect("handle");
    let heap = CudaDeviceHeap::open_ipc(0, &handle).expect("open_ipc in the reader");
    let meta = parse_meta(&env("MOONCAKE_GPU_IPC_META"));
    let dst = heap.alloc_buffer(LEN).expect("destination");
    let n = heap.read_into_device(&meta, &KeyId::of(KEY), dst.ptr(), LEN as u64).expect("read");
    assert_eq!(n, LEN as u64);
    let mut back = vec![0u8; LEN];
    dst.download(&mut back).expect("download");
    assert!(back == pattern(LEN), "the reader got other bytes");
    println!("IPC:reader-ok");
}

/// Children killed (SIGKILL) if the test fails half-way.
struct Kids(Vec<Child>);

impl Drop for Kids {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn spawn(role: &str, vars: &[(&str, String)]) -> Child {
    let mut cmd = Command::new(std::env::current_exe().expect("test executable"));
    cmd.args(["--exact", TEST, "--nocapture", "--test-threads", "1"]).env(ROLE, role);
    for (k, v) in vars {
        cmd.env(k, v);
    }
    cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn().expect("spawn")
}

/// Waits (bounded) for a child to exit successfully.
fn finish(child: &mut Child, what: &str) {
    let deadline = Instant::now() + LIMIT;
    loop {
        if let Some(st) = child.try_wait().expect("wait") {
            assert!(st.success(), "{what} failed: {st}");
            return;
        }
        assert!(Instant::now() < deadline, "{what} did not finish in {LIMIT:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn send(stdin: &mut ChildStdin, line: &str) {
    writeln!(stdin, "{line}").expect("write to the owner");
    stdin.flush().expect("flush");
}

#[test]
fn one_hop_write_into_a_peer_heap_across_processes() {
    match std::env::var(ROLE).as_deref() {
        Ok("owner") => return owner(),
        Ok("producer") => return producer(),
        Ok("reader") => return reader(),
        _ => {}
    }
    if !cuda_available() || !nvrtc_available() {
        eprintln!("note: skipping the two-process CUDA IPC test: no usable GPU (or no NVRTC) on this machine");
        return;
    }
    let mut kids = Kids(Vec::new());
    kids.0.push(spawn("owner", &[]));
    let mut owner_in = kids.0[0].stdin.take().expect("stdin");
    let owner_out = kids.0[0].stdout.take().expect("stdout");
    // The owner's protocol lines, read on a thread so that every wait is bounded.
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(owner_out).lines().map_while(|l| l.ok()) {
            // The harness's "test NAME ... " has no newline: the first protocol
            // line follows it on the same line.
            if let Some(at) = line.find("IPC:") {
                let _ = tx.send(line[at + 4..].to_owned());
            }
        }
    });
    let next = |want: &str| -> String {
        let line = rx.recv_timeout(LIMIT).unwrap_or_else(|_| panic!("the owner did not send {want}"));
        line.strip_prefix(want).unwrap_or_else(|| panic!("expected {want}, got {line}")).trim().to_owned()
    };
    let handle = next("handle");
    let plan = next("plan");

    let mut p = spawn("producer", &[("MOONCAKE_GPU_IPC_HANDLE", handle.clone()), ("MOONCAKE_GPU_IPC_PLAN", plan)]);
    finish(&mut p, "the producer");
    kids.0.push(p);
    send(&mut owner_in, "published");
    let meta = next("meta");

    let mut r = spawn("reader", &[("MOONCAKE_GPU_IPC_HANDLE", handle), ("MOONCAKE_GPU_IPC_META", meta)]);
    finish(&mut r, "the reader");
    kids.0.push(r);
    send(&mut owner_in, "done");
    assert_eq!(next("owner-ok"), "");
    finish(&mut kids.0[0], "the owner");
}
