//! `SoftRdma`: software NICs implementing the verbs seam, so that the whole RDMA
//! transport runs (and is tested) on machines without an RDMA device.
//!
//! Each software NIC listens on a loopback TCP port; its GID is the IPv4-mapped
//! address and its LID the port (as a RoCE v2 GID carries an IP address). A queue
//! pair that posts work opens one connection to the NIC of its remote queue pair,
//! which checks the connection names one of its queue pairs in RTR/RTS connected
//! back to the sender, then serves READ and WRITE requests against its memory
//! regions by rkey, with the bounds and protection-domain checks of a real NIC.
//! Requests of one queue pair are answered in order, like an RC connection.
//! Nothing measured on it is an RDMA result.

use std::collections::{HashMap, VecDeque};
use std::io::{BufReader, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::{Condvar, Mutex, RwLock};

use super::{
    Completion, CompletionStatus, MemoryRegion, PortInfo, ProtectionDomain, QpAddress, QpState, QueuePair,
    RdmaProvider, RemoteAccess, WorkOp, WorkRequest,
};
use crate::error::{Result, TransferError};

/// Bytes of a request on the soft fabric: op u8 | wr_id u64 | addr u64 | rkey u32 | len u32.
const REQ_LEN: usize = 25;
/// Bytes of a response: wr_id u64 | status u8.
const RESP_LEN: usize = 9;

/// Faults injected into every NIC of a [`SoftRdma`].
#[derive(Debug, Default)]
pub struct SoftFaults {
    dead: AtomicBool,
    delay_us: AtomicU64,
    qp_errors: AtomicU32,
    served: Mutex<Vec<TcpStream>>,
    /// Posts that sent work (one write to the fabric each): the doorbells rung.
    doorbells: AtomicU64,
    refuse_dmabuf: AtomicBool,
    /// dma-buf memory regions registered so far.
    dmabuf_registrations: AtomicU64,
}

impl SoftFaults {
    /// The NICs die: every connection they serve is cut and new ones are refused,
    /// so peers' outstanding requests complete with
    /// [`CompletionStatus::RetryExceeded`].
    pub fn kill(&self) {
        self.dead.store(true, Ordering::SeqCst);
        for c in self.served.lock().drain(..) {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
    }

    /// The NICs serve again (after [`kill`](Self::kill)).
    pub fn revive(&self) {
        self.dead.store(false, Ordering::SeqCst);
    }

    /// Every answer of these NICs waits `delay` first (slow completions).
    pub fn set_completion_delay(&self, delay: Duration) {
        self.delay_us.store(delay.as_micros() as u64, Ordering::SeqCst);
    }

    /// The next `n` posts on queue pairs of these NICs put the queue pair in error
    /// (their requests complete as flushed).
    pub fn fail_next_posts(&self, n: u32) {
        self.qp_errors.store(n, Ordering::SeqCst);
    }

    /// With `refuse`, the NICs refuse every dma-buf registration, as a device
    /// without dma-buf support (or without a peer-to-peer path to the GPU) does.
    pub fn refuse_dmabuf(&self, refuse: bool) {
        self.refuse_dmabuf.store(refuse, Ordering::SeqCst);
    }

    fn take_qp_error(&self) -> bool {
        self.qp_errors.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok()
    }
}

/// How one software port is set up.
#[derive(Clone, Copy, Debug)]
pub struct SoftPortConfig {
    /// Active MTU in bytes (default 4096).
    pub mtu: u32,
    /// Largest memory region registered at once (default 1 GiB).
    pub max_mr_size: u64,
    /// NUMA node reported for the device (default node 0).
    pub numa_node: Option<u32>,
}

impl Default for SoftPortConfig {
    fn default() -> Self {
        Self { mtu: 4096, max_mr_size: 1 << 30, numa_node: Some(0) }
    }
}

/// A memory region as the NIC sees it.
#[derive(Clone, Copy, Debug)]
struct MrEntry {
    pd: u64,
    /// First byte, as work requests name it (a host address, or a dma-buf's iova).
    addr: u64,
    len: u64,
    remote: bool,
    /// Peers may WRITE it (a remote key only).
    writable: bool,
    /// Where the NIC reaches the first byte: `addr` itself for host memory, the
    /// NIC's own mapping of a dma-buf.
    host: u64,
}

impl MrEntry {
    fn covers(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr && addr.checked_add(len).is_some_and(|end| end <= self.addr + self.len)
    }

    /// The host address of `addr` (inside the region).
    fn translate(&self, addr: u64) -> u64 {
        self.host + (addr - self.addr)
    }
}

/// What a queue pair shares with its completion thread and with its NIC's server.
#[derive(Debug)]
struct QpShared {
    qp_num: u32,
    pd: u64,
    state: Mutex<QpState>,
    remote: Mutex<Option<QpAddress>>,
    path_mtu: AtomicU32,
    outstanding: Mutex<VecDeque<WorkRequest>>,
    cq: Mutex<VecDeque<Completion>>,
    cq_ready: Condvar,
}

impl QpShared {
    fn complete(&self, c: Completion) {
        self.cq.lock().push_back(c);
        self.cq_ready.notify_all();
    }

    /// Puts the queue pair in error and completes what is outstanding: as flushed if
    /// it was moved to ERR on purpose, as retry-exceeded if the link broke.
    fn fail_outstanding(&self) {
        let status = {
            let mut state = self.state.lock();
            let s = if *state == QpState::Error { CompletionStatus::Flushed } else { CompletionStatus::RetryExceeded };
            *state = QpState::Error;
            s
        };
        let pending: Vec<WorkRequest> = self.outstanding.lock().drain(..).collect();
        for wr in pending {
            self.complete(Completion { wr_id: wr.wr_id, status });
        }
    }
}

/// One software NIC (one port).
#[derive(Debug)]
struct SoftNic {
    info: PortInfo,
    addr: SocketAddr,
    mrs: RwLock<HashMap<u32, MrEntry>>,
    /// The NIC's mappings of registered dma-bufs, by lkey: what a device's DMA
    /// engine reaches them through.
    dmabufs: Mutex<HashMap<u32, memmap2::MmapRaw>>,
    qps: Mutex<HashMap<u32, Weak<QpShared>>>,
    next_key: AtomicU32,
    next_qpn: AtomicU32,
    next_pd: AtomicU64,
    faults: Arc<SoftFaults>,
    stop: AtomicBool,
}

impl Drop for SoftNic {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(100));
    }
}

