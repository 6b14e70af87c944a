//! [`CudaDeviceHeap`]: a device heap in GPU memory, its header atomics run as
//! one-thread kernels and its hot paths as stream-ordered kernels.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use cudarc::driver::{
    result as cu, sys, CudaContext, CudaFunction, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg,
};
use parking_lot::Mutex;

use super::driver::{alloc_mapped_host, cuda_device_count, drv, guarded, nvrtc_available};
use super::ipc::IpcHeapHandle;
use super::kernels::{self, op, status};
use super::memory::DeviceBuffer;
use crate::cache::{ObjMeta, WritePlan};
use crate::error::{GpuError, Result};
use crate::header::{
    header_offsets, HeaderSnapshot, HeaderU32Field, HeaderU64Field, ObjectState, HEADER_SIZE, HEADER_VERSION,
};
use crate::heap::{DeviceHeap, PageSpan};
use crate::key::KeyId;

/// Threads per block of the copy kernels.
const COPY_THREADS: u32 = 256;
/// Bytes each block of a copy kernel moves (a page is split over
/// `page_size / COPY_BYTES_PER_BLOCK` blocks).
const COPY_BYTES_PER_BLOCK: u32 = 32 * 1024;
/// The most blocks a read runs in one launch (`nk_read`, each block pinning the
/// object on its own, 4 MiB at most): beyond, the pins on one header word cost
/// more than the second launch of `nk_reader_enter` + `nk_read_exit` saves.
const ONE_LAUNCH_READ_BLOCKS: u32 = 128;

struct Kernels {
    hdr_op: CudaFunction,
    write_header: CudaFunction,
    publish: CudaFunction,
    reader_enter: CudaFunction,
    read_exit: CudaFunction,
    read: CudaFunction,
}

/// Bytes of device scratch a heap keeps.
const SCRATCH_BYTES: usize = 64;
/// Offset in the scratch of the blocks' arrival counter of the one-launch
/// kernels (`last_block`: zero between launches).
const ARRIVED: u64 = 16;
/// Offset in the scratch of the worst status the blocks of an `nk_read` met
/// (zero between launches).
const WORST: u64 = 32;
/// What the host writes into the answer word before a launch: a kernel that
/// did not answer reads as no state the kernels answer.
const NO_ANSWER: u64 = 0xDEAD_BEEF_DEAD_BEEF;

/// What a heap's host operations use, under one lock (which also serialises
/// them on the heap's stream).
struct Scratch {
    /// [`SCRATCH_BYTES`] of device memory: the reader status at 0, the arrival
    /// counter at [`ARRIVED`], a one-launch read's worst status at [`WORST`].
    dev: sys::CUdeviceptr,
    /// 8 bytes of page-locked host memory, mapped into the device's address
    /// space, that the kernels write their answer into: read once the stream
    /// synchronized, with no device-to-host copy to enqueue.
    answer: *mut u64,
    /// `answer`'s device address.
    answer_dev: sys::CUdeviceptr,
}

// SAFETY: the pointers are allocations owned by the heap, used only under the
// `Mutex` around this value.
unsafe impl Send for Scratch {}

impl Scratch {
    const NONE: Scratch = Scratch { dev: 0, answer: std::ptr::null_mut(), answer_dev: 0 };

    /// Allocates the scratch (zeroed) and the answer word, in the bound context.
    fn alloc(&mut self) -> Result<()> {
        // SAFETY: a plain device allocation, freed in `free`.
        self.dev = drv("cuMemAlloc(scratch)", unsafe { cu::malloc_sync(SCRATCH_BYTES) })?;
        // SAFETY: `dev` is the live allocation of SCRATCH_BYTES just made.
        drv("cuMemsetD8(scratch)", unsafe { cu::memset_d8_sync(self.dev, 0, SCRATCH_BYTES) })?;
        // Freed in `free`.
        let (host, dev) = alloc_mapped_host(8)?;
        (self.answer, self.answer_dev) = (host.cast(), dev);
        Ok(())
    }

    /// Marks the answer word unanswered (before a launch that answers).
    fn clear_answer(&self) {
        // SAFETY: `answer` is the live page-locked word (under the lock); no
        // kernel writes it now (every launch that does was synchronized).
        unsafe { self.answer.write_volatile(NO_ANSWER) }
    }

    /// The answer of the kernel the stream ran last (after the synchronize).
    fn answer(&self) -> u64 {
        // SAFETY: as in `clear_answer`; the kernel that wrote it completed.
        unsafe { self.answer.read_volatile() }
    }

