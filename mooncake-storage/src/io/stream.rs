//! Pipelined writes ([`IoEngine::write_stream`]) and completion-driven batched reads
//! ([`IoEngine::read_batch_each`]): their types and the engine-independent parts
//! (`O_DIRECT` rules, bounce buffers, short transfers).
//!
//! An engine only provides the raw forms ([`IoEngine::raw_write_stream`],
//! [`IoEngine::raw_read_each`]); the defaults run them one request at a time, and
//! [`IoUringEngine`](super::IoUringEngine) keeps up to [`QUEUE_DEPTH`](super::QUEUE_DEPTH)
//! requests in flight.

use std::collections::VecDeque;
use std::io;
use std::os::fd::RawFd;

use super::{is_aligned, read_exact, AlignedBuf, IoEngine, IoFile, RawRead, ReadOp, BOUNCE_CHUNK, IO_ALIGN, MAX_OP};
use crate::error::{Result, StorageError};

/// Most bytes of bounce buffers (for unaligned `O_DIRECT` data) a stream keeps in
/// flight; beyond it the stream waits for completions before copying more.
const BOUNCE_BUDGET: usize = 16 << 20;

/// The bytes of one [`WriteOp`].
#[derive(Debug)]
pub enum WriteData<'a> {
    /// Written from the caller's memory. With `O_DIRECT`, straight from it when the
    /// address is 4 KiB-aligned; an unaligned tail (padded with zeros to 4 KiB), or all
    /// of an unaligned buffer, goes through bounce buffers.
    Borrowed(&'a [u8]),
    /// The first `len` bytes of a buffer the stream holds until the write completes,
    /// then hands back through [`WriteSource::recycle`]. With `O_DIRECT` the bytes
    /// after `len` up to the next 4 KiB boundary are zeroed and written too (into a
    /// copy if the buffer is too short for that). At most 1 GiB.
    Owned {
        /// The buffer.
        buf: AlignedBuf,
        /// Bytes of data at its start.
        len: usize,
    },
}

/// One write of a stream: `data` at `offset` of the stream's file.
#[derive(Debug)]
pub struct WriteOp<'a> {
    /// Offset in the file (4 KiB-aligned with `O_DIRECT`).
    pub offset: u64,
    /// What to write.
    pub data: WriteData<'a>,
}

/// What a [`WriteSource`] gives next.
#[derive(Debug)]
pub enum WriteNext<'a> {
    /// Submit this write.
    Op(WriteOp<'a>),
    /// Nothing until a write in flight completes (typically: every buffer of the
    /// source is in flight; one comes back through [`WriteSource::recycle`]). Returned
    /// while nothing is in flight, it fails the stream.
    Wait,
    /// No more writes: the stream ends once those in flight complete.
    Done,
    /// Stop: the stream fails with this error once the writes in flight complete.
    Fail(StorageError),
}

/// The writes of one [`IoEngine::write_stream`], handed over one at a time as the
/// engine has room for them.
///
/// With `io_uring`, writes already handed over are in flight while `next_write` runs,
/// so work done there (checksums of values already written, copying the next values
/// into a buffer) overlaps the I/O. `next_write` runs inside the engine's loop: I/O it
/// does itself on the same thread goes through POSIX calls (the thread's ring is
/// busy).
pub trait WriteSource<'a> {
    /// The next write.
    fn next_write(&mut self) -> WriteNext<'a>;

    /// An owned buffer whose write finished (or was abandoned), for reuse.
    fn recycle(&mut self, buf: AlignedBuf) {
        drop(buf);
    }
}

/// A [`WriteSource`] over a slice of `(offset, bytes)`.
#[derive(Debug)]
pub(crate) struct SliceWrites<'s, 'a> {
    writes: &'s [(u64, &'a [u8])],
    next: usize,
}

impl<'s, 'a> SliceWrites<'s, 'a> {
    /// The writes of `writes`, in order.
    pub fn new(writes: &'s [(u64, &'a [u8])]) -> Self {
        SliceWrites { writes, next: 0 }
    }
}

