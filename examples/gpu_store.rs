//! GPU memory as a target of the store: a prefill worker puts KV blocks straight
//! from device memory (`put_from_device`), a decode worker reads them straight
//! into its device memory (`get_into_device`, and the pipelined batch form).
//! Bytes are staged through pinned host buffers and moved with asynchronous
//! DMA. Last, device memory is mounted as a store segment through
//! `GpuTransport`, so the pool itself lives in GPU memory.
//!
//! Without a GPU (or without the CUDA driver) the same code runs over the host
//! emulation of device memory, and says so.
//!
//! Run: `cargo run --release --example gpu_store`
//!
//! Bench mode (needs a GPU; exits 2 with a message without one): for replicas
//! in the client's own segment (`local`; `own_remote_master` with a master daemon
//! over RPC, as the Python drop-in runs), in a same-host peer's segment mapped
//! through shared memory (`shm_peer`) and in a peer's segment over TCP
//! (`tcp_peer`), and objects of 64 KiB .. 64 MiB (`--max-size`), times
//! `get_into_device`, `put_from_device` and their batch forms against pinned
//! host <-> device DMA (the PCIe ceiling) and against the same transport's host
//! `get_into` / `put`, and the same objects split over [`LAYERS`] ranges of the
//! device memory (one `DeviceScatter`, as the Python drop-in's multi-buffer calls
//! pass a block's per-layer KV tensors), and prints one JSON document (mean
//! throughputs, the median call of the single-object device calls and of the
//! DMAs, and how many of a row's device puts wrote into room its master held
//! ahead: `bound_puts` of `device_puts`). `--master-bin PATH` adds `own_master_process`: the client's own segment
//! with a `mooncake-master` started from PATH as its master, in its own process,
//! as the Python drop-in's bench (`mooncake-py/bench/gpu_pointers.py`) runs it.
//! `--emulate` runs it over the host emulation, to test the bench itself (its
//! figures are no GPU result):
//!
//! `cargo run --release --example gpu_store -- --bench [--iters N] [--device D] [--max-size B] [--master-bin PATH] [--emulate]`
//!
//! First-call mode: how long the first device calls of a fresh store with a
//! segment of SEGMENT bytes take (six 1 MiB `put_from_device`, then three
//! `get_into_device`), with the segment page-locked in pieces (the default) and as
//! one piece (how every segment was locked before pieces), then how long
//! `Store::page_lock_segments` takes to lock the rest; one JSON document:
//!
//! `cargo run --release --example gpu_store -- --first-call SEGMENT [--device D] [--emulate]`

use std::io::BufRead;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Instant;

use mooncake_core::gpu::{
    allocate_or_emulate, DeviceBuffer, DeviceMemory, DeviceScatter, GpuError, GpuTransport, HostDeviceMemory,
    MemoryLocation,
};
use mooncake_core::{Error, MasterDaemon, Protocol, ReplicateConfig, Store};

/// Ranges a bench object is split over in its per-layer rows.
const LAYERS: usize = 32;

fn kv_block(layer: usize, block: usize, len: usize) -> Vec<u8> {
    (0..len).map(|i| (layer * 131 + block * 17 + i / 7) as u8).collect()
}

struct Args {
    bench: bool,
    iters: usize,
    device: usize,
    /// Largest object size of the bench (from 64 KiB, times 4).
    max_size: usize,
    /// Bench over the host emulation (to test the bench itself without a GPU).
    emulate: bool,
    /// Smallest object size of the bench.
    min_size: usize,
    /// Only these replica placements (by name); all when empty.
    replicas: Vec<String>,
    /// A `mooncake-master` binary: adds the `own_master_process` placement, the
    /// client's own segment with that binary as its master, in its own process
    /// (as the Python drop-in's bench runs it).
    master_bin: Option<String>,
    /// First-call mode: the segment's bytes.
    first_call: Option<u64>,
}

