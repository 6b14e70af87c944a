//! Model test: random sequences of put / get / remove / replicate / evict /
//! client-loss against a plain `HashMap` reference model.
//!
//! The property that matters most: a get never returns bytes other than what was put
//! under that key. Beyond it, the model knows when an object *must* still be there
//! (it was put, not removed, and no eviction or loss of all its replicas could have
//! taken it) and checks that it is.

use std::collections::HashMap;
use std::time::Duration;

use mooncake_core::{Error, Master, MasterConfig, ReplicateConfig, Store};
use proptest::prelude::*;

const KEYS: usize = 12;
const STORES: usize = 3;

#[derive(Clone, Debug)]
enum Op {
    Put { key: usize, seed: u8, len: usize, replicas: usize, via: usize },
    Get { key: usize, via: usize },
    GetInto { key: usize, via: usize },
    BatchGet { via: usize },
    Remove { key: usize },
    Replicate { key: usize, replicas: usize, via: usize },
    Evict { bytes: u64 },
    LoseClient { which: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..KEYS, any::<u8>(), 1usize..70_000, 1usize..=3, 0..STORES)
            .prop_map(|(key, seed, len, replicas, via)| Op::Put { key, seed, len, replicas, via }),
        4 => (0..KEYS, 0..STORES).prop_map(|(key, via)| Op::Get { key, via }),
        1 => (0..KEYS, 0..STORES).prop_map(|(key, via)| Op::GetInto { key, via }),
        1 => (0..STORES).prop_map(|via| Op::BatchGet { via }),
        2 => (0..KEYS).prop_map(|key| Op::Remove { key }),
        1 => (0..KEYS, 1usize..=3, 0..STORES).prop_map(|(key, replicas, via)| Op::Replicate { key, replicas, via }),
        1 => (1u64..400_000).prop_map(|bytes| Op::Evict { bytes }),
        1 => (0..STORES).prop_map(|which| Op::LoseClient { which }),
    ]
}

/// What the model knows of one key.
#[derive(Clone, Debug, PartialEq)]
enum Known {
    /// Must be readable with these bytes; at least `replicas` copies on distinct segments.
    Present { value: Vec<u8>, replicas: usize },
    /// Either these bytes or gone (eviction or client loss may have taken it).
    Maybe(Vec<u8>),
}

fn value(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| seed.wrapping_mul(31).wrapping_add((i * 7 % 256) as u8)).collect()
}

fn new_store(master: &Master) -> Store {
    Store::builder().master(master).global_segment_size(4 << 20).build().unwrap()
}

