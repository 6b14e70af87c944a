//! One shard of the index: a hash table of one-pointer slots, each pointing at one
//! allocation that holds the object's entry followed by its key.
//!
//! A `HashMap<Box<str>, Box<ObjectEntry>>` spends two allocations per object (each
//! with malloc's 8-byte header and rounding to 16 bytes) and a 16-byte slot on the
//! key's fat pointer. Here the key lives in the entry's allocation, after a varint
//! of its length, and a slot is one thin pointer (plus hashbrown's control byte).
//!
//! Each shard also keeps the totals of its entries ([`Totals`]: objects, bytes,
//! replicas, memory), so that the master's stats add up 1024 shards instead of
//! walking every object. Every change to an entry goes through a `&mut self` call of
//! the shard, which accounts for it: at once for inserts, removes and the
//! closure-based walks, and for the one entry [`Shard::get_mut`] lends out at the
//! shard's next `&mut self` call (by then the borrow has ended, and the entry is
//! final until the next one).

use std::alloc::{alloc, dealloc, handle_alloc_error, Layout};
use std::ptr::NonNull;

use hashbrown::HashTable;

use crate::master::object::entry::ObjectEntry;
use crate::master::object::index::{entry_variable_heap_bytes, key_heap_bytes};

/// Bytes of the LEB128 varint of `n`.
fn varint_len(mut n: usize) -> usize {
    let mut bytes = 1;
    while n >= 0x80 {
        n >>= 7;
        bytes += 1;
    }
    bytes
}

/// Layout of an allocation holding an entry and a key of `key_len` bytes.
fn layout_for(key_len: usize) -> Layout {
    let size = std::mem::size_of::<ObjectEntry>() + varint_len(key_len) + key_len;
    // The entry comes first, so the allocation takes its alignment; the tail is bytes.
    Layout::from_size_align(size, std::mem::align_of::<ObjectEntry>()).expect("entry layout (keys are bounded)")
}

/// An entry and its key in one heap allocation: `[ObjectEntry][varint key length][key
/// bytes]`. Owns the allocation like a `Box`: dropping it drops the entry (freeing its
/// replicas) and frees the memory. Derefs to the entry.
///
/// The key's length is kept in the tail, out of reach of the `&mut ObjectEntry` this
/// hands out: whatever safe code does to the entry, the layout stays known.
pub(crate) struct EntryBox(NonNull<ObjectEntry>);

// SAFETY: an `EntryBox` owns its allocation exclusively (like `Box<ObjectEntry>` plus
// immutable bytes), so it may move to or be shared with another thread whenever the
// entry may (asserted below).
unsafe impl Send for EntryBox {}
// SAFETY: as above; shared access only hands out `&ObjectEntry` and `&str`.
unsafe impl Sync for EntryBox {}

const _: () = {
    const fn entry_is_send_sync<T: Send + Sync>() {}
    entry_is_send_sync::<ObjectEntry>();
};

impl EntryBox {
    /// Moves `entry` and a copy of `key` into one new allocation.
    pub(crate) fn new(key: &str, entry: ObjectEntry) -> Self {
        let layout = layout_for(key.len());
        // SAFETY: the layout's size is at least `size_of::<ObjectEntry>()`, not zero.
        let raw = unsafe { alloc(layout) };
        let Some(base) = NonNull::new(raw) else { handle_alloc_error(layout) };
        let entry_ptr = base.cast::<ObjectEntry>();
        // SAFETY: `base` is a fresh allocation of `layout`: aligned for `ObjectEntry`,
        // with room for it, then for the varint and the key bytes (`layout_for` counts
        // them all); nothing else points into it yet.
        unsafe {
            entry_ptr.as_ptr().write(entry);
            let mut tail = raw.add(std::mem::size_of::<ObjectEntry>());
            let mut n = key.len();
            while n >= 0x80 {
                tail.write((n as u8 & 0x7f) | 0x80);
                tail = tail.add(1);
                n >>= 7;
            }
            tail.write(n as u8);
            std::ptr::copy_nonoverlapping(key.as_ptr(), tail.add(1), key.len());
        }
        Self(entry_ptr)
    }