/// Software RDMA NICs of this process, with injectable faults.
///
/// ```
/// use mooncake_transfer::{RdmaProvider, SoftRdma};
/// let soft = SoftRdma::new(2)?;
/// assert_eq!(soft.implementation(), "soft");
/// assert_eq!(soft.ports().len(), 2);
/// # Ok::<(), mooncake_transfer::TransferError>(())
/// ```
#[derive(Debug)]
pub struct SoftRdma {
    nics: Vec<Arc<SoftNic>>,
    faults: Arc<SoftFaults>,
}

impl SoftRdma {
    /// `nics` software NICs with default ports.
    pub fn new(nics: usize) -> Result<Self> {
        Self::with_ports(&vec![SoftPortConfig::default(); nics])
    }

    /// One software NIC per entry of `ports`.
    pub fn with_ports(ports: &[SoftPortConfig]) -> Result<Self> {
        let faults = Arc::new(SoftFaults::default());
        let mut nics = Vec::with_capacity(ports.len());
        for (i, cfg) in ports.iter().enumerate() {
            let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
                .map_err(|e| TransferError::Registration(format!("soft NIC listener: {e}")))?;
            let addr = listener.local_addr().map_err(|e| TransferError::Io(e.to_string()))?;
            let mut gid = [0u8; 16];
            gid[10] = 0xff;
            gid[11] = 0xff;
            gid[12..16].copy_from_slice(&Ipv4Addr::LOCALHOST.octets());
            let info = PortInfo {
                device: format!("soft{i}"),
                port: 1,
                numa_node: cfg.numa_node,
                active_mtu: cfg.mtu,
                max_mr_size: cfg.max_mr_size,
                lid: addr.port(),
                gid,
                gid_index: 0,
            };
            let nic = Arc::new(SoftNic {
                info,
                addr,
                mrs: RwLock::new(HashMap::new()),
                dmabufs: Mutex::new(HashMap::new()),
                qps: Mutex::new(HashMap::new()),
                // Random bases: a restarted peer never honours a key or queue pair
                // number handed out by its previous life.
                next_key: AtomicU32::new((rand::random::<u32>() & !0xffff) | 2),
                next_qpn: AtomicU32::new(rand::random::<u32>() & 0x00ff_0000 | 0x100),
                next_pd: AtomicU64::new(1),
                faults: faults.clone(),
                stop: AtomicBool::new(false),
            });
            let weak = Arc::downgrade(&nic);
            std::thread::Builder::new()
                .name("mooncake-soft-nic".into())
                .spawn(move || accept_loop(listener, weak))
                .map_err(|e| TransferError::Io(format!("soft NIC thread: {e}")))?;
            nics.push(nic);
        }
        Ok(Self { nics, faults })
    }

    /// The faults injected into these NICs.
    pub fn faults(&self) -> &Arc<SoftFaults> {
        &self.faults
    }

    /// Doorbells rung so far on queue pairs of these NICs: one per post that sent
    /// work, however many work requests it carried.
    pub fn doorbells(&self) -> u64 {
        self.faults.doorbells.load(Ordering::Relaxed)
    }

