//! Checksums taken in flight (`TransferRequest::with_checksum`) through the public
//! API: every transport that takes one gives the crc32c of exactly the bytes moved,
//! whatever the size (pieces, striped chunks, several requests of a batch), and
//! none is reported for a request that failed or did not ask.

use std::sync::Arc;

use mooncake_transfer::checksum::crc32c;
use mooncake_transfer::{
    LocalTransport, ShmTransport, TcpTransport, TransferEngine, TransferError, TransferRequest, Transport,
};
use proptest::prelude::*;

fn server() -> TransferEngine {
    TransferEngine::builder().tcp_listen("127.0.0.1:0").shared_memory(true).build().unwrap()
}

/// A client engine with exactly one transport, so nothing else can serve.
fn client(t: Arc<dyn Transport>) -> TransferEngine {
    TransferEngine::builder().transport(t).build().unwrap()
}

fn bytes(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| seed.wrapping_add((i % 251) as u8) ^ (i >> 12) as u8).collect()
}

/// Writes and reads back a batch of objects of `lens` bytes through `cli`, every
/// request asking for its checksum, and checks bytes and sums against crc32c of the
/// `crc32c` crate (an independent implementation).
fn summed_round_trip(srv: &TransferEngine, cli: &TransferEngine, lens: &[usize], seed: u8) {
    let seg = srv.register_region(16 << 20).unwrap();
    let target = srv.remote(seg.id());
    let data: Vec<Vec<u8>> = lens.iter().enumerate().map(|(i, &n)| bytes(seed.wrapping_add(i as u8), n)).collect();
    let offsets: Vec<u64> = lens.iter().scan(7u64, |at, &n| Some(std::mem::replace(at, *at + n as u64 + 5))).collect();
    let mut writes: Vec<TransferRequest<'_>> =
        data.iter().zip(&offsets).map(|(d, &o)| TransferRequest::write(&target, o, d).with_checksum()).collect();
    assert!(cli.transfer(&mut writes).iter().all(Result::is_ok));
    for (w, d) in writes.iter().zip(&data) {
        assert_eq!(w.checksum(), Some(::crc32c::crc32c(d)), "write of {} bytes", d.len());
    }
    drop(writes);
    let mut back: Vec<Vec<u8>> = lens.iter().map(|&n| vec![0u8; n]).collect();
    let mut reads: Vec<TransferRequest<'_>> =
        back.iter_mut().zip(&offsets).map(|(b, &o)| TransferRequest::read(&target, o, b).with_checksum()).collect();
    assert!(cli.transfer(&mut reads).iter().all(Result::is_ok));
    let sums: Vec<Option<u32>> = reads.iter().map(TransferRequest::checksum).collect();
    drop(reads);
    for ((b, d), sum) in back.iter().zip(&data).zip(sums) {
        assert!(b == d, "{} bytes came back different", d.len());
        assert_eq!(sum, Some(::crc32c::crc32c(d)), "read of {} bytes", d.len());
    }
}

/// Sizes around the pieces (256 KiB) of memory copies and the stripes (1 MiB) of TCP.
const LENS: [usize; 7] = [0, 1, 4096, (256 << 10) + 1, 1 << 20, (1 << 20) + 3, (3 << 20) - 7];

#[test]
fn tcp_sums_what_it_moves() {
    let srv = server();
    summed_round_trip(&srv, &client(Arc::new(TcpTransport::new())), &LENS, 1);
}

#[test]
fn shm_sums_what_it_moves() {
    let srv = server();
    let shm = Arc::new(ShmTransport::new());
    assert!(shm.can_reach(srv.endpoint()));
    summed_round_trip(&srv, &client(shm), &LENS, 2);
}

#[test]
fn local_sums_what_it_moves() {
    let srv = server();
    summed_round_trip(&srv, &client(Arc::new(LocalTransport)), &LENS, 3);
}

#[test]
fn no_checksum_unless_asked_or_when_the_request_failed() {
    let srv = server();
    let seg = srv.register_region(1 << 20).unwrap();
    let target = srv.remote(seg.id());
    for cli in [client(Arc::new(TcpTransport::new())), client(Arc::new(LocalTransport))] {
        let data = bytes(9, 300 << 10);
        let mut reqs = [
            TransferRequest::write(&target, 0, &data),
            // Out of bounds: refused, nothing of it stored, no checksum.
            TransferRequest::write(&target, (1 << 20) - 100, &data).with_checksum(),
        ];
        let res = cli.transfer(&mut reqs);
        assert!(res[0].is_ok());
        assert!(matches!(res[1], Err(TransferError::OutOfBounds { .. })), "{:?}", res[1]);
        assert_eq!(reqs[0].checksum(), None, "not asked");
        assert_eq!(reqs[1].checksum(), None, "failed");
        assert!(reqs[1].checksum_asked());
        let mut tail = vec![0u8; 100];
        seg.copy_out((1 << 20) - 100, &mut tail).unwrap();
        assert!(tail.iter().all(|&b| b == 0), "a refused write stored nothing");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]
    #[test]
    fn batches_of_any_sizes_are_summed_exactly(
        lens in proptest::collection::vec(0usize..(2 << 20), 1..6),
        seed in any::<u8>(),
    ) {
        let srv = server();
        summed_round_trip(&srv, &client(Arc::new(TcpTransport::new())), &lens, seed);
        summed_round_trip(&srv, &client(Arc::new(LocalTransport)), &lens, seed);
    }
}

#[test]
fn our_crc32c_is_the_standard_one() {
    let data = bytes(4, 1 << 20);
    assert_eq!(crc32c(&data), ::crc32c::crc32c(&data));
}
