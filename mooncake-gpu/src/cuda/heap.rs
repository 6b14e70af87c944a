//! [`CudaDeviceHeap`]: a device heap in GPU memory, its header atomics run as
//! one-thread kernels and its hot paths as stream-ordered kernels.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use cudarc::driver::{result as cu, sys, CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use parking_lot::Mutex;

use super::driver::{cuda_device_count, drv, guarded, nvrtc_available};
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

struct Kernels {
    hdr_op: CudaFunction,
    push_pages: CudaFunction,
    publish: CudaFunction,
    reader_enter: CudaFunction,
    read_pages: CudaFunction,
    reader_exit: CudaFunction,
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
    /// Device scratch (64 bytes) for kernel results; the lock also serialises
    /// the host operations on the stream.
    scratch: Mutex<sys::CUdeviceptr>,
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
                scratch: Mutex::new(0),
            };
            // From here `heap`'s Drop frees the allocations on error.
            // SAFETY: plain device allocation, freed in Drop.
            let scratch = drv("cuMemAlloc(scratch)", unsafe { cu::malloc_sync(64) })?;
            *heap.scratch.lock() = scratch;
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
                scratch: Mutex::new(0),
            };
            // SAFETY: plain device allocation, freed in Drop.
            let scratch = drv("cuMemAlloc(scratch)", unsafe { cu::malloc_sync(64) })?;
            *heap.scratch.lock() = scratch;
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
                push_pages: f("nk_push_pages")?,
                publish: f("nk_publish")?,
                reader_enter: f("nk_reader_enter")?,
                read_pages: f("nk_read_pages")?,
                reader_exit: f("nk_reader_exit")?,
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
            let out: u64 = *scratch;
            let mut l = self.stream.launch_builder(&self.k.hdr_op);
            l.arg(&addr).arg(&code).arg(&a).arg(&b).arg(&out);
            // SAFETY: argument types match the kernel signature
            // (u64, u32, u64, u64, u64*); `addr` is a header word inside this
            // heap (checked by `hdr`), `out` is our 64-byte scratch.
            drv("launch nk_hdr_op", unsafe { l.launch(cfg1()) })?;
            let mut r = [0u64; 1];
            drv("cuMemcpyDtoH", self.ctx.bind_to_thread())?;
            // SAFETY: `out` is a live 64-byte device allocation; `r` is 8 bytes.
            drv("cuMemcpyDtoH", unsafe { cu::memcpy_dtoh_async(&mut r, out, self.stream.cu_stream()) })?;
            self.sync()?;
            Ok(r[0])
        })
    }

    /// Runs `nk_hdr_op` for a store (whose result nobody reads): the kernel,
    /// then one stream synchronization, without the read-back copy `hdr_op`
    /// makes (one device-to-host copy less per store).
    fn hdr_store(&self, addr: sys::CUdeviceptr, code: u32, v: u64) -> Result<()> {
        guarded("hdr_store", || {
            let scratch = self.scratch.lock();
            let out: u64 = *scratch;
            let zero = 0u64;
            let mut l = self.stream.launch_builder(&self.k.hdr_op);
            l.arg(&addr).arg(&code).arg(&v).arg(&zero).arg(&out);
            // SAFETY: as in `hdr_op`: argument types match the kernel signature
            // (u64, u32, u64, u64, u64*); `addr` is a header word inside this
            // heap (checked by `hdr`), `out` is our 64-byte scratch (held locked
            // until the kernel completed: synchronized below).
            drv("launch nk_hdr_op", unsafe { l.launch(cfg1()) })?;
            self.sync()
        })
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
    /// the heap with `nk_push_pages`, and, if `publish`, flips READY with
    /// `nk_publish` on the same stream after the last page. Synchronous.
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
            let out: u64 = *scratch;
            let page0 = self.payload + span.payload_base;
            let mut l = self.stream.launch_builder(&self.k.push_pages);
            l.arg(&src).arg(&page0).arg(&span.page_size).arg(&first_page).arg(&span.n_pages).arg(&span.last_page_bytes);
            // SAFETY: argument types match (u8*, u64, u32, u32, u32, u32); the
            // destination pages lie inside the arena (check_span) and the
            // source holds `n_pages` pages (caller's contract on `src`).
            drv("launch nk_push_pages", unsafe { l.launch(copy_cfg(span.page_size, n_pages)) })?;
            if !publish {
                return self.sync();
            }
            self.publish_kernel(out, hdr, plan.epoch, now_ns)
        })
    }

    /// `nk_publish` of the header at `hdr` on the heap's stream (after whatever
    /// was enqueued before), its answer read back through the scratch word `out`
    /// (the caller holds the scratch lock): one host round trip.
    fn publish_kernel(&self, out: u64, hdr: sys::CUdeviceptr, epoch: u32, now_ns: u64) -> Result<()> {
        let mut l = self.stream.launch_builder(&self.k.publish);
        l.arg(&hdr).arg(&epoch).arg(&now_ns).arg(&out);
        // SAFETY: types match (u64, u32, u64, u32*); `hdr` is in bounds (the
        // callers got it from `hdr`).
        drv("launch nk_publish", unsafe { l.launch(cfg1()) })?;
        let mut r = [0u32; 1];
        // SAFETY: `out` is our live scratch allocation.
        drv("cuMemcpyDtoH", unsafe { cu::memcpy_dtoh_async(&mut r, out, self.stream.cu_stream()) })?;
        self.sync()?;
        let writing = ObjectState::Writing.as_u32();
        let ready = ObjectState::Ready.as_u32();
        if r[0] == writing || r[0] == ready {
            Ok(())
        } else {
            Err(GpuError::Stale)
        }
    }

    /// Reader path: copies the object at `meta` into the device buffer `dst`
    /// (`dst_cap` bytes) with the device-side protocol (`nk_reader_enter`
    /// acquire + pin + re-check, `nk_read_pages` tail-clamped copy,
    /// `nk_reader_exit` unpin), stream-ordered, one host round trip.
    /// Returns the object size.
    pub fn read_into_device(&self, meta: &ObjMeta, key: &KeyId, dst: u64, dst_cap: u64) -> Result<u64> {
        let hdr = self.hdr(meta.slot)?;
        self.check_span(&meta.span())?;
        guarded("read_into_device", || {
            let scratch = self.scratch.lock();
            let st: u64 = *scratch;
            let mut l = self.stream.launch_builder(&self.k.reader_enter);
            l.arg(&hdr).arg(&meta.epoch).arg(&key.hash).arg(&key.fp_hi).arg(&key.len).arg(&dst_cap).arg(&st);
            // SAFETY: types match (u64, u32, u64, u64, u32, u64, u32*).
            drv("launch nk_reader_enter", unsafe { l.launch(cfg1()) })?;
            let mut l = self.stream.launch_builder(&self.k.read_pages);
            l.arg(&st).arg(&hdr).arg(&self.payload).arg(&dst);
            // SAFETY: types match (u32*, u64, u64, u8*); the kernel copies only
            // when pinned and the header's size was checked against `dst_cap`
            // by nk_reader_enter; the pinned header equals `meta` (epoch).
            drv("launch nk_read_pages", unsafe { l.launch(copy_cfg(meta.page_bytes, meta.n_pages)) })?;
            let mut l = self.stream.launch_builder(&self.k.reader_exit);
            l.arg(&hdr).arg(&st);
            // SAFETY: types match (u64, u32*).
            drv("launch nk_reader_exit", unsafe { l.launch(cfg1()) })?;
            let mut r = [0u32; 1];
            // SAFETY: `st` is our live scratch allocation.
            drv("cuMemcpyDtoH", unsafe { cu::memcpy_dtoh_async(&mut r, st, self.stream.cu_stream()) })?;
            self.sync()?;
            match r[0] {
                status::PINNED => Ok(meta.bytes_total),
                status::NOT_READY => Err(GpuError::NotReady),
                status::TOO_SMALL => Err(GpuError::BufferTooSmall { need: meta.bytes_total, got: dst_cap }),
                status::STALE => Err(GpuError::Stale),
                other => Err(GpuError::Corrupted(format!("reader status {other}"))),
            }
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
            let scratch = *self.scratch.lock();
            // SAFETY: each pointer is freed/closed exactly once; the stream is
            // idle, so no kernel still uses them.
            unsafe {
                if scratch != 0 {
                    let _ = cu::free_sync(scratch);
                }
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
            let out: u64 = *scratch;
            drv("bind", self.ctx.bind_to_thread())?;
            self.publish_kernel(out, hdr, epoch, now_ns)
        })
    }

    fn write_header(&self, slot: u32, h: &HeaderSnapshot) -> Result<()> {
        let hdr = self.hdr(slot)?;
        let b = h.to_bytes();
        guarded("write_header", || {
            let _g = self.scratch.lock();
            drv("bind", self.ctx.bind_to_thread())?;
            // Everything before `state`, then everything after `reader_refcnt`.
            let tail = header_offsets::READER_REFCNT + 4;
            // SAFETY: both ranges lie inside this slot's 128-byte header; the
            // host buffer `b` outlives the copies: it lives to the end of this
            // function, after the state store below synchronized the stream.
            unsafe {
                drv("cuMemcpyHtoD", cu::memcpy_htod_async(hdr, &b[..header_offsets::STATE], self.stream.cu_stream()))?;
                drv("cuMemcpyHtoD", cu::memcpy_htod_async(hdr + tail as u64, &b[tail..], self.stream.cu_stream()))?;
            }
            Ok(())
        })?;
        // State last, SeqCst store (fence.sc.sys: release for the copies above).
        // No synchronization between the copies and this kernel: it runs after
        // them on the same stream, and `hdr_store` synchronizes the stream before it
        // returns, so one host round trip covers the whole header write (it was
        // two: a sync after the copies, then the kernel's).
        self.hdr_store(hdr + header_offsets::STATE as u64, op::ST32_SEQCST, u64::from(h.state))
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
