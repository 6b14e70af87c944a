//! GPU memory as a `get_into` target and a `put` source of the store, over the
//! host emulation of device memory (CI has no GPU): `get_into_device`,
//! `put_from_device` and their batch forms, and device memory mounted as a
//! store segment through `GpuTransport` plugged into `StoreBuilder::transport`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use mooncake_core::gpu::{
    allocate_or_emulate, cuda_available, DeviceBuffer, DeviceMemory, GpuError, GpuTransport, HostDeviceMemory,
    MemoryLocation,
};
use mooncake_core::{Error, Master, MasterConfig, Protocol, ReplicateConfig, Store};
use mooncake_transfer::{TransferError, TransferRequest, Transport};

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn store(segment: u64) -> Store {
    Store::builder().global_segment_size(segment).build().unwrap()
}

fn device(len: u64) -> HostDeviceMemory {
    HostDeviceMemory::new(len).unwrap()
}

#[test]
fn kv_sizes_round_trip_through_device_memory() {
    let store = store(64 << 20);
    let src = device(16 << 20);
    let dst = device(16 << 20);
    for (i, len) in [64usize << 10, (256 << 10) + 1, 1 << 20, (4 << 20) + 3, 8 << 20].into_iter().enumerate() {
        let data = pattern(i as u64, len);
        let (src_off, dst_off) = (1000 * i as u64 + 7, 4096 * i as u64);
        src.copy_from_host(src_off, &data).unwrap();
        let key = format!("kv/{len}");
        store.put_from_device(&key, &src, src_off, len as u64).unwrap();
        // What the store holds is exactly the device bytes.
        assert!(store.get(&key).unwrap()[..] == data[..], "{len}: stored bytes");
        assert_eq!(store.get_into_device(&key, &dst, dst_off).unwrap(), len);
        let all = dst.to_vec();
        assert!(all[dst_off as usize..dst_off as usize + len] == data[..], "{len}: device bytes");
        // Nothing around the target range was touched.
        assert!(all[..dst_off as usize].iter().all(|&b| b == 0), "{len}: bytes before the range");
        assert!(all[dst_off as usize + len..].iter().all(|&b| b == 0), "{len}: bytes after the range");
        dst.with_bytes_mut(|b| b.fill(0));
    }
    // An embedded store maps its own segment: every object went in one DMA into
    // it (put) and out of it (get), page-locked once, with no staging copy.
    let total: u64 = [64u64 << 10, (256 << 10) + 1, 1 << 20, (4 << 20) + 3, 8 << 20].iter().sum();
    let s = store.stats();
    assert_eq!((s.device_direct_bytes, s.device_staged_bytes), (2 * total, 0));
}

#[test]
fn small_and_boundary_sizes_and_changing_sizes() {
    let store = store(32 << 20);
    let dst = device(8 << 20);
    // 1 byte, staging-class boundaries (64 KiB classes and powers of two), and
    // sizes that alternate so the staging size guess misses both ways.
    let sizes = [1usize, 65_535, 65_536, 65_537, 3 << 20, 10, (1 << 20) + 1, 2 << 20, 1];
    for (i, len) in sizes.into_iter().enumerate() {
        let data = pattern(100 + i as u64, len);
        let key = format!("b/{i}");
        store.put(&key, &data).unwrap();
        let off = (8 << 20) - len as u64; // flush with the end of device memory
        assert_eq!(store.get_into_device(&key, &dst, off).unwrap(), len);
        assert!(dst.to_vec()[off as usize..] == data[..], "size {len}");
    }
}