    /// The answer of a kernel that answers 32 bits (a state or a status): the
    /// word's first 4 bytes, where it wrote them (`NO_ANSWER` reads there as
    /// no state and no status either way round).
    fn answer32(&self) -> u32 {
        // SAFETY: as in `answer`: the first 4 bytes of the live, aligned word.
        unsafe { self.answer.cast::<u32>().read_volatile() }
    }

    /// Frees both (the stream idle, the context bound).
    fn free(&mut self) {
        // SAFETY: each allocation is freed once; no kernel uses them any more.
        unsafe {
            if self.dev != 0 {
                let _ = cu::free_sync(self.dev);
            }
            if !self.answer.is_null() {
                let _ = cu::free_host(self.answer.cast());
            }
        }
        *self = Scratch::NONE;
    }
}

/// A [`DeviceHeap`] in GPU memory (header array + payload arena allocated with
/// `cuMemAlloc`, or opened from another process with CUDA IPC).
pub struct CudaDeviceHeap {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    k: Kernels,
    headers: sys::CUdeviceptr,
    payload: sys::CUdeviceptr,
    header_slots: u32,
    capacity: u64,
    ordinal: usize,
    imported: bool,
    /// Scratch and answer word of the host operations; the lock also serialises
    /// them on the stream.
    scratch: Mutex<Scratch>,
}

impl std::fmt::Debug for CudaDeviceHeap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDeviceHeap")
            .field("ordinal", &self.ordinal)
            .field("header_slots", &self.header_slots)
            .field("capacity", &self.capacity)
            .field("imported", &self.imported)
            .finish()
    }
}

fn cfg1() -> LaunchConfig {
    LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1, 1, 1), shared_mem_bytes: 0 }
}

fn copy_cfg(page_size: u32, n_pages: u32) -> LaunchConfig {
    let per_page = page_size.div_ceil(COPY_BYTES_PER_BLOCK).max(1);
    LaunchConfig { grid_dim: (per_page, n_pages.max(1), 1), block_dim: (COPY_THREADS, 1, 1), shared_mem_bytes: 0 }
}

impl CudaDeviceHeap {
    /// Allocates a heap of `header_slots` headers and a `payload_bytes` arena
    /// on device `ordinal`, compiles the kernels, and sets every header DEAD.
    /// `Err(NoGpu)` without a GPU (never panics).
    pub fn new(ordinal: usize, header_slots: u32, payload_bytes: u64) -> Result<Self> {
        if header_slots == 0 || payload_bytes == 0 {
            return Err(GpuError::InvalidArgument("a heap needs at least one header slot and one payload byte".into()));
        }
        let (ctx, stream, k) = Self::setup(ordinal)?;
        guarded("CudaDeviceHeap::new", || {
            ctx.bind_to_thread().map_err(|e| GpuError::Cuda { op: "bind", msg: e.to_string() })?;
            let hdr_bytes = header_slots as usize * HEADER_SIZE;
            // SAFETY: plain device allocations; freed in Drop (or below on error).
            let headers = drv("cuMemAlloc(headers)", unsafe { cu::malloc_sync(hdr_bytes) })?;
            // SAFETY: as above.
            let payload = match drv("cuMemAlloc(payload)", unsafe { cu::malloc_sync(payload_bytes as usize) }) {
                Ok(p) => p,
                Err(e) => {
                    // SAFETY: `headers` was just allocated and is not used elsewhere.
                    unsafe {
                        let _ = cu::free_sync(headers);
                    }
                    return Err(e);
                }
            };
            let heap = Self {
                ctx: ctx.clone(),
                stream: stream.clone(),
                k,
                headers,
                payload,
                header_slots,
                capacity: payload_bytes,
                ordinal,
                imported: false,
                scratch: Mutex::new(Scratch::NONE),
            };
            // From here `heap`'s Drop frees the allocations on error.
            heap.scratch.lock().alloc()?;
            heap.reset_all_headers()?;
            Ok(heap)
        })
    }