impl<'a> WriteSource<'a> for SliceWrites<'_, 'a> {
    fn next_write(&mut self) -> WriteNext<'a> {
        match self.writes.get(self.next) {
            Some(&(offset, data)) => {
                self.next += 1;
                WriteNext::Op(WriteOp { offset, data: WriteData::Borrowed(data) })
            }
            None => WriteNext::Done,
        }
    }
}

/// One raw kernel write of a stream (see [`IoEngine::raw_write_stream`]).
#[derive(Debug)]
pub struct RawWrite {
    /// Descriptor.
    pub fd: RawFd,
    /// Offset in the file.
    pub offset: u64,
    /// Source start.
    pub ptr: *const u8,
    /// Bytes to write (at most 1 GiB).
    pub len: usize,
    /// Passed back to [`RawWriteSource::done`].
    pub tag: u64,
}

/// What a [`RawWriteSource`] gives next.
#[derive(Debug)]
pub enum RawNext {
    /// Submit this write.
    Write(RawWrite),
    /// Nothing until a write in flight completes.
    Wait,
    /// Nothing more for now. The stream ends when `End` (or `Wait`) comes while nothing
    /// is in flight; otherwise the engine asks again after the next completions (a
    /// short write may have to be resubmitted).
    End,
}

/// The source of [`IoEngine::raw_write_stream`].
pub trait RawWriteSource {
    /// The next write.
    fn next(&mut self) -> RawNext;
    /// The write tagged `tag` finished: bytes written (possibly short) or the error.
    fn done(&mut self, tag: u64, result: io::Result<usize>);
}

/// A piece of a stream as the kernel takes it.
struct Piece {
    offset: u64,
    ptr: *const u8,
    len: usize,
    /// Bytes already written (after short writes).
    written: usize,
    /// The buffer `ptr` points into when the stream holds one; `true` if it is the
    /// source's (recycled when written), `false` for a bounce buffer.
    owned: Option<(AlignedBuf, bool)>,
}

/// Turns a [`WriteSource`] into raw writes that obey the file's `O_DIRECT` rules.
struct Adapter<'s, 'a> {
    fd: RawFd,
    direct: bool,
    src: &'s mut dyn WriteSource<'a>,
    slots: Vec<Option<Piece>>,
    free: Vec<usize>,
    /// Slots whose piece (or its rest) is to be submitted.
    ready: VecDeque<usize>,
    inflight: usize,
    /// Unaligned borrowed data still to go through bounce buffers: file offset, bytes.
    bounce_rest: Option<(u64, &'a [u8])>,
    /// Bytes of bounce buffers held by pieces.
    bounce_bytes: usize,
    src_done: bool,
    error: Option<StorageError>,
}

impl<'a> Adapter<'_, 'a> {
    fn fail(&mut self, e: StorageError) {
        if self.error.is_none() {
            self.error = Some(e);
        }
    }

    fn add(&mut self, piece: Piece) {
        let slot = match self.free.pop() {
            Some(s) => {
                self.slots[s] = Some(piece);
                s
            }
            None => {
                self.slots.push(Some(piece));
                self.slots.len() - 1
            }
        };
        self.ready.push_back(slot);
    }

    fn add_borrowed(&mut self, offset: u64, data: &'a [u8]) {
        // MAX_OP is a multiple of IO_ALIGN, so every chunk but the last stays aligned.
        for (i, chunk) in data.chunks(MAX_OP).enumerate() {
            let offset = offset + (i * MAX_OP) as u64;
            self.add(Piece { offset, ptr: chunk.as_ptr(), len: chunk.len(), written: 0, owned: None });
        }
    }

    fn add_owned(&mut self, offset: u64, buf: AlignedBuf, len: usize, theirs: bool) {
        if !theirs {
            self.bounce_bytes += buf.len();
        }
        self.add(Piece { offset, ptr: buf.as_ptr(), len, written: 0, owned: Some((buf, theirs)) });
    }

