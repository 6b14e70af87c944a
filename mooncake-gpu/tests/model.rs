//! Property test: NanoKvCache over HostHeap against a HashMap model of
//! put / get / remove / open_for_write / commit / evict.
//!
//! Eviction choices are checked rather than re-derived: whatever disappears
//! from the cache must be exactly the oldest READY objects of the model, in
//! FIFO order (never a WRITING one), and usage must match the model.

use std::collections::HashMap;
use std::sync::Arc;

use mooncake_gpu::{CacheConfig, GpuError, HostHeap, NanoKvCache, WritePlan};
use proptest::prelude::*;

const PAGE: u32 = 1024;
const PAGES: u64 = 32;
const SLOTS: u32 = 8;
const KEYS: usize = 10;

#[derive(Debug, Clone)]
enum Op {
    Put(usize, usize, u8),
    Open(usize, usize),
    Commit(usize, u8),
    Get(usize),
    Remove(usize),
    Evict(u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..KEYS, 1usize..6000, any::<u8>()).prop_map(|(k, l, b)| Op::Put(k, l, b)),
        1 => (0..KEYS, 1usize..6000).prop_map(|(k, l)| Op::Open(k, l)),
        1 => (0..KEYS, any::<u8>()).prop_map(|(k, b)| Op::Commit(k, b)),
        4 => (0..KEYS).prop_map(Op::Get),
        2 => (0..KEYS).prop_map(Op::Remove),
        1 => (0u8..=100).prop_map(Op::Evict),
    ]
}

struct Obj {
    value: Option<Vec<u8>>, // None while WRITING
    plan: Option<WritePlan>,
    len: usize,
}

struct Model {
    objs: HashMap<String, Obj>,
    order: Vec<String>, // FIFO (insertion) order
}

impl Model {
    fn used(&self) -> u64 {
        self.objs.values().map(|o| (o.len as u64).div_ceil(u64::from(PAGE)) * u64::from(PAGE)).sum()
    }

    fn ready_in_order(&self) -> Vec<String> {
        self.order.iter().filter(|k| self.objs[*k].value.is_some()).cloned().collect()
    }

    fn remove(&mut self, k: &str) {
        self.objs.remove(k);
        self.order.retain(|x| x != k);
    }

    /// Reconciles evictions: what vanished must be the oldest READY objects.
    fn sync(&mut self, c: &NanoKvCache<HostHeap>) -> Result<Vec<String>, TestCaseError> {
        let ready = self.ready_in_order();
        let gone: Vec<String> = self.order.iter().filter(|k| !c.contains(k)).cloned().collect();
        prop_assert_eq!(&gone[..], &ready[..gone.len()], "evicted set is not a FIFO prefix of READY objects");
        for k in &gone {
            self.remove(k);
        }
        prop_assert_eq!(c.stats().bytes_used, self.used());
        prop_assert_eq!(c.stats().objects as usize, self.objs.len());
        Ok(gone)
    }
}

