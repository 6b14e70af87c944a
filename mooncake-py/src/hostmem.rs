//! `MooncakeHostMemAllocator` (host memory a framework allocates for its KV pool and
//! registers with the store) and `bind_to_numa_node`.

use std::collections::HashMap;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::OnceLock;

use parking_lot::Mutex;
use pyo3::prelude::*;

/// Mappings made by `alloc`, by address: their length and memfd. Process-wide, as the
/// reference's allocator is a singleton: any allocator object frees any block.
fn blocks() -> &'static Mutex<HashMap<usize, (usize, OwnedFd)>> {
    static BLOCKS: OnceLock<Mutex<HashMap<usize, (usize, OwnedFd)>>> = OnceLock::new();
    BLOCKS.get_or_init(Default::default)
}

/// Maps `size` zeroed bytes of a new memfd (shared memory another process can map).
fn map_shared(size: usize) -> Option<(usize, OwnedFd)> {
    // SAFETY: memfd_create takes a NUL-terminated name and flags; it returns a new
    // descriptor or -1.
    let fd = unsafe { libc::memfd_create(c"mooncake-host-mem".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return None;
    }
    // SAFETY: `fd` was just returned by memfd_create and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let len = libc::off_t::try_from(size).ok()?;
    use std::os::fd::AsRawFd;
    // SAFETY: ftruncate on a descriptor we own.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len) } != 0 {
        return None;
    }
    // SAFETY: a fresh shared mapping of the whole memfd; the kernel picks the address.
    let ptr = unsafe {
        libc::mmap(std::ptr::null_mut(), size, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd.as_raw_fd(), 0)
    };
    if ptr == libc::MAP_FAILED {
        return None;
    }
    Some((ptr as usize, fd))
}

/// Host memory for a framework's KV pool, backed by shared memory (a memfd) so that a
/// storage process on this host can map it. `alloc(size)` returns the address of
/// `size` zeroed bytes (0 on failure); `free(ptr)` returns 0, or -1 for an address
/// `alloc` did not return.
#[pyclass(name = "MooncakeHostMemAllocator", module = "mooncake_rs.store", frozen)]
#[derive(Default)]
pub struct MooncakeHostMemAllocator;

#[pymethods]
impl MooncakeHostMemAllocator {
    /// An allocator (all allocators share one table of blocks).
    #[new]
    fn new() -> Self {
        Self
    }

    /// The address of `size` new zeroed bytes of shared memory, or 0.
    fn alloc(&self, py: Python<'_>, size: usize) -> usize {
        if size == 0 {
            return 0;
        }
        py.detach(|| match map_shared(size) {
            Some((ptr, fd)) => {
                blocks().lock().insert(ptr, (size, fd));
                ptr
            }
            None => 0,
        })
    }

    /// Unmaps a block `alloc` returned: 0, or -1 if `ptr` is not one.
    fn free(&self, py: Python<'_>, ptr: usize) -> i32 {
        let Some((len, fd)) = blocks().lock().remove(&ptr) else { return -1 };
        py.detach(move || {
            // SAFETY: `[ptr, ptr + len)` is a mapping `alloc` made and nobody unmapped
            // (it was still in the table); Python promised not to use it any more.
            let rc = unsafe { libc::munmap(ptr as *mut libc::c_void, len) };
            drop(fd);
            if rc == 0 {
                0
            } else {
                -1
            }
        })
    }
}

/// The CPUs of NUMA node `node`, from sysfs (`None` without NUMA information).
fn node_cpus(node: u32) -> Option<Vec<usize>> {
    let text = std::fs::read_to_string(format!("/sys/devices/system/node/node{node}/cpulist")).ok()?;
    let mut cpus = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => cpus.extend(a.parse::<usize>().ok()?..=b.parse::<usize>().ok()?),
            None => cpus.push(part.parse().ok()?),
        }
    }
    Some(cpus)
}

/// Binds the calling thread to the CPUs of NUMA node `node` and makes that node the
/// preferred one for its future memory allocations, as the reference's function does
/// with libnuma. Like the reference, an unknown node or a machine without NUMA only
/// warns (a `RuntimeWarning`); it never raises.
#[pyfunction]
pub fn bind_to_numa_node(py: Python<'_>, node: i32) -> PyResult<()> {
    let warn = |msg: String| -> PyResult<()> {
        let category = py.get_type::<pyo3::exceptions::PyRuntimeWarning>();
        PyErr::warn(py, &category, &std::ffi::CString::new(msg).unwrap_or_default(), 1)
    };
    let Some(cpus) = u32::try_from(node).ok().and_then(node_cpus).filter(|c| !c.is_empty()) else {
        return warn(format!("NUMA node {node} does not exist on this machine; binding skipped"));
    };
    // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET writes inside it for CPUs
    // below CPU_SETSIZE (checked), and sched_setaffinity reads it.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cpus.iter().filter(|&&c| c < libc::CPU_SETSIZE as usize) {
            libc::CPU_SET(c, &mut set);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if rc != 0 {
        warn(format!("cannot run on the CPUs of NUMA node {node}: {}", std::io::Error::last_os_error()))?;
    }
    // MPOL_PREFERRED with one node: allocate there when it has room, else elsewhere
    // (the reference's numa_set_preferred with non-strict binding).
    const MPOL_PREFERRED: libc::c_long = 1;
    let mut mask = [0u64; 16];
    let bits = mask.len() * 64;
    if (node as usize) < bits {
        mask[node as usize / 64] |= 1 << (node as usize % 64);
        // SAFETY: set_mempolicy reads `maxnode` bits of the mask, which has that many.
        let rc =
            unsafe { libc::syscall(libc::SYS_set_mempolicy, MPOL_PREFERRED, mask.as_ptr(), bits as libc::c_ulong) };
        if rc != 0 {
            warn(format!("cannot prefer memory of NUMA node {node}: {}", std::io::Error::last_os_error()))?;
        }
    }
    Ok(())
}
