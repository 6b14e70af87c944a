//! `VerbsRdma`: the seam on real RDMA devices, through libibverbs loaded at run
//! time with `libloading` (no build- or link-time dependency on rdma-core; a host
//! without it gets a [`TransferError::NoDevice`]).
//!
//! Exported functions are resolved by name. `ibv_post_send` and `ibv_poll_cq` are
//! inline in `verbs.h` (they call through the context's operation table), so they
//! are called the same way here: the offsets of `struct ibv_context_ops` and the
//! layouts of the structures below are compiled into every verbs application,
//! which makes them a frozen ABI of libibverbs.

use std::collections::HashMap;
use std::ffi::{c_int, c_uint, c_void, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::{
    Completion, CompletionStatus, MemoryRegion, PortInfo, ProtectionDomain, QpAddress, QpState, QueuePair,
    RdmaProvider, RemoteAccess, WorkOp, WorkRequest,
};
use crate::error::{Result, TransferError};

// Offsets and constants of rdma-core's public ABI (infiniband/verbs.h).
/// `struct ibv_context`: `ops` follows the device pointer.
const CTX_OPS: usize = 8;
/// `struct ibv_context_ops`: slot of `poll_cq` and of `post_send`.
const OPS_POLL_CQ: usize = 11;
const OPS_POST_SEND: usize = 25;
/// `struct ibv_device_attr`.
const DEV_MAX_MR_SIZE: usize = 80;
const DEV_MAX_QP_RD_ATOM: usize = 144;
const DEV_PHYS_PORT_CNT: usize = 227;
/// `struct ibv_port_attr`.
const PORT_STATE: usize = 0;
const PORT_ACTIVE_MTU: usize = 8;
const PORT_LID: usize = 34;
const PORT_LINK_LAYER: usize = 46;
const PORT_ACTIVE: u32 = 4;
const LINK_LAYER_ETHERNET: u8 = 2;
/// `struct ibv_mr`: keys.
const MR_LKEY: usize = 36;
const MR_RKEY: usize = 40;
/// `struct ibv_qp`: `qp_num`.
const QP_NUM: usize = 52;
/// Access flags: local write, remote write, remote read.
const ACCESS_LOCAL: c_int = 1;
const ACCESS_REMOTE_READ: c_int = 1 | 4;
const ACCESS_REMOTE: c_int = 1 | 2 | 4;

/// The `ibv_access_flags` of `access`.
fn access_flags(access: RemoteAccess) -> c_int {
    match access {
        RemoteAccess::LocalOnly => ACCESS_LOCAL,
        RemoteAccess::Read => ACCESS_REMOTE_READ,
        RemoteAccess::ReadWrite => ACCESS_REMOTE,
    }
}
/// `enum ibv_qp_type` RC, `enum ibv_qp_state`.
const QPT_RC: u32 = 2;
const QPS_INIT: u32 = 1;
const QPS_RTR: u32 = 2;
const QPS_RTS: u32 = 3;
const QPS_ERR: u32 = 6;
/// `enum ibv_qp_attr_mask`.
const M_STATE: c_int = 1;
const M_ACCESS: c_int = 1 << 3;
const M_PKEY: c_int = 1 << 4;
const M_PORT: c_int = 1 << 5;
const M_AV: c_int = 1 << 7;
const M_PATH_MTU: c_int = 1 << 8;
const M_TIMEOUT: c_int = 1 << 9;
const M_RETRY: c_int = 1 << 10;
const M_RNR_RETRY: c_int = 1 << 11;
const M_RQ_PSN: c_int = 1 << 12;
const M_RD_ATOMIC: c_int = 1 << 13;
const M_MIN_RNR: c_int = 1 << 15;
const M_SQ_PSN: c_int = 1 << 16;
const M_DEST_RD_ATOMIC: c_int = 1 << 17;
const M_DEST_QPN: c_int = 1 << 20;
/// `enum ibv_wr_opcode` and `IBV_SEND_SIGNALED`.
const WR_RDMA_WRITE: u32 = 0;
const WR_RDMA_READ: u32 = 4;
const SEND_SIGNALED: u32 = 2;

/// `struct ibv_qp_attr` (144 bytes), written by field offset.
#[repr(C, align(8))]
struct QpAttr([u8; 144]);

impl QpAttr {
    fn new() -> Self {
        Self([0; 144])
    }
    fn u8(&mut self, at: usize, v: u8) -> &mut Self {
        self.0[at] = v;
        self
    }
    fn u16(&mut self, at: usize, v: u16) -> &mut Self {
        self.0[at..at + 2].copy_from_slice(&v.to_ne_bytes());
        self
    }
    fn u32(&mut self, at: usize, v: u32) -> &mut Self {
        self.0[at..at + 4].copy_from_slice(&v.to_ne_bytes());
        self
    }
}

/// `struct ibv_qp_attr` field offsets (`ah_attr` starts at 56).
mod attr {
    pub(super) const STATE: usize = 0;
    pub(super) const PATH_MTU: usize = 8;
    pub(super) const RQ_PSN: usize = 20;
    pub(super) const SQ_PSN: usize = 24;
    pub(super) const DEST_QPN: usize = 28;
    pub(super) const ACCESS: usize = 32;
    pub(super) const AH_DGID: usize = 56;
    pub(super) const AH_SGID_INDEX: usize = 56 + 20;
    pub(super) const AH_HOP_LIMIT: usize = 56 + 21;
    pub(super) const AH_DLID: usize = 56 + 24;
    pub(super) const AH_IS_GLOBAL: usize = 56 + 29;
    pub(super) const AH_PORT: usize = 56 + 30;
    pub(super) const PKEY_INDEX: usize = 120;
    pub(super) const MAX_RD_ATOMIC: usize = 126;
    pub(super) const MAX_DEST_RD_ATOMIC: usize = 127;
    pub(super) const MIN_RNR_TIMER: usize = 128;
    pub(super) const PORT: usize = 129;
    pub(super) const TIMEOUT: usize = 130;
    pub(super) const RETRY_CNT: usize = 131;
    pub(super) const RNR_RETRY: usize = 132;
}

/// `struct ibv_sge`.
#[repr(C)]
struct Sge {
    addr: u64,
    length: u32,
    lkey: u32,
}

/// `struct ibv_send_wr` (128 bytes): the fields an RDMA READ/WRITE uses.
#[repr(C)]
struct SendWr {
    wr_id: u64,
    next: *mut SendWr,
    sg_list: *mut Sge,
    num_sge: c_int,
    opcode: u32,
    send_flags: c_uint,
    imm_data: u32,
    remote_addr: u64,
    rkey: u32,
    _rest: [u32; 21],
}

/// `struct ibv_wc` (48 bytes).
#[repr(C)]
#[derive(Clone, Copy)]
struct Wc {
    wr_id: u64,
    status: u32,
    _rest: [u32; 9],
}

type GetDeviceList = unsafe extern "C" fn(*mut c_int) -> *mut *mut c_void;
type FreeDeviceList = unsafe extern "C" fn(*mut *mut c_void);
type GetDeviceName = unsafe extern "C" fn(*mut c_void) -> *const std::ffi::c_char;
type OpenDevice = unsafe extern "C" fn(*mut c_void) -> *mut c_void;
type QueryDevice = unsafe extern "C" fn(*mut c_void, *mut u8) -> c_int;
type QueryPort = unsafe extern "C" fn(*mut c_void, u8, *mut u8) -> c_int;
type QueryGid = unsafe extern "C" fn(*mut c_void, u8, c_int, *mut [u8; 16]) -> c_int;
type AllocPd = unsafe extern "C" fn(*mut c_void) -> *mut c_void;
type Destroy = unsafe extern "C" fn(*mut c_void) -> c_int;
type RegMr = unsafe extern "C" fn(*mut c_void, *mut c_void, usize, c_int) -> *mut c_void;
type RegDmabufMr = unsafe extern "C" fn(*mut c_void, u64, usize, u64, c_int, c_int) -> *mut c_void;
type CreateCq = unsafe extern "C" fn(*mut c_void, c_int, *mut c_void, *mut c_void, c_int) -> *mut c_void;
type CreateQp = unsafe extern "C" fn(*mut c_void, *mut u8) -> *mut c_void;
type ModifyQp = unsafe extern "C" fn(*mut c_void, *mut QpAttr, c_int) -> c_int;
type PostSend = unsafe extern "C" fn(*mut c_void, *mut SendWr, *mut *mut SendWr) -> c_int;
type PollCq = unsafe extern "C" fn(*mut c_void, c_int, *mut Wc) -> c_int;

/// The libibverbs functions used, resolved once.
struct Lib {
    _lib: libloading::Library,
    get_device_list: GetDeviceList,
    free_device_list: FreeDeviceList,
    get_device_name: GetDeviceName,
    open_device: OpenDevice,
    close_device: Destroy,
    query_device: QueryDevice,
    query_port: QueryPort,
    query_gid: QueryGid,
    alloc_pd: AllocPd,
    dealloc_pd: Destroy,
    reg_mr: RegMr,
    /// `ibv_reg_dmabuf_mr` (rdma-core 34 and later), for GPU memory.
    reg_dmabuf_mr: Option<RegDmabufMr>,
    dereg_mr: Destroy,
    create_cq: CreateCq,
    destroy_cq: Destroy,
    create_qp: CreateQp,
    destroy_qp: Destroy,
    modify_qp: ModifyQp,
}

fn no_device(what: impl std::fmt::Display) -> TransferError {
    TransferError::NoDevice(format!("libibverbs: {what}"))
}

impl Lib {
    fn load() -> Result<Self> {
        // SAFETY: loading libibverbs runs its initialisers, which have no
        // preconditions on the loading process.
        let lib = unsafe { libloading::Library::new("libibverbs.so.1") }.map_err(no_device)?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol is libibverbs' exported function of that name,
                // whose C signature the type alias spells; the library is kept
                // alive in `_lib` as long as the pointer.
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }.map_err(no_device)?
            };
        }
        Ok(Self {
            get_device_list: sym!("ibv_get_device_list"),
            free_device_list: sym!("ibv_free_device_list"),
            get_device_name: sym!("ibv_get_device_name"),
            open_device: sym!("ibv_open_device"),
            close_device: sym!("ibv_close_device"),
            query_device: sym!("ibv_query_device"),
            query_port: sym!("ibv_query_port"),
            query_gid: sym!("ibv_query_gid"),
            alloc_pd: sym!("ibv_alloc_pd"),
            dealloc_pd: sym!("ibv_dealloc_pd"),
            reg_mr: sym!("ibv_reg_mr"),
            // SAFETY: as `sym!`; absent from older libraries, hence optional.
            reg_dmabuf_mr: unsafe { lib.get::<RegDmabufMr>(b"ibv_reg_dmabuf_mr\0") }.ok().map(|f| *f),
            dereg_mr: sym!("ibv_dereg_mr"),
            create_cq: sym!("ibv_create_cq"),
            destroy_cq: sym!("ibv_destroy_cq"),
            create_qp: sym!("ibv_create_qp"),
            destroy_qp: sym!("ibv_destroy_qp"),
            modify_qp: sym!("ibv_modify_qp"),
            _lib: lib,
        })
    }
}