    /// Opens an owner heap exported by another process on this host
    /// (`cuIpcOpenMemHandle`, lazy peer access). The memory stays owned by the
    /// exporter; dropping this closes the mapping.
    pub fn open_ipc(ordinal: usize, handle: &IpcHeapHandle) -> Result<Self> {
        let (ctx, stream, k) = Self::setup(ordinal)?;
        guarded("CudaDeviceHeap::open_ipc", || {
            drv("bind", ctx.bind_to_thread())?;
            let open = |bytes: &[u8; 64]| -> Result<sys::CUdeviceptr> {
                let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
                for (d, s) in h.reserved.iter_mut().zip(bytes.iter()) {
                    *d = *s as _;
                }
                let mut ptr: sys::CUdeviceptr = 0;
                // SAFETY: `ptr` is a valid out-pointer; the handle is plain data
                // (the driver validates it).
                let r = unsafe {
                    sys::cuIpcOpenMemHandle_v2(
                        &mut ptr,
                        h,
                        sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                    )
                };
                drv("cuIpcOpenMemHandle", r.result())?;
                Ok(ptr)
            };
            let headers = open(&handle.headers)?;
            let payload = match open(&handle.payload) {
                Ok(p) => p,
                Err(e) => {
                    // SAFETY: `headers` was opened just above and is unused.
                    unsafe {
                        let _ = sys::cuIpcCloseMemHandle(headers);
                    }
                    return Err(e);
                }
            };
            // The handle's sizes come from another process: every offset checked later
            // is checked against them, so they must fit what the driver mapped.
            let mapped = |ptr: sys::CUdeviceptr| -> Result<u64> {
                let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
                // SAFETY: both out-pointers are valid; `ptr` was just mapped.
                let r = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) };
                drv("cuMemGetAddressRange", r.result())?;
                Ok((base + size as u64).saturating_sub(ptr))
            };
            let need_headers = u64::from(handle.header_slots) * crate::header::HEADER_SIZE as u64;
            let sizes = mapped(headers).and_then(|h| Ok((h, mapped(payload)?)));
            let fits = match sizes {
                Ok((h, p)) if h >= need_headers && p >= handle.payload_bytes => Ok(()),
                Ok((h, p)) => Err(GpuError::InvalidArgument(format!(
                    "the heap handle names {} header slots and {} payload bytes, but the mappings hold {h} and \
                     {p} bytes",
                    handle.header_slots, handle.payload_bytes
                ))),
                Err(e) => Err(e),
            };
            if let Err(e) = fits {
                // SAFETY: both were opened just above and are unused.
                unsafe {
                    let _ = sys::cuIpcCloseMemHandle(headers);
                    let _ = sys::cuIpcCloseMemHandle(payload);
                }
                return Err(e);
            }
            let heap = Self {
                ctx: ctx.clone(),
                stream: stream.clone(),
                k,
                headers,
                payload,
                header_slots: handle.header_slots,
                capacity: handle.payload_bytes,
                ordinal,
                imported: true,
                scratch: Mutex::new(Scratch::NONE),
            };
            heap.scratch.lock().alloc()?;
            Ok(heap)
        })
    }

    /// Exports the heap for [`open_ipc`](Self::open_ipc) in another process
    /// (`cuIpcGetMemHandle` of the header array and the arena).
    pub fn export_ipc(&self) -> Result<IpcHeapHandle> {
        guarded("export_ipc", || {
            drv("bind", self.ctx.bind_to_thread())?;
            let get = |ptr: sys::CUdeviceptr| -> Result<[u8; 64]> {
                let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
                // SAFETY: `h` is a valid out-pointer; `ptr` is the base of a
                // cuMemAlloc allocation owned or mapped by this heap.
                let r = unsafe { sys::cuIpcGetMemHandle(&mut h, ptr) };
                drv("cuIpcGetMemHandle", r.result())?;
                let mut out = [0u8; 64];
                for (d, s) in out.iter_mut().zip(h.reserved.iter()) {
                    *d = *s as u8;
                }
                Ok(out)
            };
            Ok(IpcHeapHandle {
                headers: get(self.headers)?,
                payload: get(self.payload)?,
                header_slots: self.header_slots,
                payload_bytes: self.capacity,
            })
        })
    }

    fn setup(ordinal: usize) -> Result<(Arc<CudaContext>, Arc<CudaStream>, Kernels)> {
        let n = cuda_device_count()?;
        if ordinal >= n {
            return Err(GpuError::InvalidArgument(format!("device {ordinal} requested, {n} present")));
        }
        if !nvrtc_available() {
            return Err(GpuError::CudaUnavailable("the NVRTC library (libnvrtc.so) is not present".into()));
        }
        guarded("CUDA setup", || {
            let ctx = drv("cuCtx", CudaContext::new(ordinal))?;
            let (major, minor) = drv("compute capability", ctx.compute_capability())?;
            if major < 7 {
                return Err(GpuError::CudaUnavailable(format!(
                    "compute capability {major}.{minor}: the kernels need sm_70 or newer"
                )));
            }
            let opts = cudarc::nvrtc::CompileOptions {
                options: vec![format!("--gpu-architecture=compute_{major}{minor}")],
                ..Default::default()
            };
            let ptx = cudarc::nvrtc::compile_ptx_with_opts(kernels::source(), opts)
                .map_err(|e| GpuError::Nvrtc(format!("{e:?}")))?;
            let module = drv("cuModuleLoadData", ctx.load_module(ptx))?;
            let f = |name: &str| drv("cuModuleGetFunction", module.load_function(name));
            let k = Kernels {
                hdr_op: f("nk_hdr_op")?,
                write_header: f("nk_write_header")?,
                publish: f("nk_publish")?,
                reader_enter: f("nk_reader_enter")?,
                read_exit: f("nk_read_exit")?,
                read: f("nk_read")?,
            };
            let stream = drv("cuStreamCreate", ctx.new_stream())?;
            Ok((ctx, stream, k))
        })
    }

    /// Device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Whether this heap was opened through CUDA IPC (memory owned elsewhere).
    pub fn is_imported(&self) -> bool {
        self.imported
    }

    /// The CUDA stream every operation of this heap runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The CUDA context of the heap.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    fn hdr(&self, slot: u32) -> Result<sys::CUdeviceptr> {
        if slot >= self.header_slots {
            return Err(GpuError::OutOfBounds(format!("header slot {slot} of {}", self.header_slots)));
        }
        Ok(self.headers + u64::from(slot) * HEADER_SIZE as u64)
    }

    fn sync(&self) -> Result<()> {
        drv("cuStreamSynchronize", self.stream.synchronize())
    }

    /// Runs `nk_hdr_op` on one header word and returns its result.
    fn hdr_op(&self, addr: sys::CUdeviceptr, code: u32, a: u64, b: u64) -> Result<u64> {
        guarded("hdr_op", || {
            let scratch = self.scratch.lock();
            scratch.clear_answer();
            self.launch_hdr_op(&scratch, addr, code, a, b)?;
            self.sync()?;
            Ok(scratch.answer())
        })
    }

    /// Runs `nk_hdr_op` for a store (whose result nobody reads): the kernel,
    /// then one stream synchronization, without the read-back copy `hdr_op`
    /// makes (one device-to-host copy less per store).
    fn hdr_store(&self, addr: sys::CUdeviceptr, code: u32, v: u64) -> Result<()> {
        guarded("hdr_store", || {
            let scratch = self.scratch.lock();
            self.launch_hdr_op(&scratch, addr, code, v, 0)?;
            self.sync()
        })
    }

    /// Enqueues `nk_hdr_op`, its result into the answer word (the caller holds
    /// the scratch lock until the stream synchronized).
    fn launch_hdr_op(&self, scratch: &Scratch, addr: sys::CUdeviceptr, code: u32, a: u64, b: u64) -> Result<()> {
        let mut l = self.stream.launch_builder(&self.k.hdr_op);
        l.arg(&addr).arg(&code).arg(&a).arg(&b).arg(&scratch.answer_dev);
        // SAFETY: argument types match the kernel signature (u64, u32, u64, u64,
        // u64*); `addr` is a header word inside this heap (checked by `hdr`),
        // `answer_dev` the device address of our live 8-byte answer word.
        drv("launch nk_hdr_op", unsafe { l.launch(cfg1()) })?;
        Ok(())
    }

    fn check_span(&self, span: &PageSpan) -> Result<()> {
        match span.payload_base.checked_add(span.alloc_bytes()) {
            Some(e) if e <= self.capacity => Ok(()),
            _ => Err(GpuError::OutOfBounds(format!(
                "span {}+{} outside the {}-byte arena",
                span.payload_base,
                span.alloc_bytes(),
                self.capacity
            ))),
        }
    }

    /// Producer path: pushes pages `first_page ..` of `plan` from the device
    /// buffer `src` (device pointer in this context, pages contiguous) into
    /// the heap and, if `publish`, flips READY after the last page: one driver
    /// copy (the pages are contiguous on both sides), followed on the stream by
    /// `nk_publish` to publish, and one host round trip. Synchronous.
    /// `Err(Stale)` if the plan was reclaimed before the publish.
    pub fn push_from_device(
        &self,
        plan: &WritePlan,
        src: u64,
        first_page: u32,
        n_pages: u32,
        publish: bool,
        now_ns: u64,
    ) -> Result<()> {
        let span = plan.span();
        self.check_span(&span)?;
        let hdr = self.hdr(plan.slot)?;
        if n_pages == 0 || first_page.checked_add(n_pages).is_none_or(|e| e > span.n_pages) {
            return Err(GpuError::InvalidArgument(format!(
                "pages {first_page}+{n_pages} of a {}-page object",
                span.n_pages
            )));
        }
        guarded("push_from_device", || {
            let scratch = self.scratch.lock();
            // The pages lie end to end in the arena as in `src`: one driver copy (as
            // fast as a device-to-device copy gets; a copy kernel with the publish in
            // its last block reached 0.71-0.81 of it for 64 MiB on an H200, this
            // 0.82-0.85), then, to publish, `nk_publish` behind it on the stream.
            let last = first_page + n_pages - 1;
            let last_bytes = if last + 1 == span.n_pages { span.last_page_bytes } else { span.page_size };
            let bytes = u64::from(n_pages - 1) * u64::from(span.page_size) + u64::from(last_bytes);
            let dst = self.payload + span.payload_base + u64::from(first_page) * u64::from(span.page_size);
            let len =
                usize::try_from(bytes).map_err(|_| GpuError::InvalidArgument(format!("a push of {bytes} bytes")))?;
            drv("bind", self.ctx.bind_to_thread())?;
            // SAFETY: the destination pages lie inside the arena (check_span), and
            // `src` holds them (the caller's contract); the stream orders the copy
            // before the publish below and every later launch of this heap.
            drv("cuMemcpyDtoDAsync", unsafe { cu::memcpy_dtod_async(dst, src, len, self.stream.cu_stream()) })?;
            if !publish {
                return self.sync();
            }
            scratch.clear_answer();
            let mut l = self.stream.launch_builder(&self.k.publish);
            l.arg(&hdr).arg(&plan.epoch).arg(&now_ns).arg(&scratch.answer_dev);
            // SAFETY: types match (u64, u32, u64, u32*); `hdr` is this plan's
            // header (checked by `hdr`), the answer word ours under the lock until
            // the stream synchronized. Stream order puts it after the copy: READY
            // is published only over complete pages.
            let launched = drv("launch nk_publish", unsafe { l.launch(cfg1()) });
            // Waited for even when the launch failed: the copy queued above reads
            // the caller's `src`, which the caller may free once this returns.
            let synced = self.sync();
            launched?;
            synced?;
            published(scratch.answer32())
        })
    }

    /// One kernel with the header as its argument: every word but the state's,
    /// then the state with SeqCst (release for the words before it); waited for
    /// when `wait` (one host round trip; it was two host-to-device copies and a
    /// kernel).
    fn launch_write_header(&self, slot: u32, h: &HeaderSnapshot, wait: bool) -> Result<()> {
        let hdr = self.hdr(slot)?;
        let words = HeaderWords::of(h);
        guarded("write_header", || {
            let _g = self.scratch.lock();
            drv("bind", self.ctx.bind_to_thread())?;
            let mut l = self.stream.launch_builder(&self.k.write_header);
            l.arg(&hdr).arg(&words).arg(&h.state);
            // SAFETY: argument types match (u64, NkHeader (16 u64, by value),
            // u32); `hdr` is this slot's 128-byte header (checked by `hdr`).
            drv("launch nk_write_header", unsafe { l.launch(cfg1()) })?;
            if wait {
                self.sync()?;
            }
            Ok(())
        })
    }

    /// Reader path: copies the object at `meta` into the device buffer `dst`
    /// (`dst_cap` bytes) with the device-side protocol (acquire READY, pin,
    /// re-check, tail-clamped copy, unpin), stream-ordered, one host round trip.
    /// A read of up to 128 copy blocks (4 MiB) is one launch
    /// (`nk_read`: each block pins, copies its share and unpins; the last to
    /// finish answers); a larger one two (`nk_reader_enter` pins once;
    /// `nk_read_exit` copies, then its last block unpins and answers). Returns
    /// the object size. On an error `dst` may have been written in part.
    pub fn read_into_device(&self, meta: &ObjMeta, key: &KeyId, dst: u64, dst_cap: u64) -> Result<u64> {
        let hdr = self.hdr(meta.slot)?;
        self.check_span(&meta.span())?;
        guarded("read_into_device", || {
            let scratch = self.scratch.lock();
            let (st, arrived) = (scratch.dev, scratch.dev + ARRIVED);
            scratch.clear_answer();
            let cfg = copy_cfg(meta.page_bytes, meta.n_pages);
            if cfg.grid_dim.0 * cfg.grid_dim.1 <= ONE_LAUNCH_READ_BLOCKS {
                let worst = scratch.dev + WORST;
                let mut l = self.stream.launch_builder(&self.k.read);
                l.arg(&hdr).arg(&meta.epoch).arg(&key.hash).arg(&key.fp_hi).arg(&key.len).arg(&dst_cap);
                l.arg(&self.payload).arg(&dst).arg(&worst).arg(&arrived).arg(&scratch.answer_dev);
                // SAFETY: types match (u64, u32, u64, u64, u32, u64, u64, u8*, u32*,
                // u32*, u32*); a block copies only while it holds its own pin, after
                // checking the header's size against `dst_cap`; the pinned header
                // equals `meta` (epoch); `worst`, `arrived` and the answer word are
                // ours under the lock.
                drv("launch nk_read", unsafe { l.launch(cfg) })?;
                self.sync()?;
                return read_status(scratch.answer32(), meta, dst_cap);
            }
            let mut l = self.stream.launch_builder(&self.k.reader_enter);
            l.arg(&hdr).arg(&meta.epoch).arg(&key.hash).arg(&key.fp_hi).arg(&key.len).arg(&dst_cap).arg(&st);
            // SAFETY: types match (u64, u32, u64, u64, u32, u64, u32*).
            drv("launch nk_reader_enter", unsafe { l.launch(cfg1()) })?;
            let mut l = self.stream.launch_builder(&self.k.read_exit);
            l.arg(&st).arg(&hdr).arg(&self.payload).arg(&dst).arg(&arrived).arg(&scratch.answer_dev);
            // SAFETY: types match (u32*, u64, u64, u8*, u32*, u32*); the kernel
            // copies only when pinned and the header's size was checked against
            // `dst_cap` by nk_reader_enter; the pinned header equals `meta`
            // (epoch); `arrived` and the answer word are ours under the lock.
            drv("launch nk_read_exit", unsafe { l.launch(cfg) })?;
            self.sync()?;
            read_status(scratch.answer32(), meta, dst_cap)
        })
    }

    /// Allocates a device buffer of `bytes` in this heap's context (for
    /// producers, readers and benchmarks). Freed by [`DeviceBuffer`]'s Drop.
    pub fn alloc_buffer(&self, bytes: usize) -> Result<DeviceBuffer> {
        guarded("alloc_buffer", || {
            drv("bind", self.ctx.bind_to_thread())?;
            // SAFETY: plain device allocation owned by the returned buffer.
            let ptr = drv("cuMemAlloc", unsafe { cu::malloc_sync(bytes.max(1)) })?;
            Ok(DeviceBuffer::owned(self.ctx.clone(), self.ordinal, ptr, bytes))
        })
    }

    /// `cuMemcpyDtoD` of `len` bytes on the heap's stream, synchronous (the
    /// bandwidth reference of the benchmark).
    pub fn memcpy_dtod(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        guarded("memcpy_dtod", || {
            drv("bind", self.ctx.bind_to_thread())?;
            // SAFETY: the caller passes device ranges of at least `len` bytes
            // in this context (e.g. two DeviceBuffers).
            drv("cuMemcpyDtoDAsync", unsafe { cu::memcpy_dtod_async(dst, src, len, self.stream.cu_stream()) })?;
            self.sync()
        })
    }
}