fn parse_args() -> Args {
    let mut a = Args {
        bench: false,
        iters: 20,
        device: 0,
        max_size: 64 << 20,
        emulate: false,
        min_size: 64 << 10,
        replicas: Vec::new(),
        master_bin: None,
        first_call: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut num = |name: &str| -> usize {
            it.next().and_then(|v| v.parse().ok()).unwrap_or_else(|| {
                eprintln!("{name} needs a number");
                std::process::exit(1)
            })
        };
        match flag.as_str() {
            "--bench" => a.bench = true,
            "--iters" => a.iters = num("--iters").max(1),
            "--device" => a.device = num("--device"),
            "--max-size" => a.max_size = num("--max-size"),
            "--min-size" => a.min_size = num("--min-size"),
            "--replicas" => {
                a.replicas = it.next().map(|v| v.split(',').map(str::to_owned).collect()).unwrap_or_default()
            }
            "--emulate" => a.emulate = true,
            "--master-bin" => a.master_bin = it.next(),
            "--first-call" => a.first_call = Some(num("--first-call") as u64),
            "-h" | "--help" => {
                eprintln!("usage: gpu_store [--bench [--iters N] [--device D] [--min-size BYTES] [--max-size BYTES] [--replicas local,own_remote_master,shm_peer,tcp_peer,own_master_process] [--master-bin PATH] [--emulate]] [--first-call SEGMENT [--device D] [--emulate]]");
                std::process::exit(0);
            }
            other => {
                eprintln!("unknown argument {other}");
                std::process::exit(1);
            }
        }
    }
    a
}

fn demo(device: usize) -> Result<(), Box<dyn std::error::Error>> {
    let layers = 4;
    let blocks = 8;
    let block_len = 512 << 10;
    let total = (layers * blocks * block_len) as u64;

    // Device memory of the prefill and of the decode worker (one process here).
    let (prefill_kv, why) = allocate_or_emulate(device, total)?;
    let (decode_kv, _) = allocate_or_emulate(device, total)?;
    match (&why, prefill_kv.location()) {
        (None, loc) => println!("device memory: {loc}"),
        (Some(reason), MemoryLocation::Emulated) => println!("device memory: host emulation — {reason}"),
        (Some(_), loc) => println!("device memory: {loc}"),
    }

    // The prefill "kernel" wrote the KV cache into device memory.
    for layer in 0..layers {
        for block in 0..blocks {
            let at = ((layer * blocks + block) * block_len) as u64;
            prefill_kv.copy_from_host(at, &kv_block(layer, block, block_len))?;
        }
    }

    let store = Store::builder().global_segment_size(64 << 20).build()?;
    let t = Instant::now();
    // Layer 0 one by one; the rest as one pipelined batch.
    for block in 0..blocks {
        let at = (block * block_len) as u64;
        store.put_from_device(&format!("req-7/layer0/block{block}"), &*prefill_kv, at, block_len as u64)?;
    }
    let keys: Vec<(String, u64, u64)> = (1..layers)
        .flat_map(|layer| (0..blocks).map(move |block| (layer, block)))
        .map(|(layer, block)| {
            let at = ((layer * blocks + block) * block_len) as u64;
            (format!("req-7/layer{layer}/block{block}"), at, block_len as u64)
        })
        .collect();
    let items: Vec<(&str, u64, u64)> = keys.iter().map(|(k, o, l)| (k.as_str(), *o, *l)).collect();
    for r in store.batch_put_from_device(&items, &*prefill_kv, &ReplicateConfig::default()) {
        r?;
    }
    println!("put {} blocks of {} KiB from device memory in {:?}", layers * blocks, block_len >> 10, t.elapsed());

    // The decode worker reads them into its own device memory, same layout.
    let t = Instant::now();
    let n = store.get_into_device("req-7/layer0/block0", &*decode_kv, 0)?;
    assert_eq!(n, block_len);
    let gets: Vec<(&str, u64)> = keys.iter().map(|(k, o, _)| (k.as_str(), *o)).collect();
    for r in store.batch_get_into_device(&gets, &*decode_kv) {
        r?;
    }
    for block in 1..blocks {
        store.get_into_device(&format!("req-7/layer0/block{block}"), &*decode_kv, (block * block_len) as u64)?;
    }
    println!("got them into device memory in {:?}", t.elapsed());

    // Check every byte (a copy back to the host, for the check only).
    let mut a = vec![0u8; total as usize];
    let mut b = vec![0u8; total as usize];
    prefill_kv.copy_to_host(0, &mut a)?;
    decode_kv.copy_to_host(0, &mut b)?;
    assert!(a == b, "device memories differ");
    println!("verified {} MiB byte for byte", total >> 20);

    // Errors are typed, never panics.
    match store.get_into_device("req-7/layer0/block0", &*decode_kv, total - 10) {
        Err(Error::BufferTooSmall { needed, capacity }) => {
            println!("a block that does not fit: BufferTooSmall (needs {needed}, room {capacity})")
        }
        other => panic!("expected BufferTooSmall, got {other:?}"),
    }

    // Device memory as a store segment: with GpuTransport in the builder, the
    // master places objects in the GPU buffer and puts/gets go through it.
    let gpu = Arc::new(GpuTransport::new());
    let pool_store = Store::builder().global_segment_size(0).transport(gpu.clone()).build()?;
    let hbm: Arc<dyn DeviceMemory> = match DeviceBuffer::new(device, 16 << 20) {
        Ok(buf) => Arc::new(buf),
        Err(_) => Arc::new(HostDeviceMemory::new(16 << 20)?),
    };
    let region = gpu.register(hbm.clone())?;
    println!("segment endpoint: {}", region.endpoint);
    pool_store.master().mount_segment(pool_store.client_id(), &region, hbm.len())?;
    pool_store.put("in-hbm", &kv_block(9, 9, 1 << 20))?;
    assert_eq!(pool_store.get("in-hbm")?[..], kv_block(9, 9, 1 << 20)[..]);
    println!("1 MiB object stored in and read back from a {} segment", hbm.location());
    Ok(())
}