/// An opened device context.
struct Ctx {
    lib: Arc<Lib>,
    ctx: *mut c_void,
    max_qp_rd_atom: u8,
}

// SAFETY: verbs objects may be used from any thread (libibverbs is thread-safe);
// the pointer is only closed on drop, when no other user is left.
unsafe impl Send for Ctx {}
// SAFETY: as above.
unsafe impl Sync for Ctx {}

impl Drop for Ctx {
    fn drop(&mut self) {
        // SAFETY: `ctx` came from ibv_open_device and every object made from it
        // holds an `Arc<Ctx>`, so none is left.
        unsafe { (self.lib.close_device)(self.ctx) };
    }
}

impl Ctx {
    /// The context's operation `slot` (see [`OPS_POST_SEND`]).
    fn op(&self, slot: usize) -> *const c_void {
        // SAFETY: `ctx` points to a live `struct ibv_context`, whose `ops` table
        // of function pointers starts at `CTX_OPS` (frozen ABI, see module docs).
        unsafe { *(self.ctx.cast::<u8>().add(CTX_OPS + slot * 8).cast::<*const c_void>()) }
    }
}

/// RDMA devices of this host through libibverbs (active ports only).
pub struct VerbsRdma {
    ports: Vec<(Arc<Ctx>, PortInfo)>,
}