    /// dma-buf memory regions registered so far on these NICs (one per NIC and
    /// piece of a registration).
    pub fn dmabuf_registrations(&self) -> u64 {
        self.faults.dmabuf_registrations.load(Ordering::Relaxed)
    }
}

impl RdmaProvider for SoftRdma {
    fn implementation(&self) -> &'static str {
        "soft"
    }

    fn ports(&self) -> Vec<PortInfo> {
        self.nics.iter().map(|n| n.info.clone()).collect()
    }

    fn open(&self, port: usize) -> Result<Arc<dyn ProtectionDomain>> {
        let nic = self.nics.get(port).ok_or_else(|| TransferError::Registration(format!("no soft port {port}")))?;
        let id = nic.next_pd.fetch_add(1, Ordering::Relaxed);
        Ok(Arc::new(SoftPd { nic: nic.clone(), id }))
    }
}

/// A protection domain of a software NIC.
struct SoftPd {
    nic: Arc<SoftNic>,
    id: u64,
}

impl SoftPd {
    fn check_len(&self, len: u64) -> Result<()> {
        if len == 0 || len > self.nic.info.max_mr_size {
            return Err(TransferError::Registration(format!(
                "memory region of {len} bytes (the device registers 1..={})",
                self.nic.info.max_mr_size
            )));
        }
        Ok(())
    }

    /// Enters a region named from `addr` on, reached at `host`, into the NIC's table.
    fn insert(&self, addr: u64, len: u64, access: RemoteAccess, host: u64) -> MemoryRegion {
        let key = self.nic.next_key.fetch_add(2, Ordering::Relaxed);
        let (lkey, rkey) = (key, if access.is_remote() { key + 1 } else { 0 });
        let mut mrs = self.nic.mrs.write();
        mrs.insert(lkey, MrEntry { pd: self.id, addr, len, remote: false, writable: false, host });
        if access.is_remote() {
            let writable = access == RemoteAccess::ReadWrite;
            mrs.insert(rkey, MrEntry { pd: self.id, addr, len, remote: true, writable, host });
        }
        MemoryRegion { addr, len, lkey, rkey }
    }
}

impl ProtectionDomain for SoftPd {
    fn port(&self) -> &PortInfo {
        &self.nic.info
    }

    unsafe fn register(&self, addr: *mut u8, len: u64, access: RemoteAccess) -> Result<MemoryRegion> {
        self.check_len(len)?;
        Ok(self.insert(addr as u64, len, access, addr as u64))
    }

    /// The soft NIC imports a dma-buf by mapping it (a software device has no
    /// other way to reach the memory): any file that can be mapped shared, such
    /// as the memfd behind emulated device memory. Work requests name its bytes
    /// from `iova` on, never by the mapping's address.
    unsafe fn register_dmabuf(
        &self,
        fd: i32,
        offset: u64,
        len: u64,
        iova: u64,
        access: RemoteAccess,
    ) -> Result<MemoryRegion> {
        if self.nic.faults.refuse_dmabuf.load(Ordering::SeqCst) {
            return Err(TransferError::Registration(format!("{}: dma-buf registration refused", self.nic.info.device)));
        }
        self.check_len(len)?;
        if iova.checked_add(len).is_none() {
            return Err(TransferError::Registration(format!("dma-buf iova {iova:#x}+{len} overflows")));
        }
        let map = memmap2::MmapOptions::new().offset(offset).len(len as usize).map_raw(fd).map_err(|e| {
            TransferError::Registration(format!("{}: cannot import the dma-buf: {e}", self.nic.info.device))
        })?;
        let mr = self.insert(iova, len, access, map.as_mut_ptr() as u64);
        self.nic.dmabufs.lock().insert(mr.lkey, map);
        self.nic.faults.dmabuf_registrations.fetch_add(1, Ordering::Relaxed);
        Ok(mr)
    }

    fn deregister(&self, mr: &MemoryRegion) {
        // The write lock waits for accesses in progress: none follows the return.
        let mut mrs = self.nic.mrs.write();
        mrs.remove(&mr.lkey);
        if mr.rkey != 0 {
            mrs.remove(&mr.rkey);
        }
        drop(mrs);
        // No access names the keys any more: the dma-buf's mapping can go.
        self.nic.dmabufs.lock().remove(&mr.lkey);
    }