impl Drop for CudaDeviceHeap {
    fn drop(&mut self) {
        let _ = guarded("CudaDeviceHeap::drop", || {
            drv("bind", self.ctx.bind_to_thread())?;
            let _ = self.stream.synchronize();
            self.scratch.lock().free();
            // SAFETY: each pointer is freed/closed exactly once; the stream is
            // idle, so no kernel still uses them.
            unsafe {
                if self.imported {
                    let _ = sys::cuIpcCloseMemHandle(self.headers);
                    let _ = sys::cuIpcCloseMemHandle(self.payload);
                } else {
                    let _ = cu::free_sync(self.headers);
                    let _ = cu::free_sync(self.payload);
                }
            }
            Ok(())
        });
    }
}

/// What a read's answer `code` means for the object at `meta`.
fn read_status(code: u32, meta: &ObjMeta, dst_cap: u64) -> Result<u64> {
    match code {
        status::PINNED => Ok(meta.bytes_total),
        status::NOT_READY => Err(GpuError::NotReady),
        status::TOO_SMALL => Err(GpuError::BufferTooSmall { need: meta.bytes_total, got: dst_cap }),
        status::STALE => Err(GpuError::Stale),
        other => Err(GpuError::Corrupted(format!("reader status {other}"))),
    }
}

