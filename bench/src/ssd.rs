//! `ssd`: the SSD tier of `mooncake-storage`, used directly through its public API,
//! on a real directory (not tmpfs: `O_DIRECT` must work there).
//!
//! Per backend (`--backends`, default the bucket layout) and I/O engine (`--engines`,
//! default `io_uring`) it measures
//! 1. **offload** — `batch_offload` of `--total` bytes of `--object-size` objects,
//!    `--offload-batch` bytes per call (one bucket per call with the default limits),
//!    from each thread count of `--writers`; GB/s and per-call latency;
//! 2. **load** — `load_into_staging` (the serving path of a remote load: a batch of
//!    `--batch` keys read with one `batch_load` into a `ClientBuffer` registered with
//!    `io_uring`) of every object, in write order, with each reader thread count of
//!    `--readers`; GB/s and per-call latency;
//! 3. **small objects** — `batch_offload` of `--small-count` objects of
//!    `--small-size` (500 per call, the bucket key limit), then `--small-secs` of
//!    uniformly random `batch_load`s into caller buffers per `--small-readers` entry
//!    (and a one-thread `load_into_staging` row), with `O_DIRECT`; ops/s and per-call
//!    latency.
//!
//! Values are written from 4 KiB-aligned buffers, so `O_DIRECT` writes take no bounce
//! copy. Phases 1–2 run with `O_DIRECT` (reads reach the device whatever the page
//! cache holds) and, unless `--no-buffered`, with buffered I/O; before
//! every buffered load the page cache of the data files is dropped with
//! `posix_fadvise(DONTNEED)` (no root needed), so those reads reach the device too.
//! Rows carry `phase/backend/io/direct/api/size/batch/threads`, ops/s, GB/s and
//! per-call p50/p99/p999 in µs; `bench/ssd.sh` puts them next to fio in one run.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use clap::Args;
use hdrhistogram::Histogram;
use mooncake_core::parse_size;
use mooncake_core::storage::AlignedBuf;
use mooncake_core::storage::{
    direct_io_supported, io_engine, load_into_staging, BackendOptions, BucketBackend, BucketConfig, ClientBuffer,
    FilePerKeyBackend, IoKind, OffsetAllocatorBackend, StorageBackend,
};
use serde::Serialize;

