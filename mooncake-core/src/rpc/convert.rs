//! Conversions between a master call's arguments and results and their wire forms.
//!
//! The table of calls (`master::master_calls!`) names, for each argument, the type the
//! [`MasterApi`](crate::master::MasterApi) method takes (`&str`, `&[(&str, u64)]`, ...)
//! and the owned type the request carries (`String`, `Vec<(String, u64)>`, ...). The
//! client turns one into the other with [`IntoWire`]; the server lends a decoded field
//! back in the borrowed form with [`Lend`] and [`Arg`]. Results travel as
//! [`WireResult`]s through [`WireReturn`].

use mooncake_transfer::RemoteRegion;

use crate::rpc::wire::WireRegion;

/// An argument as the client holds it, turned into what the request carries.
pub trait IntoWire<W> {
    /// The wire form.
    fn into_wire(self) -> W;
}

macro_rules! copy_into_wire {
    ($($t:ty),*) => { $( impl IntoWire<$t> for $t { fn into_wire(self) -> $t { self } } )* };
}
copy_into_wire!(u64, u32, i64, usize, bool);

impl IntoWire<String> for &str {
    fn into_wire(self) -> String {
        self.to_owned()
    }
}

impl<T: Clone> IntoWire<T> for &T {
    fn into_wire(self) -> T {
        self.clone()
    }
}

impl<T: Clone> IntoWire<Vec<T>> for &[T] {
    fn into_wire(self) -> Vec<T> {
        self.to_vec()
    }
}

impl IntoWire<Vec<String>> for &[&str] {
    fn into_wire(self) -> Vec<String> {
        self.iter().map(|k| (*k).to_owned()).collect()
    }
}

impl<A: Copy> IntoWire<Vec<(String, A)>> for &[(&str, A)] {
    fn into_wire(self) -> Vec<(String, A)> {
        self.iter().map(|(k, a)| ((*k).to_owned(), *a)).collect()
    }
}

impl<A: Copy, B: Copy> IntoWire<Vec<(String, A, B)>> for &[(&str, A, B)] {
    fn into_wire(self) -> Vec<(String, A, B)> {
        self.iter().map(|(k, a, b)| ((*k).to_owned(), *a, *b)).collect()
    }
}

impl<A: Copy, B: Copy, C: Copy> IntoWire<Vec<(String, A, B, C)>> for &[(&str, A, B, C)] {
    fn into_wire(self) -> Vec<(String, A, B, C)> {
        self.iter().map(|(k, a, b, c)| ((*k).to_owned(), *a, *b, *c)).collect()
    }
}

/// A decoded request field, lent in the shape the trait method borrows it in
/// (`String` as `&str`, `Vec<String>` as a `Vec<&str>` to take a slice of, ...).
pub trait Lend {
    /// The lent form.
    type Lent<'a>
    where
        Self: 'a;
    /// Lends the field.
    fn lend(&self) -> Self::Lent<'_>;
}

macro_rules! lend_copy {
    ($($t:ty),*) => { $( impl Lend for $t { type Lent<'a> = $t; fn lend(&self) -> $t { *self } } )* };
}
lend_copy!(u64, u32, i64, usize, bool);

macro_rules! lend_ref {
    ($($t:ty),*) => { $( impl Lend for $t { type Lent<'a> = &'a $t; fn lend(&self) -> &$t { self } } )* };
}
lend_ref!(crate::config::ReplicateConfig);
lend_ref!(crate::master::DrainProgress);

impl Lend for WireRegion {
    type Lent<'a> = &'a RemoteRegion;
    fn lend(&self) -> &RemoteRegion {
        &self.0
    }
}

impl IntoWire<WireRegion> for &RemoteRegion {
    fn into_wire(self) -> WireRegion {
        WireRegion(self.clone())
    }
}

impl Lend for String {
    type Lent<'a> = &'a str;
    fn lend(&self) -> &str {
        self
    }
}

impl<T: LendItem> Lend for Vec<T> {
    type Lent<'a>
        = Vec<T::Lent<'a>>
    where
        T: 'a;
    fn lend(&self) -> Self::Lent<'_> {
        self.iter().map(LendItem::lend_item).collect()
    }
}

/// An element of a lent `Vec`: keys become `&str`, and the numbers beside them are
/// copied.
pub trait LendItem {
    /// The lent element.
    type Lent<'a>
    where
        Self: 'a;
    /// Lends one element.
    fn lend_item(&self) -> Self::Lent<'_>;
}

impl LendItem for String {
    type Lent<'a> = &'a str;
    fn lend_item(&self) -> &str {
        self
    }
}

impl<A: Copy> LendItem for (String, A) {
    type Lent<'a>
        = (&'a str, A)
    where
        A: 'a;
    fn lend_item(&self) -> (&str, A) {
        (&self.0, self.1)
    }
}

impl<A: Copy, B: Copy> LendItem for (String, A, B) {
    type Lent<'a>
        = (&'a str, A, B)
    where
        A: 'a,
        B: 'a;
    fn lend_item(&self) -> (&str, A, B) {
        (&self.0, self.1, self.2)
    }
}

impl<A: Copy, B: Copy, C: Copy> LendItem for (String, A, B, C) {
    type Lent<'a>
        = (&'a str, A, B, C)
    where
        A: 'a,
        B: 'a,
        C: 'a;
    fn lend_item(&self) -> (&str, A, B, C) {
        (&self.0, self.1, self.2, self.3)
    }
}

/// Vectors of values the call takes as they are (records, replicas) are lent as
/// slices of the decoded vector, not copied: a remount's records would otherwise be
/// held twice while the master takes them.
macro_rules! lend_slice {
    ($($t:ty),*) => { $(
        impl Lend for Vec<$t> {
            type Lent<'a> = &'a [$t];
            fn lend(&self) -> &[$t] {
                self
            }
        }
    )* };
}
lend_slice!(crate::master::ObjectRecord, crate::master::MemoryReplica, u8);

/// A lent field passed to the trait method: plain values and references as they are,
/// a lent `Vec` as a slice.
pub trait Arg<'b, T> {
    /// The argument.
    fn arg(&'b self) -> T;
}

impl<T: Copy> Arg<'_, T> for T {
    fn arg(&self) -> T {
        *self
    }
}

impl<'b, T> Arg<'b, &'b [T]> for Vec<T> {
    fn arg(&'b self) -> &'b [T] {
        self
    }
}

/// Items of a batch argument, to answer a failed batch call with one error per item.
pub trait BatchLen {
    /// Number of items, if this argument is a batch.
    fn batch_len(&self) -> Option<usize> {
        None
    }
}

impl<T> BatchLen for &[T] {
    fn batch_len(&self) -> Option<usize> {
        Some(self.len())
    }
}

macro_rules! not_batch {
    ($($t:ty),*) => { $( impl BatchLen for $t {} )* };
}
not_batch!(
    u64,
    u32,
    i64,
    usize,
    bool,
    &str,
    &crate::config::ReplicateConfig,
    &crate::master::DrainProgress,
    &mooncake_transfer::RemoteRegion
);