#[test]
fn device_ranges_outside_the_memory_are_errors_not_panics() {
    let store = store(16 << 20);
    let mem = device(1 << 20);
    store.put("obj", &pattern(1, 100_000)).unwrap();

    // Offset beyond the end.
    assert!(matches!(store.get_into_device("obj", &mem, (1 << 20) + 1), Err(Error::InvalidArgument(_))));
    assert!(matches!(store.get_into_device("obj", &mem, u64::MAX), Err(Error::InvalidArgument(_))));
    // At the end / too close to it: the object does not fit.
    match store.get_into_device("obj", &mem, 1 << 20) {
        Err(Error::BufferTooSmall { needed: 100_000, capacity: 0 }) => {}
        other => panic!("expected BufferTooSmall, got {other:?}"),
    }
    match store.get_into_device("obj", &mem, (1 << 20) - 99_999) {
        Err(Error::BufferTooSmall { needed: 100_000, capacity: 99_999 }) => {}
        other => panic!("expected BufferTooSmall, got {other:?}"),
    }
    assert!(mem.to_vec().iter().all(|&b| b == 0), "nothing copied on errors");
    assert!(matches!(store.get_into_device("missing", &mem, 0), Err(Error::NotFound(_))));

    // Puts from outside the device memory, or of nothing.
    for (off, len) in [(1u64 << 20, 1u64), ((1 << 20) - 10, 11), (u64::MAX, 2), (0, (1 << 20) + 1)] {
        let r = store.put_from_device("p", &mem, off, len);
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "{off}+{len}: {r:?}");
    }
    assert!(matches!(store.put_from_device("p", &mem, 0, 0), Err(Error::InvalidArgument(_))));
    assert!(!store.exists("p").unwrap(), "a refused put stores nothing");
    store.put_from_device("p", &mem, (1 << 20) - 10, 10).unwrap();
    assert_eq!(store.get("p").unwrap().len(), 10);
    // Objects are immutable through this path too.
    assert!(matches!(store.put_from_device("p", &mem, 0, 10), Err(Error::AlreadyExists(_))));
}

#[test]
fn put_from_device_with_replicas() {
    let master = Master::new(MasterConfig::default()).unwrap();
    let a = Store::builder().master(&master).global_segment_size(16 << 20).build().unwrap();
    let b = Store::builder().master(&master).global_segment_size(16 << 20).build().unwrap();
    let mem = device(4 << 20);
    let data = pattern(5, 3 << 20);
    mem.copy_from_host(0, &data).unwrap();
    a.put_from_device_with("r2", &mem, 0, data.len() as u64, &ReplicateConfig::replicas(2)).unwrap();
    drop(a); // one replica survives on b's segment
    let out = device(4 << 20);
    assert_eq!(b.get_into_device("r2", &out, 1 << 20).unwrap(), data.len());
    assert!(out.to_vec()[1 << 20..] == data[..]);
}

#[test]
fn batch_get_into_device_pipelines_and_reports_per_item() {
    let store = store(64 << 20);
    let dst = device(32 << 20);
    let lens = [64usize << 10, 1 << 20, 3, (2 << 20) + 5, 8 << 20, 100_000];
    let mut items: Vec<(String, u64)> = Vec::new();
    let mut off = 0u64;
    for (i, &len) in lens.iter().enumerate() {
        let key = format!("bg/{i}");
        store.put(&key, &pattern(200 + i as u64, len)).unwrap();
        items.push((key, off));
        off += len as u64 + 17;
    }
    items.insert(2, ("bg/missing".into(), 0));
    items.push(("bg/0".into(), (32 << 20) - 10)); // does not fit
    items.push(("bg/1".into(), (32 << 20) + 1)); // offset beyond the memory
    let refs: Vec<(&str, u64)> = items.iter().map(|(k, o)| (k.as_str(), *o)).collect();
    let res = store.batch_get_into_device(&refs, &dst);
    assert_eq!(res.len(), refs.len());
    assert!(matches!(res[2], Err(Error::NotFound(_))));
    assert!(matches!(res[refs.len() - 2], Err(Error::BufferTooSmall { .. })));
    assert!(matches!(res[refs.len() - 1], Err(Error::InvalidArgument(_))));
    let all = dst.to_vec();
    let mut lens_iter = lens.iter().enumerate();
    for (j, (key, off)) in items.iter().enumerate() {
        if j == 2 || j >= refs.len() - 2 {
            continue;
        }
        let (i, &len) = lens_iter.next().unwrap();
        assert_eq!(res[j].as_ref().copied().unwrap(), len, "{key}");
        assert!(all[*off as usize..*off as usize + len] == pattern(200 + i as u64, len)[..], "{key}");
    }
    assert!(store.batch_get_into_device(&[], &dst).is_empty());
}