/// Options of the `ssd` subcommand.
#[derive(Args, Debug)]
pub struct SsdArgs {
    /// Directory to measure in (on the device; not tmpfs). Sub-directories made here
    /// are removed at the end unless `--keep`.
    #[arg(long, default_value = "/var/tmp/mooncake-ssd-bench")]
    pub dir: PathBuf,
    /// Bytes of large objects offloaded (and loaded) per I/O mode.
    #[arg(long, default_value = "2GiB")]
    pub total: String,
    /// Size of the large objects.
    #[arg(long, default_value = "1MiB")]
    pub object_size: String,
    /// Bytes per `batch_offload` call (one bucket per call with the default 256 MiB
    /// bucket limit).
    #[arg(long, default_value = "256MiB")]
    pub offload_batch: String,
    /// Counts of threads calling `batch_offload` at once; one offload row each (the
    /// store's offload heartbeat is one thread). Loads read what the first wrote.
    #[arg(long, default_value = "1")]
    pub writers: String,
    /// Keys per load call (the `io_uring` engine submits up to 32 reads at once).
    #[arg(long, default_value_t = 32)]
    pub batch: usize,
    /// Reader thread counts; one row each.
    #[arg(long, default_value = "1,2")]
    pub readers: String,
    /// Number of small objects.
    #[arg(long, default_value_t = 200_000)]
    pub small_count: usize,
    /// Size of the small objects.
    #[arg(long, default_value = "4KiB")]
    pub small_size: String,
    /// Seconds of random small-object loads per row.
    #[arg(long, default_value_t = 5.0)]
    pub small_secs: f64,
    /// I/O engines: uring (the default of the store), posix (comma-separated); every
    /// phase runs with each.
    #[arg(long, default_value = "uring")]
    pub engines: String,
    /// Backends: bucket, file_per_key, offset_allocator (comma-separated).
    #[arg(long, default_value = "bucket")]
    pub backends: String,
    /// Skip the buffered (page cache) variant of the large-object phases.
    #[arg(long)]
    pub no_buffered: bool,
    /// Skip the small-object phase.
    #[arg(long)]
    pub no_small: bool,
    /// Skip the large-object phases.
    #[arg(long)]
    pub no_large: bool,
    /// Random small-object load rows: `T` (T threads, `--batch` keys per call) or
    /// `TxB` (T threads, B keys per call), comma-separated. `2x16` keeps at most 32
    /// reads in flight, as fio at QD32.
    #[arg(long, default_value = "1,2,2x16")]
    pub small_readers: String,
    /// Do not check each value's crc32c on load (the store checks by default).
    #[arg(long)]
    pub no_verify: bool,
    /// Keep the data written (default: removed at the end).
    #[arg(long)]
    pub keep: bool,
    /// JSON output file (stdout if absent).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// One measured phase.
#[derive(Serialize, Debug, Clone)]
pub struct SsdRow {
    system: &'static str,
    mode: &'static str,
    /// `offload`, `load` or `load_random`.
    phase: &'static str,
    backend: &'static str,
    io: &'static str,
    direct: bool,
    /// `batch_offload`, `batch_load` or `load_into_staging`.
    api: &'static str,
    size: u64,
    /// Objects per call.
    batch: u64,
    threads: usize,
    /// Calls made.
    calls: u64,
    /// Objects moved.
    items: u64,
    fail: u64,
    wall_s: f64,
    ops_per_s: f64,
    #[serde(rename = "GB_per_s")]
    gb_per_s: f64,
    /// Per-call latency percentiles (a call moves `batch` objects).
    p50_us: f64,
    p99_us: f64,
    p999_us: f64,
    mean_us: f64,
    /// CPU time of the process (user + system) per wall second of the phase: 1.0 is
    /// one core busy; this machine class has 2.
    cpu_cores: f64,
}

/// What one bench thread gathered.
struct Sample {
    hist: Histogram<u64>,
    items: u64,
    fail: u64,
}

impl Sample {
    fn new() -> Self {
        Sample { hist: Histogram::new(3).expect("histogram"), items: 0, fail: 0 }
    }
}

/// Identifies a row apart from its measurements.
#[derive(Clone, Copy)]
struct RowId {
    phase: &'static str,
    backend: &'static str,
    io: &'static str,
    direct: bool,
    api: &'static str,
    size: u64,
    batch: usize,
    threads: usize,
}

impl RowId {
    fn row(self, samples: Vec<Sample>, wall: Duration, cpu: f64) -> SsdRow {
        let mut hist = Histogram::<u64>::new(3).expect("histogram");
        let (mut items, mut fail) = (0, 0);
        for s in samples {
            hist.add(s.hist).ok();
            items += s.items;
            fail += s.fail;
        }
        let w = wall.as_secs_f64();
        let ok = items - fail.min(items);
        SsdRow {
            system: "mooncake-rs",
            mode: "ssd",
            phase: self.phase,
            backend: self.backend,
            io: self.io,
            direct: self.direct,
            api: self.api,
            size: self.size,
            batch: self.batch as u64,
            threads: self.threads,
            calls: hist.len(),
            items,
            fail,
            wall_s: w,
            ops_per_s: ok as f64 / w,
            gb_per_s: ok as f64 * self.size as f64 / w / 1e9,
            p50_us: hist.value_at_quantile(0.50) as f64 / 1e3,
            p99_us: hist.value_at_quantile(0.99) as f64 / 1e3,
            p999_us: hist.value_at_quantile(0.999) as f64 / 1e3,
            mean_us: hist.mean() / 1e3,
            cpu_cores: cpu / w,
        }
    }
}

/// CPU seconds (user + system) this process has used, from `/proc/self/stat`
/// (clock ticks of 1/100 s, the Linux `USER_HZ`); 0 where it cannot be read.
fn cpu_seconds() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else { return 0.0 };
    // Fields after the parenthesized command name: state is field 3, utime 14, stime 15.
    let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else { return 0.0 };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    (ticks(11) + ticks(12)) as f64 / 100.0
}