impl std::fmt::Debug for VerbsRdma {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsRdma").field("ports", &self.ports.iter().map(|(_, p)| p).collect::<Vec<_>>()).finish()
    }
}

fn sysfs(path: &str) -> Option<String> {
    std::fs::read_to_string(path).ok().map(|s| s.trim().to_owned())
}

fn mtu_bytes(code: u32) -> u32 {
    match code {
        1 => 256,
        2 => 512,
        3 => 1024,
        4 => 2048,
        _ => 4096,
    }
}

fn mtu_code(bytes: u32) -> u32 {
    match bytes {
        256 => 1,
        512 => 2,
        1024 => 3,
        2048 => 4,
        _ => 5,
    }
}

impl VerbsRdma {
    /// Loads libibverbs and discovers every active port;
    /// [`TransferError::NoDevice`] if the library or any active port is missing.
    pub fn open() -> Result<Self> {
        let lib = Arc::new(Lib::load()?);
        let mut n: c_int = 0;
        // SAFETY: writes the count to `n`; returns a NULL-terminated array or NULL.
        let list = unsafe { (lib.get_device_list)(&mut n) };
        if list.is_null() {
            return Err(no_device("no device list"));
        }
        let mut ports = Vec::new();
        for i in 0..n.max(0) as usize {
            // SAFETY: `i < n`, inside the array returned above.
            let dev = unsafe { *list.add(i) };
            // SAFETY: `dev` is a device of the list; the name is a C string it owns.
            let name = unsafe { CStr::from_ptr((lib.get_device_name)(dev)) }.to_string_lossy().into_owned();
            if let Err(e) = Self::discover(&lib, dev, &name, &mut ports) {
                tracing::warn!(device = name, error = %e, "skipping an RDMA device");
            }
        }
        // SAFETY: the list came from ibv_get_device_list; opened contexts stay valid.
        unsafe { (lib.free_device_list)(list) };
        if ports.is_empty() {
            return Err(no_device("no active port"));
        }
        Ok(Self { ports })
    }