    /// The key's length and where its bytes start.
    fn key_raw(&self) -> (*const u8, usize) {
        // SAFETY: the tail after the entry holds a varint written by `new` and never
        // changed since (no `&mut` to the tail is ever handed out); it lies inside the
        // allocation, which lives as long as `self`.
        unsafe {
            let mut p = self.0.as_ptr().cast::<u8>().add(std::mem::size_of::<ObjectEntry>()).cast_const();
            let (mut n, mut shift) = (0usize, 0);
            loop {
                let b = *p;
                p = p.add(1);
                n |= usize::from(b & 0x7f) << shift;
                if b & 0x80 == 0 {
                    return (p, n);
                }
                shift += 7;
            }
        }
    }

    /// The key.
    pub(crate) fn key(&self) -> &str {
        let (p, n) = self.key_raw();
        // SAFETY: `n` bytes at `p` are the copy of a `&str` made by `new`, inside the
        // allocation, immutable while `self` lives (borrowed here for as long).
        unsafe { std::str::from_utf8_unchecked(std::slice::from_raw_parts(p, n)) }
    }

    /// The allocation's address: tells this entry from every other one alive.
    fn addr(&self) -> usize {
        self.0.as_ptr() as usize
    }

    /// The key and a mutable entry at once (they do not overlap).
    pub(crate) fn parts_mut(&mut self) -> (&str, &mut ObjectEntry) {
        let (p, n) = self.key_raw();
        // SAFETY: the entry and the key bytes are disjoint parts of the allocation
        // (`layout_for`); `&mut self` makes this the only access to either for the
        // returned lifetime; the key bytes are a valid `str` (see `key`).
        unsafe {
            let key = std::str::from_utf8_unchecked(std::slice::from_raw_parts(p, n));
            (key, &mut *self.0.as_ptr())
        }
    }
}

impl std::ops::Deref for EntryBox {
    type Target = ObjectEntry;

    fn deref(&self) -> &ObjectEntry {
        // SAFETY: `self.0` points at the entry written by `new`, alive until `drop`.
        unsafe { self.0.as_ref() }
    }
}

impl std::ops::DerefMut for EntryBox {
    fn deref_mut(&mut self) -> &mut ObjectEntry {
        // SAFETY: as in `deref`; `&mut self` makes the access exclusive.
        unsafe { self.0.as_mut() }
    }
}

impl Drop for EntryBox {
    fn drop(&mut self) {
        let layout = layout_for(self.key_raw().1);
        // SAFETY: the entry is initialized (written by `new`) and dropped exactly once
        // here; the allocation was made by `new` with this same layout (the key length
        // read back from the tail is the one it was made for).
        unsafe {
            std::ptr::drop_in_place(self.0.as_ptr());
            dealloc(self.0.as_ptr().cast(), layout);
        }
    }
}

/// What a set of entries adds up to: the counts the master's stats report. Sums are
/// taken with wrapping arithmetic (an entry's part is added, later taken away
/// again), so they are exact whatever the order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Totals {
    /// Entries (complete or not).
    pub(crate) entries: u64,
    /// Complete objects.
    pub(crate) objects: u64,
    /// Logical bytes of the complete objects.
    pub(crate) object_bytes: u64,
    /// Memory replicas (complete or not).
    pub(crate) replicas: u64,
    /// Bytes of keys.
    pub(crate) key_bytes: u64,
    /// Heap bytes behind the entries, keys included (`entry_heap_bytes`).
    pub(crate) heap_bytes: u64,
}

impl Totals {
    /// The part of an entry that changes with it (everything but its key's).
    fn of_entry(e: &ObjectEntry) -> Self {
        let complete = e.complete();
        Self {
            entries: 0,
            objects: u64::from(complete),
            object_bytes: if complete { e.len() } else { 0 },
            replicas: e.replicas.len() as u64,
            key_bytes: 0,
            heap_bytes: entry_variable_heap_bytes(e),
        }
    }