#[test]
fn batch_put_from_device_pipelines_and_reports_per_item() {
    let store = store(64 << 20);
    let src = device(24 << 20);
    let data = pattern(9, 24 << 20);
    src.copy_from_host(0, &data).unwrap();
    let items: Vec<(String, u64, u64)> = vec![
        ("bp/0".into(), 0, 64 << 10),
        ("bp/1".into(), 100, 1 << 20),
        ("bp/bad".into(), (24 << 20) - 5, 6), // out of the device memory
        ("bp/2".into(), 5 << 20, 8 << 20),
        ("bp/3".into(), 1, 1),
        ("bp/1".into(), 0, 10), // exists already
        ("bp/4".into(), (24 << 20) - 4097, 4097),
    ];
    let refs: Vec<(&str, u64, u64)> = items.iter().map(|(k, o, l)| (k.as_str(), *o, *l)).collect();
    let res = store.batch_put_from_device(&refs, &src, &ReplicateConfig::default());
    assert!(matches!(res[2], Err(Error::InvalidArgument(_))), "{:?}", res[2]);
    assert!(matches!(res[5], Err(Error::AlreadyExists(_))), "{:?}", res[5]);
    for (j, (key, off, len)) in items.iter().enumerate() {
        if j == 2 || j == 5 {
            continue;
        }
        assert!(res[j].is_ok(), "{key}: {:?}", res[j]);
        let got = store.get(key).unwrap();
        assert!(got[..] == data[*off as usize..(*off + *len) as usize], "{key}");
    }
    assert!(!store.exists("bp/bad").unwrap());
}