    fn discover(lib: &Arc<Lib>, dev: *mut c_void, name: &str, out: &mut Vec<(Arc<Ctx>, PortInfo)>) -> Result<()> {
        // SAFETY: `dev` is a device of a live device list.
        let raw = unsafe { (lib.open_device)(dev) };
        if raw.is_null() {
            return Err(no_device(format!("cannot open {name}")));
        }
        let mut dattr = [0u8; 512];
        // SAFETY: `raw` is an open context; the buffer is larger than the attributes.
        if unsafe { (lib.query_device)(raw, dattr.as_mut_ptr()) } != 0 {
            // SAFETY: closing the context just opened.
            unsafe { (lib.close_device)(raw) };
            return Err(no_device(format!("cannot query {name}")));
        }
        let max_mr_size = u64::from_ne_bytes(dattr[DEV_MAX_MR_SIZE..DEV_MAX_MR_SIZE + 8].try_into().expect("8"));
        let rd_atom = i32::from_ne_bytes(dattr[DEV_MAX_QP_RD_ATOM..DEV_MAX_QP_RD_ATOM + 4].try_into().expect("4"));
        let ctx = Arc::new(Ctx { lib: lib.clone(), ctx: raw, max_qp_rd_atom: rd_atom.clamp(1, 16) as u8 });
        let numa_node = sysfs(&format!("/sys/class/infiniband/{name}/device/numa_node"))
            .and_then(|s| s.parse::<i64>().ok())
            .and_then(|n| u32::try_from(n).ok());
        for port in 1..=dattr[DEV_PHYS_PORT_CNT] {
            let mut pattr = [0u8; 256];
            // SAFETY: open context, valid port number, buffer larger than the attributes.
            if unsafe { (lib.query_port)(raw, port, pattr.as_mut_ptr()) } != 0 {
                continue;
            }
            let u32_at = |at: usize| u32::from_ne_bytes(pattr[at..at + 4].try_into().expect("4"));
            if u32_at(PORT_STATE) != PORT_ACTIVE {
                continue;
            }
            let roce = pattr[PORT_LINK_LAYER] == LINK_LAYER_ETHERNET;
            let Some((gid_index, gid)) = Self::pick_gid(lib, raw, name, port, roce) else { continue };
            out.push((
                ctx.clone(),
                PortInfo {
                    device: name.to_owned(),
                    port,
                    numa_node,
                    active_mtu: mtu_bytes(u32_at(PORT_ACTIVE_MTU)),
                    max_mr_size,
                    lid: u16::from_ne_bytes([pattr[PORT_LID], pattr[PORT_LID + 1]]),
                    gid,
                    gid_index,
                },
            ));
        }
        Ok(())
    }