/// Checks one read result against the model and updates it.
fn check_read(model: &mut HashMap<usize, Known>, key: usize, got: Result<Vec<u8>, Error>) -> Result<(), TestCaseError> {
    match (model.get(&key).cloned(), got) {
        (Some(Known::Present { value, .. }), Ok(bytes)) | (Some(Known::Maybe(value)), Ok(bytes)) => {
            prop_assert!(bytes == value, "key {} returned bytes that were not put under it", key);
        }
        (Some(Known::Present { .. }), Err(e)) => prop_assert!(false, "key {} must be readable, got {}", key, e),
        (Some(Known::Maybe(_)), Err(Error::NotFound(_))) => {
            model.remove(&key);
        }
        (None, Ok(_)) => prop_assert!(false, "key {} returned bytes but was never put or was removed", key),
        (None, Err(Error::NotFound(_))) => {}
        (_, Err(e)) => prop_assert!(false, "unexpected error for key {}: {}", key, e),
    }
    Ok(())
}

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    // No leases (they would make removal depend on timing) and no background eviction
    // (4 MiB segments never pass the watermark with these sizes); `Evict` forces it.
    let master = Master::new(MasterConfig { default_lease: Duration::ZERO, ..Default::default() }).unwrap();
    let mut stores: Vec<Store> = (0..STORES).map(|_| new_store(&master)).collect();
    let mut model: HashMap<usize, Known> = HashMap::new();
    let key_name = |k: usize| format!("model/{k}");

    for op in ops {
        match op {
            Op::Put { key, seed, len, replicas, via } => {
                let v = value(seed, len);
                let res = stores[via].put_with(&key_name(key), &v, &ReplicateConfig::replicas(replicas));
                match (model.get(&key).cloned(), res) {
                    (None, Ok(())) => {
                        model.insert(key, Known::Present { value: v, replicas: replicas.min(STORES) });
                    }
                    (Some(Known::Maybe(_)), Ok(())) => {
                        model.insert(key, Known::Present { value: v, replicas: replicas.min(STORES) });
                    }
                    (Some(Known::Maybe(old)), Err(Error::AlreadyExists(_))) => {
                        // Still there, so still the old bytes; may be evicted later.
                        model.insert(key, Known::Maybe(old));
                    }
                    (Some(Known::Present { .. }), Err(Error::AlreadyExists(_))) => {}
                    (known, res) => prop_assert!(false, "put of key {} with model {:?} gave {:?}", key, known, res),
                }
            }
            Op::Get { key, via } => {
                let got = stores[via].get(&key_name(key)).map(|b| b.to_vec());
                check_read(&mut model, key, got)?;
            }
            Op::GetInto { key, via } => {
                let mut buf = vec![0u8; 80_000];
                let got = stores[via].get_into(&key_name(key), &mut buf).map(|n| buf[..n].to_vec());
                check_read(&mut model, key, got)?;
            }
            Op::BatchGet { via } => {
                let names: Vec<String> = (0..KEYS).map(key_name).collect();
                let refs: Vec<&str> = names.iter().map(String::as_str).collect();
                for (key, got) in stores[via].batch_get(&refs).into_iter().enumerate() {
                    check_read(&mut model, key, got.map(|b| b.to_vec()))?;
                }
            }
            Op::Remove { key } => {
                let res = stores[0].remove(&key_name(key));
                match (model.remove(&key), res) {
                    (Some(Known::Present { .. }), Ok(())) | (Some(Known::Maybe(_)), Ok(())) => {}
                    (Some(Known::Maybe(_)), Err(Error::NotFound(_))) | (None, Err(Error::NotFound(_))) => {}
                    (known, res) => prop_assert!(false, "remove of key {} with model {:?} gave {:?}", key, known, res),
                }
            }
            Op::Replicate { key, replicas, via } => {
                let res = stores[via].replicate(&key_name(key), &ReplicateConfig::replicas(replicas));
                match (model.get(&key).cloned(), res) {
                    (Some(Known::Present { value, .. }), Ok(())) => {
                        model.insert(key, Known::Present { value, replicas: replicas.min(STORES) });
                    }
                    (Some(Known::Maybe(value)), Ok(())) => {
                        model.insert(key, Known::Present { value, replicas: replicas.min(STORES) });
                    }
                    (Some(Known::Maybe(_)), Err(Error::NotFound(_))) => {
                        model.remove(&key);
                    }
                    (None, Err(Error::NotFound(_))) => {}
                    (known, res) => {
                        prop_assert!(false, "replicate of key {} with model {:?} gave {:?}", key, known, res)
                    }
                }
            }
            Op::Evict { bytes } => {
                master.evict_for(bytes);
                for known in model.values_mut() {
                    if let Known::Present { value, .. } = known {
                        *known = Known::Maybe(std::mem::take(value));
                    }
                }
            }
            Op::LoseClient { which } => {
                stores[which] = new_store(&master);
                // Replicas sit on distinct segments: losing one segment costs each
                // object at most one replica.
                for known in model.values_mut() {
                    match known {
                        Known::Present { replicas, .. } if *replicas > 1 => *replicas -= 1,
                        Known::Present { value, .. } => *known = Known::Maybe(std::mem::take(value)),
                        Known::Maybe(_) => {}
                    }
                }
            }
        }
    }
    // Final sweep: everything the model is sure of reads back exact bytes.
    for key in 0..KEYS {
        let got = stores[0].get(&key_name(key)).map(|b| b.to_vec());
        check_read(&mut model, key, got)?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]
    #[test]
    fn store_matches_a_hashmap_model(ops in proptest::collection::vec(op(), 1..60)) {
        run(ops)?;
    }
}