#[test]
fn concurrent_device_gets_and_puts_share_the_staging_pool() {
    let store = store(128 << 20);
    let threads: Vec<_> = (0..6u64)
        .map(|t| {
            let store = store.clone();
            std::thread::spawn(move || {
                let mem = device(8 << 20);
                for round in 0..5u64 {
                    let len = ((t + 1) * (round + 1) * 97_531) as usize % (4 << 20) + 1;
                    let data = pattern(t * 100 + round, len);
                    mem.copy_from_host(0, &data).unwrap();
                    let key = format!("c/{t}/{round}");
                    store.put_from_device(&key, &mem, 0, len as u64).unwrap();
                    mem.with_bytes_mut(|b| b.fill(0));
                    assert_eq!(store.get_into_device(&key, &mem, 4 << 20).unwrap(), len);
                    assert!(mem.to_vec()[4 << 20..(4 << 20) + len] == data[..], "thread {t} round {round}");
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

// --- Device memory as a store segment, through the Transport trait ----------

/// A user-defined transport: counts the bytes it hands to the GPU transport.
struct Counting {
    inner: Arc<GpuTransport>,
    bytes: AtomicU64,
}

impl Transport for Counting {
    fn name(&self) -> &str {
        "counting-gpu"
    }
    fn can_reach(&self, endpoint: &str) -> bool {
        self.inner.can_reach(endpoint)
    }
    fn transfer(&self, requests: &mut [TransferRequest<'_>]) -> Vec<mooncake_transfer::Result<()>> {
        let n: usize = requests.iter().map(|r| r.op.len()).sum();
        self.bytes.fetch_add(n as u64, Ordering::Relaxed);
        self.inner.transfer(requests)
    }
}

#[test]
fn device_memory_mounted_as_a_segment_through_a_user_transport() {
    // Small staging chunks, so objects cross many chunk boundaries.
    let chunk = 4096;
    let gpu = Arc::new(GpuTransport::with_staging(chunk, 2).unwrap());
    let counting = Arc::new(Counting { inner: gpu.clone(), bytes: AtomicU64::new(0) });
    // No DRAM segment: the device memory below is the only place objects can go.
    let store = Store::builder().global_segment_size(0).transport(counting.clone()).build().unwrap();
    let hbm = Arc::new(device(16 << 20));
    let region = gpu.register(hbm.clone()).unwrap();
    let segment = store.master().mount_segment(store.client_id(), &region, hbm.len()).unwrap();

    let sizes = [1usize, chunk - 1, chunk, chunk + 1, 2 * chunk, 3 * chunk + 7, 1 << 20, (4 << 20) + 3];
    for (i, &len) in sizes.iter().enumerate() {
        let data = pattern(300 + i as u64, len);
        let key = format!("hbm/{i}");
        store.put(&key, &data).unwrap();
        // The bytes are in device memory, where the master placed them.
        let info = store.master().object_info(&key).unwrap();
        assert_eq!(info.replicas.len(), 1);
        assert_eq!(info.replicas[0].segment, segment);
        let at = info.replicas[0].offset as usize;
        assert!(hbm.to_vec()[at..at + len] == data[..], "{len}: bytes in device memory");
        // And come back through the transport, checksum-verified.
        assert!(store.get(&key).unwrap()[..] == data[..], "{len}: get");
        // Device (segment) -> host staging -> another device buffer.
        let other = device(8 << 20);
        assert_eq!(store.get_into_device(&key, &other, 0).unwrap(), len);
        assert!(other.to_vec()[..len] == data[..]);
    }
    let moved: u64 = sizes.iter().map(|&l| l as u64).sum::<u64>() * 3; // put + get + get_into_device
    assert_eq!(counting.bytes.load(Ordering::Relaxed), moved);
    let gpu_stats = gpu.stats().unwrap().snapshot("gpu");
    assert_eq!(gpu_stats.bytes_written, moved / 3);
    assert_eq!(gpu_stats.bytes_read, 2 * moved / 3);
    assert_eq!(gpu_stats.errors, 0);
}

#[test]
fn gpu_transport_plugs_into_the_store_builder_and_leaves_host_segments_alone() {
    let gpu = Arc::new(GpuTransport::new());
    let store = Store::builder().global_segment_size(8 << 20).transport(gpu.clone()).build().unwrap();
    store.put("host-object", &pattern(1, 50_000)).unwrap();
    assert_eq!(store.get("host-object").unwrap()[..], pattern(1, 50_000)[..]);
    let s = gpu.stats().unwrap().snapshot("gpu");
    assert_eq!((s.bytes_read, s.bytes_written), (0, 0), "host segments are not the GPU transport's");
}

// --- Without a GPU ---------------------------------------------------------

#[test]
fn without_cuda_the_typed_error_maps_into_the_store_error() {
    if cuda_available() {
        eprintln!("note: a GPU is present; the no-GPU path is not exercised here");
        return;
    }
    let e = std::panic::catch_unwind(|| DeviceBuffer::new(0, 1 << 20)).expect("no panic").unwrap_err();
    assert!(matches!(e, GpuError::NoGpu(_)), "{e:?}");
    match Error::from(e) {
        Error::Transport(TransferError::Io(msg)) => assert!(msg.contains("no GPU"), "{msg}"),
        other => panic!("expected Transport(Io), got {other:?}"),
    }
    assert!(matches!(Error::from(GpuError::OutOfBounds("x".into())), Error::InvalidArgument(_)));
    assert!(matches!(
        Error::from(GpuError::BufferTooSmall { need: 5, got: 4 }),
        Error::BufferTooSmall { needed: 5, capacity: 4 }
    ));
    // The fallback the example uses: emulated device memory, same store API.
    let (mem, why) = allocate_or_emulate(0, 1 << 20).unwrap();
    assert_eq!(mem.location(), MemoryLocation::Emulated);
    assert!(why.is_some());
    let store = store(8 << 20);
    store.put("k", b"bytes for the emulated gpu").unwrap();
    assert_eq!(store.get_into_device("k", &*mem, 10).unwrap(), 26);
    let mut back = [0u8; 26];
    mem.copy_to_host(10, &mut back).unwrap();
    assert_eq!(&back, b"bytes for the emulated gpu");
}

#[test]
fn over_tcp_device_memory_is_staged_as_before() {
    // `Protocol::Tcp` reaches every peer over TCP, in-process ones too.
    let master = Master::new(MasterConfig::default()).unwrap();
    let tcp = |segment: u64| {
        let b = Store::builder().master(&master).protocol(Protocol::Tcp).global_segment_size(segment);
        if segment > 0 { b.listen("127.0.0.1:0") } else { b }.build().unwrap()
    };
    let (node, client) = (tcp(32 << 20), tcp(0));
    let (src, dst) = (device(8 << 20), device(8 << 20));
    let data = pattern(77, (3 << 20) + 5);
    src.copy_from_host(11, &data).unwrap();
    client.put_from_device("tcp/obj", &src, 11, data.len() as u64).unwrap();
    assert!(node.get("tcp/obj").unwrap()[..] == data[..]);
    assert_eq!(client.get_into_device("tcp/obj", &dst, 1 << 20).unwrap(), data.len());
    assert!(dst.to_vec()[1 << 20..(1 << 20) + data.len()] == data[..]);
    let s = client.stats();
    assert_eq!((s.device_direct_bytes, s.device_staged_bytes), (0, 2 * data.len() as u64));
    // A failed get moves (and counts) nothing.
    assert!(matches!(client.get_into_device("tcp/none", &dst, 0), Err(Error::NotFound(_))));
    assert_eq!(client.stats().device_staged_bytes, 2 * data.len() as u64);
}

/// Objects read over TCP into device memory stream through two pinned chunks
/// that take turns: objects larger than a chunk, pieces of several objects in one
/// chunk, a 1-byte object, two device memories, and a corrupted replica (failed
/// on the device bytes, the others unharmed) all come out exact.
#[test]
fn over_tcp_objects_stream_into_device_memory_through_two_chunks() {
    let master = Master::new(MasterConfig::default()).unwrap();
    let tcp = |segment: u64| {
        let b = Store::builder().master(&master).protocol(Protocol::Tcp).global_segment_size(segment);
        if segment > 0 { b.listen("127.0.0.1:0") } else { b }.build().unwrap()
    };
    let (node, client) = (tcp(96 << 20), tcp(0));
    let sizes = [(3 << 20) + 1, 7 << 20, 1, (5 << 20) + 4095, 9 << 20];
    let keys: Vec<String> = (0..sizes.len()).map(|i| format!("stream/{i}")).collect();
    let data: Vec<Vec<u8>> = sizes.iter().enumerate().map(|(i, &n)| pattern(300 + i as u64, n)).collect();
    for (k, d) in keys.iter().zip(&data) {
        node.put(k, d).unwrap();
    }
    let (a, b) = (device(16 << 20), device(16 << 20));
    // Objects 0..3 into `a`, 3.. into `b`, each at its own offset.
    let mut at = [0u64; 5];
    let (mut on_a, mut on_b) = (5u64, 3u64);
    for i in 0..sizes.len() {
        let slot = if i < 3 { &mut on_a } else { &mut on_b };
        at[i] = *slot;
        *slot += sizes[i] as u64 + 11;
    }
    let mem = |i: usize| -> &dyn mooncake_core::gpu::DeviceMemory {
        if i < 3 {
            &a
        } else {
            &b
        }
    };
    let items: Vec<(&str, &dyn mooncake_core::gpu::DeviceMemory, u64)> =
        (0..sizes.len()).map(|i| (keys[i].as_str(), mem(i), at[i])).collect();
    let got = client.batch_get_into_devices(&items);
    let (va, vb) = (a.to_vec(), b.to_vec());
    for i in 0..sizes.len() {
        assert_eq!(*got[i].as_ref().unwrap(), sizes[i], "object {i}");
        let v = if i < 3 { &va } else { &vb };
        assert!(v[at[i] as usize..at[i] as usize + sizes[i]] == data[i][..], "object {i}: device bytes");
    }
    assert_eq!(client.stats().device_staged_bytes, sizes.iter().sum::<usize>() as u64);
    // Every object's check chained behind its memory's last copies.
    assert_eq!((a.chained_sums(), b.chained_sums()), (3, 2));
    // One replica corrupted: that object fails its checksum on the device bytes;
    // the others read exactly as before.
    let info = client.master().object_info(&keys[1]).unwrap();
    let r = info.replicas[0];
    let region = client.master().segment_info(r.segment).unwrap().region;
    let t = mooncake_transfer::TcpTransport::new();
    let mut byte = [0u8; 1];
    let mut reqs = [TransferRequest::read(&region, r.offset + (6 << 20), &mut byte)];
    assert!(t.transfer(&mut reqs).into_iter().all(|x| x.is_ok()));
    byte[0] ^= 0x5a;
    let mut reqs = [TransferRequest::write(&region, r.offset + (6 << 20), &byte)];
    assert!(t.transfer(&mut reqs).into_iter().all(|x| x.is_ok()));
    a.with_bytes_mut(|m| m.fill(0));
    b.with_bytes_mut(|m| m.fill(0));
    let got = client.batch_get_into_devices(&items);
    assert!(matches!(got[1], Err(Error::Corrupted(_))), "{:?}", got[1]);
    let (va, vb) = (a.to_vec(), b.to_vec());
    for i in [0, 2, 3, 4] {
        assert_eq!(*got[i].as_ref().unwrap(), sizes[i], "object {i}");
        let v = if i < 3 { &va } else { &vb };
        assert!(v[at[i] as usize..at[i] as usize + sizes[i]] == data[i][..], "object {i}: device bytes after");
    }
}

/// Two scatters of one call that start at the same device address (the same
/// first layer, different tails, as a framework's per-layer blocks can be) are
/// two memories: each object gets its own bytes, over TCP (streamed) and in
/// the store's own segment (one DMA).
#[test]
fn scatters_sharing_a_start_address_keep_their_own_bytes() {
    use mooncake_core::gpu::DeviceScatter;
    let master = Master::new(MasterConfig::default()).unwrap();
    let _node = Store::builder()
        .master(&master)
        .protocol(Protocol::Tcp)
        .global_segment_size(16 << 20)
        .listen("127.0.0.1:0")
        .build()
        .unwrap();
    let client = Store::builder().master(&master).protocol(Protocol::Tcp).global_segment_size(0).build().unwrap();
    let local = store(16 << 20);
    let (a, b, c) = (Arc::new(device(4096)), Arc::new(device(4096)), Arc::new(device(4096)));
    let (pa, pb, pc) = (pattern(1, 4096), pattern(2, 4096), pattern(3, 4096));
    a.copy_from_host(0, &pa).unwrap();
    b.copy_from_host(0, &pb).unwrap();
    c.copy_from_host(0, &pc).unwrap();
    let two = |tail: &Arc<HostDeviceMemory>| {
        DeviceScatter::new(vec![(a.clone() as Arc<dyn DeviceMemory>, 0, 1000), (tail.clone(), 0, 500)]).unwrap()
    };
    let (s1, s2) = (two(&b), two(&c));
    let want1 = [&pa[..1000], &pb[..500]].concat();
    let want2 = [&pa[..1000], &pc[..500]].concat();
    for (name, st) in [("tcp", &client), ("local", &local)] {
        let (k1, k2) = (format!("{name}/s1"), format!("{name}/s2"));
        let items: [(&str, &dyn DeviceMemory, u64, u64); 2] = [(&k1, &s1, 0, 1500), (&k2, &s2, 0, 1500)];
        assert!(st.batch_put_from_devices(&items, &ReplicateConfig::default()).iter().all(|r| r.is_ok()));
        assert_eq!(st.get(&k1).unwrap()[..], want1[..], "{name}: first object");
        assert_eq!(st.get(&k2).unwrap()[..], want2[..], "{name}: second object");
        // And back into two scatters sharing a start address.
        let (d, e, f) = (Arc::new(device(4096)), Arc::new(device(4096)), Arc::new(device(4096)));
        let back = |tail: &Arc<HostDeviceMemory>| {
            DeviceScatter::new(vec![(d.clone() as Arc<dyn DeviceMemory>, 0, 1000), (tail.clone(), 0, 500)]).unwrap()
        };
        let (t1, t2) = (back(&e), back(&f));
        let got = st.batch_get_into_devices(&[(&k1, &t1, 0), (&k2, &t2, 0)]);
        assert!(got.iter().all(|r| r.as_ref().is_ok_and(|&n| n == 1500)), "{name}: {got:?}");
        assert_eq!(e.to_vec()[..500], pb[..500], "{name}: first tail");
        assert_eq!(f.to_vec()[..500], pc[..500], "{name}: second tail");
    }
}

#[test]
fn a_replica_in_a_mapped_segment_moves_in_one_dma_and_a_tcp_one_is_staged() {
    // Same host, other store: its segment is reached by shared memory (mapped into
    // this process), so a device put or get is one DMA into or out of it; over TCP
    // the same calls stage through pinned buffers. The decision is the store's,
    // per replica, whichever way the device memory is (emulated here).
    let daemon = mooncake_core::MasterDaemon::builder("127.0.0.1:0").serve().unwrap();
    let addr = daemon.local_addr().to_string();
    let shm = |segment: u64| {
        let shm: Arc<dyn Transport> = Arc::new(mooncake_transfer::ShmTransport::new());
        let b = Store::builder().master_address(&addr).protocol(Protocol::Shm).transport(shm);
        b.global_segment_size(segment).listen("127.0.0.1:0").build().unwrap()
    };
    let (node, client) = (shm(32 << 20), shm(0));
    let (src, dst) = (device(8 << 20), device(8 << 20));
    let data = pattern(91, (2 << 20) + 9);
    src.copy_from_host(5, &data).unwrap();
    client.put_from_device("shm/obj", &src, 5, data.len() as u64).unwrap();
    assert!(node.get("shm/obj").unwrap()[..] == data[..], "the DMA wrote the node's segment");
    assert_eq!(client.get_into_device("shm/obj", &dst, 64).unwrap(), data.len());
    assert!(dst.to_vec()[64..64 + data.len()] == data[..]);
    let s = client.stats();
    assert_eq!((s.device_direct_bytes, s.device_staged_bytes), (2 * data.len() as u64, 0));
    assert_eq!(dst.chained_sums(), 1, "the get's check was chained behind its DMA, one wait for both");
    // A corrupted replica in the mapped segment fails its checksum on the device
    // bytes: never returned.
    let info = client.master().object_info("shm/obj").unwrap();
    let r = info.replicas[0];
    let region = client.master().segment_info(r.segment).unwrap().region;
    let shm_t = mooncake_transfer::ShmTransport::new();
    let mut flip = [0u8; 1];
    let mut reqs = [TransferRequest::read(&region, r.offset + 1000, &mut flip)];
    assert!(shm_t.transfer(&mut reqs).into_iter().all(|x| x.is_ok()));
    flip[0] ^= 0xff;
    let mut reqs = [TransferRequest::write(&region, r.offset + 1000, &flip)];
    assert!(shm_t.transfer(&mut reqs).into_iter().all(|x| x.is_ok()));
    assert!(matches!(client.get_into_device("shm/obj", &dst, 0), Err(Error::Corrupted(_))));
}

/// A batch read into several memories whose ranges are device ranges is summed
/// as one batch on the device where a GPU is; where none is, the device sum
/// declines and each memory's stream sums its own, every object still checked.
#[test]
fn a_batch_into_several_device_memories_is_checked_without_a_gpu_too() {
    if cuda_available() {
        println!("a GPU is present: the batched path is tested by mooncake-gpu's CUDA tests");
        return;
    }
    let master = Master::new(MasterConfig::default()).unwrap();
    let b = Store::builder().master(&master).protocol(Protocol::Shm);
    let node = b.global_segment_size(32 << 20).listen("127.0.0.1:0").build().unwrap();
    let b = Store::builder().master(&master).protocol(Protocol::Shm);
    let client = b.global_segment_size(0).build().unwrap();
    let mems: Vec<HostDeviceMemory> = (0..3).map(|_| device(1 << 20).with_device_ranges(0)).collect();
    let data: Vec<Vec<u8>> = (0..3).map(|i| pattern(600 + i, 300_000 + i as usize)).collect();
    let keys: Vec<String> = (0..3).map(|i| format!("claims/{i}")).collect();
    for (k, d) in keys.iter().zip(&data) {
        node.put(k, d).unwrap();
    }
    let items: Vec<(&str, &dyn DeviceMemory, u64)> =
        (0..3).map(|i| (keys[i].as_str(), &mems[i] as &dyn DeviceMemory, 7)).collect();
    for (i, got) in client.batch_get_into_devices(&items).into_iter().enumerate() {
        assert_eq!(got.unwrap(), data[i].len(), "object {i}");
        assert!(mems[i].to_vec()[7..7 + data[i].len()] == data[i][..], "object {i}: device bytes");
        assert_eq!(mems[i].chained_sums(), 1, "object {i}: summed behind its own copies");
    }
    assert_eq!(client.stats().device_direct_bytes, data.iter().map(|d| d.len() as u64).sum::<u64>());
}

/// What the Python binding does with a framework's per-layer KV tensors: the layers
/// of one block, borrowed ranges of device memory (emulated here), seen as one
/// `DeviceScatter` by the store's device API: one object in, one object out, and an
/// object larger than the parts refused without a byte written.
#[test]
fn per_layer_ranges_as_one_scatter_through_the_device_api() {
    use mooncake_core::gpu::{DeviceScatter, EmulatedPointers, PointerClassifier};
    let store = store(16 << 20);
    let layers = 4;
    let block = 10_000;
    // Two "tensors" of `layers` blocks each: the source and the destination.
    let mut src_t = vec![0u8; layers * 2 * block];
    let mut dst_t = vec![0u8; layers * 2 * block];
    let want: Vec<u8> = (0..layers).flat_map(|l| pattern(l as u64, block)).collect();
    for l in 0..layers {
        src_t[l * 2 * block..][..block].copy_from_slice(&want[l * block..][..block]);
    }
    let pointers = EmulatedPointers::default();
    // SAFETY: both vectors outlive `pointers` and every borrow below, and are read
    // here only after the store's calls returned.
    unsafe {
        pointers.declare(src_t.as_mut_ptr() as u64, src_t.len() as u64, 0).unwrap();
        pointers.declare(dst_t.as_mut_ptr() as u64, dst_t.len() as u64, 0).unwrap();
    }
    let parts = |base: u64, n: usize, len: u64| -> DeviceScatter {
        let ranges = (0..n).map(|l| (pointers.borrow(base + (l * 2 * block) as u64, len).unwrap(), 0, len)).collect();
        DeviceScatter::new(ranges).unwrap()
    };
    let src = parts(src_t.as_ptr() as u64, layers, block as u64);
    store.put_from_device("req/block0", &src, 0, (layers * block) as u64).unwrap();
    assert_eq!(store.get("req/block0").unwrap()[..], want[..]);
    // One DMA into the store's own segment.
    assert_eq!(store.stats().device_direct_bytes, (layers * block) as u64);

    // Three parts are too few: BufferTooSmall, nothing written.
    let short = parts(dst_t.as_ptr() as u64, layers - 1, block as u64);
    assert!(matches!(store.get_into_device("req/block0", &short, 0), Err(Error::BufferTooSmall { .. })));
    drop(short);
    let dst = parts(dst_t.as_ptr() as u64, layers, block as u64);
    assert_eq!(store.get_into_device("req/block0", &dst, 0).unwrap(), layers * block);
    drop((dst, src));
    assert!(pointers.forget(src_t.as_ptr() as u64) && pointers.forget(dst_t.as_ptr() as u64));
    for l in 0..layers {
        assert_eq!(dst_t[l * 2 * block..][..block], want[l * block..][..block], "layer {l}");
        assert!(dst_t[l * 2 * block + block..][..block].iter().all(|&b| b == 0), "gap after layer {l} written");
    }
}

/// On a real GPU: a replica in the store's own segment moves to and from CUDA
/// device memory by DMA (the pieces of the segment it lies in page-locked once
/// each, one DMA per piece), counted as direct, with exact bytes: with the default
/// 64 MiB pieces, and with 1 MiB pieces, where every object lies across several
/// registrations of the driver's. Skipped, with a message, without a GPU.
#[test]
fn with_a_gpu_the_own_segment_moves_by_dma_piece_by_piece() {
    use mooncake_core::gpu::{DeviceBuffer, DeviceMemory};
    let dev = match DeviceBuffer::new(0, 16 << 20) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("note: skipping GPU test: {e}");
            return;
        }
    };
    for piece in [None, Some(1u64 << 20)] {
        let mut builder = Store::builder().global_segment_size(256 << 20);
        if let Some(piece) = piece {
            builder = builder.page_lock_piece(piece);
        }
        let store = builder.build().unwrap();
        for (i, len) in [(1usize << 20) + 5, 8 << 20, (3 << 20) + 4097].into_iter().enumerate() {
            let data = pattern(40 + i as u64, len);
            let mut stream = dev.open_stream().unwrap();
            // SAFETY: `data` outlives the copy, which is synchronized right away.
            unsafe { stream.copy_to_device_async(data.as_ptr(), len, 0).unwrap() };
            stream.synchronize().unwrap();
            drop(stream);
            let key = format!("gpu/{len}");
            store.put_from_device(&key, &dev, 0, len as u64).unwrap();
            assert!(store.get(&key).unwrap()[..] == data[..], "{piece:?} {len}: stored bytes");
            assert_eq!(store.get_into_device(&key, &dev, 4096).unwrap(), len);
            let mut back = vec![0u8; len];
            let mut stream = dev.open_stream().unwrap();
            // SAFETY: as above.
            unsafe { stream.copy_from_device_async(back.as_mut_ptr(), len, 4096).unwrap() };
            stream.synchronize().unwrap();
            assert!(back == data, "{piece:?} {len}: device bytes");
        }
        let s = store.stats();
        let total = 2 * ((1u64 << 20) + 5 + (8 << 20) + (3 << 20) + 4097);
        assert_eq!((s.device_direct_bytes, s.device_staged_bytes), (total, 0), "{piece:?}: not page-locked");
        assert!(s.device_page_locked_bytes > 0 && s.device_page_locked_bytes < 256 << 20, "{piece:?}");
        assert_eq!(store.page_lock_segments(), 256 << 20, "{piece:?}: the whole segment, locked now");
    }
}