fn gbps(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs.max(1e-9) / 1e9
}

/// Where the replicas a bench row reads and writes live.
struct Replicas {
    name: &'static str,
    /// The client the calls are made on (no segment of its own for the peers).
    client: Store,
    /// The store holding the peers' segment (kept alive by one row).
    _node: Option<Store>,
}

/// The placements: the client's own segment (embedded master), its own segment
/// with a master daemon over RPC and the segment mapped through shared memory
/// (as the Python drop-in runs: `own_remote_master`), a same-host peer's segment
/// mapped through shared memory, the same peer's segment over TCP. The peer runs
/// in this process (a served master, a node store serving its segment on
/// loopback), and the two peer clients reach it only through their transport.
fn placements(segment: u64, master_bin: Option<&str>) -> Result<(Vec<Replicas>, Masters), Box<dyn std::error::Error>> {
    // Timed phase by phase (a device call takes 20 us and more; a clock reading 20 ns).
    let local = Store::builder().phase_times(true).global_segment_size(segment).build()?;
    let own_daemon = MasterDaemon::builder("127.0.0.1:0").serve()?;
    let own = Store::builder()
        .phase_times(true)
        .master_address(&own_daemon.local_addr().to_string())
        .protocol(Protocol::Shm)
        .global_segment_size(segment)
        .listen("127.0.0.1:0")
        .build()?;
    let daemon = MasterDaemon::builder("127.0.0.1:0").serve()?;
    let addr = daemon.local_addr().to_string();
    let node = Store::builder().master_address(&addr).global_segment_size(segment).build()?;
    let client = |protocol: Protocol| {
        Store::builder().phase_times(true).master_address(&addr).protocol(protocol).global_segment_size(0).build()
    };
    let mut out = vec![
        Replicas { name: "local", client: local, _node: None },
        Replicas { name: "own_remote_master", client: own, _node: None },
        Replicas { name: "shm_peer", client: client(Protocol::Shm)?, _node: None },
        Replicas { name: "tcp_peer", client: client(Protocol::Tcp)?, _node: Some(node) },
    ];
    let process = match master_bin {
        Some(bin) => {
            let master = MasterProcess::start(bin)?;
            let own = Store::builder()
                .master_address(&master.addr)
                .protocol(Protocol::Shm)
                .global_segment_size(segment)
                .listen("127.0.0.1:0")
                .build()?;
            out.push(Replicas { name: "own_master_process", client: own, _node: None });
            Some(master)
        }
        None => None,
    };
    Ok((out, Masters { _served: vec![own_daemon, daemon], _process: process }))
}

