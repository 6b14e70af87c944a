//! Why an allocation (or a segment) could not be made.

/// Why nothing could be placed (or a segment could not be made).
///
/// ```
/// use mooncake_alloc::{AllocationError, AllocationRequest, AllocationStrategy, Random, SegmentAllocator};
/// let req = AllocationRequest { size: 4096, replica_num: 1, ..Default::default() };
/// assert_eq!(Random.allocate(&req, &[], None).unwrap_err(), AllocationError::NoSegment);
/// let tiny = [SegmentAllocator::new(0, "tiny", 1024)];
/// let err = Random.allocate(&req, &tiny, None).unwrap_err();
/// assert_eq!(err, AllocationError::NoSpace { size: 4096, replica_num: 1, candidates: 1 });
/// assert_eq!(err.to_string(), "no space for 4096 bytes x1 in 1 segment(s)");
/// ```
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum AllocationError {
    /// There is no segment to place on.
    #[error("no segment is mounted")]
    NoSegment,
    /// Size 0, replica count 0, or similar.
    #[error("invalid allocation request: {0}")]
    InvalidRequest(String),
    /// No candidate segment has a free block of the size.
    #[error("no space for {size} bytes x{replica_num} in {candidates} segment(s)")]
    NoSpace {
        /// Bytes per replica.
        size: u64,
        /// Replicas asked.
        replica_num: usize,
        /// Segments tried.
        candidates: usize,
    },
    /// Alignment is not a power of two.
    #[error("invalid alignment {0}")]
    InvalidAlignment(u64),
}