    fn create_qp(&self, _depth: u32) -> Result<Box<dyn QueuePair>> {
        let qp_num = self.nic.next_qpn.fetch_add(1, Ordering::Relaxed) & 0x00ff_ffff;
        let shared = Arc::new(QpShared {
            qp_num,
            pd: self.id,
            state: Mutex::new(QpState::Reset),
            remote: Mutex::new(None),
            path_mtu: AtomicU32::new(0),
            outstanding: Mutex::new(VecDeque::new()),
            cq: Mutex::new(VecDeque::new()),
            cq_ready: Condvar::new(),
        });
        self.nic.qps.lock().insert(qp_num, Arc::downgrade(&shared));
        Ok(Box::new(SoftQp { nic: self.nic.clone(), shared, stream: None, receiver: None }))
    }
}

/// A queue pair of a software NIC: its outbound connection is opened by the first post.
struct SoftQp {
    nic: Arc<SoftNic>,
    shared: Arc<QpShared>,
    stream: Option<TcpStream>,
    receiver: Option<JoinHandle<()>>,
}

impl Drop for SoftQp {
    fn drop(&mut self) {
        self.to_error();
        self.nic.qps.lock().remove(&self.shared.qp_num);
    }
}

impl SoftQp {
    fn transition(&self, from: QpState, to: QpState) -> Result<()> {
        let mut state = self.shared.state.lock();
        if *state != from {
            return Err(TransferError::Protocol(format!("queue pair in {:?}, not {from:?}", *state)));
        }
        *state = to;
        Ok(())
    }

    /// Opens the connection to the remote queue pair's NIC and starts the thread
    /// that turns its answers into completions.
    fn connect(&mut self) -> std::io::Result<()> {
        let remote = self.shared.remote.lock().ok_or(std::io::ErrorKind::NotConnected)?;
        let ip = Ipv4Addr::new(remote.gid[12], remote.gid[13], remote.gid[14], remote.gid[15]);
        let mut s = TcpStream::connect_timeout(&SocketAddr::from((ip, remote.lid)), Duration::from_secs(2))?;
        s.set_nodelay(true)?;
        let mut hello = [0u8; 8];
        hello[0..4].copy_from_slice(&remote.qp_num.to_le_bytes());
        hello[4..8].copy_from_slice(&self.shared.qp_num.to_le_bytes());
        s.write_all(&hello)?;
        let mut verdict = [0u8; 1];
        s.read_exact(&mut verdict)?;
        if verdict[0] != 1 {
            return Err(std::io::ErrorKind::ConnectionRefused.into());
        }
        let (shared, reader) = (self.shared.clone(), s.try_clone()?);
        self.receiver =
            Some(std::thread::Builder::new().name("mooncake-soft-cq".into()).spawn(move || receive(reader, &shared))?);
        self.stream = Some(s);
        Ok(())
    }

    /// Where the NIC reaches `wr`'s local range, if it lies in a local memory
    /// region of this protection domain.
    fn local_host(&self, wr: &WorkRequest) -> Option<u64> {
        self.nic
            .mrs
            .read()
            .get(&wr.lkey)
            .filter(|mr| !mr.remote && mr.pd == self.shared.pd && mr.covers(wr.local_addr, u64::from(wr.len)))
            .map(|mr| mr.translate(wr.local_addr))
    }
}

/// Turns the answers of the remote NIC into completions, in order; the link
/// breaking fails every outstanding request.
fn receive(stream: TcpStream, qp: &QpShared) {
    let mut r = BufReader::with_capacity(64 << 10, stream);
    let mut head = [0u8; RESP_LEN];
    loop {
        if r.read_exact(&mut head).is_err() {
            break;
        }
        let wr_id = u64::from_le_bytes(head[0..8].try_into().expect("8 bytes"));
        let Some(wr) = qp.outstanding.lock().pop_front() else { break };
        if wr.wr_id != wr_id {
            break;
        }
        if head[8] != 0 {
            qp.complete(Completion { wr_id, status: CompletionStatus::RemoteAccess });
            *qp.state.lock() = QpState::Error;
            break;
        }
        if wr.op == WorkOp::Read {
            // SAFETY: `post`'s contract keeps the local range writable and unused
            // by anything else until this completion is polled; the range was
            // checked against a local memory region when posted and translated to
            // where the NIC reaches it (a dma-buf's mapping lives as long as its
            // registration, which outlives the request); `to_error` joins this
            // thread before the queue pair gives the range up.
            let dst = unsafe { std::slice::from_raw_parts_mut(wr.local_addr as *mut u8, wr.len as usize) };
            if r.read_exact(dst).is_err() {
                qp.outstanding.lock().push_front(wr);
                break;
            }
        }
        qp.complete(Completion { wr_id, status: CompletionStatus::Success });
    }
    qp.fail_outstanding();
}

impl QueuePair for SoftQp {
    fn address(&self) -> QpAddress {
        let info = &self.nic.info;
        QpAddress {
            nic: 0,
            qp_num: self.shared.qp_num,
            lid: info.lid,
            gid: info.gid,
            gid_index: info.gid_index,
            mtu: info.active_mtu,
            psn: self.shared.qp_num & 0xff_ffff,
        }
    }