/// The masters of the placements: served in this process, and the one started
/// from `--master-bin` (stopped when dropped). Declared after the clients where
/// held, so that the clients close first.
struct Masters {
    _served: Vec<MasterDaemon>,
    _process: Option<MasterProcess>,
}

/// A `mooncake-master` process listening on loopback.
struct MasterProcess {
    child: Child,
    addr: String,
}

impl MasterProcess {
    /// Starts `bin --listen 127.0.0.1:0` and reads the address it says it
    /// listens on (its first line).
    fn start(bin: &str) -> Result<Self, Box<dyn std::error::Error>> {
        let mut child = Command::new(bin)
            .args(["--listen", "127.0.0.1:0"])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("cannot start {bin}: {e}"))?;
        let mut line = String::new();
        let stdout = child.stdout.take().ok_or("no stdout")?;
        std::io::BufReader::new(stdout).read_line(&mut line)?;
        match line.split_whitespace().last() {
            Some(addr) if line.contains("listening on") => Ok(Self { addr: addr.to_owned(), child }),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                Err(format!("{bin} did not start: {line:?}").into())
            }
        }
    }
}

impl Drop for MasterProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Seconds a call took over a run of calls.
struct Timing {
    /// The mean (what throughputs are computed from).
    mean: f64,
    /// The median call (a rare slow call does not move it: what per-call
    /// costs are compared with).
    p50: f64,
}

/// Untimed calls before a timed loop (the Python bench, `gpu_pointers.py`, makes as
/// many, so that the two compare the same steady state).
const WARM_UP: usize = 5;

/// A call's phases (`WriteTime` / `ReadTime::per_call_us`) as a JSON object of
/// microseconds.
fn phases_json(phases: &[(&str, f64)]) -> String {
    let fields: Vec<String> = phases.iter().map(|(name, us)| format!("\"{name}\":{us:.1}")).collect();
    format!("{{{}}}", fields.join(","))
}

/// The calls of `f` over `iters` calls, `undo` run after each outside the clock.
fn timed(
    iters: usize,
    mut f: impl FnMut(usize) -> Result<(), Box<dyn std::error::Error>>,
    mut undo: impl FnMut(usize),
) -> Result<Timing, Box<dyn std::error::Error>> {
    // Warm-up, untimed: the first device calls fill the staging pool, the streams
    // and the room held ahead.
    for w in 0..WARM_UP {
        f(usize::MAX - w)?;
        undo(usize::MAX - w);
    }
    let mut each = Vec::with_capacity(iters);
    for i in 0..iters {
        let t = Instant::now();
        f(i)?;
        each.push(t.elapsed().as_secs_f64());
        undo(i);
    }
    let mean = each.iter().sum::<f64>() / iters as f64;
    each.sort_by(f64::total_cmp);
    Ok(Timing { mean, p50: each[iters / 2] })
}