    /// The GID to use: on RoCE the first RoCE v2 entry, preferring an IPv4-mapped
    /// one (routable, and what peers on IPv4 networks share); on InfiniBand index 0.
    fn pick_gid(lib: &Lib, ctx: *mut c_void, name: &str, port: u8, roce: bool) -> Option<(u8, [u8; 16])> {
        let query = |i: u8| {
            let mut gid = [0u8; 16];
            // SAFETY: open context, active port; writes 16 bytes to `gid`.
            (unsafe { (lib.query_gid)(ctx, port, c_int::from(i), &mut gid) } == 0 && gid != [0; 16]).then_some(gid)
        };
        if !roce {
            return query(0).map(|g| (0, g));
        }
        let mut best: Option<(u8, [u8; 16])> = None;
        for i in 0..=254u8 {
            let kind = sysfs(&format!("/sys/class/infiniband/{name}/ports/{port}/gid_attrs/types/{i}"));
            if kind.as_deref() != Some("RoCE v2") {
                continue;
            }
            let Some(gid) = query(i) else { continue };
            let v4 = gid[..10] == [0; 10] && gid[10..12] == [0xff, 0xff];
            if v4 {
                return Some((i, gid));
            }
            best.get_or_insert((i, gid));
        }
        best
    }
}

impl RdmaProvider for VerbsRdma {
    fn implementation(&self) -> &'static str {
        "verbs"
    }

    fn ports(&self) -> Vec<PortInfo> {
        self.ports.iter().map(|(_, p)| p.clone()).collect()
    }

    fn open(&self, port: usize) -> Result<Arc<dyn ProtectionDomain>> {
        let (ctx, info) = self.ports.get(port).ok_or_else(|| no_device(format!("no port {port}")))?;
        // SAFETY: open context.
        let pd = unsafe { (ctx.lib.alloc_pd)(ctx.ctx) };
        if pd.is_null() {
            return Err(TransferError::Registration(format!("ibv_alloc_pd on {}", info.device)));
        }
        Ok(Arc::new(VerbsPd { ctx: ctx.clone(), pd, info: info.clone(), mrs: Mutex::new(HashMap::new()) }))
    }
}

/// A protection domain, and its registered regions by lkey.
struct VerbsPd {
    ctx: Arc<Ctx>,
    pd: *mut c_void,
    info: PortInfo,
    mrs: Mutex<HashMap<u32, usize>>,
}

// SAFETY: see `Ctx`; the region table is behind a mutex.
unsafe impl Send for VerbsPd {}
// SAFETY: as above.
unsafe impl Sync for VerbsPd {}

impl Drop for VerbsPd {
    fn drop(&mut self) {
        for (_, mr) in self.mrs.get_mut().drain() {
            // SAFETY: each pointer came from ibv_reg_mr and is deregistered once.
            unsafe { (self.ctx.lib.dereg_mr)(mr as *mut c_void) };
        }
        // SAFETY: its regions are gone and its queue pairs hold an `Arc` of this
        // domain, so none is left.
        unsafe { (self.ctx.lib.dealloc_pd)(self.pd) };
    }
}

impl ProtectionDomain for VerbsPd {
    fn port(&self) -> &PortInfo {
        &self.info
    }

    unsafe fn register(&self, addr: *mut u8, len: u64, access: RemoteAccess) -> Result<MemoryRegion> {
        if len == 0 || len > self.info.max_mr_size {
            return Err(TransferError::Registration(format!("memory region of {len} bytes")));
        }
        let flags = access_flags(access);
        // SAFETY: the caller keeps the range valid as the trait requires.
        let mr = unsafe { (self.ctx.lib.reg_mr)(self.pd, addr.cast(), len as usize, flags) };
        if mr.is_null() {
            return Err(TransferError::Registration(format!(
                "ibv_reg_mr of {len} bytes: {}",
                std::io::Error::last_os_error()
            )));
        }
        // SAFETY: `mr` points to a live `struct ibv_mr`; keys at their ABI offsets.
        let (lkey, rkey) =
            unsafe { (*mr.cast::<u8>().add(MR_LKEY).cast::<u32>(), *mr.cast::<u8>().add(MR_RKEY).cast::<u32>()) };
        self.mrs.lock().insert(lkey, mr as usize);
        Ok(MemoryRegion { addr: addr as u64, len, lkey, rkey: if access.is_remote() { rkey } else { 0 } })
    }