/// Runs `work(thread, sample)` on `threads` threads at once; returns their samples,
/// the wall time of the slowest and the CPU seconds used meanwhile.
fn run_threads(threads: usize, work: impl Fn(usize, &mut Sample) + Sync) -> (Vec<Sample>, Duration, f64) {
    let cpu0 = cpu_seconds();
    let start = Instant::now();
    let samples = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads.max(1))
            .map(|t| {
                let work = &work;
                s.spawn(move || {
                    let mut sample = Sample::new();
                    work(t, &mut sample);
                    sample
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("bench thread")).collect()
    });
    (samples, start.elapsed(), cpu_seconds() - cpu0)
}

/// A small xorshift64* generator (keys and payload bytes; no quality needed).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// `count` 4 KiB-aligned buffers of `len` pseudo-random bytes (aligned so that
/// `O_DIRECT` writes go straight from them, with no bounce copy).
fn sources(count: usize, len: usize) -> Vec<AlignedBuf> {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    (0..count)
        .map(|_| {
            let mut b = AlignedBuf::zeroed(len);
            for chunk in b.chunks_mut(8) {
                let w = rng.next().to_le_bytes();
                chunk.copy_from_slice(&w[..chunk.len()]);
            }
            b
        })
        .collect()
}

extern "C" {
    /// `posix_fadvise(2)` from the C library (which std links already).
    fn posix_fadvise(fd: i32, offset: i64, len: i64, advice: i32) -> i32;
}

/// `POSIX_FADV_DONTNEED` on Linux.
const POSIX_FADV_DONTNEED: i32 = 4;

/// Drops the page cache of every (synced) file under `dir`, so that buffered reads
/// reach the device; returns how many files were dropped.
fn drop_page_cache(dir: &Path) -> usize {
    use std::os::fd::AsRawFd;
    let mut n = 0;
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    for e in entries.flatten() {
        let path = e.path();
        match e.file_type() {
            Ok(t) if t.is_dir() => n += drop_page_cache(&path),
            Ok(t) if t.is_file() => {
                if let Ok(f) = std::fs::File::open(&path) {
                    // SAFETY: `f` is an open descriptor for the whole call; fadvise only
                    // gives the kernel a hint about that file's cached pages.
                    let r = unsafe { posix_fadvise(f.as_raw_fd(), 0, 0, POSIX_FADV_DONTNEED) };
                    n += (r == 0) as usize;
                }
            }
            _ => {}
        }
    }
    n
}

/// The filesystem type of `dir` if it keeps files in memory (tmpfs, ramfs: recent
/// kernels accept `O_DIRECT` there, so the probe alone does not catch them), from the
/// longest mount point of `/proc/mounts` that contains it.
fn memory_fs(dir: &Path) -> Option<String> {
    let dir = std::fs::canonicalize(dir).ok()?;
    let mounts = std::fs::read_to_string("/proc/mounts").ok()?;
    let fs = mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_, point, fs) = (f.next()?, f.next()?, f.next()?);
            // Mount points escape spaces as \040; none of ours has one.
            dir.starts_with(point).then(|| (point.len(), fs.to_owned()))
        })
        .max_by_key(|(len, _)| *len)?
        .1;
    matches!(fs.as_str(), "tmpfs" | "ramfs").then_some(fs)
}

/// Opens backend `kind` in `dir` (made empty first) with the given I/O engine.
fn open_backend(
    kind: &str,
    dir: &Path,
    engine: IoKind,
    direct: bool,
    verify: bool,
    bytes_hint: u64,
) -> Result<Box<dyn StorageBackend>, String> {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut opts = BackendOptions::default().with_io(io_engine(engine, direct));
    opts.verify_on_load = verify;
    let err = |e: mooncake_core::storage::StorageError| format!("{kind} in {}: {e}", dir.display());
    Ok(match kind {
        "bucket" => Box::new(BucketBackend::open(dir, opts, BucketConfig::default()).map_err(err)?),
        "file_per_key" => Box::new(FilePerKeyBackend::open(dir, opts).map_err(err)?),
        "offset_allocator" => Box::new(OffsetAllocatorBackend::open(dir, bytes_hint, opts).map_err(err)?),
        other => return Err(format!("unknown backend {other:?} (bucket, file_per_key, offset_allocator)")),
    })
}