fn bench(a: &Args) -> Result<String, Box<dyn std::error::Error>> {
    let sizes: Vec<usize> = (0..)
        .map(|i| (64usize << 10) << (2 * i))
        .take_while(|&s| s <= a.max_size.max(64 << 10))
        .filter(|&s| s >= a.min_size.min(a.max_size.max(64 << 10)))
        .collect();
    let max = *sizes.last().expect("sizes");
    let batch = 8;
    let dev: Arc<dyn DeviceMemory> = if a.emulate {
        Arc::new(HostDeviceMemory::new((max * batch) as u64)?)
    } else {
        Arc::new(DeviceBuffer::new(a.device, max * batch)?)
    };
    let dst = &*dev;
    let segment = (max * batch * 3) as u64 + (64 << 20);
    let (rows_of, _masters) = placements(segment, a.master_bin.as_deref())?;
    let cfg = ReplicateConfig::default();
    let mut rows = Vec::new();
    for &size in &sizes {
        // References: pinned host <-> device DMA (the PCIe ceiling).
        let pinned = dst.alloc_pinned(size)?;
        let mut stream = dst.open_stream()?;
        let htod = timed(
            a.iters,
            |_| {
                // SAFETY: `pinned` outlives the stream and is not written while the
                // copy runs (synchronized right after).
                unsafe { stream.copy_to_device_async(pinned.as_ptr(), size, 0)? };
                Ok(stream.synchronize()?)
            },
            |_| {},
        )?;
        let mut pinned_back = dst.alloc_pinned(size)?;
        let dtoh = timed(
            a.iters,
            |_| {
                // SAFETY: as above, for the copy into `pinned_back`.
                unsafe { stream.copy_from_device_async(pinned_back.as_mut_ptr(), size, 0)? };
                Ok(stream.synchronize()?)
            },
            |_| {},
        )?;
        drop(stream);
        // What a device get's check costs: the crc32c of the object's device bytes.
        let crc = timed(a.iters, |_| Ok(dst.crc32c(0, size as u64).map(|_| ())?), |_| {})?.mean;
        let (htod_us, crc_us) = (htod.mean * 1e6, crc * 1e6);
        let (htod_p50_us, dtoh_p50_us) = (htod.p50 * 1e6, dtoh.p50 * 1e6);
        let (htod, dtoh) = (gbps(size, htod.mean), gbps(size, dtoh.mean));
        // The object's bytes as LAYERS ranges of the device memory, one scatter.
        let part = size / LAYERS;
        let layers = DeviceScatter::new((0..LAYERS).map(|l| (dev.clone(), (l * part) as u64, part as u64)).collect())?;
        let layered = (part * LAYERS) as u64;
        for r in rows_of.iter().filter(|r| a.replicas.is_empty() || a.replicas.iter().any(|n| n == r.name)) {
            let store = &r.client;
            let before = store.stats();
            let keys: Vec<String> = (0..batch).map(|i| format!("bench/{}/{size}/{i}", r.name)).collect();
            for (i, k) in keys.iter().enumerate() {
                store.put(k, &kv_block(i, size, size))?;
            }
            // The segment this row's device calls map, page-locked whole now (as a
            // server would at setup): no timed call waits for a piece of it.
            store.get_into_device(&keys[0], dst, 0)?;
            store.page_lock_segments();
            let mut host = vec![0u8; size];
            let get_host =
                timed(a.iters, |i| Ok(store.get_into(&keys[i % batch], &mut host).map(|_| ())?), |_| {})?.mean;
            let phases = store.stats().read_time;
            let get_dev = timed(a.iters, |i| Ok(store.get_into_device(&keys[i % batch], dst, 0).map(|_| ())?), |_| {})?;
            let get_phases = phases_json(&store.stats().read_time.since(&phases).per_call_us());
            let layer_keys: Vec<String> = (0..batch).map(|i| format!("{}/layers", keys[i])).collect();
            for (i, k) in layer_keys.iter().enumerate() {
                store.put(k, &kv_block(i, size, layered as usize))?;
            }
            let get_layers =
                timed(a.iters, |i| Ok(store.get_into_device(&layer_keys[i % batch], &layers, 0).map(|_| ())?), |_| {})?
                    .mean;
            let items: Vec<(&str, u64)> =
                keys.iter().enumerate().map(|(i, k)| (k.as_str(), (i * size) as u64)).collect();
            let batch_get = timed(
                a.iters.div_ceil(batch),
                |_| {
                    for res in store.batch_get_into_device(&items, dst) {
                        res?;
                    }
                    Ok(())
                },
                |_| {},
            )?
            .mean;
            let put_key = |i: usize| format!("bench/{}/{size}/put/{i}", r.name);
            let put_host = timed(
                a.iters,
                |i| Ok(store.put_with(&put_key(i), &host, &cfg)?),
                |i| {
                    let _ = store.remove(&put_key(i));
                },
            )?
            .mean;
            let phases = store.stats().write_time;
            let put_dev = timed(
                a.iters,
                |i| Ok(store.put_from_device_with(&put_key(i), dst, 0, size as u64, &cfg)?),
                |i| {
                    let _ = store.remove(&put_key(i));
                },
            )?;
            // Where a device put's time went (the untimed calls of `timed` included).
            let put_phases = phases_json(&store.stats().write_time.since(&phases).per_call_us());
            let bkeys = |i: usize| -> Vec<String> { (0..batch).map(|j| format!("{}/{j}", put_key(i))).collect() };
            let batch_put = timed(
                a.iters.div_ceil(batch),
                |i| {
                    let ks = bkeys(i);
                    let items: Vec<(&str, u64, u64)> =
                        ks.iter().enumerate().map(|(j, k)| (k.as_str(), (j * size) as u64, size as u64)).collect();
                    for res in store.batch_put_from_device(&items, dst, &cfg) {
                        res?;
                    }
                    Ok(())
                },
                |i| {
                    for k in bkeys(i) {
                        let _ = store.remove(&k);
                    }
                },
            )?
            .mean;
            let put_layers = timed(
                a.iters,
                |i| Ok(store.put_from_device_with(&put_key(i), &layers, 0, layered, &cfg)?),
                |i| {
                    let _ = store.remove(&put_key(i));
                },
            )?
            .mean;
            for k in keys.iter().chain(&layer_keys) {
                let _ = store.remove(k);
            }
            // Which share of the device bytes moved without a staging copy.
            let after = store.stats();
            let direct = (after.device_direct_bytes - before.device_direct_bytes) as f64;
            let staged = (after.device_staged_bytes - before.device_staged_bytes) as f64;
            let direct_share = direct / (direct + staged).max(1.0);
            // Device puts written into room held ahead (a master daemon's), of all
            // the row's device puts (single, batch, per layer).
            let bound = after.master.bound_puts - before.master.bound_puts;
            let device_puts = 2 * a.iters + a.iters.div_ceil(batch) * batch;
            let get_dev_us = get_dev.mean * 1e6;
            let (get_dev_p50_us, put_dev_p50_us) = (get_dev.p50 * 1e6, put_dev.p50 * 1e6);
            let (get_host, get_dev, put_host, put_dev) =
                (gbps(size, get_host), gbps(size, get_dev.mean), gbps(size, put_host), gbps(size, put_dev.mean));
            let (batch_get, batch_put) = (gbps(size * batch, batch_get), gbps(size * batch, batch_put));
            let (get_layers, put_layers) = (gbps(layered as usize, get_layers), gbps(layered as usize, put_layers));
            rows.push(format!(
                "{{\"replica\":\"{}\",\"object_bytes\":{size},\"iters\":{},\
                 \"get_into_device_gbps\":{get_dev:.3},\"batch_get_into_device_gbps\":{batch_get:.3},\
                 \"put_from_device_gbps\":{put_dev:.3},\"batch_put_from_device_gbps\":{batch_put:.3},\
                 \"host_get_into_gbps\":{get_host:.3},\"host_put_gbps\":{put_host:.3},\
                 \"htod_pinned_gbps\":{htod:.3},\"dtoh_pinned_gbps\":{dtoh:.3},\
                 \"get_into_device_vs_pinned_htod\":{:.3},\"put_from_device_vs_pinned_dtoh\":{:.3},\
                 \"get_into_device_vs_host_get_into\":{:.3},\"put_from_device_vs_host_put\":{:.3},\
                 \"device_direct_share\":{direct_share:.3},\"bound_puts\":{bound},\"device_puts\":{device_puts},\
                 \"get_into_device_us\":{get_dev_us:.1},\
                 \"htod_pinned_us\":{htod_us:.1},\"device_crc32c_us\":{crc_us:.1},\
                 \"get_into_device_p50_us\":{get_dev_p50_us:.1},\"put_from_device_p50_us\":{put_dev_p50_us:.1},\
                 \"get_into_device_phases_us\":{get_phases},\"put_from_device_phases_us\":{put_phases},\
                 \"htod_pinned_p50_us\":{htod_p50_us:.1},\"dtoh_pinned_p50_us\":{dtoh_p50_us:.1},\
                 \"layers\":{LAYERS},\"get_into_device_layers_gbps\":{get_layers:.3},\
                 \"put_from_device_layers_gbps\":{put_layers:.3},\
                 \"layers_vs_one_range_get\":{:.3},\"layers_vs_one_range_put\":{:.3}}}",
                r.name,
                a.iters,
                get_dev / htod,
                put_dev / dtoh,
                get_dev / get_host,
                put_dev / put_host,
                get_layers / get_dev,
                put_layers / put_dev,
            ));
        }
    }
    let device = if a.emulate {
        "\"host emulation (no GPU): a test of the bench, not a GPU result\"".to_owned()
    } else {
        format!("\"{}\"", dst.location())
    };
    Ok(format!(
        "{{\"bench\":\"gpu_store\",\"device\":{device},\"batch\":{batch},\"rows\":[\n  {}\n]}}",
        rows.join(",\n  ")
    ))
}