    /// The part of an entry fixed by its key while it lives (its allocation).
    fn of_key(key: &str) -> Self {
        Self { entries: 1, key_bytes: key.len() as u64, heap_bytes: key_heap_bytes(key), ..Self::default() }
    }

    /// Everything an entry adds.
    fn of(key: &str, e: &ObjectEntry) -> Self {
        let mut t = Self::of_key(key);
        t.add(Self::of_entry(e));
        t
    }

    /// Adds `o`.
    pub(crate) fn add(&mut self, o: Self) {
        self.entries = self.entries.wrapping_add(o.entries);
        self.objects = self.objects.wrapping_add(o.objects);
        self.object_bytes = self.object_bytes.wrapping_add(o.object_bytes);
        self.replicas = self.replicas.wrapping_add(o.replicas);
        self.key_bytes = self.key_bytes.wrapping_add(o.key_bytes);
        self.heap_bytes = self.heap_bytes.wrapping_add(o.heap_bytes);
    }

    /// Takes `o` away (it was added before).
    fn sub(&mut self, o: Self) {
        self.entries = self.entries.wrapping_sub(o.entries);
        self.objects = self.objects.wrapping_sub(o.objects);
        self.object_bytes = self.object_bytes.wrapping_sub(o.object_bytes);
        self.replicas = self.replicas.wrapping_sub(o.replicas);
        self.key_bytes = self.key_bytes.wrapping_sub(o.key_bytes);
        self.heap_bytes = self.heap_bytes.wrapping_sub(o.heap_bytes);
    }

    /// Takes `before` away and adds `after` (one entry changed).
    fn replace(&mut self, before: Self, after: Self) {
        if before != after {
            self.sub(before);
            self.add(after);
        }
    }
}

/// The entry [`Shard::get_mut`] lent out, found again by its hash and address, and
/// what it added to the totals when lent.
struct Lent {
    hash: u64,
    addr: usize,
    before: Totals,
}

/// One shard of the index: key -> entry, with the `HashMap`-like calls the master's
/// facets use, and the totals of its entries.
pub(crate) struct Shard {
    table: HashTable<EntryBox>,
    hasher: ahash::RandomState,
    /// The entries' totals, but for the changes to `lent` not yet settled.
    totals: Totals,
    /// The entry last handed out by `get_mut`, until the next `&mut self` call
    /// accounts for what the borrower changed.
    lent: Option<Lent>,
    /// While a recovery window is open: (key hash, generation) of each copy the
    /// master took back for an object of this shard (`master/recovered.rs`).
    /// Appended to under the lock a re-mount holds anyway; looked through only for
    /// a copy that conflicts with the object.
    recovered: Vec<(u64, u64)>,
}

impl Default for Shard {
    fn default() -> Self {
        Self {
            table: HashTable::new(),
            hasher: ahash::RandomState::new(),
            totals: Totals::default(),
            lent: None,
            recovered: Vec::new(),
        }
    }
}

impl Shard {
    fn hash(&self, key: &str) -> u64 {
        self.hasher.hash_one(key)
    }

    /// Accounts for the changes made to the entry `get_mut` lent out. Every `&mut
    /// self` call begins with it: by then that borrow has ended, and the entry is
    /// still in the table (only `&mut self` calls take entries out).
    fn settle(&mut self) {
        let Some(lent) = self.lent.take() else { return };
        match self.table.find(lent.hash, |e| e.addr() == lent.addr) {
            Some(e) => self.totals.replace(lent.before, Totals::of_entry(e)),
            None => debug_assert!(false, "a lent entry left the table unaccounted"),
        }
    }

    /// The totals of every entry.
    pub(crate) fn totals(&mut self) -> Totals {
        self.settle();
        self.totals
    }

