//! `kill -9` of a storage node in the middle of heavy offload to its SSD: after a
//! restart on the same directory, every acknowledged object is either intact or
//! absent, never corrupt.

mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use mooncake_core::{Error, Store};
use support::{ssd_node, unique_dir, wait_until, Cluster};

const MIB: usize = 1 << 20;

fn block(i: usize) -> Vec<u8> {
    let mut v = support::payload(i as u8, MIB);
    v[..8].copy_from_slice(&(i as u64).to_le_bytes());
    v
}

#[test]
fn kill_9_during_offload_leaves_objects_intact_or_absent() {
    let dir = unique_dir("ssd-crash");
    let cluster = Cluster::start(&["--client-ttl-ms", "1000"], 0);
    let mut node = ssd_node(&cluster.master_addr, &dir, "1GiB");
    let writer = Store::builder().master_address(&cluster.master_addr).global_segment_size(0).build().unwrap();

    // Write 1 MiB objects through the node's 16 MiB segment: everything past the
    // first few must be offloaded for the puts to succeed.
    let acked = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let put_thread = {
        let (writer, acked, stop) = (writer.clone(), acked.clone(), stop.clone());
        std::thread::spawn(move || {
            for i in 0..400 {
                if stop.load(Ordering::Relaxed) {
                    return;
                }
                if writer.put(&format!("crash/{i}"), &block(i)).is_ok() {
                    acked.lock().unwrap().push(i);
                }
            }
        })
    };
    wait_until(Duration::from_secs(60), || acked.lock().unwrap().len() >= 60);
    node.kill9();
    stop.store(true, Ordering::Relaxed);
    put_thread.join().unwrap();
    let acked = acked.lock().unwrap().clone();

    // Restart on the same directory; wait until the dead node's segment is dropped.
    let node2 = ssd_node(&cluster.master_addr, &dir, "1GiB");
    // The dead node is forgotten at a monitor tick past its TTL (later on a loaded
    // machine: a stalled tick grants a fresh TTL), and the new node announces what
    // its SSD holds on its own thread: wait for both, however slow, before reading.
    wait_until(Duration::from_secs(30), || cluster.status().contains("\"segments\": 1"));
    wait_until(Duration::from_secs(30), || {
        acked.iter().filter(|&&i| writer.exists(&format!("crash/{i}")).unwrap_or(false)).count() + 20 >= acked.len()
    });
    let mut buf = vec![0u8; MIB];
    let (mut intact, mut absent) = (0, 0);
    for &i in &acked {
        match writer.get_into(&format!("crash/{i}"), &mut buf) {
            Ok(n) => {
                assert_eq!(n, MIB, "crash/{i} has the wrong length");
                assert!(buf == block(i), "crash/{i} came back corrupt");
                intact += 1;
            }
            Err(Error::NotFound(_)) => absent += 1,
            Err(e) => panic!("crash/{i}: {e} (must be intact or absent)"),
        }
    }
    eprintln!("{} acknowledged: {intact} intact, {absent} absent", acked.len());
    // All but the objects still only in the dead node's memory reached the disk.
    assert!(intact + 20 >= acked.len(), "{intact} of {} acknowledged objects survived", acked.len());
    drop((writer, node2));
    std::fs::remove_dir_all(&dir).ok();
}
