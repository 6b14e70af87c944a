//! What RDMA peers exchange over the TCP control channel: their queue pairs'
//! addresses ([`RdmaHandshake`]) and the memory regions of one served region
//! ([`RdmaRegionInfo`]). Fixed-layout little-endian; decoders never panic.
//!
//! ```text
//! handshake:   "MCRD" | version u8 | count u16 | count x (nic u8 | gid index u8 | lid u16
//!              | qp num u32 | psn u32 | mtu u32 | gid [16])
//! region info: "MCRR" | version u8 | region len u64 | nics u8 | count u16
//!              | count x (offset u64 | len u64 | addr u64 | nics x rkey u32)
//! ```

use super::QpAddress;
use crate::frame::{FrameError, MAX_HANDSHAKE_BYTES};

const HANDSHAKE_MAGIC: [u8; 4] = *b"MCRD";
const REGION_MAGIC: [u8; 4] = *b"MCRR";
const VERSION: u8 = 1;
const QP_ENTRY: usize = 32;

/// The queue pairs one side of a link offers (a request) or connected (the answer).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RdmaHandshake {
    /// One address per queue pair, in pool order.
    pub qps: Vec<QpAddress>,
}

/// One memory region of a served region: bytes `[offset, offset + len)` of the
/// region start at `addr` in the server and are reached with `rkeys[nic]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionPiece {
    /// Offset inside the served region.
    pub offset: u64,
    /// Bytes of this piece.
    pub len: u64,
    /// Address of the piece's first byte in the server.
    pub addr: u64,
    /// Remote key of the piece on each of the server's NICs.
    pub rkeys: Vec<u32>,
}

/// How to reach a served region with one-sided operations: its length and the
/// memory regions covering it (several when it exceeds the device's `max_mr_size`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RdmaRegionInfo {
    /// Registered length of the served region.
    pub len: u64,
    /// Pieces in order, covering `[0, len)` without gaps.
    pub pieces: Vec<RegionPiece>,
}

struct Cursor<'a>(&'a [u8]);

impl Cursor<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], FrameError> {
        if self.0.len() < N {
            return Err(FrameError::Truncated(self.0.len()));
        }
        let (head, rest) = self.0.split_at(N);
        self.0 = rest;
        Ok(head.try_into().expect("N bytes"))
    }
    fn u8(&mut self) -> Result<u8, FrameError> {
        Ok(self.take::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16, FrameError> {
        Ok(u16::from_le_bytes(self.take()?))
    }
    fn u32(&mut self) -> Result<u32, FrameError> {
        Ok(u32::from_le_bytes(self.take()?))
    }
    fn u64(&mut self) -> Result<u64, FrameError> {
        Ok(u64::from_le_bytes(self.take()?))
    }
    fn header(&mut self, magic: [u8; 4]) -> Result<(), FrameError> {
        let m = self.take::<4>()?;
        if m != magic {
            return Err(FrameError::BadMagic(m));
        }
        match self.u8()? {
            VERSION => Ok(()),
            v => Err(FrameError::Version(v)),
        }
    }
}

impl RdmaHandshake {
    /// Encodes the handshake.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(7 + self.qps.len() * QP_ENTRY);
        b.extend_from_slice(&HANDSHAKE_MAGIC);
        b.push(VERSION);
        b.extend_from_slice(&(self.qps.len() as u16).to_le_bytes());
        for q in &self.qps {
            b.push(q.nic);
            b.push(q.gid_index);
            b.extend_from_slice(&q.lid.to_le_bytes());
            b.extend_from_slice(&q.qp_num.to_le_bytes());
            b.extend_from_slice(&q.psn.to_le_bytes());
            b.extend_from_slice(&q.mtu.to_le_bytes());
            b.extend_from_slice(&q.gid);
        }
        b
    }

    /// Decodes and checks a handshake: magic, version, a count that fits the bytes
    /// and the handshake limit, 24-bit queue pair numbers and PSNs, valid MTUs.
    /// Never panics.
    ///
    /// ```
    /// use mooncake_transfer::{FrameError, RdmaHandshake};
    /// assert_eq!(RdmaHandshake::decode(b"MCRD\x01\x00\x00"), Ok(RdmaHandshake { qps: vec![] }));
    /// assert!(matches!(RdmaHandshake::decode(b"MCRD\x01\x01\x00"), Err(FrameError::TooLong(1))));
    /// ```
    pub fn decode(b: &[u8]) -> Result<Self, FrameError> {
        if b.len() as u64 > MAX_HANDSHAKE_BYTES {
            return Err(FrameError::TooLong(b.len() as u64));
        }
        let mut c = Cursor(b);
        c.header(HANDSHAKE_MAGIC)?;
        let count = c.u16()? as usize;
        if count * QP_ENTRY != c.0.len() {
            return Err(FrameError::TooLong(count as u64));
        }
        let mut qps = Vec::with_capacity(count);
        for _ in 0..count {
            let (nic, gid_index, lid) = (c.u8()?, c.u8()?, c.u16()?);
            let (qp_num, psn, mtu) = (c.u32()?, c.u32()?, c.u32()?);
            let gid = c.take::<16>()?;
            if qp_num >> 24 != 0 || psn >> 24 != 0 {
                return Err(FrameError::Code(3));
            }
            if !matches!(mtu, 256 | 512 | 1024 | 2048 | 4096) {
                return Err(FrameError::Code(4));
            }
            qps.push(QpAddress { nic, qp_num, lid, gid, gid_index, mtu, psn });
        }
        Ok(Self { qps })
    }
}