    fn state(&self) -> QpState {
        *self.shared.state.lock()
    }

    fn to_init(&mut self) -> Result<()> {
        self.transition(QpState::Reset, QpState::Init)
    }

    fn to_rtr(&mut self, remote: &QpAddress, mtu: u32) -> Result<()> {
        if !matches!(mtu, 256 | 512 | 1024 | 2048 | 4096) || mtu > self.nic.info.active_mtu {
            return Err(TransferError::Protocol(format!("path MTU {mtu} is not valid on this port")));
        }
        self.transition(QpState::Init, QpState::Rtr)?;
        *self.shared.remote.lock() = Some(*remote);
        self.shared.path_mtu.store(mtu, Ordering::Relaxed);
        Ok(())
    }

    fn to_rts(&mut self) -> Result<()> {
        self.transition(QpState::Rtr, QpState::Rts)
    }

    fn to_error(&mut self) {
        *self.shared.state.lock() = QpState::Error;
        if let Some(s) = self.stream.take() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        // After this join no completion thread touches local memory any more.
        if let Some(t) = self.receiver.take() {
            let _ = t.join();
        }
        self.shared.fail_outstanding();
    }

    fn path_mtu(&self) -> u32 {
        self.shared.path_mtu.load(Ordering::Relaxed)
    }

    unsafe fn post(&mut self, batch: &[WorkRequest]) -> Result<()> {
        match self.state() {
            QpState::Rts => {}
            QpState::Error => {
                for wr in batch {
                    self.shared.complete(Completion { wr_id: wr.wr_id, status: CompletionStatus::Flushed });
                }
                return Ok(());
            }
            s => return Err(TransferError::Protocol(format!("posting on a queue pair in {s:?}"))),
        }
        if self.nic.faults.take_qp_error() {
            self.to_error();
            for wr in batch {
                self.shared.complete(Completion { wr_id: wr.wr_id, status: CompletionStatus::Flushed });
            }
            return Ok(());
        }
        let mut frames = Vec::with_capacity(batch.len() * REQ_LEN);
        // The batch as the NIC executes it: local addresses translated to where
        // it reaches them (a dma-buf's mapping for device memory).
        let mut reached = Vec::with_capacity(batch.len());
        for wr in batch {
            let Some(host) = self.local_host(wr) else { break };
            let wr = &WorkRequest { local_addr: host, ..*wr };
            reached.push(*wr);
            frames.push(match wr.op {
                WorkOp::Read => 1u8,
                WorkOp::Write => 2u8,
            });
            frames.extend_from_slice(&wr.wr_id.to_le_bytes());
            frames.extend_from_slice(&wr.remote_addr.to_le_bytes());
            frames.extend_from_slice(&wr.rkey.to_le_bytes());
            frames.extend_from_slice(&wr.len.to_le_bytes());
            if wr.op == WorkOp::Write {
                // SAFETY: the caller keeps the range readable until its completion
                // (it is copied right here); it lies in a local region (checked) and
                // `local_addr` is where the NIC reaches it: the host buffer itself, or
                // the NIC's mapping of a dma-buf, kept while the region is registered.
                frames.extend_from_slice(unsafe {
                    std::slice::from_raw_parts(wr.local_addr as *const u8, wr.len as usize)
                });
            }
        }
        let accepted = reached.len();
        if self.stream.is_none() && accepted > 0 && self.connect().is_err() {
            self.shared.outstanding.lock().extend(reached);
            self.shared.fail_outstanding();
        } else if accepted > 0 {
            self.shared.outstanding.lock().extend(reached);
            // One write of the whole batch: the doorbell.
            self.nic.faults.doorbells.fetch_add(1, Ordering::Relaxed);
            let sent = self.stream.as_ref().map(|mut s| s.write_all(&frames));
            if !matches!(sent, Some(Ok(()))) {
                if let Some(s) = &self.stream {
                    let _ = s.shutdown(std::net::Shutdown::Both);
                }
            }
        }
        if accepted < batch.len() {
            // A local protection error puts the queue pair in error, like a NIC.
            self.shared
                .complete(Completion { wr_id: batch[accepted].wr_id, status: CompletionStatus::LocalProtection });
            self.to_error();
            for wr in &batch[accepted + 1..] {
                self.shared.complete(Completion { wr_id: wr.wr_id, status: CompletionStatus::Flushed });
            }
        }
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<Completion>, wait: Duration) -> Result<usize> {
        let mut cq = self.shared.cq.lock();
        if cq.is_empty() && !wait.is_zero() {
            self.shared.cq_ready.wait_for(&mut cq, wait);
        }
        let n = cq.len();
        out.extend(cq.drain(..));
        Ok(n)
    }
}

