//! `ReplicateConfig` and `SoftPinAction`, spelled as the reference spells them.

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

use crate::codes::INVALID_PARAMS;

/// What a write does to the object's soft pin.
#[pyclass(name = "SoftPinAction", module = "mooncake_rs.store", eq, eq_int)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SoftPinAction {
    /// Keep the pin state the object has (a new object is not pinned).
    #[pyo3(name = "PRESERVE")]
    Preserve,
    /// Soft-pin the object: it is evicted only when nothing else can be.
    #[pyo3(name = "ENABLE")]
    Enable,
    /// Do not pin the object.
    #[pyo3(name = "DISABLE")]
    Disable,
}

impl SoftPinAction {
    /// The name Python spells it with.
    fn name(self) -> &'static str {
        match self {
            SoftPinAction::Preserve => "PRESERVE",
            SoftPinAction::Enable => "ENABLE",
            SoftPinAction::Disable => "DISABLE",
        }
    }
}

/// How many copies of an object to keep, and where.
#[pyclass(name = "ReplicateConfig", module = "mooncake_rs.store")]
#[derive(Clone, Debug)]
pub struct ReplicateConfig {
    /// Number of memory replicas, each on a distinct segment.
    #[pyo3(get, set)]
    pub replica_num: usize,
    /// Accepted for compatibility; this engine has no NoF tier.
    #[pyo3(get, set)]
    pub nof_replica_num: usize,
    /// Accepted for compatibility; this engine has no DFS tier.
    #[pyo3(get, set)]
    pub dfs_replica_num: usize,
    /// What the write does to the soft pin.
    #[pyo3(get, set)]
    pub soft_pin_action: SoftPinAction,
    soft_pin_ttl_ms: Option<u64>,
    /// Accepted for compatibility; objects are never hard-pinned.
    #[pyo3(get, set)]
    pub with_hard_pin: bool,
    /// Segment to try first (tried before `preferred_segments`).
    #[pyo3(get, set)]
    pub preferred_segment: String,
    /// Segments to try first, in order.
    #[pyo3(get, set)]
    pub preferred_segments: Vec<String>,
    /// Accepted for compatibility; this engine has no NoF tier.
    #[pyo3(get, set)]
    pub preferred_nof_segments: Vec<String>,
    /// Place the (single) replica on this node's segment when it has room: the
    /// client's own, or the storage process a dummy client attached to. Like the
    /// reference, a write with it and `replica_num != 1` is refused (-600).
    #[pyo3(get, set)]
    pub prefer_alloc_in_same_node: bool,
    /// One group id per key of the write (a batch call's list must have one per key,
    /// else -600), or `None`. The reference's master keeps the objects of a group on
    /// one metadata shard; this engine's objects need no such grouping, so the ids
    /// are checked and then not used.
    #[pyo3(get, set)]
    pub group_ids: Option<Vec<String>>,
}

impl Default for ReplicateConfig {
    fn default() -> Self {
        Self {
            replica_num: 1,
            nof_replica_num: 0,
            dfs_replica_num: 0,
            soft_pin_action: SoftPinAction::Preserve,
            soft_pin_ttl_ms: None,
            with_hard_pin: false,
            preferred_segment: String::new(),
            preferred_segments: Vec::new(),
            preferred_nof_segments: Vec::new(),
            prefer_alloc_in_same_node: false,
            group_ids: None,
        }
    }
}

#[pymethods]
impl ReplicateConfig {
    /// The defaults: one replica, no pin, no preferred segment.
    #[new]
    fn new() -> Self {
        Self::default()
    }

    /// How long a soft pin outlives the last access (ms), or `None`: as long as the
    /// object lives (the reference defaults to its master's 30-minute TTL).
    #[getter]
    fn soft_pin_ttl_ms(&self) -> Option<u64> {
        self.soft_pin_ttl_ms
    }

    /// Sets the soft-pin TTL; `None` restores the default. Like the reference, a value
    /// that is not a non-negative 64-bit integer is a `TypeError`.
    #[setter]
    fn set_soft_pin_ttl_ms(&mut self, value: Option<Bound<'_, PyAny>>) -> PyResult<()> {
        self.soft_pin_ttl_ms = match value {
            None => None,
            Some(v) if v.is_none() => None,
            Some(v) => {
                let n: i128 =
                    v.extract().map_err(|_| PyTypeError::new_err("soft_pin_ttl_ms must be an int or None"))?;
                Some(u64::try_from(n).map_err(|_| PyTypeError::new_err("soft_pin_ttl_ms must fit in 0..2**64"))?)
            }
        };
        Ok(())
    }

    fn __str__(&self) -> String {
        let ttl = self.soft_pin_ttl_ms.map_or_else(|| "default".to_owned(), |t| t.to_string());
        format!(
            "ReplicateConfig: {{ replica_num: {}, nof_replica_num: {}, dfs_replica_num: {}, soft_pin_action: {}, \
             soft_pin_ttl_ms: {ttl}, with_hard_pin: {}, preferred_segments: {:?}, preferred_nof_segments: {:?}, \
             prefer_alloc_in_same_node: {}, group_ids: {:?} }}",
            self.replica_num,
            self.nof_replica_num,
            self.dfs_replica_num,
            self.soft_pin_action.name(),
            u8::from(self.with_hard_pin),
            self.preferred_segments,
            self.preferred_nof_segments,
            u8::from(self.prefer_alloc_in_same_node),
            self.group_ids,
        )
    }

    fn __repr__(&self) -> String {
        self.__str__()
    }
}

impl ReplicateConfig {
    /// The engine's configuration, or `INVALID_PARAMS` for a combination the reference
    /// refuses too (a soft-pin TTL on a write that does not enable the pin).
    ///
    /// With `ENABLE`, `soft_pin_ttl_ms` is how long the pin outlives the object's last
    /// write or read (each read renews it); `None` keeps the pin as long as the
    /// object lives. A pinned object is evicted only when nothing else can be.
    pub fn to_core(&self) -> Result<mooncake_core::ReplicateConfig, i32> {
        if self.soft_pin_ttl_ms.is_some() && self.soft_pin_action != SoftPinAction::Enable {
            return Err(INVALID_PARAMS);
        }
        if self.replica_num == 0 {
            return Err(INVALID_PARAMS);
        }
        let mut preferred = Vec::with_capacity(self.preferred_segments.len() + 1);
        if !self.preferred_segment.is_empty() {
            preferred.push(self.preferred_segment.clone());
        }
        for s in &self.preferred_segments {
            if !preferred.contains(s) {
                preferred.push(s.clone());
            }
        }
        Ok(mooncake_core::ReplicateConfig {
            replica_num: self.replica_num,
            preferred_segments: preferred,
            soft_pin: self.soft_pin_action == SoftPinAction::Enable,
            soft_pin_ttl: self.soft_pin_ttl_ms.map(std::time::Duration::from_millis),
            // An upsert of an existing object keeps its pin under PRESERVE.
            keep_soft_pin: self.soft_pin_action == SoftPinAction::Preserve,
            ..Default::default()
        })
    }

    /// The reference's extra check of the `pub_tensor` family: preferred segments, when
    /// given, name one segment per replica.
    pub fn check_pub(&self) -> Result<(), i32> {
        if !self.preferred_segments.is_empty() && self.preferred_segments.len() != self.replica_num {
            return Err(INVALID_PARAMS);
        }
        Ok(())
    }
}
