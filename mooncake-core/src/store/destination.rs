//! Where the read engine puts an object: the caller's host buffers, a buffer of
//! the engine's that the caller gets as `Bytes`, or device memory (through a
//! pinned staging buffer unless the replica's transport moves device memory).

use bytes::Bytes;
use mooncake_gpu::{DeviceMemory, PooledBuffer};

use super::buffers;
use super::device::{room_after, staging, Copies, Keep};
use crate::error::{Error, Result};

/// Where an object read goes, as the caller asks.
pub(super) enum Dest<'a> {
    /// A buffer the engine takes from the pool and hands out (`get`).
    Owned,
    /// The caller's host buffers, filled in order.
    Host(Vec<&'a mut [u8]>),
    /// Device memory from `offset` on.
    Device { mem: &'a dyn DeviceMemory, offset: u64 },
}

/// What reading one object gave.
pub(super) enum Got {
    /// The object's length (it is in the caller's buffers).
    Len(usize),
    /// The object, in a buffer of the engine's.
    Owned(Bytes),
}

impl Got {
    /// The object's length.
    pub(super) fn len(&self) -> usize {
        match self {
            Got::Len(n) => *n,
            Got::Owned(b) => b.len(),
        }
    }
}

/// A host buffer of the engine's that an object is read into.
enum Scratch {
    None,
    Owned(Vec<u8>),
    Pinned(PooledBuffer<'static>),
}

/// One object's destination, and the host buffer it is read into when that is not
/// the caller's memory. Every slice it hands out is at most the object's length
/// and never out of bounds (a buffer too short gives a short slice, whose read
/// then fails its checksum).
pub(super) struct Destination<'a> {
    pub(super) dest: Dest<'a>,
    scratch: Scratch,
}

impl<'a> Destination<'a> {
    pub(super) fn new(dest: Dest<'a>) -> Self {
        Destination { dest, scratch: Scratch::None }
    }

    /// Fails unless the destination holds `len` bytes; takes the host buffer an
    /// owned read needs, or a device read through host memory (`staged`).
    pub(super) fn prepare(&mut self, len: usize, staged: bool) -> Result<()> {
        // The length is the master's word: nothing is allocated for more than an
        // object can hold.
        if crate::config::check_value_len(len as u64).is_err() {
            return Err(Error::Corrupted(format!("a replica list of {len} bytes, over the largest object")));
        }
        match &self.dest {
            Dest::Owned => self.scratch(len, false),
            Dest::Host(bufs) => {
                let capacity: u64 = bufs.iter().map(|b| b.len() as u64).sum();
                if capacity < len as u64 {
                    return Err(Error::BufferTooSmall { needed: len as u64, capacity });
                }
                Ok(())
            }
            Dest::Device { mem, offset } => {
                let room = room_after(*mem, *offset)?;
                if len > room {
                    return Err(Error::BufferTooSmall { needed: len as u64, capacity: room as u64 });
                }
                if staged {
                    return self.scratch(len, true);
                }
                Ok(())
            }
        }
    }

    /// A scratch buffer of at least `len` bytes (pinned for a device).
    fn scratch(&mut self, len: usize, pinned: bool) -> Result<()> {
        match (&self.scratch, &self.dest) {
            (Scratch::Owned(b), _) if !pinned && b.len() >= len => Ok(()),
            (Scratch::Pinned(b), _) if pinned && b.len() >= len => Ok(()),
            (_, Dest::Device { mem, .. }) if pinned => {
                self.scratch = Scratch::None; // back to the pool first
                self.scratch = Scratch::Pinned(staging(*mem, len)?);
                Ok(())
            }
            _ => {
                self.scratch = Scratch::Owned(buffers::take(len));
                Ok(())
            }
        }
    }

    /// The host memory `len` bytes are read into: the caller's buffers (each
    /// piece with the object offset of its first byte) or the scratch buffer.
    pub(super) fn pieces(&mut self, len: usize) -> Vec<(u64, &mut [u8])> {
        match (&mut self.dest, &mut self.scratch) {
            (Dest::Host(bufs), _) => {
                let mut at = 0;
                bufs.iter_mut()
                    .map(|b| {
                        let n = (len - at).min(b.len());
                        at += n;
                        ((at - n) as u64, &mut b[..n])
                    })
                    .filter(|(_, p)| !p.is_empty())
                    .collect()
            }
            (_, Scratch::Owned(b)) => vec![(0, b.get_mut(..len).unwrap_or_default())],
            (_, Scratch::Pinned(b)) => vec![(0, b.get_mut(..len).unwrap_or_default())],
            (_, Scratch::None) => Vec::new(),
        }
    }

    /// The bytes read, as [`pieces`](Self::pieces) lays them out.
    pub(super) fn filled(&self, len: usize) -> Vec<&[u8]> {
        match (&self.dest, &self.scratch) {
            (Dest::Host(bufs), _) => {
                let mut left = len;
                bufs.iter()
                    .map(|b| {
                        let n = left.min(b.len());
                        left -= n;
                        &b[..n]
                    })
                    .filter(|p| !p.is_empty())
                    .collect()
            }
            (_, Scratch::Owned(b)) => vec![b.get(..len).unwrap_or_default()],
            (_, Scratch::Pinned(b)) => vec![b.get(..len).unwrap_or_default()],
            (_, Scratch::None) => Vec::new(),
        }
    }

    /// One buffer of `len` bytes, for a disk read: the caller's only buffer, else
    /// the scratch buffer ([`spread`](Self::spread) over several caller buffers
    /// afterwards).
    pub(super) fn whole(&mut self, len: usize) -> &mut [u8] {
        let several = matches!(&self.dest, Dest::Host(b) if b.len() > 1);
        if several {
            let _ = self.scratch(len, false);
        }
        match (&mut self.dest, &mut self.scratch) {
            (Dest::Host(b), _) if !several => b.first_mut().and_then(|b| b.get_mut(..len)).unwrap_or_default(),
            (_, Scratch::Owned(b)) => b.get_mut(..len).unwrap_or_default(),
            (_, Scratch::Pinned(b)) => b.get_mut(..len).unwrap_or_default(),
            _ => &mut [],
        }
    }

    /// Copies what [`whole`](Self::whole) read into the caller's buffers, if
    /// they are several.
    pub(super) fn spread(&mut self, len: usize) {
        if !matches!(&self.dest, Dest::Host(b) if b.len() > 1) {
            return;
        }
        if let Scratch::Owned(whole) = std::mem::replace(&mut self.scratch, Scratch::None) {
            for (at, p) in self.pieces(len) {
                let at = at as usize;
                p.copy_from_slice(&whole[at..at + p.len()]);
            }
        }
    }

    /// Enqueues the copy of a staged read of `len` bytes to device memory (item
    /// `item` of `uploads`); nothing for other destinations.
    pub(super) fn upload(&mut self, item: usize, len: usize, copies: &mut Copies<'a>) -> Result<()> {
        if let (Dest::Device { mem, offset }, Scratch::Pinned(_)) = (&self.dest, &self.scratch) {
            let (mem, offset) = (*mem, *offset);
            if let Scratch::Pinned(buf) = std::mem::replace(&mut self.scratch, Scratch::None) {
                let src = buf.as_ptr();
                // SAFETY: `buf` holds the `len` bytes read (`prepare` sized it), is
                // kept with the copy and written by no one until it is done.
                return unsafe { copies.enqueue_upload(item, mem, src, len, offset, Keep::Staged(buf)) };
            }
        }
        Ok(())
    }

    /// The result of a read of `len` bytes into this destination.
    pub(super) fn into_got(self, len: usize) -> Got {
        match (self.dest, self.scratch) {
            (Dest::Owned, Scratch::Owned(buf)) => Got::Owned(buffers::freeze(buf, len)),
            _ => Got::Len(len),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A replica list's length is the master's word: one beyond the largest object is
    /// refused before any buffer is taken for it, whatever the destination.
    #[test]
    fn a_length_over_the_largest_object_is_refused_before_allocating() {
        for len in [usize::MAX / 2, (crate::config::MAX_VALUE_LEN + 1) as usize] {
            let mut owned = Destination::new(Dest::Owned);
            assert!(matches!(owned.prepare(len, false), Err(Error::Corrupted(_))), "{len}");
            let mut buf = [0u8; 16];
            let mut host = Destination::new(Dest::Host(vec![&mut buf[..]]));
            assert!(matches!(host.prepare(len, false), Err(Error::Corrupted(_))), "{len}");
        }
        let mut owned = Destination::new(Dest::Owned);
        assert!(owned.prepare(4096, false).is_ok());
    }
}
