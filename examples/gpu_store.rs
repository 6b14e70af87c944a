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
//! Bench mode (needs a GPU; exits 2 with a message without one): times the
//! store -> GPU path (`get_into_device`, `batch_get_into_device`) against a
//! plain `cuMemcpyHtoD` from pageable memory and an async HtoD from pinned
//! memory (the PCIe ceiling), per object size, and prints one JSON document:
//!
//! `cargo run --release --example gpu_store -- --bench [--iters N] [--device D]`

use std::sync::Arc;
use std::time::Instant;

use mooncake_core::gpu::{
    allocate_or_emulate, DeviceBuffer, DeviceMemory, GpuError, GpuTransport, HostDeviceMemory, MemoryLocation,
};
use mooncake_core::{Error, ReplicateConfig, Store};

fn kv_block(layer: usize, block: usize, len: usize) -> Vec<u8> {
    (0..len).map(|i| (layer * 131 + block * 17 + i / 7) as u8).collect()
}

struct Args {
    bench: bool,
    iters: usize,
    device: usize,
}

fn parse_args() -> Args {
    let mut a = Args { bench: false, iters: 20, device: 0 };
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
            "-h" | "--help" => {
                eprintln!("usage: gpu_store [--bench [--iters N] [--device D]]");
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
    bytes as f64 / secs / 1e9
}

fn bench(a: &Args) -> Result<String, Box<dyn std::error::Error>> {
    let sizes: [usize; 4] = [1 << 20, 4 << 20, 16 << 20, 64 << 20];
    let max = *sizes.iter().max().expect("sizes");
    let batch = 8;
    let dst = DeviceBuffer::new(a.device, max * batch)?;
    let store = Store::builder().global_segment_size((max * batch * 2) as u64 + (256 << 20)).build()?;
    let mut rows = Vec::new();
    for &size in &sizes {
        let keys: Vec<String> = (0..batch).map(|i| format!("bench/{size}/{i}")).collect();
        for (i, k) in keys.iter().enumerate() {
            store.put(k, &kv_block(i, size, size))?;
        }
        // Warm-up (staging pool, streams, page faults of the segment).
        store.get_into_device(&keys[0], &dst, 0)?;

        let t = Instant::now();
        for i in 0..a.iters {
            store.get_into_device(&keys[i % batch], &dst, 0)?;
        }
        let single = gbps(size * a.iters, t.elapsed().as_secs_f64());

        let items: Vec<(&str, u64)> = keys.iter().enumerate().map(|(i, k)| (k.as_str(), (i * size) as u64)).collect();
        let rounds = a.iters.div_ceil(batch).max(1);
        let t = Instant::now();
        for _ in 0..rounds {
            for r in store.batch_get_into_device(&items, &dst) {
                r?;
            }
        }
        let batched = gbps(size * batch * rounds, t.elapsed().as_secs_f64());

        // Host-only part of the path: the store read into host memory.
        let mut host = vec![0u8; size];
        let t = Instant::now();
        for i in 0..a.iters {
            store.get_into(&keys[i % batch], &mut host)?;
        }
        let host_get = gbps(size * a.iters, t.elapsed().as_secs_f64());

        // References: cuMemcpyHtoD from pageable memory, and an async HtoD
        // from pinned memory (what the DMA engine can do).
        dst.upload(&host)?;
        let t = Instant::now();
        for _ in 0..a.iters {
            dst.upload(&host)?;
        }
        let pageable = gbps(size * a.iters, t.elapsed().as_secs_f64());
        let pinned = dst.alloc_pinned(size)?;
        let mut stream = dst.open_stream()?;
        let t = Instant::now();
        for _ in 0..a.iters {
            // SAFETY: `pinned` outlives the stream and is not written while
            // the copies run (synchronized right after).
            unsafe { stream.copy_to_device_async(pinned.as_ptr(), size, 0)? };
            stream.synchronize()?;
        }
        let pinned_gbps = gbps(size * a.iters, t.elapsed().as_secs_f64());
        drop(stream);

        rows.push(format!(
            "{{\"object_bytes\":{size},\"iters\":{},\"get_into_device_gbps\":{single:.3},\
             \"batch_get_into_device_gbps\":{batched:.3},\"store_get_into_host_gbps\":{host_get:.3},\
             \"htod_pageable_gbps\":{pageable:.3},\"htod_pinned_gbps\":{pinned_gbps:.3},\
             \"get_into_device_vs_pinned\":{:.3},\"batch_vs_pinned\":{:.3}}}",
            a.iters,
            single / pinned_gbps,
            batched / pinned_gbps,
        ));
        for k in &keys {
            let _ = store.remove(k);
        }
    }
    Ok(format!(
        "{{\"bench\":\"gpu_store\",\"device\":{},\"batch\":{batch},\"rows\":[\n  {}\n]}}",
        a.device,
        rows.join(",\n  ")
    ))
}

fn main() {
    let a = parse_args();
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