    /// The entry of `key`.
    pub(crate) fn get(&self, key: &str) -> Option<&ObjectEntry> {
        self.table.find(self.hash(key), |e| e.key() == key).map(|e| &**e)
    }

    /// The entry of `key`, to change (accounted for at the shard's next `&mut self`
    /// call).
    pub(crate) fn get_mut(&mut self, key: &str) -> Option<&mut ObjectEntry> {
        self.settle();
        let hash = self.hash(key);
        let e = self.table.find_mut(hash, |e| e.key() == key)?;
        self.lent = Some(Lent { hash, addr: e.addr(), before: Totals::of_entry(e) });
        Some(&mut **e)
    }

    /// Whether `key` has an entry.
    pub(crate) fn contains_key(&self, key: &str) -> bool {
        self.get(key).is_some()
    }

    /// Sets the entry of `key`, returning the one it replaces.
    pub(crate) fn insert(&mut self, key: &str, entry: ObjectEntry) -> Option<EntryBox> {
        self.settle();
        self.totals.add(Totals::of(key, &entry));
        let hash = self.hash(key);
        let hasher = &self.hasher;
        let old = match self.table.entry(hash, |e| e.key() == key, |e| hasher.hash_one(e.key())) {
            hashbrown::hash_table::Entry::Occupied(mut o) => {
                Some(std::mem::replace(o.get_mut(), EntryBox::new(key, entry)))
            }
            hashbrown::hash_table::Entry::Vacant(v) => {
                v.insert(EntryBox::new(key, entry));
                None
            }
        };
        if let Some(old) = &old {
            self.totals.sub(Totals::of(old.key(), old));
        }
        old
    }

    /// Takes the entry of `key` out.
    pub(crate) fn remove(&mut self, key: &str) -> Option<EntryBox> {
        self.settle();
        let hash = self.hash(key);
        let old = self.table.find_entry(hash, |e| e.key() == key).ok().map(|o| o.remove().0)?;
        self.totals.sub(Totals::of(old.key(), &old));
        Some(old)
    }

