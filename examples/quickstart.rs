//! Quickstart: a single-process Mooncake Store with an embedded master.
//!
//! Three clients share one master, each giving 64 MiB of DRAM to the pool. We put a
//! few KV-cache-sized blocks, read them from another client, lose a client, and show
//! that objects with two replicas survive while single-replica objects on the lost
//! client's segment are reported as not found — never as garbage.
//!
//! Run: `cargo run --release --example quickstart`

use mooncake_core::{Error, Master, MasterConfig, ReplicateConfig, Store};

fn kv_block(layer: usize, block: usize, len: usize) -> Vec<u8> {
    (0..len).map(|i| (layer * 131 + block * 17 + i) as u8).collect()
}

fn main() -> Result<(), Error> {
    let master = Master::new(MasterConfig::default())?;
    let prefill = Store::builder().master(&master).global_segment_size(64 << 20).build()?;
    let decode = Store::builder().master(&master).global_segment_size(64 << 20).build()?;
    let spare = Store::builder().master(&master).global_segment_size(64 << 20).build()?;

    // The prefill worker writes the KV cache of a prompt: 4 layers x 8 blocks of 256 KiB.
    let block_len = 256 << 10;
    let two_copies = ReplicateConfig::replicas(2);
    let mut keys = Vec::new();
    for layer in 0..4 {
        for block in 0..8 {
            let key = format!("prompt-42/layer{layer}/block{block}");
            prefill.put_with(&key, &kv_block(layer, block, block_len), &two_copies)?;
            keys.push((key, layer, block));
        }
    }
    // One object with a single replica, placed on the spare client's segment.
    let spare_segment = master.segment_info(spare.segment_id().expect("spare has a segment")).expect("mounted").name;
    let on_spare = ReplicateConfig { preferred_segments: vec![spare_segment], ..Default::default() };
    prefill.put_with("scratch/single-copy", &[0xAB; 4096], &on_spare)?;
    println!("put {} blocks of {} KiB with 2 replicas, 1 object with 1 replica", keys.len(), block_len >> 10);

    // The decode worker fetches them in one batch and checks every byte.
    let names: Vec<&str> = keys.iter().map(|(k, _, _)| k.as_str()).collect();
    for (res, (key, layer, block)) in decode.batch_get(&names).into_iter().zip(&keys) {
        assert_eq!(res?.as_ref(), &kv_block(*layer, *block, block_len)[..], "{key}");
    }
    let mut buf = vec![0u8; block_len];
    let n = decode.get_into(&keys[0].0, &mut buf)?;
    println!("decode read {} blocks (batch) and {n} bytes with get_into", keys.len());

    // Lose the spare client: its segment leaves the pool.
    drop(spare);
    let survivors = decode.batch_get(&names).into_iter().filter(|r| r.is_ok()).count();
    println!("after losing a client: {survivors}/{} two-replica blocks still readable", keys.len());
    assert_eq!(survivors, keys.len());
    match decode.get("scratch/single-copy") {
        Err(Error::NotFound(key)) => println!("single-replica object on the lost client: not found ({key})"),
        other => panic!("expected NotFound, got {other:?}"),
    }

    println!("\n{}", decode.stats());
    Ok(())
}