/// Bytes the offset-allocator file needs for `count` objects of `size` (a 4 KiB
/// header each, plus slack for the allocator's size classes).
fn file_bytes(count: usize, size: u64) -> u64 {
    let per = size.div_ceil(4096) * 4096 + 4096;
    count as u64 * per * 5 / 4 + (64 << 20)
}

/// Writes `keys` (values cycling over `src`) with `id.threads` threads, `id.batch`
/// objects per `batch_offload`; one row.
fn offload(backend: &dyn StorageBackend, keys: &[String], src: &[AlignedBuf], id: RowId) -> SsdRow {
    let next = AtomicUsize::new(0);
    let per_call = id.batch.max(1);
    let calls = keys.len().div_ceil(per_call);
    let (samples, wall, cpu) = run_threads(id.threads, |_, s| loop {
        let c = next.fetch_add(1, Ordering::Relaxed);
        if c >= calls {
            break;
        }
        let range = c * per_call..((c + 1) * per_call).min(keys.len());
        let objects: Vec<(&str, &[u8])> = range.map(|i| (keys[i].as_str(), &src[i % src.len()][..])).collect();
        let t0 = Instant::now();
        let res = backend.batch_offload(&objects);
        s.hist.record(t0.elapsed().as_nanos() as u64).ok();
        s.items += objects.len() as u64;
        s.fail += res.iter().filter(|r| r.is_err()).count() as u64;
    });
    id.row(samples, wall, cpu)
}

/// Loads every key once, in order, `id.batch` per `load_into_staging` call, from
/// `id.threads` threads; one row.
fn load_all(backend: &dyn StorageBackend, staging: &ClientBuffer, keys: &[String], id: RowId) -> SsdRow {
    let next = AtomicUsize::new(0);
    let batch = id.batch.max(1);
    let calls = keys.len().div_ceil(batch);
    let (samples, wall, cpu) = run_threads(id.threads, |_, s| loop {
        let c = next.fetch_add(1, Ordering::Relaxed);
        if c >= calls {
            break;
        }
        let names: Vec<&str> = keys[c * batch..((c + 1) * batch).min(keys.len())].iter().map(String::as_str).collect();
        let t0 = Instant::now();
        match load_into_staging(backend, staging, &names) {
            Ok(lease) => {
                staging.release(lease.batch_id);
            }
            Err(e) => {
                if s.fail == 0 {
                    eprintln!("ssd: load_into_staging failed: {e}");
                }
                s.fail += names.len() as u64;
            }
        }
        s.hist.record(t0.elapsed().as_nanos() as u64).ok();
        s.items += names.len() as u64;
    });
    id.row(samples, wall, cpu)
}