fn new_cache() -> NanoKvCache<HostHeap> {
    let heap = Arc::new(HostHeap::new(SLOTS, PAGES * u64::from(PAGE)).unwrap());
    NanoKvCache::new(heap, CacheConfig { page_size: PAGE, ..Default::default() }).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn cache_matches_model(ops in proptest::collection::vec(op(), 1..120)) {
        let c = new_cache();
        let mut m = Model { objs: HashMap::new(), order: Vec::new() };
        for op in ops {
            match op {
                Op::Put(k, len, b) => {
                    let key = format!("k{k}");
                    let v: Vec<u8> = (0..len).map(|i| b.wrapping_add(i as u8)).collect();
                    let r = c.put(&key, &v);
                    if m.objs.contains_key(&key) {
                        prop_assert_eq!(r, Err(GpuError::AlreadyExists));
                        continue;
                    }
                    match r {
                        Ok(()) => {
                            m.objs.insert(key.clone(), Obj { value: Some(v), plan: None, len });
                            m.order.push(key.clone());
                            let gone = m.sync(&c)?;
                            prop_assert!(!gone.contains(&key));
                            prop_assert_eq!(c.stats().bytes_used, m.used());
                        }
                        Err(GpuError::NoSpace { .. }) | Err(GpuError::NoHeaderSlot { .. }) => {
                            // only after every READY object was evicted
                            m.sync(&c)?;
                            prop_assert!(m.ready_in_order().is_empty(), "gave up with evictable objects left");
                        }
                        Err(e) => prop_assert!(false, "unexpected {e:?}"),
                    }
                }
                Op::Open(k, len) => {
                    let key = format!("k{k}");
                    let r = c.open_for_write(&key, len as u64);
                    if m.objs.contains_key(&key) {
                        prop_assert_eq!(r.err(), Some(GpuError::AlreadyExists));
                        continue;
                    }
                    match r {
                        Ok(plan) => {
                            m.objs.insert(key.clone(), Obj { value: None, plan: Some(plan), len });
                            m.order.push(key);
                            m.sync(&c)?;
                        }
                        Err(GpuError::NoSpace { .. }) | Err(GpuError::NoHeaderSlot { .. }) => {
                            m.sync(&c)?;
                            prop_assert!(m.ready_in_order().is_empty());
                        }
                        Err(e) => prop_assert!(false, "unexpected {e:?}"),
                    }
                }
                Op::Commit(k, b) => {
                    let key = format!("k{k}");
                    if let Some(o) = m.objs.get_mut(&key) {
                        if let Some(plan) = o.plan.take() {
                            let v: Vec<u8> = (0..o.len).map(|i| b.wrapping_add(i as u8)).collect();
                            c.write(&plan, 0, &v).unwrap();
                            c.commit(&plan).unwrap();
                            o.value = Some(v);
                        }
                    }
                }
                Op::Get(k) => {
                    let key = format!("k{k}");
                    let r = c.get(&key);
                    match m.objs.get(&key) {
                        None => prop_assert_eq!(r, Err(GpuError::NotFound)),
                        Some(Obj { value: None, .. }) => prop_assert_eq!(r, Err(GpuError::NotReady)),
                        Some(Obj { value: Some(v), .. }) => prop_assert_eq!(&r.unwrap(), v),
                    }
                }
                Op::Remove(k) => {
                    let key = format!("k{k}");
                    let r = c.remove(&key);
                    if m.objs.contains_key(&key) {
                        prop_assert_eq!(r, Ok(()));
                        m.remove(&key);
                    } else {
                        prop_assert_eq!(r, Err(GpuError::NotFound));
                    }
                }
                Op::Evict(pct) => {
                    let ratio = f64::from(pct) / 100.0;
                    let sizes: HashMap<String, u64> = m
                        .objs
                        .iter()
                        .map(|(k, o)| (k.clone(), (o.len as u64).div_ceil(u64::from(PAGE)) * u64::from(PAGE)))
                        .collect();
                    let n = c.evict_until_below(ratio);
                    let gone = m.sync(&c)?;
                    prop_assert_eq!(n, gone.len());
                    let target = (ratio * (PAGES * u64::from(PAGE)) as f64) as u64;
                    prop_assert!(m.used() <= target || m.ready_in_order().is_empty());
                    // it stops at the watermark: before the last victim went,
                    // usage was still above the target
                    if let Some(last) = gone.last() {
                        prop_assert!(m.used() + sizes[last] > target);
                    }
                }
            }
            let s = c.stats();
            prop_assert_eq!(s.bytes_used, m.used());
            prop_assert_eq!(s.header_slots_used as usize, m.objs.len());
            prop_assert!(s.bytes_used <= s.bytes_total);
        }
        // everything still in the model reads back exactly
        for (k, o) in &m.objs {
            if let Some(v) = &o.value {
                prop_assert_eq!(&c.get(k).unwrap(), v);
            }
        }
    }
}
