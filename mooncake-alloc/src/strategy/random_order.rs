//! Uniformly random orders of the candidate segments, drawn lazily from a
//! per-thread permutation.

use std::cell::RefCell;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// Per-thread randomness: a fast generator and a permutation of `0..n` that
/// successive shuffles keep permuting (a partial Fisher-Yates shuffle of *any*
/// permutation yields a uniformly random prefix, so it never needs resetting while
/// the number of candidates stays the same).
struct Scratch {
    rng: SmallRng,
    perm: Vec<u32>,
}

impl Scratch {
    fn new() -> Self {
        Self { rng: SmallRng::from_rng(&mut rand::rng()), perm: Vec::new() }
    }

    fn order(&mut self, n: usize) -> Order<'_> {
        if self.perm.len() != n {
            self.perm.clear();
            self.perm.extend((0..n).map(|i| i as u32));
        }
        Order { rng: &mut self.rng, perm: &mut self.perm, next: 0 }
    }
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::new());
}

/// Runs `f` with a uniformly random order of `0..n`, drawn lazily (O(1) per index
/// taken, no allocation once the thread has seen `n` candidates).
pub(super) fn with_random_order<R>(n: usize, f: impl FnOnce(&mut Order<'_>) -> R) -> R {
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut scratch) => f(&mut scratch.order(n)),
        // Re-entered (only possible from a callback): use a private one.
        Err(_) => f(&mut Scratch::new().order(n)),
    })
}

/// Indices of `0..n`, each once, in uniformly random order.
pub(super) struct Order<'a> {
    rng: &'a mut SmallRng,
    perm: &'a mut [u32],
    next: usize,
}

impl Iterator for Order<'_> {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        let n = self.perm.len();
        if self.next >= n {
            return None;
        }
        let j = self.next;
        let r = self.rng.random_range(j..n);
        self.perm.swap(j, r);
        self.next += 1;
        Some(self.perm[j] as usize)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.perm.len() - self.next;
        (left, Some(left))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orders_visit_every_index_once_uniformly() {
        for n in 1..40 {
            let mut firsts = vec![0usize; n];
            for _ in 0..400 {
                let mut seen: Vec<usize> = with_random_order(n, |o| o.collect());
                firsts[seen[0]] += 1;
                seen.sort_unstable();
                assert_eq!(seen, (0..n).collect::<Vec<_>>());
            }
            if n <= 8 {
                assert!(firsts.iter().all(|&f| f > 400 / n / 3), "n {n}: {firsts:?}");
            }
        }
    }

    #[test]
    fn samples_are_not_structured() {
        // Every pair of 16 shows up as the first two (a rotation or a fixed stride
        // would give only some).
        let mut pairs = std::collections::HashSet::new();
        for _ in 0..20_000 {
            let w: Vec<usize> = with_random_order(16, |o| o.take(2).collect());
            pairs.insert((w[0], w[1]));
        }
        assert_eq!(pairs.len(), 16 * 15);
        // Changing n mid-thread resets the permutation.
        let w: Vec<usize> = with_random_order(3, |o| o.collect());
        assert_eq!(w.len(), 3);
        assert!(w.iter().all(|&i| i < 3));
    }

    #[test]
    fn reentrant_use_does_not_panic() {
        let inner = with_random_order(4, |o| {
            let first = o.next().unwrap();
            let nested: Vec<usize> = with_random_order(5, |o2| o2.collect());
            (first, nested.len())
        });
        assert!(inner.0 < 4 && inner.1 == 5);
    }
}
