//! Replica descriptors (`get_replica_desc`, `batch_get_replica_desc`) and clearing
//! replicas (`batch_replica_clear`).

use std::collections::HashMap;

use mooncake_core::alloc::SegmentId;
use mooncake_core::SegmentInfo;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

use crate::session::Session;

/// The state of a replica (those the master hands out are `COMPLETE`).
#[pyclass(name = "ReplicaStatus", module = "mooncake_rs.store", eq, eq_int)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplicaStatus {
    /// Not set.
    #[pyo3(name = "UNDEFINED")]
    Undefined,
    /// Allocated, not written.
    #[pyo3(name = "INITIALIZED")]
    Initialized,
    /// Being written.
    #[pyo3(name = "PROCESSING")]
    Processing,
    /// Written and readable.
    #[pyo3(name = "COMPLETE")]
    Complete,
    /// Removed.
    #[pyo3(name = "REMOVED")]
    Removed,
    /// Its write failed.
    #[pyo3(name = "FAILED")]
    Failed,
}

#[pymethods]
impl ReplicaStatus {
    /// The status's name (`"COMPLETE"`), as Python enums spell it.
    #[getter]
    fn name(&self) -> &'static str {
        match self {
            ReplicaStatus::Undefined => "UNDEFINED",
            ReplicaStatus::Initialized => "INITIALIZED",
            ReplicaStatus::Processing => "PROCESSING",
            ReplicaStatus::Complete => "COMPLETE",
            ReplicaStatus::Removed => "REMOVED",
            ReplicaStatus::Failed => "FAILED",
        }
    }
}

/// Where a memory replica's bytes are.
#[pyclass(name = "Descriptor", module = "mooncake_rs.store", get_all, set_all)]
#[derive(Clone, Debug, Default)]
pub struct Descriptor {
    /// Bytes of the replica (the object's length).
    pub size: u64,
    /// Offset of the replica in its segment (this engine addresses segments by
    /// offset, not by the owner's virtual address).
    pub buffer_address: u64,
    /// `host:port` the segment is served at.
    pub transport_endpoint: String,
}

#[pymethods]
impl Descriptor {
    /// An empty descriptor.
    #[new]
    fn new() -> Self {
        Self::default()
    }

    fn __repr__(&self) -> String {
        format!(
            "<Descriptor size={} buffer_address={} transport_endpoint={}>",
            self.size, self.buffer_address, self.transport_endpoint
        )
    }
}

/// A memory replica: where its bytes are.
#[pyclass(name = "MemoryDescriptor", module = "mooncake_rs.store", get_all)]
#[derive(Clone, Debug)]
pub struct MemoryDescriptor {
    /// The buffer.
    pub buffer_descriptor: Descriptor,
}

/// A replica on a file system (this engine's disk replicas live on a client's SSD
/// tier and are `is_local_disk_replica()`; this class exists for the reference's API).
#[pyclass(name = "DiskDescriptor", module = "mooncake_rs.store", get_all)]
#[derive(Clone, Debug)]
pub struct DiskDescriptor {
    /// Path of the file ("" when the engine does not expose it).
    pub file_path: String,
    /// Bytes of the object.
    pub object_size: u64,
}

/// What kind of replica a descriptor describes.
#[derive(Clone, Debug)]
enum Kind {
    Memory(MemoryDescriptor),
    LocalDisk { object_size: u64 },
}

/// One replica of an object.
#[pyclass(name = "ReplicaDescriptor", module = "mooncake_rs.store", frozen)]
#[derive(Clone, Debug)]
pub struct ReplicaDescriptor {
    kind: Kind,
    /// Name of the segment holding a memory replica (`endpoint#n`; "" for a disk
    /// replica): what `create_move_task`, `batch_replica_clear` and
    /// `ReplicateConfig.preferred_segments` take.
    #[pyo3(get)]
    segment_name: String,
}

#[pymethods]
impl ReplicaDescriptor {
    /// Always `COMPLETE`: the master describes only readable replicas.
    #[getter]
    fn status(&self) -> ReplicaStatus {
        ReplicaStatus::Complete
    }

    /// A replica in a segment's memory.
    fn is_memory_replica(&self) -> bool {
        matches!(self.kind, Kind::Memory(_))
    }

    /// A replica on a shared file system (this engine has none).
    fn is_disk_replica(&self) -> bool {
        false
    }