/// Uniformly random loads of `id.batch` keys per call for `secs`, from `id.threads`
/// threads: through `batch_load` into caller buffers (4 KiB-aligned, so `O_DIRECT`
/// reads land in them directly), or through `load_into_staging` if `staging` is given.
fn load_random(
    backend: &dyn StorageBackend,
    staging: Option<&ClientBuffer>,
    keys: &[String],
    secs: f64,
    id: RowId,
) -> SsdRow {
    let deadline = Duration::from_secs_f64(secs);
    let (batch, slot) = (id.batch.max(1), (id.size as usize).div_ceil(4096) * 4096);
    let (samples, wall, cpu) = run_threads(id.threads, |t, s| {
        let mut rng = Rng(0x5851_f42d_4c95_7f2d ^ ((t as u64 + 1) << 32));
        let mut bufs = AlignedBuf::zeroed(slot * batch);
        let start = Instant::now();
        while start.elapsed() < deadline {
            let names: Vec<&str> =
                (0..batch).map(|_| keys[(rng.next() % keys.len() as u64) as usize].as_str()).collect();
            let t0 = Instant::now();
            let failed = match staging {
                Some(st) => match load_into_staging(backend, st, &names) {
                    Ok(lease) => {
                        st.release(lease.batch_id);
                        0
                    }
                    Err(_) => names.len(),
                },
                None => {
                    let mut reqs: Vec<(&str, &mut [u8])> = names.iter().copied().zip(bufs.chunks_mut(slot)).collect();
                    backend.batch_load(&mut reqs).iter().filter(|r| r.is_err()).count()
                }
            };
            s.hist.record(t0.elapsed().as_nanos() as u64).ok();
            s.items += names.len() as u64;
            s.fail += failed as u64;
        }
    });
    id.row(samples, wall, cpu)
}

fn parse_list(text: &str) -> Result<Vec<usize>, String> {
    text.split(',').map(|t| t.trim().parse::<usize>().map_err(|e| format!("{t:?}: {e}"))).collect()
}

/// Parses `T` or `TxB` items: (threads, keys per call), `B` defaulting to `batch`.
fn parse_readers(text: &str, batch: usize) -> Result<Vec<(usize, usize)>, String> {
    text.split(',')
        .map(|item| {
            let (t, b) = item.trim().split_once('x').unwrap_or((item.trim(), ""));
            let t = t.parse::<usize>().map_err(|e| format!("{item:?}: {e}"))?.max(1);
            let b = if b.is_empty() { batch } else { b.parse::<usize>().map_err(|e| format!("{item:?}: {e}"))? };
            Ok((t, b.max(1)))
        })
        .collect()
}

fn size_of(text: &str) -> Result<u64, String> {
    parse_size(text).map_err(|e| e.to_string())
}

fn report(r: &SsdRow) {
    eprintln!(
        "ssd {:<11} {:<16} {:<8} {:<8} {:<17} {:>8} B x{:<3} {}thr: {:>9.0} ops/s {:>6.3} GB/s  p50 {:>8.0} us  p99 {:>8.0} us  cpu {:.2}{}",
        r.phase,
        r.backend,
        r.io,
        if r.direct { "direct" } else { "buffered" },
        r.api,
        r.size,
        r.batch,
        r.threads,
        r.ops_per_s,
        r.gb_per_s,
        r.p50_us,
        r.p99_us,
        r.cpu_cores,
        if r.fail > 0 { format!("  FAILED {}", r.fail) } else { String::new() }
    );
}