/// What a publish answered (the state it found): Ok when it published or the
/// object was READY already, `Stale` otherwise (another epoch, or not written).
fn published(previous: u32) -> Result<()> {
    if previous == ObjectState::Writing.as_u32() || previous == ObjectState::Ready.as_u32() {
        Ok(())
    } else {
        Err(GpuError::Stale)
    }
}

/// A header's 128 bytes as the 16 native-endian words `nk_write_header` takes
/// by value (its `NkHeader`).
#[repr(C)]
#[derive(Clone, Copy)]
struct HeaderWords([u64; HEADER_SIZE / 8]);

// SAFETY: plain data with the layout of the kernel's `NkHeader` (16 u64, no
// padding), passed by value.
unsafe impl DeviceRepr for HeaderWords {}

impl HeaderWords {
    fn of(h: &HeaderSnapshot) -> Self {
        let b = h.to_bytes();
        Self(std::array::from_fn(|i| u64::from_ne_bytes(b[i * 8..i * 8 + 8].try_into().expect("8 bytes"))))
    }
}

fn ld_code(order: Ordering, relaxed: u32, acquire: u32, seqcst: u32) -> u32 {
    match order {
        Ordering::Relaxed => relaxed,
        Ordering::Acquire => acquire,
        _ => seqcst,
    }
}