    /// Keeps the entries for which `keep` says so (the others are dropped).
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(&str, &mut ObjectEntry) -> bool) {
        self.settle();
        let totals = &mut self.totals;
        self.table.retain(|e| {
            let (k, e) = e.parts_mut();
            let before = Totals::of_entry(e);
            if keep(k, e) {
                totals.replace(before, Totals::of_entry(e));
                true
            } else {
                totals.sub(before);
                totals.sub(Totals::of_key(k));
                false
            }
        });
    }

    /// Every key and entry.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&str, &ObjectEntry)> {
        self.table.iter().map(|e| (e.key(), &**e))
    }

    /// Calls `f` with every key and entry, to change.
    pub(crate) fn for_each_mut(&mut self, mut f: impl FnMut(&str, &mut ObjectEntry)) {
        self.settle();
        for e in self.table.iter_mut() {
            let (k, e) = e.parts_mut();
            let before = Totals::of_entry(e);
            f(k, e);
            self.totals.replace(before, Totals::of_entry(e));
        }
    }

    /// Every entry.
    pub(crate) fn values(&self) -> impl Iterator<Item = &ObjectEntry> {
        self.table.iter().map(|e| &**e)
    }

    /// Number of entries.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.table.len()
    }

    /// A copy of `key` stamped `generation` was taken back (see `recovered`).
    pub(crate) fn note_recovered(&mut self, key: &str, generation: u64) {
        let hash = self.hash(key);
        self.recovered.push((hash, generation));
    }

    /// The newest generation of the copies taken back for `key` (or for a key
    /// sharing its hash), if any is remembered.
    pub(crate) fn recovered_generation(&self, key: &str) -> Option<u64> {
        let hash = self.hash(key);
        self.recovered.iter().filter(|&&(h, _)| h == hash).map(|&(_, g)| g).max()
    }

    /// Forgets the generations of copies taken back (their memory goes too).
    pub(crate) fn forget_recovered(&mut self) {
        self.recovered = Vec::new();
    }

    /// Heap bytes of the generations of copies taken back.
    pub(crate) fn recovered_bytes(&self) -> usize {
        self.recovered.capacity() * std::mem::size_of::<(u64, u64)>()
    }

    /// Slots the table has allocated (used or spare).
    pub(crate) fn slots(&self) -> usize {
        self.table.num_buckets()
    }

    /// Heap bytes of the allocation behind `key`'s entry (the entry, the key and
    /// its length), before malloc's own header and rounding.
    pub(crate) fn entry_alloc_bytes(key: &str) -> usize {
        layout_for(key.len()).size()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    /// An entry told apart by `checksum` (the only field the model tracks).
    fn entry(value: u32) -> ObjectEntry {
        ObjectEntry::new_complete(4096, value, 0)
    }

    /// An entry whose length, completeness and side box follow from `value`, for the
    /// totals to see all kinds.
    fn varied_entry(value: u32) -> ObjectEntry {
        let mut e = if value.is_multiple_of(3) {
            ObjectEntry::new(u64::from(value % 5000) + 1, 7, 0)
        } else {
            ObjectEntry::new_complete(u64::from(value % 7000) + 1, 0, 0)
        };
        e.checksum = value;
        e.set_disk(u64::from(value % 2));
        e
    }

    /// Changes what the totals count of `e`: completes it, gives it another length,
    /// a replica (from `seg`) or a side box.
    fn reshape(e: &mut ObjectEntry, seg: &std::sync::Arc<mooncake_alloc::SegmentAllocator>) {
        match e.checksum % 4 {
            0 => e.mark_complete(),
            1 => e.set_len(u64::from(e.checksum % 9000) + 1),
            2 => {
                if let Some(buf) = seg.allocate(64) {
                    e.replicas.push(crate::master::object::entry::StoredReplica::new(buf, true));
                }
            }
            _ => e.set_disk(if e.disk() == 0 { 3 } else { 0 }),
        }
    }

    /// The totals of `shard`'s entries, counted one by one.
    fn recount(shard: &Shard) -> Totals {
        let mut t = Totals::default();
        for (k, e) in shard.iter() {
            t.add(Totals::of(k, e));
        }
        t
    }

    #[derive(Clone, Debug)]
    enum Op {
        Insert(String, u32),
        Remove(String),
        Get(String),
        Bump(String),
        /// Drops the entries whose value is divisible by this.
        Retain(u32),
        /// Adds one to every value (through `iter_mut`).
        BumpAll,
        /// Adds two to every value (through `values_mut`).
        BumpValues,
    }

    /// Keys of 0..300 bytes from a small alphabet (so that operations meet), some
    /// with multi-byte characters (the length is in bytes).
    fn key() -> impl Strategy<Value = String> {
        prop_oneof!["[ab]{0,3}", "[ab]{120,135}", "[aé]{0,150}", (0usize..300).prop_map(|n| "k".repeat(n)),]
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (key(), any::<u32>()).prop_map(|(k, v)| Op::Insert(k, v)),
            2 => key().prop_map(Op::Remove),
            2 => key().prop_map(Op::Get),
            1 => key().prop_map(Op::Bump),
            1 => (2u32..5).prop_map(Op::Retain),
            1 => Just(Op::BumpAll),
            1 => Just(Op::BumpValues),
        ]
    }

    proptest! {
        #[test]
        fn shard_behaves_like_a_hash_map(ops in prop::collection::vec(op(), 1..200)) {
            let seg = mooncake_alloc::SegmentAllocator::new(1, "s", 1 << 20);
            let mut shard = Shard::default();
            let mut model: HashMap<String, u32> = HashMap::new();
            for op in ops {
                match op {
                    Op::Insert(k, v) => {
                        let old = shard.insert(&k, varied_entry(v)).map(|e| e.checksum);
                        prop_assert_eq!(old, model.insert(k, v));
                    }
                    Op::Remove(k) => {
                        let got = shard.remove(&k).map(|e| (e.key().to_owned(), e.checksum));
                        prop_assert_eq!(got, model.remove(&k).map(|v| (k.clone(), v)));
                    }
                    Op::Get(k) => {
                        prop_assert_eq!(shard.get(&k).map(|e| e.checksum), model.get(&k).copied());
                        prop_assert_eq!(shard.contains_key(&k), model.contains_key(&k));
                    }
                    Op::Bump(k) => {
                        if let Some(e) = shard.get_mut(&k) {
                            reshape(e, &seg);
                            e.checksum = e.checksum.wrapping_add(1);
                        }
                        if let Some(v) = model.get_mut(&k) {
                            *v = v.wrapping_add(1);
                        }
                    }
                    Op::Retain(d) => {
                        shard.retain(|k, e| {
                            assert_eq!(model.get(k), Some(&e.checksum), "retain sees each key with its entry");
                            e.checksum % d != 0
                        });
                        model.retain(|_, v| *v % d != 0);
                    }
                    Op::BumpAll => {
                        shard.for_each_mut(|k, e| {
                            assert!(model.contains_key(k));
                            reshape(e, &seg);
                            e.checksum = e.checksum.wrapping_add(1);
                        });
                        for v in model.values_mut() {
                            *v = v.wrapping_add(1);
                        }
                    }
                    Op::BumpValues => {
                        shard.for_each_mut(|_, e| e.checksum = e.checksum.wrapping_add(2));
                        for v in model.values_mut() {
                            *v = v.wrapping_add(2);
                        }
                    }
                }
                prop_assert_eq!(shard.len(), model.len());
                let counted = recount(&shard);
                prop_assert_eq!(shard.totals(), counted, "the kept totals are the counted ones");
                prop_assert_eq!(counted.entries as usize, model.len());
            }
            let mut seen: Vec<(String, u32)> = shard.iter().map(|(k, e)| (k.to_owned(), e.checksum)).collect();
            let mut want: Vec<(String, u32)> = model.into_iter().collect();
            seen.sort();
            want.sort();
            prop_assert_eq!(&seen, &want);
            let mut values: Vec<u32> = shard.values().map(|e| e.checksum).collect();
            values.sort();
            let mut from_iter: Vec<u32> = seen.iter().map(|(_, v)| *v).collect();
            from_iter.sort();
            prop_assert_eq!(values, from_iter);
        }
    }

    #[test]
    fn long_keys_keep_their_length() {
        // Varint lengths of one, two and three bytes.
        let mut shard = Shard::default();
        for n in [0, 1, 127, 128, 300, 16_383, 16_384, 70_000] {
            let k = "x".repeat(n);
            assert!(shard.insert(&k, entry(n as u32)).is_none());
        }
        for n in [0, 1, 127, 128, 300, 16_383, 16_384, 70_000] {
            let k = "x".repeat(n);
            assert_eq!(shard.get(&k).map(|e| e.checksum), Some(n as u32));
            let e = shard.remove(&k).unwrap();
            assert_eq!((e.key().len(), e.checksum), (n, n as u32));
        }
        assert_eq!(shard.len(), 0);
    }

    #[test]
    fn dropping_an_entry_frees_its_replicas() {
        let seg = mooncake_alloc::SegmentAllocator::new(1, "s", 1 << 20);
        let mut shard = Shard::default();
        let mut e = entry(4096);
        e.replicas.push(crate::master::object::entry::StoredReplica::new(seg.allocate(4096).unwrap(), true));
        shard.insert("a", e);
        assert_eq!(seg.used_bytes(), 4096);
        drop(shard.remove("a"));
        assert_eq!(seg.used_bytes(), 0);
        let mut e = entry(4096);
        e.replicas.push(crate::master::object::entry::StoredReplica::new(seg.allocate(4096).unwrap(), true));
        shard.insert("b", e);
        drop(shard);
        assert_eq!(seg.used_bytes(), 0, "dropping the shard drops its entries");
    }
}