impl RdmaRegionInfo {
    /// Encodes the region info (every piece carries as many keys as the first).
    pub fn encode(&self) -> Vec<u8> {
        let nics = self.pieces.first().map_or(0, |p| p.rkeys.len());
        let mut b = Vec::with_capacity(16 + self.pieces.len() * (24 + 4 * nics));
        b.extend_from_slice(&REGION_MAGIC);
        b.push(VERSION);
        b.extend_from_slice(&self.len.to_le_bytes());
        b.push(nics as u8);
        b.extend_from_slice(&(self.pieces.len() as u16).to_le_bytes());
        for p in &self.pieces {
            b.extend_from_slice(&p.offset.to_le_bytes());
            b.extend_from_slice(&p.len.to_le_bytes());
            b.extend_from_slice(&p.addr.to_le_bytes());
            for k in p.rkeys.iter().take(nics) {
                b.extend_from_slice(&k.to_le_bytes());
            }
        }
        b
    }

    /// Decodes and checks region info: magic, version, at least one NIC and one
    /// piece, pieces that fit the bytes, are non-empty, contiguous from 0 and end at
    /// the region's length, with addresses that do not wrap. Never panics.
    pub fn decode(b: &[u8]) -> Result<Self, FrameError> {
        if b.len() as u64 > MAX_HANDSHAKE_BYTES {
            return Err(FrameError::TooLong(b.len() as u64));
        }
        let mut c = Cursor(b);
        c.header(REGION_MAGIC)?;
        let len = c.u64()?;
        let nics = c.u8()? as usize;
        let count = c.u16()? as usize;
        // A region has at least one byte, so at least one piece.
        if nics == 0 || count == 0 {
            return Err(FrameError::Code(0));
        }
        if count * (24 + 4 * nics) != c.0.len() {
            return Err(FrameError::TooLong(count as u64));
        }
        let mut pieces = Vec::with_capacity(count);
        let mut next = 0u64;
        for _ in 0..count {
            let (offset, plen, addr) = (c.u64()?, c.u64()?, c.u64()?);
            let rkeys = (0..nics).map(|_| c.u32()).collect::<Result<Vec<_>, _>>()?;
            if offset != next || plen == 0 || addr.checked_add(plen).is_none() {
                return Err(FrameError::Code(1));
            }
            next = offset.checked_add(plen).ok_or(FrameError::TooLong(plen))?;
            pieces.push(RegionPiece { offset, len: plen, addr, rkeys });
        }
        if next != len {
            return Err(FrameError::Code(2));
        }
        Ok(Self { len, pieces })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qp(n: u32) -> QpAddress {
        QpAddress { nic: n as u8, qp_num: n, lid: 7, gid: [n as u8; 16], gid_index: 3, mtu: 1024, psn: n + 1 }
    }

    #[test]
    fn handshakes_round_trip_and_every_truncation_is_refused() {
        let h = RdmaHandshake { qps: (1..5).map(qp).collect() };
        let b = h.encode();
        assert_eq!(RdmaHandshake::decode(&b), Ok(h));
        for cut in 0..b.len() {
            assert!(RdmaHandshake::decode(&b[..cut]).is_err(), "{cut} bytes");
        }
        let mut bad_mtu = b.clone();
        bad_mtu[7 + 12..7 + 16].copy_from_slice(&1000u32.to_le_bytes());
        assert!(RdmaHandshake::decode(&bad_mtu).is_err());
    }

    #[test]
    fn region_infos_round_trip_and_gaps_are_refused() {
        let info = RdmaRegionInfo {
            len: 300,
            pieces: vec![
                RegionPiece { offset: 0, len: 200, addr: 4096, rkeys: vec![1, 2] },
                RegionPiece { offset: 200, len: 100, addr: 4296, rkeys: vec![3, 4] },
            ],
        };
        let b = info.encode();
        assert_eq!(RdmaRegionInfo::decode(&b), Ok(info.clone()));
        for cut in 0..b.len() {
            assert!(RdmaRegionInfo::decode(&b[..cut]).is_err(), "{cut} bytes");
        }
        let mut gap = info.clone();
        gap.pieces[1].offset = 201;
        assert!(RdmaRegionInfo::decode(&gap.encode()).is_err());
        let mut short = info;
        short.len = 301;
        assert!(RdmaRegionInfo::decode(&short.encode()).is_err());
    }
}
