//! GPU page-size sweep: for page sizes 128/256/512
//! KiB and a few object sizes, pushes objects from a device producer buffer
//! into a `CudaDeviceHeap` with `NanoKvCache::put_from_device` (one wait: the
//! header write, the page copy and `nk_publish` in order on the heap's stream; `put_*`),
//! times `push_from_device` alone on plans from `open_for_write`
//! (`push_publish_*`), reads them back with the device reader kernels, and measures
//! `cuMemcpyDtoD` of the same sizes in the same run as the bandwidth reference.
//! Prints one JSON document on stdout.
//!
//! ```text
//! cargo run --release -p mooncake-gpu --example gpu_sweep -- [--iters N] [--heap-mb M] [--device D]
//! cargo run --release -p mooncake-gpu --example gpu_sweep -- --staging [--iters N] [--device D]
//! ```
//!
//! `--staging` sweeps instead the staged host <-> device path of
//! `GpuTransport` ([`Stager`]: pageable host memory copied in chunks through
//! two pinned buffers, double-buffered) over chunk sizes 1–16 MiB, against a
//! synchronous `cuMemcpyHtoD` from pageable memory and an async HtoD from
//! pinned memory (the DMA ceiling).
//!
//! Without a GPU it prints `gpu_sweep: no GPU: ...` on stderr and exits with
//! status 2.

use std::sync::Arc;
use std::time::Instant;

use mooncake_gpu::{CacheConfig, CudaDeviceHeap, DeviceBuffer, DeviceMemory, GpuError, KeyId, NanoKvCache, Stager};

struct Args {
    staging: bool,
    iters: usize,
    heap_mb: u64,
    device: usize,
}

fn parse_args() -> Args {
    let mut a = Args { staging: false, iters: 50, heap_mb: 8192, device: 0 };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = |name: &str| -> u64 {
            it.next().and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{name} needs a number"))
        };
        match flag.as_str() {
            "--iters" => a.iters = val("--iters").max(1) as usize,
            "--heap-mb" => a.heap_mb = val("--heap-mb").max(64),
            "--device" => a.device = val("--device") as usize,
            "--staging" => a.staging = true,
            "-h" | "--help" => {
                eprintln!("usage: gpu_sweep [--staging] [--iters N] [--heap-mb M] [--device D]");
                std::process::exit(0);
            }
            other => panic!("unknown argument {other}"),
        }
    }
    a
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn run(a: &Args) -> Result<String, GpuError> {
    let heap_bytes = a.heap_mb << 20;
    let heap = Arc::new(CudaDeviceHeap::new(a.device, 4096, heap_bytes)?);
    let sizes: [u64; 4] = [1 << 20, 4 << 20, 16 << 20, 64 << 20];
    let max = *sizes.iter().max().expect("sizes");
    let src = heap.alloc_buffer(max as usize)?;
    let dst = heap.alloc_buffer(max as usize)?;
    src.upload(&(0..max).map(|i| (i * 31 % 251) as u8).collect::<Vec<u8>>())?;
    let mut rows = Vec::new();
    for page_kb in [128u32, 256, 512] {
        let cfg = CacheConfig { page_size: page_kb << 10, ..Default::default() };
        let cache = NanoKvCache::new(heap.clone(), cfg)?;
        for &size in &sizes {
            if size * 4 > heap_bytes {
                continue;
            }
            // warm-up
            let plan = cache.open_for_write("warm", size)?;
            heap.push_from_device(&plan, src.ptr(), 0, plan.n_pages, true, cache.now_ns())?;
            cache.remove("warm")?;

            let mut put_us = Vec::with_capacity(a.iters);
            let mut push_us = Vec::with_capacity(a.iters);
            let t_all = Instant::now();
            for i in 0..a.iters {
                let key = format!("p{page_kb}/s{size}/{i}");
                let t0 = Instant::now();
                cache.put_from_device(&key, src.ptr(), size)?;
                put_us.push(t0.elapsed().as_secs_f64() * 1e6);
            }
            let put_s = t_all.elapsed().as_secs_f64();
            // The push and publish alone (a producer holding a plan).
            for i in 0..a.iters {
                let plan = cache.open_for_write(&format!("q{page_kb}/s{size}/{i}"), size)?;
                let t0 = Instant::now();
                heap.push_from_device(&plan, src.ptr(), 0, plan.n_pages, true, cache.now_ns())?;
                push_us.push(t0.elapsed().as_secs_f64() * 1e6);
            }

            let mut get_us = Vec::with_capacity(a.iters);
            for i in 0..a.iters {
                let key = format!("p{page_kb}/s{size}/{i}");
                let Ok(meta) = cache.get_location(&key) else { continue };
                let t0 = Instant::now();
                heap.read_into_device(&meta, &KeyId::of(&key), dst.ptr(), max)?;
                get_us.push(t0.elapsed().as_secs_f64() * 1e6);
            }
            let t0 = Instant::now();
            for _ in 0..a.iters {
                heap.memcpy_dtod(dst.ptr(), src.ptr(), size as usize)?;
            }
            let dtod_s = t0.elapsed().as_secs_f64();
            cache.evict_until_below(0.0);

            for v in [&mut put_us, &mut push_us, &mut get_us] {
                v.sort_by(|x, y| x.total_cmp(y));
            }
            let bytes = (size * a.iters as u64) as f64;
            let put_gbps = bytes / put_s / 1e9;
            let push_gbps = bytes / (push_us.iter().sum::<f64>() / 1e6) / 1e9;
            let get_gbps = (size as f64 * get_us.len() as f64) / (get_us.iter().sum::<f64>() / 1e6) / 1e9;
            let dtod_gbps = bytes / dtod_s / 1e9;
            rows.push(format!(
                "{{\"page_kb\":{page_kb},\"object_bytes\":{size},\"iters\":{},\
                 \"put_gbps\":{put_gbps:.3},\"put_p50_us\":{:.1},\"put_p99_us\":{:.1},\
                 \"push_publish_gbps\":{push_gbps:.3},\"push_publish_p50_us\":{:.1},\
                 \"get_device_gbps\":{get_gbps:.3},\"get_p50_us\":{:.1},\"get_p99_us\":{:.1},\
                 \"dtod_gbps\":{dtod_gbps:.3},\"put_vs_dtod\":{:.3},\"get_vs_dtod\":{:.3}}}",
                a.iters,
                pct(&put_us, 0.5),
                pct(&put_us, 0.99),
                pct(&push_us, 0.5),
                pct(&get_us, 0.5),
                pct(&get_us, 0.99),
                put_gbps / dtod_gbps,
                get_gbps / dtod_gbps,
            ));
        }
    }
    Ok(format!(
        "{{\"bench\":\"gpu_sweep\",\"device\":{},\"heap_bytes\":{heap_bytes},\"rows\":[\n  {}\n]}}",
        a.device,
        rows.join(",\n  ")
    ))
}