fn accept_loop(listener: TcpListener, nic: Weak<SoftNic>) {
    for conn in listener.incoming() {
        let Some(n) = nic.upgrade() else { return };
        if n.stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(conn) = conn else {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        if n.faults.dead.load(Ordering::SeqCst) {
            continue;
        }
        if let Ok(c) = conn.try_clone() {
            n.faults.served.lock().push(c);
        }
        drop(n);
        let nic = nic.clone();
        let _ = std::thread::Builder::new().name("mooncake-soft-serve".into()).spawn(move || serve(conn, &nic));
    }
}

/// Serves one queue pair's connection: checks who it is, then answers its
/// requests in order until it closes or sends a request a NIC would refuse.
fn serve(conn: TcpStream, nic: &Weak<SoftNic>) {
    let _ = conn.set_nodelay(true);
    let _ = conn.set_read_timeout(Some(Duration::from_secs(30)));
    let mut r = BufReader::with_capacity(256 << 10, &conn);
    let mut w = &conn;
    let mut hello = [0u8; 8];
    if r.read_exact(&mut hello).is_err() {
        return;
    }
    let target = u32::from_le_bytes(hello[0..4].try_into().expect("4 bytes"));
    let source = u32::from_le_bytes(hello[4..8].try_into().expect("4 bytes"));
    let qp = nic.upgrade().and_then(|n| n.qps.lock().get(&target).and_then(Weak::upgrade));
    let accepted = qp.as_ref().is_some_and(|qp| {
        matches!(*qp.state.lock(), QpState::Rtr | QpState::Rts)
            && qp.remote.lock().is_some_and(|remote| remote.qp_num == source)
    });
    if w.write_all(&[u8::from(accepted)]).is_err() || !accepted {
        return;
    }
    let pd = qp.map(|qp| qp.pd).unwrap_or_default();
    let mut head = [0u8; REQ_LEN];
    while r.read_exact(&mut head).is_ok() {
        let Some(nic) = nic.upgrade() else { return };
        if nic.faults.dead.load(Ordering::SeqCst) {
            return;
        }
        let op = head[0];
        let wr_id = u64::from_le_bytes(head[1..9].try_into().expect("8 bytes"));
        let addr = u64::from_le_bytes(head[9..17].try_into().expect("8 bytes"));
        let rkey = u32::from_le_bytes(head[17..21].try_into().expect("4 bytes"));
        let len = u32::from_le_bytes(head[21..25].try_into().expect("4 bytes")) as u64;
        let delay = nic.faults.delay_us.load(Ordering::Relaxed);
        if delay > 0 {
            std::thread::sleep(Duration::from_micros(delay));
        }
        // Held across the access: deregistration waits for it.
        let mrs = nic.mrs.read();
        // A WRITE needs a region peers may write (a NIC checks the access flags).
        let host = mrs
            .get(&rkey)
            .filter(|mr| mr.remote && mr.pd == pd && mr.covers(addr, len) && (op != 2 || mr.writable))
            .map(|mr| mr.translate(addr));
        let ok = host.is_some();
        let mut resp = [0u8; RESP_LEN];
        resp[0..8].copy_from_slice(&wr_id.to_le_bytes());
        resp[8] = u8::from(!ok);
        let served = match (op, host) {
            (1, Some(addr)) => {
                // SAFETY: the requested range lies in a registered remote-access
                // region (checked under the read lock that deregistration waits
                // for) and `addr` is where the NIC reaches it (the registrant keeps
                // host memory mapped, the NIC its dma-buf mapping, until deregistered).
                let src = unsafe { std::slice::from_raw_parts(addr as *const u8, len as usize) };
                w.write_all(&resp).and_then(|()| w.write_all(src))
            }
            (2, Some(addr)) => {
                // SAFETY: as above; the region's owner lets peers write it.
                let dst = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len as usize) };
                r.read_exact(dst).and_then(|()| w.write_all(&resp))
            }
            _ => {
                // A refused access: the NIC answers with an error and the
                // connection (like the RC queue pair) is over.
                let _ = w.write_all(&resp);
                return;
            }
        };
        if served.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two connected queue pairs on two software NICs, with a region each.
    struct Pair {
        _a: SoftRdma,
        b: SoftRdma,
        qa: Box<dyn QueuePair>,
        _qb: Box<dyn QueuePair>,
        pda: Arc<dyn ProtectionDomain>,
        pdb: Arc<dyn ProtectionDomain>,
    }

    fn pair() -> Pair {
        let (a, b) = (SoftRdma::new(1).unwrap(), SoftRdma::new(1).unwrap());
        let (pda, pdb) = (a.open(0).unwrap(), b.open(0).unwrap());
        let (mut qa, mut qb) = (pda.create_qp(16).unwrap(), pdb.create_qp(16).unwrap());
        assert_eq!(qa.state(), QpState::Reset);
        // Out of order transitions are refused.
        assert!(qa.to_rts().is_err());
        assert!(qa.to_rtr(&qb.address(), 4096).is_err());
        qa.to_init().unwrap();
        qb.to_init().unwrap();
        assert!(qa.to_rtr(&qb.address(), 1000).is_err(), "not an MTU");
        let (ra, rb) = (qa.address(), qb.address());
        qb.to_rtr(&ra, 4096).unwrap();
        qb.to_rts().unwrap();
        // Posting before RTS is an error.
        // SAFETY: nothing is posted (empty batch); the call only checks the state.
        assert!(unsafe { qa.post(&[]) }.is_err());
        qa.to_rtr(&rb, 4096).unwrap();
        qa.to_rts().unwrap();
        assert_eq!((qa.state(), qa.path_mtu()), (QpState::Rts, 4096));
        Pair { _a: a, b, qa, _qb: qb, pda, pdb }
    }

    fn wait_all(qp: &mut dyn QueuePair, n: usize) -> Vec<Completion> {
        let mut out = Vec::new();
        let until = std::time::Instant::now() + Duration::from_secs(5);
        while out.len() < n && std::time::Instant::now() < until {
            qp.poll(&mut out, Duration::from_millis(50)).unwrap();
        }
        out
    }

    #[test]
    fn soft_seam_one_sided_reads_and_writes_with_keys_bounds_and_errors() {
        let mut p = pair();
        let mut local = vec![0u8; 8192];
        let mut remote = vec![0u8; 4096];
        // SAFETY: both vectors outlive their registrations (deregistered below).
        let lmr = unsafe { p.pda.register(local.as_mut_ptr(), 8192, RemoteAccess::LocalOnly) }.unwrap();
        // SAFETY: as above.
        let rmr = unsafe { p.pdb.register(remote.as_mut_ptr(), 4096, RemoteAccess::ReadWrite) }.unwrap();
        assert_eq!(lmr.rkey, 0, "local-only regions have no remote key");
        local[..5].copy_from_slice(b"hello");
        let wr = |wr_id, op, local_off: u64, remote_off: u64, len, rkey| WorkRequest {
            wr_id,
            op,
            local_addr: lmr.addr + local_off,
            len,
            lkey: lmr.lkey,
            remote_addr: rmr.addr + remote_off,
            rkey,
        };
        // One doorbell: a write then a read of the same bytes, completed in order.
        let batch = [wr(1, WorkOp::Write, 0, 100, 5, rmr.rkey), wr(2, WorkOp::Read, 4096, 100, 5, rmr.rkey)];
        // SAFETY: `local` lives until the completions are polled below.
        unsafe { p.qa.post(&batch) }.unwrap();
        let done = wait_all(p.qa.as_mut(), 2);
        assert_eq!(
            done.iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(),
            [(1, CompletionStatus::Success), (2, CompletionStatus::Success)]
        );
        assert_eq!(&remote[100..105], b"hello");
        assert_eq!(&local[4096..4101], b"hello");
        // Out of the remote region: a remote access error, and the QP is in error.
        // SAFETY: as above.
        unsafe { p.qa.post(&[wr(3, WorkOp::Read, 0, 4090, 16, rmr.rkey)]) }.unwrap();
        assert_eq!(wait_all(p.qa.as_mut(), 1)[0].status, CompletionStatus::RemoteAccess);
        let until = std::time::Instant::now() + Duration::from_secs(5);
        while p.qa.state() != QpState::Error && std::time::Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(p.qa.state(), QpState::Error);
        // SAFETY: as above.
        unsafe { p.qa.post(&[wr(4, WorkOp::Read, 0, 0, 1, rmr.rkey)]) }.unwrap();
        assert_eq!(wait_all(p.qa.as_mut(), 1)[0].status, CompletionStatus::Flushed);
        p.pda.deregister(&lmr);
        p.pdb.deregister(&rmr);
    }

    #[test]
    fn soft_seam_bad_rkeys_local_protection_and_peer_death() {
        let mut p = pair();
        let mut local = vec![0u8; 4096];
        let mut remote = vec![0u8; 4096];
        // SAFETY: both vectors outlive their registrations.
        let lmr = unsafe { p.pda.register(local.as_mut_ptr(), 4096, RemoteAccess::LocalOnly) }.unwrap();
        // SAFETY: as above.
        let rmr = unsafe { p.pdb.register(remote.as_mut_ptr(), 4096, RemoteAccess::ReadWrite) }.unwrap();
        let wr = WorkRequest {
            wr_id: 1,
            op: WorkOp::Write,
            local_addr: lmr.addr,
            len: 8,
            lkey: lmr.lkey,
            remote_addr: rmr.addr,
            rkey: rmr.rkey ^ 0x40,
        };
        // SAFETY: `local` outlives the completion.
        unsafe { p.qa.post(&[wr]) }.unwrap();
        assert_eq!(wait_all(p.qa.as_mut(), 1)[0].status, CompletionStatus::RemoteAccess, "bad rkey");

        let mut p = pair();
        // SAFETY: as above.
        let lmr = unsafe { p.pda.register(local.as_mut_ptr(), 4096, RemoteAccess::LocalOnly) }.unwrap();
        // SAFETY: as above.
        let rmr = unsafe { p.pdb.register(remote.as_mut_ptr(), 4096, RemoteAccess::ReadWrite) }.unwrap();
        let outside = WorkRequest { lkey: lmr.lkey, local_addr: lmr.addr + 4090, rkey: rmr.rkey, ..wr };
        // SAFETY: the request is refused before any memory is touched.
        unsafe { p.qa.post(&[outside]) }.unwrap();
        assert_eq!(wait_all(p.qa.as_mut(), 1)[0].status, CompletionStatus::LocalProtection);
        assert_eq!(p.qa.state(), QpState::Error);

        let mut p = pair();
        // SAFETY: as above.
        let lmr = unsafe { p.pda.register(local.as_mut_ptr(), 4096, RemoteAccess::LocalOnly) }.unwrap();
        // SAFETY: as above.
        let rmr = unsafe { p.pdb.register(remote.as_mut_ptr(), 4096, RemoteAccess::ReadWrite) }.unwrap();
        p.b.faults().kill();
        let good = WorkRequest { lkey: lmr.lkey, local_addr: lmr.addr, rkey: rmr.rkey, ..wr };
        // SAFETY: as above.
        unsafe { p.qa.post(&[good]) }.unwrap();
        assert_eq!(wait_all(p.qa.as_mut(), 1)[0].status, CompletionStatus::RetryExceeded, "dead peer");
        // A deregistered key is refused.
        p.b.faults().revive();
        let mut p2 = pair();
        // SAFETY: as above.
        let lmr = unsafe { p2.pda.register(local.as_mut_ptr(), 4096, RemoteAccess::LocalOnly) }.unwrap();
        // SAFETY: as above.
        let rmr = unsafe { p2.pdb.register(remote.as_mut_ptr(), 4096, RemoteAccess::ReadWrite) }.unwrap();
        p2.pdb.deregister(&rmr);
        let stale = WorkRequest { lkey: lmr.lkey, local_addr: lmr.addr, rkey: rmr.rkey, ..wr };
        // SAFETY: as above.
        unsafe { p2.qa.post(&[stale]) }.unwrap();
        assert_eq!(wait_all(p2.qa.as_mut(), 1)[0].status, CompletionStatus::RemoteAccess, "deregistered");
    }

    /// A region registered for remote READ only: peers read it, and a WRITE fails
    /// at the NIC without touching it (an engine's read-only region).
    #[test]
    fn soft_seam_read_only_regions_refuse_writes() {
        let mut p = pair();
        let mut local = vec![0u8; 4096];
        let mut remote = vec![7u8; 4096];
        // SAFETY: both vectors outlive their registrations (deregistered below).
        let lmr = unsafe { p.pda.register(local.as_mut_ptr(), 4096, RemoteAccess::LocalOnly) }.unwrap();
        // SAFETY: as above.
        let rmr = unsafe { p.pdb.register(remote.as_mut_ptr(), 4096, RemoteAccess::Read) }.unwrap();
        assert_ne!(rmr.rkey, 0, "a read-only region has a remote key");
        let wr = |wr_id, op| WorkRequest {
            wr_id,
            op,
            local_addr: lmr.addr,
            len: 16,
            lkey: lmr.lkey,
            remote_addr: rmr.addr,
            rkey: rmr.rkey,
        };
        // SAFETY: `local` outlives the completion.
        unsafe { p.qa.post(&[wr(1, WorkOp::Read)]) }.unwrap();
        assert_eq!(wait_all(p.qa.as_mut(), 1)[0].status, CompletionStatus::Success);
        assert_eq!(&local[..16], &[7u8; 16]);
        local[..16].fill(1);
        // SAFETY: as above.
        unsafe { p.qa.post(&[wr(2, WorkOp::Write)]) }.unwrap();
        assert_eq!(wait_all(p.qa.as_mut(), 1)[0].status, CompletionStatus::RemoteAccess);
        p.pda.deregister(&lmr);
        p.pdb.deregister(&rmr);
        assert_eq!(remote, vec![7u8; 4096], "nothing was written");
    }
}
