//! The incremental frame reader: frames assembled from bytes as they arrive.

use super::wire::{FrameError, FrameHeader, HEADER_LEN};

/// A frame as read: its header and its undecoded body.
pub type RawFrame = (FrameHeader, Vec<u8>);

/// Assembles frames from bytes as they arrive, holding in memory only the body bytes
/// already received: a header announcing a large body costs nothing until that body
/// is actually sent.
///
/// ```
/// # // Public only with the `fuzzing` feature (a workspace test enables it).
/// # #[cfg(feature = "fuzzing")] {
/// use mooncake_core::rpc::wire::{encode_frame, FrameKind, Request};
/// use mooncake_core::rpc::FrameReader;
///
/// let frame = encode_frame(FrameKind::Request, 7, &Request::Stats {}).unwrap();
/// let mut reader = FrameReader::new(1 << 20);
/// // The first byte alone completes nothing.
/// assert_eq!(reader.feed(&frame[..1], usize::MAX).unwrap(), (1, None));
/// let (used, frame_out) = reader.feed(&frame[1..], usize::MAX).unwrap();
/// assert_eq!(used, frame.len() - 1);
/// let (header, body) = frame_out.unwrap();
/// assert_eq!((header.request_id, body.len() + 20), (7, frame.len()));
/// # }
/// ```
#[derive(Debug)]
pub struct FrameReader {
    max_body: u32,
    header: [u8; HEADER_LEN],
    header_filled: usize,
    current: Option<FrameHeader>,
    body: Vec<u8>,
}

impl FrameReader {
    /// A reader of frames whose bodies are at most `max_body` bytes.
    pub fn new(max_body: u32) -> Self {
        Self { max_body, header: [0; HEADER_LEN], header_filled: 0, current: None, body: Vec::new() }
    }

    /// Body bytes of the frame in progress held in memory.
    pub fn buffered(&self) -> usize {
        self.body.len()
    }

    /// The body length the frame in progress announced, once its header is read
    /// (`None` before that, and between frames). The server reserves that much of its
    /// memory budget before it feeds the reader any body byte.
    pub fn body_len(&self) -> Option<usize> {
        self.current.map(|h| h.body_len as usize)
    }

    /// Whether no byte of a next frame has arrived yet.
    #[cfg(any(test, feature = "fuzzing"))]
    pub fn is_idle(&self) -> bool {
        self.header_filled == 0 && self.current.is_none()
    }

    /// Consumes bytes of `input`, taking at most `allowance` body bytes into memory.
    /// Returns how many bytes were consumed and, when they complete one, the frame
    /// (header and body); bytes after a complete frame are left unconsumed. A
    /// malformed header is an error, after which the reader must not be fed again.
    pub fn feed(&mut self, input: &[u8], allowance: usize) -> Result<(usize, Option<RawFrame>), FrameError> {
        let mut used = 0;
        if self.current.is_none() {
            let take = (HEADER_LEN - self.header_filled).min(input.len());
            self.header[self.header_filled..self.header_filled + take].copy_from_slice(&input[..take]);
            self.header_filled += take;
            used += take;
            if self.header_filled < HEADER_LEN {
                return Ok((used, None));
            }
            let header = FrameHeader::decode(&self.header, self.max_body)?;
            self.current = Some(header);
        }
        let Some(header) = self.current else { return Ok((used, None)) };
        let want = header.body_len as usize - self.body.len();
        let take = want.min(input.len() - used).min(allowance);
        if take > 0 {
            // Grow with the bytes that arrived, never to the announced size ahead of
            // them, and never past it (a doubling `Vec` could overshoot it twofold).
            let needed = self.body.len() + take;
            if needed > self.body.capacity() {
                let target = (self.body.capacity() * 2).clamp(needed, header.body_len as usize);
                self.body.reserve_exact(target - self.body.len());
            }
            self.body.extend_from_slice(&input[used..used + take]);
            used += take;
        }
        if self.body.len() < header.body_len as usize {
            return Ok((used, None));
        }
        self.current = None;
        self.header_filled = 0;
        Ok((used, Some((header, std::mem::take(&mut self.body)))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rpc::wire::{encode_frame, FrameKind, Request};

    #[test]
    fn a_header_alone_holds_no_body_memory() {
        let header = FrameHeader { kind: FrameKind::Request, request_id: 1, body_len: 64 << 20 }.encode();
        let mut r = FrameReader::new(64 << 20);
        assert_eq!(r.feed(&header, usize::MAX).unwrap(), (HEADER_LEN, None));
        assert_eq!((r.buffered(), r.body.capacity()), (0, 0));
        assert_eq!(r.feed(&[0; 1000], usize::MAX).unwrap(), (1000, None));
        assert!(r.body.capacity() < 4096, "{}", r.body.capacity());
    }

    #[test]
    fn frames_split_anywhere_come_out_whole_and_in_order() {
        let mut stream = Vec::new();
        for id in 0..20u64 {
            stream.extend(
                encode_frame(FrameKind::Request, id, &Request::Exists { key: "k".repeat(id as usize) }).unwrap(),
            );
        }
        for step in [1, 3, 7, 64, stream.len()] {
            let mut r = FrameReader::new(1 << 20);
            let mut ids = Vec::new();
            let mut at = 0;
            while at < stream.len() {
                let end = (at + step).min(stream.len());
                let mut chunk = &stream[at..end];
                while !chunk.is_empty() {
                    let (used, frame) = r.feed(chunk, 5).unwrap();
                    chunk = &chunk[used..];
                    at += used;
                    if let Some((h, body)) = frame {
                        let req: Request = crate::rpc::wire::decode_body(&body).unwrap();
                        assert_eq!(req, Request::Exists { key: "k".repeat(h.request_id as usize) });
                        ids.push(h.request_id);
                    }
                }
            }
            assert_eq!(ids, (0..20).collect::<Vec<_>>());
            assert!(r.is_idle());
        }
    }

    #[test]
    fn an_allowance_of_zero_takes_no_body_byte() {
        let frame = encode_frame(FrameKind::Request, 1, &Request::Exists { key: "abc".into() }).unwrap();
        let mut r = FrameReader::new(1 << 20);
        assert_eq!(r.feed(&frame, 0).unwrap(), (HEADER_LEN, None));
        assert_eq!(r.buffered(), 0);
        assert!(r.feed(&frame[HEADER_LEN..], usize::MAX).unwrap().1.is_some());
    }

    #[test]
    fn the_announced_body_length_is_known_from_the_header_on() {
        let frame = encode_frame(FrameKind::Request, 1, &Request::Exists { key: "abc".into() }).unwrap();
        let mut r = FrameReader::new(1 << 20);
        assert_eq!(r.feed(&frame[..HEADER_LEN - 1], usize::MAX).unwrap(), (HEADER_LEN - 1, None));
        assert_eq!(r.body_len(), None);
        assert_eq!(r.feed(&frame[HEADER_LEN - 1..], 0).unwrap(), (1, None));
        assert_eq!(r.body_len(), Some(frame.len() - HEADER_LEN));
        assert!(r.feed(&frame[HEADER_LEN..], usize::MAX).unwrap().1.is_some());
        assert_eq!(r.body_len(), None);
    }

    #[test]
    fn an_oversized_header_is_refused_before_any_body() {
        let header = FrameHeader { kind: FrameKind::Request, request_id: 1, body_len: 2 << 20 }.encode();
        let mut r = FrameReader::new(1 << 20);
        assert!(matches!(r.feed(&header, usize::MAX), Err(FrameError::TooLarge { .. })));
    }
}