    /// Splits one write of the source into pieces.
    fn split(&mut self, op: WriteOp<'a>) {
        if self.direct && !is_aligned(op.offset as usize) {
            if let WriteData::Owned { buf, .. } = op.data {
                self.src.recycle(buf);
            }
            let offset = op.offset;
            return self.fail(StorageError::InvalidArgument(format!("O_DIRECT write at unaligned offset {offset}")));
        }
        match op.data {
            WriteData::Borrowed(data) if !self.direct => self.add_borrowed(op.offset, data),
            WriteData::Borrowed(data) => {
                let mut pos = 0;
                if is_aligned(data.as_ptr() as usize) {
                    pos = data.len() / IO_ALIGN * IO_ALIGN;
                    self.add_borrowed(op.offset, &data[..pos]);
                }
                if pos < data.len() {
                    // copied lazily (next_bounce), so that bounce memory stays bounded
                    self.bounce_rest = Some((op.offset + pos as u64, &data[pos..]));
                }
            }
            WriteData::Owned { mut buf, len } => {
                if len > buf.len() {
                    self.src.recycle(buf);
                    return self.fail(StorageError::InvalidArgument(format!(
                        "owned write of {len} bytes from a shorter buffer"
                    )));
                }
                let span = if self.direct { len.div_ceil(IO_ALIGN) * IO_ALIGN } else { len };
                if span > MAX_OP {
                    self.src.recycle(buf);
                    return self
                        .fail(StorageError::InvalidArgument(format!("owned write of {len} bytes (over 1 GiB)")));
                }
                if len == 0 {
                    self.src.recycle(buf);
                } else if span <= buf.len() {
                    buf[len..span].fill(0);
                    self.add_owned(op.offset, buf, span, true);
                } else {
                    // no room for the zero padding: a copy that has it
                    let mut b = AlignedBuf::zeroed(span);
                    b[..len].copy_from_slice(&buf[..len]);
                    self.src.recycle(buf);
                    self.add_owned(op.offset, b, span, false);
                }
            }
        }
    }

    /// Copies the next chunk of `bounce_rest` into a bounce buffer, unless that would
    /// exceed the budget; whether a piece was made.
    fn next_bounce(&mut self) -> bool {
        let Some((offset, rest)) = self.bounce_rest else { return false };
        let n = rest.len().min(BOUNCE_CHUNK);
        let span = n.div_ceil(IO_ALIGN) * IO_ALIGN;
        if self.bounce_bytes > 0 && self.bounce_bytes + span > BOUNCE_BUDGET {
            return false;
        }
        let mut b = AlignedBuf::zeroed(span);
        b[..n].copy_from_slice(&rest[..n]);
        self.bounce_rest = (n < rest.len()).then(|| (offset + n as u64, &rest[n..]));
        self.add_owned(offset, b, span, false);
        true
    }

    fn release(&mut self, slot: usize) {
        let Some(p) = self.slots[slot].take() else { return };
        self.free.push(slot);
        match p.owned {
            Some((buf, true)) => self.src.recycle(buf),
            Some((buf, false)) => self.bounce_bytes -= buf.len(),
            None => {}
        }
    }
}

impl RawWriteSource for Adapter<'_, '_> {
    fn next(&mut self) -> RawNext {
        loop {
            if self.error.is_some() {
                return RawNext::End;
            }
            if let Some(slot) = self.ready.pop_front() {
                let p = self.slots[slot].as_ref().expect("a ready slot holds a piece");
                self.inflight += 1;
                return RawNext::Write(RawWrite {
                    fd: self.fd,
                    offset: p.offset + p.written as u64,
                    ptr: p.ptr.wrapping_add(p.written),
                    len: p.len - p.written,
                    tag: slot as u64,
                });
            }
            if self.bounce_rest.is_some() {
                if self.next_bounce() {
                    continue;
                }
                // over budget: some bounce piece is in flight (none is ready)
                return RawNext::Wait;
            }
            if self.src_done {
                return RawNext::End;
            }
            match self.src.next_write() {
                WriteNext::Op(op) => self.split(op),
                WriteNext::Wait if self.inflight > 0 => return RawNext::Wait,
                WriteNext::Wait => {
                    self.fail(StorageError::Io(io::Error::other("the write source waits while no write is in flight")))
                }
                WriteNext::Done => self.src_done = true,
                WriteNext::Fail(e) => self.fail(e),
            }
        }
    }