fn st_code(order: Ordering, relaxed: u32, release: u32, seqcst: u32) -> u32 {
    match order {
        Ordering::Relaxed => relaxed,
        Ordering::Release => release,
        _ => seqcst,
    }
}

impl DeviceHeap for CudaDeviceHeap {
    fn header_slots(&self) -> u32 {
        self.header_slots
    }

    fn payload_capacity(&self) -> u64 {
        self.capacity
    }

    fn header_addr(&self, slot: u32) -> u64 {
        self.headers + u64::from(slot) * HEADER_SIZE as u64
    }

    fn payload_addr(&self, offset: u64) -> u64 {
        self.payload + offset
    }

    fn device_ordinal(&self) -> Option<usize> {
        Some(self.ordinal)
    }

    fn read_header(&self, slot: u32) -> Result<HeaderSnapshot> {
        let hdr = self.hdr(slot)?;
        let state = self.hdr_op(hdr + header_offsets::STATE as u64, op::LD32_ACQUIRE, 0, 0)? as u32;
        guarded("read_header", || {
            let _g = self.scratch.lock();
            drv("bind", self.ctx.bind_to_thread())?;
            let mut b = [0u8; HEADER_SIZE];
            // SAFETY: `hdr` is a 128-byte header inside the header array.
            drv("cuMemcpyDtoH", unsafe { cu::memcpy_dtoh_async(&mut b, hdr, self.stream.cu_stream()) })?;
            self.sync()?;
            let mut h = HeaderSnapshot::from_bytes(&b);
            h.state = state;
            Ok(h)
        })
    }