    unsafe fn register_dmabuf(
        &self,
        fd: i32,
        offset: u64,
        len: u64,
        iova: u64,
        access: RemoteAccess,
    ) -> Result<MemoryRegion> {
        let Some(reg) = self.ctx.lib.reg_dmabuf_mr else {
            return Err(TransferError::Registration("libibverbs has no ibv_reg_dmabuf_mr".into()));
        };
        if len == 0 || len > self.info.max_mr_size {
            return Err(TransferError::Registration(format!("dma-buf memory region of {len} bytes")));
        }
        let flags = access_flags(access);
        // SAFETY: the caller keeps the dma-buf allocated as the trait requires.
        let mr = unsafe { reg(self.pd, offset, len as usize, iova, fd, flags) };
        if mr.is_null() {
            return Err(TransferError::Registration(format!(
                "ibv_reg_dmabuf_mr of {len} bytes: {}",
                std::io::Error::last_os_error()
            )));
        }
        // SAFETY: `mr` points to a live `struct ibv_mr`; keys at their ABI offsets.
        let (lkey, rkey) =
            unsafe { (*mr.cast::<u8>().add(MR_LKEY).cast::<u32>(), *mr.cast::<u8>().add(MR_RKEY).cast::<u32>()) };
        self.mrs.lock().insert(lkey, mr as usize);
        Ok(MemoryRegion { addr: iova, len, lkey, rkey: if access.is_remote() { rkey } else { 0 } })
    }

    fn deregister(&self, mr: &MemoryRegion) {
        if let Some(p) = self.mrs.lock().remove(&mr.lkey) {
            // SAFETY: the pointer came from ibv_reg_mr and was removed from the table.
            unsafe { (self.ctx.lib.dereg_mr)(p as *mut c_void) };
        }
    }

    fn create_qp(&self, depth: u32) -> Result<Box<dyn QueuePair>> {
        let lib = &self.ctx.lib;
        // SAFETY: open context; no completion channel.
        let cq =
            unsafe { (lib.create_cq)(self.ctx.ctx, depth as c_int * 2, std::ptr::null_mut(), std::ptr::null_mut(), 0) };
        if cq.is_null() {
            return Err(TransferError::Registration("ibv_create_cq".into()));
        }
        // `struct ibv_qp_init_attr`: send/recv CQ, capabilities, RC, not all signaled.
        let mut init = [0u8; 64];
        init[8..16].copy_from_slice(&(cq as u64).to_ne_bytes());
        init[16..24].copy_from_slice(&(cq as u64).to_ne_bytes());
        for (at, v) in [(32, depth), (36, 1), (40, 1), (44, 1), (48, 0), (52, QPT_RC), (56, 0)] {
            init[at..at + 4].copy_from_slice(&v.to_ne_bytes());
        }
        // SAFETY: live protection domain; `init` is a complete init-attr structure.
        let qp = unsafe { (lib.create_qp)(self.pd, init.as_mut_ptr()) };
        if qp.is_null() {
            // SAFETY: the CQ just created has no queue pair.
            unsafe { (lib.destroy_cq)(cq) };
            return Err(TransferError::Registration("ibv_create_qp".into()));
        }
        // SAFETY: `qp` points to a live `struct ibv_qp`.
        let qp_num = unsafe { *qp.cast::<u8>().add(QP_NUM).cast::<u32>() };
        Ok(Box::new(VerbsQp {
            ctx: self.ctx.clone(),
            info: self.info.clone(),
            qp,
            cq,
            qp_num,
            psn: rand::random::<u32>() & 0xff_ffff,
            state: QpState::Reset,
            path_mtu: 0,
            outstanding: AtomicUsize::new(0),
            stash: Vec::new(),
        }))
    }
}