    /// A replica on a client's SSD tier.
    fn is_local_disk_replica(&self) -> bool {
        matches!(self.kind, Kind::LocalDisk { .. })
    }

    /// A replica on an NVMe-oF target (this engine has none).
    fn is_nof_replica(&self) -> bool {
        false
    }

    /// Where a memory replica's bytes are; `RuntimeError` for another kind.
    fn get_memory_descriptor(&self) -> PyResult<MemoryDescriptor> {
        match &self.kind {
            Kind::Memory(m) => Ok(m.clone()),
            Kind::LocalDisk { .. } => Err(PyRuntimeError::new_err("not a memory replica")),
        }
    }

    /// The file of a file-system replica; `RuntimeError` for another kind (this
    /// engine's disk replicas are local: `is_local_disk_replica()`).
    fn get_disk_descriptor(&self) -> PyResult<DiskDescriptor> {
        Err(PyRuntimeError::new_err("not a disk replica"))
    }

    /// The SSD replica's size as a `DiskDescriptor` (no path: the tier's layout is
    /// its own); `RuntimeError` for another kind.
    fn get_local_disk_descriptor(&self) -> PyResult<DiskDescriptor> {
        match &self.kind {
            Kind::LocalDisk { object_size } => {
                Ok(DiskDescriptor { file_path: String::new(), object_size: *object_size })
            }
            Kind::Memory(_) => Err(PyRuntimeError::new_err("not a local disk replica")),
        }
    }

    fn __repr__(&self) -> String {
        match &self.kind {
            Kind::Memory(m) => format!(
                "ReplicaDescriptor(memory, segment={}, size={}, endpoint={})",
                self.segment_name, m.buffer_descriptor.size, m.buffer_descriptor.transport_endpoint
            ),
            Kind::LocalDisk { object_size } => format!("ReplicaDescriptor(local disk, size={object_size})"),
        }
    }
}

/// The replicas of each key, `None` for a key the master does not have (or could not
/// answer for). One master round trip for the lists, one to give their read leases
/// back (asking is not reading), and one per segment not seen yet.
pub fn describe(s: &Session, keys: &[&str]) -> Vec<Option<Vec<ReplicaDescriptor>>> {
    let master = s.store.master();
    let lists = master.batch_get_replica_list(keys);
    let found: Vec<&str> = keys.iter().zip(&lists).filter(|(_, l)| l.is_ok()).map(|(k, _)| *k).collect();
    if !found.is_empty() {
        let _ = master.release_leases(&found);
    }
    let mut segments: HashMap<SegmentId, Option<SegmentInfo>> = HashMap::new();
    lists
        .into_iter()
        .map(|list| {
            let list = list.ok()?;
            let mut out = Vec::with_capacity(list.replicas.len() + 1);
            for r in &list.replicas {
                let info = segments.entry(r.segment).or_insert_with(|| master.segment_info(r.segment).ok());
                let (name, endpoint) = match info {
                    Some(i) => (i.name.clone(), i.region.endpoint.clone()),
                    None => (String::new(), String::new()),
                };
                out.push(ReplicaDescriptor {
                    kind: Kind::Memory(MemoryDescriptor {
                        buffer_descriptor: Descriptor {
                            size: r.len,
                            buffer_address: r.offset,
                            transport_endpoint: endpoint,
                        },
                    }),
                    segment_name: name,
                });
            }
            if list.disk.is_some() {
                out.push(ReplicaDescriptor {
                    kind: Kind::LocalDisk { object_size: list.len },
                    segment_name: String::new(),
                });
            }
            Some(out)
        })
        .collect()
}

/// `batch_replica_clear`: the keys whose replicas were cleared. With `segment_name`
/// "", the objects are removed; else only the replicas on that segment go (an object
/// left with none is removed). Leased objects are skipped, as in the reference.
pub fn clear(s: &Session, keys: &[&str], segment_name: &str) -> Vec<String> {
    let results = if segment_name.is_empty() {
        s.store.batch_remove(keys)
    } else {
        match s.resolve_segment(segment_name) {
            Some(name) => s.store.drop_replicas(keys, &name),
            None => return Vec::new(),
        }
    };
    keys.iter().zip(results).filter(|(_, r)| r.is_ok()).map(|(k, _)| (*k).to_owned()).collect()
}