/// Staged (chunked, double-buffered) host <-> device copies vs plain copies.
fn run_staging(a: &Args) -> Result<String, GpuError> {
    let sizes: [usize; 3] = [4 << 20, 16 << 20, 64 << 20];
    let max = *sizes.iter().max().expect("sizes");
    let buf = DeviceBuffer::new(a.device, max)?;
    let host: Vec<u8> = (0..max).map(|i| (i * 31 % 251) as u8).collect();
    let mut back = vec![0u8; max];
    let pinned = buf.alloc_pinned(max)?;
    let gbps = |bytes: usize, s: f64| bytes as f64 / s / 1e9;
    let mut rows = Vec::new();
    for &size in &sizes {
        let t = Instant::now();
        for _ in 0..a.iters {
            buf.upload(&host[..size])?;
        }
        let pageable = gbps(size * a.iters, t.elapsed().as_secs_f64());
        let mut stream = buf.open_stream()?;
        let t = Instant::now();
        for _ in 0..a.iters {
            // SAFETY: `pinned` outlives the stream and is not written while
            // the copy runs (synchronized right after).
            unsafe { stream.copy_to_device_async(pinned.as_ptr(), size, 0)? };
            stream.synchronize()?;
        }
        let pinned_h2d = gbps(size * a.iters, t.elapsed().as_secs_f64());
        drop(stream);
        for chunk_mb in [1usize, 2, 4, 8, 16] {
            let mut st = Stager::new(&buf, chunk_mb << 20, 2)?;
            st.upload(&buf, &host[..size], 0)?; // warm-up
            let t = Instant::now();
            for _ in 0..a.iters {
                st.upload(&buf, &host[..size], 0)?;
            }
            let up = gbps(size * a.iters, t.elapsed().as_secs_f64());
            let t = Instant::now();
            for _ in 0..a.iters {
                st.download(&buf, &mut back[..size], 0)?;
            }
            let down = gbps(size * a.iters, t.elapsed().as_secs_f64());
            if back[..size] != host[..size] {
                return Err(GpuError::Corrupted(format!("staged round trip of {size} bytes differs")));
            }
            rows.push(format!(
                "{{\"object_bytes\":{size},\"chunk_bytes\":{},\"iters\":{},\"staged_h2d_gbps\":{up:.3},\
                 \"staged_d2h_gbps\":{down:.3},\"htod_pageable_gbps\":{pageable:.3},\"htod_pinned_gbps\":{pinned_h2d:.3},\
                 \"staged_h2d_vs_pinned\":{:.3}}}",
                chunk_mb << 20,
                a.iters,
                up / pinned_h2d,
            ));
        }
    }
    Ok(format!("{{\"bench\":\"gpu_staging\",\"device\":{},\"rows\":[\n  {}\n]}}", a.device, rows.join(",\n  ")))
}

fn main() {
    let a = parse_args();
    let res = if a.staging { run_staging(&a) } else { run(&a) };
    match res {
        Ok(json) => println!("{json}"),
        Err(e @ (GpuError::NoGpu(_) | GpuError::CudaUnavailable(_))) => {
            eprintln!("gpu_sweep: {e}; nothing to measure (exit 2)");
            std::process::exit(2);
        }
        Err(e) => {
            eprintln!("gpu_sweep: {e}");
            std::process::exit(1);
        }
    }
}