/// An RC queue pair and its completion queue.
struct VerbsQp {
    ctx: Arc<Ctx>,
    info: PortInfo,
    qp: *mut c_void,
    cq: *mut c_void,
    qp_num: u32,
    psn: u32,
    state: QpState,
    path_mtu: u32,
    outstanding: AtomicUsize,
    /// Completions reaped while moving to ERR, handed out by the next poll.
    stash: Vec<Completion>,
}

// SAFETY: see `Ctx`; one owner at a time (`&mut self` for every call).
unsafe impl Send for VerbsQp {}

impl Drop for VerbsQp {
    fn drop(&mut self) {
        if self.state != QpState::Error {
            self.to_error();
        }
        // SAFETY: the queue pair, then its CQ, each destroyed once.
        unsafe {
            (self.ctx.lib.destroy_qp)(self.qp);
            (self.ctx.lib.destroy_cq)(self.cq);
        }
    }
}

impl VerbsQp {
    fn modify(&mut self, attr: &mut QpAttr, mask: c_int, to: QpState) -> Result<()> {
        // SAFETY: live queue pair; `attr` is a complete `struct ibv_qp_attr`.
        let rc = unsafe { (self.ctx.lib.modify_qp)(self.qp, attr, mask) };
        if rc != 0 {
            return Err(TransferError::Protocol(format!("ibv_modify_qp to {to:?}: error {rc}")));
        }
        self.state = to;
        Ok(())
    }

    fn reap(&mut self, out: &mut Vec<Completion>) -> usize {
        let mut wc = [Wc { wr_id: 0, status: 0, _rest: [0; 9] }; 32];
        // SAFETY: `poll_cq` of this context's operation table (frozen ABI), on
        // this queue pair's CQ, with room for 32 completions.
        let n = unsafe {
            let poll: PollCq = std::mem::transmute::<*const c_void, PollCq>(self.ctx.op(OPS_POLL_CQ));
            poll(self.cq, wc.len() as c_int, wc.as_mut_ptr())
        };
        let n = n.max(0) as usize;
        for w in &wc[..n] {
            let status = match w.status {
                0 => CompletionStatus::Success,
                4 | 8 => CompletionStatus::LocalProtection,
                5 => CompletionStatus::Flushed,
                9 | 10 => CompletionStatus::RemoteAccess,
                12 | 13 => CompletionStatus::RetryExceeded,
                s => CompletionStatus::Other(s),
            };
            out.push(Completion { wr_id: w.wr_id, status });
        }
        self.outstanding.fetch_sub(n, Ordering::Relaxed);
        n
    }
}

impl QueuePair for VerbsQp {
    fn address(&self) -> QpAddress {
        QpAddress {
            nic: 0,
            qp_num: self.qp_num,
            lid: self.info.lid,
            gid: self.info.gid,
            gid_index: self.info.gid_index,
            mtu: self.info.active_mtu,
            psn: self.psn,
        }
    }

    fn state(&self) -> QpState {
        self.state
    }

    fn to_init(&mut self) -> Result<()> {
        let mut a = QpAttr::new();
        a.u32(attr::STATE, QPS_INIT).u16(attr::PKEY_INDEX, 0).u8(attr::PORT, self.info.port);
        a.u32(attr::ACCESS, ACCESS_REMOTE as u32);
        self.modify(&mut a, M_STATE | M_PKEY | M_PORT | M_ACCESS, QpState::Init)
    }

    fn to_rtr(&mut self, remote: &QpAddress, mtu: u32) -> Result<()> {
        let mut a = QpAttr::new();
        a.u32(attr::STATE, QPS_RTR).u32(attr::PATH_MTU, mtu_code(mtu)).u32(attr::DEST_QPN, remote.qp_num);
        a.u32(attr::RQ_PSN, remote.psn).u8(attr::MAX_DEST_RD_ATOMIC, self.ctx.max_qp_rd_atom);
        a.u8(attr::MIN_RNR_TIMER, 12).u16(attr::AH_DLID, remote.lid).u8(attr::AH_PORT, self.info.port);
        if remote.gid != [0; 16] {
            a.0[attr::AH_DGID..attr::AH_DGID + 16].copy_from_slice(&remote.gid);
            a.u8(attr::AH_IS_GLOBAL, 1).u8(attr::AH_SGID_INDEX, self.info.gid_index).u8(attr::AH_HOP_LIMIT, 64);
        }
        let mask = M_STATE | M_AV | M_PATH_MTU | M_DEST_QPN | M_RQ_PSN | M_DEST_RD_ATOMIC | M_MIN_RNR;
        self.modify(&mut a, mask, QpState::Rtr)?;
        self.path_mtu = mtu;
        Ok(())
    }