    /// The publish protocol of [`DeviceHeap::publish`] in one kernel
    /// (`nk_publish`: epoch check, system fence, `CAS WRITING -> READY`,
    /// `state_ts` stamp) and one host round trip, instead of the provided
    /// method's three or four (epoch load, CAS, `state_ts` store, each a kernel
    /// and a synchronization). Same answers: Ok when it published or the object
    /// was READY already with this epoch, `Stale` otherwise.
    fn publish(&self, slot: u32, epoch: u32, now_ns: u64) -> Result<()> {
        let hdr = self.hdr(slot)?;
        guarded("publish", || {
            let scratch = self.scratch.lock();
            drv("bind", self.ctx.bind_to_thread())?;
            scratch.clear_answer();
            let mut l = self.stream.launch_builder(&self.k.publish);
            l.arg(&hdr).arg(&epoch).arg(&now_ns).arg(&scratch.answer_dev);
            // SAFETY: types match (u64, u32, u64, u32*); `hdr` is in bounds
            // (checked by `hdr`), the answer word ours under the lock.
            drv("launch nk_publish", unsafe { l.launch(cfg1()) })?;
            self.sync()?;
            published(scratch.answer32())
        })
    }

    fn write_header(&self, slot: u32, h: &HeaderSnapshot) -> Result<()> {
        self.launch_write_header(slot, h, true)
    }

    fn write_header_in_order(&self, slot: u32, h: &HeaderSnapshot) -> Result<()> {
        // The kernel takes the header by value: nothing of ours is in flight
        // once it is enqueued, and every later launch of this heap runs after it.
        self.launch_write_header(slot, h, false)
    }

