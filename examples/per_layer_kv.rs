//! One block's KV cache kept in per-layer buffers, stored and loaded as one object
//! without joining the layers in memory: `put_parts` / `get_into_parts`, and their
//! batch forms for many blocks with one master round trip.
//!
//! Run: `cargo run --example per_layer_kv`

use mooncake_core::{Error, ReplicateConfig, Store};

const LAYERS: usize = 8;
const LAYER_BYTES: usize = 32 << 10;

fn main() -> Result<(), Error> {
    let store = Store::builder().global_segment_size(64 << 20).build()?;

    // Prefill: each block's KV sits in one buffer per layer.
    let blocks: Vec<Vec<Vec<u8>>> =
        (0..4).map(|b| (0..LAYERS).map(|l| vec![(b * LAYERS + l) as u8; LAYER_BYTES]).collect()).collect();
    let keys: Vec<String> = (0..blocks.len()).map(|b| format!("prefix/block{b}")).collect();
    let parts: Vec<Vec<&[u8]>> = blocks.iter().map(|layers| layers.iter().map(|l| &l[..]).collect()).collect();
    let items: Vec<(&str, &[&[u8]])> = keys.iter().map(|k| &k[..]).zip(parts.iter().map(|p| &p[..])).collect();
    for res in store.batch_put_parts(&items, &ReplicateConfig::default()) {
        res?;
    }

    // Decode: load every block straight into its per-layer buffers.
    let mut loaded: Vec<Vec<Vec<u8>>> = (0..blocks.len()).map(|_| vec![vec![0u8; LAYER_BYTES]; LAYERS]).collect();
    let mut per_block: Vec<Vec<&mut [u8]>> =
        loaded.iter_mut().map(|layers| layers.iter_mut().map(|l| &mut l[..]).collect()).collect();
    let mut bufs: Vec<&mut [&mut [u8]]> = per_block.iter_mut().map(|b| &mut b[..]).collect();
    let key_refs: Vec<&str> = keys.iter().map(|k| &k[..]).collect();
    for res in store.batch_get_into_parts(&key_refs, &mut bufs) {
        assert_eq!(res?, LAYERS * LAYER_BYTES);
    }
    assert_eq!(loaded, blocks);

    // One block on its own.
    let mut one: Vec<Vec<u8>> = vec![vec![0u8; LAYER_BYTES]; LAYERS];
    let mut layers: Vec<&mut [u8]> = one.iter_mut().map(|l| &mut l[..]).collect();
    store.get_into_parts("prefix/block2", &mut layers)?;
    assert_eq!(one, blocks[2]);
    println!("{} blocks of {LAYERS} layers stored and loaded layer by layer", blocks.len());
    Ok(())
}