    fn to_rts(&mut self) -> Result<()> {
        // 4.096 µs x 2^14 = 67 ms per try, 7 tries: a dead peer is known in about
        // half a second instead of hanging a transfer.
        let mut a = QpAttr::new();
        a.u32(attr::STATE, QPS_RTS).u8(attr::TIMEOUT, 14).u8(attr::RETRY_CNT, 7).u8(attr::RNR_RETRY, 7);
        a.u32(attr::SQ_PSN, self.psn).u8(attr::MAX_RD_ATOMIC, self.ctx.max_qp_rd_atom);
        self.modify(&mut a, M_STATE | M_TIMEOUT | M_RETRY | M_RNR_RETRY | M_SQ_PSN | M_RD_ATOMIC, QpState::Rts)
    }

    fn to_error(&mut self) {
        let mut a = QpAttr::new();
        a.u32(attr::STATE, QPS_ERR);
        let _ = self.modify(&mut a, M_STATE, QpState::Error);
        self.state = QpState::Error;
        // Wait for every posted request to be flushed: only then is the device
        // done with their buffers.
        let until = Instant::now() + Duration::from_secs(2);
        let mut stash = std::mem::take(&mut self.stash);
        while self.outstanding.load(Ordering::Relaxed) > 0 && Instant::now() < until {
            if self.reap(&mut stash) == 0 {
                std::thread::yield_now();
            }
        }
        self.stash = stash;
    }

    fn path_mtu(&self) -> u32 {
        self.path_mtu
    }

    unsafe fn post(&mut self, batch: &[WorkRequest]) -> Result<()> {
        if batch.is_empty() {
            return Ok(());
        }
        let mut sges: Vec<Sge> =
            batch.iter().map(|w| Sge { addr: w.local_addr, length: w.len, lkey: w.lkey }).collect();
        let mut wrs: Vec<SendWr> = batch
            .iter()
            .zip(sges.iter_mut())
            .map(|(w, sge)| SendWr {
                wr_id: w.wr_id,
                next: std::ptr::null_mut(),
                sg_list: sge,
                num_sge: 1,
                opcode: match w.op {
                    WorkOp::Read => WR_RDMA_READ,
                    WorkOp::Write => WR_RDMA_WRITE,
                },
                send_flags: SEND_SIGNALED,
                imm_data: 0,
                remote_addr: w.remote_addr,
                rkey: w.rkey,
                _rest: [0; 21],
            })
            .collect();
        // Chain them: one post, one doorbell.
        let base = wrs.as_mut_ptr();
        for i in 0..wrs.len() - 1 {
            // SAFETY: `i + 1 < len`: both pointers are inside `wrs`.
            wrs[i].next = unsafe { base.add(i + 1) };
        }
        let mut bad: *mut SendWr = std::ptr::null_mut();
        // SAFETY: `post_send` of this context's operation table (frozen ABI) on a
        // live queue pair; the chain and its SGEs live across the call (the
        // device copies them); local ranges are valid per this method's contract.
        let rc = unsafe {
            let post: PostSend = std::mem::transmute::<*const c_void, PostSend>(self.ctx.op(OPS_POST_SEND));
            post(self.qp, base, &mut bad)
        };
        // Requests before `bad` were posted and will complete (flushed, if the
        // caller moves the queue pair to ERR).
        let posted = if rc == 0 || bad.is_null() {
            if rc == 0 {
                batch.len()
            } else {
                0
            }
        } else {
            (bad as usize - base as usize) / std::mem::size_of::<SendWr>()
        };
        self.outstanding.fetch_add(posted, Ordering::Relaxed);
        if rc != 0 {
            return Err(TransferError::Io(format!("ibv_post_send: error {rc}")));
        }
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<Completion>, wait: Duration) -> Result<usize> {
        let before = out.len();
        out.append(&mut self.stash);
        let until = Instant::now() + wait;
        loop {
            self.reap(out);
            if out.len() > before || Instant::now() >= until {
                return Ok(out.len() - before);
            }
            std::thread::yield_now();
        }
    }
}