/// The whole `ssd` run; returns the JSON document.
pub fn ssd(a: &SsdArgs) -> Result<serde_json::Value, String> {
    let total = size_of(&a.total)?;
    let obj = size_of(&a.object_size)?.max(1);
    let small = size_of(&a.small_size)?.max(1);
    let per_call = (size_of(&a.offload_batch)? / obj).max(1) as usize;
    let readers = parse_list(&a.readers)?;
    let writers = parse_list(&a.writers)?;
    let first_writers = writers.first().copied().unwrap_or(1).max(1);
    let batch = a.batch.max(1);
    let count = (total / obj).max(1) as usize;
    std::fs::create_dir_all(&a.dir).map_err(|e| format!("{}: {e}", a.dir.display()))?;
    if let Some(fs) = memory_fs(&a.dir) {
        return Err(format!("{} is on {fs}, in memory: use --dir on the device", a.dir.display()));
    }
    if !direct_io_supported(&a.dir) {
        return Err(format!("O_DIRECT is refused in {}: use --dir on the device", a.dir.display()));
    }
    let root = a.dir.join(format!("mooncake-ssd-{}", std::process::id()));
    let verify = !a.no_verify;
    let mut rows = Vec::new();
    let mut push = |r: SsdRow| {
        report(&r);
        rows.push(r);
    };
    let src = sources(count.min(16), obj as usize);
    let keys: Vec<String> = (0..count).map(|i| format!("ssd/large/{i:08}")).collect();
    let max_readers = readers.iter().copied().max().unwrap_or(1).max(1);
    // Room for every reader's batch in flight, twice over.
    let slot = obj.div_ceil(4096) * 4096;
    let staging = ClientBuffer::new(2 * slot * (batch * max_readers) as u64, Duration::from_secs(60))
        .map_err(|e| e.to_string())?;
    staging.register_with_uring();
    let modes: &[bool] = match (a.no_large, a.no_buffered) {
        (true, _) => &[],
        (false, true) => &[true],
        (false, false) => &[true, false],
    };
    let small_readers = parse_readers(&a.small_readers, batch)?;
    let engines = a
        .engines
        .split(',')
        .map(|e| match e.trim() {
            "uring" | "io_uring" => Ok(IoKind::Uring),
            "posix" => Ok(IoKind::Posix),
            other => Err(format!("unknown engine {other:?} (uring, posix)")),
        })
        .collect::<Result<Vec<_>, _>>()?;
    let result = (|| {
        for (backend_kind, engine) in
            a.backends.split(',').map(str::trim).flat_map(|b| engines.iter().map(move |&e| (b, e)))
        {
            let tag = format!("{backend_kind}-{engine:?}");
            for &direct in modes {
                // Buffered I/O: with the first writer count only.
                let counts = if direct { &writers[..] } else { &writers[..1] };
                for (wi, &w) in counts.iter().enumerate() {
                    let mode = if direct { "direct" } else { "buffered" };
                    let dir = root.join(format!("{tag}-{mode}-w{w}"));
                    let backend = open_backend(backend_kind, &dir, engine, direct, verify, file_bytes(count, obj))?;
                    let (name, io) = (backend.name(), backend.stats().io);
                    let id = |phase, api, batch, threads| RowId {
                        phase,
                        backend: name,
                        io,
                        direct,
                        api,
                        size: obj,
                        batch,
                        threads,
                    };
                    push(offload(&*backend, &keys, &src, id("offload", "batch_offload", per_call, w.max(1))));
                    for &r in readers.iter().filter(|_| wi == 0) {
                        drop_page_cache(&dir);
                        push(load_all(&*backend, &staging, &keys, id("load", "load_into_staging", batch, r)));
                    }
                    drop(backend);
                    if !a.keep {
                        let _ = std::fs::remove_dir_all(&dir);
                    }
                }
            }
            if a.no_small || a.small_count == 0 {
                continue;
            }
            let dir = root.join(format!("{tag}-small"));
            let n = a.small_count;
            let backend = open_backend(backend_kind, &dir, engine, true, verify, file_bytes(n, small))?;
            let (name, io) = (backend.name(), backend.stats().io);
            let id = |phase, api, batch, threads| RowId {
                phase,
                backend: name,
                io,
                direct: true,
                api,
                size: small,
                batch,
                threads,
            };
            let small_keys: Vec<String> = (0..n).map(|i| format!("ssd/small/{i:08}")).collect();
            let small_src = sources(64, small as usize);
            // 500 keys per call: the bucket layout's per-bucket key limit.
            push(offload(&*backend, &small_keys, &small_src, id("offload", "batch_offload", 500, first_writers)));
            drop_page_cache(&dir);
            for &(r, small_batch) in &small_readers {
                let row = id("load_random", "batch_load", small_batch, r);
                push(load_random(&*backend, None, &small_keys, a.small_secs, row));
            }
            let row = id("load_random", "load_into_staging", batch, 1);
            push(load_random(&*backend, Some(&staging), &small_keys, a.small_secs, row));
            drop(backend);
            if !a.keep {
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
        Ok::<(), String>(())
    })();
    if !a.keep {
        let _ = std::fs::remove_dir_all(&root);
    }
    result?;
    Ok(serde_json::json!({
        "system": "mooncake-rs",
        "bench": "ssd",
        "dir": a.dir,
        "total": count as u64 * obj,
        "verify_on_load": verify,
        "rows": rows,
    }))
}