    fn done(&mut self, tag: u64, result: io::Result<usize>) {
        self.inflight -= 1;
        let slot = tag as usize;
        let Some(p) = self.slots.get_mut(slot).and_then(Option::as_mut) else { return };
        match result {
            Ok(0) => {
                self.fail(StorageError::Io(io::Error::new(io::ErrorKind::WriteZero, "write returned 0")));
                self.release(slot);
            }
            Ok(n) if p.written + n < p.len => {
                // short: the rest goes again, first
                p.written += n;
                self.ready.push_front(slot);
            }
            Ok(_) => self.release(slot),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => self.ready.push_front(slot),
            Err(e) => {
                self.fail(e.into());
                self.release(slot);
            }
        }
    }
}

/// [`IoEngine::write_stream`] of any engine.
pub(crate) fn write_stream<'a, E: IoEngine + ?Sized>(
    e: &E,
    file: &IoFile,
    src: &mut dyn WriteSource<'a>,
) -> Result<()> {
    let mut a = Adapter {
        fd: file.fd(),
        direct: file.is_direct(),
        src,
        slots: Vec::new(),
        free: Vec::new(),
        ready: VecDeque::new(),
        inflight: 0,
        bounce_rest: None,
        bounce_bytes: 0,
        src_done: false,
        error: None,
    };
    // SAFETY: every raw write points into data the source lent for `'a` (alive for
    // this whole call) or into a buffer held by its slot, and a slot is released only
    // by `done` for its tag, i.e. once the kernel has finished with it.
    unsafe { e.raw_write_stream(&mut a) };
    if let Some(err) = a.error.take() {
        return Err(err);
    }
    if !a.src_done || a.inflight > 0 || !a.ready.is_empty() || a.bounce_rest.is_some() {
        return Err(StorageError::Io(io::Error::other("the engine ended a write stream early")));
    }
    Ok(())
}

/// [`IoEngine::read_batch_each`] of any engine.
pub(crate) fn read_batch_each<E: IoEngine + ?Sized>(
    e: &E,
    ops: &mut [ReadOp<'_>],
    done: &mut dyn FnMut(usize, Result<&mut [u8]>),
) {
    // Ops the kernel can take as they are go in one raw batch; the others one by one.
    let mut raw = Vec::with_capacity(ops.len());
    let mut raw_idx = Vec::with_capacity(ops.len());
    let mut slow = Vec::new();
    for (i, op) in ops.iter_mut().enumerate() {
        let simple = op.buf.len() <= MAX_OP
            && (!op.file.direct
                || (is_aligned(op.offset as usize)
                    && is_aligned(op.buf.as_ptr() as usize)
                    && is_aligned(op.buf.len())));
        if simple && !op.buf.is_empty() {
            raw.push(RawRead {
                fd: op.file.fd(),
                offset: op.offset,
                ptr: op.buf.as_mut_ptr(),
                len: op.buf.len(),
                result: None,
            });
            raw_idx.push(i);
        } else {
            slow.push(i);
        }
    }
    if !raw.is_empty() {
        let mut on_raw = |j: usize, res: io::Result<usize>| {
            let i = raw_idx[j];
            // The kernel is done with this op's buffer; the others are not touched.
            let op = &mut ops[i];
            let r = match res {
                Ok(n) if n >= op.buf.len() => Ok(()),
                // short (end of file, or a signal): the rest the simple way
                Ok(n) => read_exact(e, op.file, op.offset + n as u64, &mut op.buf[n..]),
                Err(err) if err.kind() == io::ErrorKind::Interrupted => read_exact(e, op.file, op.offset, op.buf),
                Err(err) => Err(err.into()),
            };
            done(i, r.map(|()| &mut *op.buf));
        };
        // SAFETY: each `ptr` comes from a distinct `&mut [u8]` of `ops`, which stays
        // borrowed until the call returns; `on_raw` touches the buffer of read `j` only
        // once it is reported done.
        unsafe { e.raw_read_each(&mut raw, &mut on_raw) };
    }
    for i in slow {
        let op = &mut ops[i];
        let r = read_exact(e, op.file, op.offset, op.buf);
        done(i, r.map(|()| &mut *op.buf));
    }
}