/// First-call mode (see the crate doc): one row per way of page-locking.
fn first_call(a: &Args, segment: u64) -> Result<String, Box<dyn std::error::Error>> {
    const SIZE: usize = 1 << 20;
    let dev: Arc<dyn DeviceMemory> = if a.emulate {
        Arc::new(HostDeviceMemory::new(2 * SIZE as u64)?)
    } else {
        Arc::new(DeviceBuffer::new(a.device, 2 * SIZE)?)
    };
    dev.copy_from_host(0, &kv_block(1, 2, SIZE))?;
    let ms = |t: Instant| format!("{:.2}", t.elapsed().as_secs_f64() * 1e3);
    let mut rows = Vec::new();
    let whole = segment.next_multiple_of(4096).max(1 << 20);
    for (name, piece) in [("pieces", None), ("whole_segment", Some(whole))] {
        let mut builder = Store::builder().global_segment_size(segment);
        if let Some(piece) = piece {
            builder = builder.page_lock_piece(piece);
        }
        let store = builder.build()?;
        let mut puts = Vec::new();
        for i in 0..6 {
            let t = Instant::now();
            store.put_from_device(&format!("first/{i}"), &*dev, 0, SIZE as u64)?;
            puts.push(ms(t));
        }
        let mut gets = Vec::new();
        for i in 0..3 {
            let t = Instant::now();
            store.get_into_device(&format!("first/{i}"), &*dev, SIZE as u64)?;
            gets.push(ms(t));
        }
        let locked_by_calls = store.stats().device_page_locked_bytes;
        let t = Instant::now();
        let locked = store.page_lock_segments();
        let lock_rest = ms(t);
        let t = Instant::now();
        drop(store);
        rows.push(format!(
            "  {{\"page_locking\":\"{name}\",\"segment_bytes\":{segment},\"device_put_ms\":[{}],\"device_get_ms\":[{}],\
             \"page_locked_by_the_calls\":{locked_by_calls},\"page_lock_segments_ms\":{lock_rest},\
             \"page_locked_after\":{locked},\"drop_ms\":{}}}",
            puts.join(","),
            gets.join(","),
            ms(t)
        ));
    }
    Ok(format!("{{\"device\":\"{}\",\"rows\":[\n{}\n]}}", dev.location(), rows.join(",\n")))
}

fn main() {
    let a = parse_args();
    if let Some(segment) = a.first_call {
        match first_call(&a, segment) {
            Ok(json) => println!("{json}"),
            Err(e) => {
                eprintln!("gpu_store --first-call: {e}");
                std::process::exit(1);
            }
        }
        return;
    }
    if a.bench {
        match bench(&a) {
            Ok(json) => println!("{json}"),
            Err(e) => {
                let no_gpu = e
                    .downcast_ref::<GpuError>()
                    .is_some_and(|g| matches!(g, GpuError::NoGpu(_) | GpuError::CudaUnavailable(_)));
                if no_gpu {
                    eprintln!("gpu_store --bench: {e}; the bench needs a GPU, nothing to measure (exit 2)");
                    std::process::exit(2);
                }
                eprintln!("gpu_store --bench: {e}");
                std::process::exit(1);
            }
        }
        return;
    }
    if let Err(e) = demo(a.device) {
        eprintln!("gpu_store: {e}");
        std::process::exit(1);
    }
}
