//! [`Lists`]: O(1) ordered sets of units, the structure both built-in strategies
//! share.

use ahash::AHashMap;

use super::UnitId;

const NIL: usize = usize::MAX;

#[derive(Clone, Copy, Debug)]
struct Node {
    unit: UnitId,
    prev: usize,
    next: usize,
    list: u8,
}

#[derive(Clone, Copy, Debug)]
struct List {
    head: usize,
    tail: usize,
}

impl List {
    const EMPTY: List = List { head: NIL, tail: NIL };
}

/// O(1) ordered sets of units: a slab of nodes threaded on a few intrusive lists.
#[derive(Debug)]
pub(super) struct Lists<const N: usize> {
    index: AHashMap<UnitId, usize>,
    nodes: Vec<Node>,
    spare: Vec<usize>,
    lists: [List; N],
}

impl<const N: usize> Lists<N> {
    pub(super) fn new() -> Self {
        Lists { index: AHashMap::new(), nodes: Vec::new(), spare: Vec::new(), lists: [List::EMPTY; N] }
    }

    fn push_back(&mut self, list: u8, unit: UnitId) -> usize {
        let node = Node { unit, prev: self.lists[list as usize].tail, next: NIL, list };
        let i = match self.spare.pop() {
            Some(i) => {
                self.nodes[i] = node;
                i
            }
            None => {
                self.nodes.push(node);
                self.nodes.len() - 1
            }
        };
        self.link_back(list, i);
        i
    }

    fn link_back(&mut self, list: u8, i: usize) {
        let l = &mut self.lists[list as usize];
        self.nodes[i].prev = l.tail;
        self.nodes[i].next = NIL;
        self.nodes[i].list = list;
        if l.tail == NIL {
            l.head = i;
        } else {
            self.nodes[l.tail].next = i;
        }
        l.tail = i;
    }

    fn unlink(&mut self, i: usize) {
        let Node { prev, next, list, .. } = self.nodes[i];
        let l = &mut self.lists[list as usize];
        if prev == NIL {
            l.head = next;
        } else {
            self.nodes[prev].next = next;
        }
        if next == NIL {
            l.tail = prev;
        } else {
            self.nodes[next].prev = prev;
        }
    }

    pub(super) fn insert(&mut self, list: u8, unit: UnitId) {
        if self.index.contains_key(&unit) {
            return;
        }
        let i = self.push_back(list, unit);
        self.index.insert(unit, i);
    }

    pub(super) fn remove(&mut self, unit: UnitId) -> bool {
        match self.index.remove(&unit) {
            Some(i) => {
                self.unlink(i);
                self.spare.push(i);
                true
            }
            None => false,
        }
    }

    /// Moves a tracked unit to the back of `list`.
    pub(super) fn touch(&mut self, list: u8, unit: UnitId) {
        if let Some(&i) = self.index.get(&unit) {
            self.unlink(i);
            self.link_back(list, i);
        }
    }

    pub(super) fn pop_front(&mut self, list: u8) -> Option<UnitId> {
        let head = self.lists[list as usize].head;
        if head == NIL {
            return None;
        }
        let unit = self.nodes[head].unit;
        self.remove(unit);
        Some(unit)
    }

    pub(super) fn len(&self) -> usize {
        self.index.len()
    }
}