    fn load_u32(&self, slot: u32, f: HeaderU32Field, order: Ordering) -> Result<u32> {
        let a = self.hdr(slot)? + f.offset() as u64;
        let code = ld_code(order, op::LD32_RELAXED, op::LD32_ACQUIRE, op::LD32_SEQCST);
        Ok(self.hdr_op(a, code, 0, 0)? as u32)
    }

    fn store_u32(&self, slot: u32, f: HeaderU32Field, v: u32, order: Ordering) -> Result<()> {
        let a = self.hdr(slot)? + f.offset() as u64;
        let code = st_code(order, op::ST32_RELAXED, op::ST32_RELEASE, op::ST32_SEQCST);
        self.hdr_store(a, code, u64::from(v))
    }

    fn compare_exchange_u32(
        &self,
        slot: u32,
        f: HeaderU32Field,
        current: u32,
        new: u32,
    ) -> Result<std::result::Result<u32, u32>> {
        let a = self.hdr(slot)? + f.offset() as u64;
        let old = self.hdr_op(a, op::CAS32, u64::from(current), u64::from(new))? as u32;
        Ok(if old == current { Ok(old) } else { Err(old) })
    }

    fn fetch_add_u32(&self, slot: u32, f: HeaderU32Field, delta: i32) -> Result<u32> {
        let a = self.hdr(slot)? + f.offset() as u64;
        Ok(self.hdr_op(a, op::ADD32, u64::from(delta as u32), 0)? as u32)
    }

    fn load_u64(&self, slot: u32, f: HeaderU64Field, order: Ordering) -> Result<u64> {
        let a = self.hdr(slot)? + f.offset() as u64;
        let code = ld_code(order, op::LD64_RELAXED, op::LD64_ACQUIRE, op::LD64_SEQCST);
        self.hdr_op(a, code, 0, 0)
    }

    fn store_u64(&self, slot: u32, f: HeaderU64Field, v: u64, order: Ordering) -> Result<()> {
        let a = self.hdr(slot)? + f.offset() as u64;
        let code = st_code(order, op::ST64_RELAXED, op::ST64_RELEASE, op::ST64_SEQCST);
        self.hdr_store(a, code, v)
    }

    fn write_pages(&self, span: &PageSpan, first_page: u32, src: &[u8]) -> Result<u32> {
        self.check_span(span)?;
        let n = span.pages_for_len(first_page, src.len())?;
        if n == 0 {
            return Ok(0);
        }
        let dst = self.payload + span.page_offset(first_page);
        guarded("write_pages", || {
            let _g = self.scratch.lock();
            drv("bind", self.ctx.bind_to_thread())?;
            // SAFETY: the destination range lies inside the arena (check_span +
            // pages_for_len); `src` outlives the copy (synced below).
            drv("cuMemcpyHtoD", unsafe { cu::memcpy_htod_async(dst, src, self.stream.cu_stream()) })?;
            self.sync()
        })?;
        Ok(n)
    }

    fn read_pages(&self, span: &PageSpan, first_page: u32, dst: &mut [u8]) -> Result<u32> {
        self.check_span(span)?;
        let n = span.pages_for_len(first_page, dst.len())?;
        if n == 0 {
            return Ok(0);
        }
        let src = self.payload + span.page_offset(first_page);
        guarded("read_pages", || {
            let _g = self.scratch.lock();
            drv("bind", self.ctx.bind_to_thread())?;
            // SAFETY: the source range lies inside the arena (check_span +
            // pages_for_len, tail clamped); `dst` outlives the copy (synced).
            drv("cuMemcpyDtoH", unsafe { cu::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) })?;
            self.sync()
        })?;
        Ok(n)
    }
}

impl CudaDeviceHeap {
    /// Sets every header to DEAD (epoch 0) with one host-to-device copy.
    fn reset_all_headers(&self) -> Result<()> {
        let mut h =
            HeaderSnapshot { state: ObjectState::Dead.as_u32(), header_version: HEADER_VERSION, ..Default::default() };
        h.epoch = 0;
        let one = h.to_bytes();
        let all: Vec<u8> = one.iter().copied().cycle().take(self.header_slots as usize * HEADER_SIZE).collect();
        guarded("reset_all_headers", || {
            drv("bind", self.ctx.bind_to_thread())?;
            // SAFETY: the header array is exactly `all.len()` bytes.
            drv("cuMemcpyHtoD", unsafe { cu::memcpy_htod_sync(self.headers, &all) })
        })
    }
}
