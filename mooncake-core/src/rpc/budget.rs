//! Decoding within a budget of what it allocates.
//!
//! A frame's body is bounded in bytes, but what decoding it allocates is not: a
//! `Vec<String>` of one-byte keys costs two bytes a key on the wire and over 50 in
//! memory (the `String` in the vector, its own heap block), and answering each key
//! costs more again. So every message is decoded through [`decode`], which wraps
//! postcard's deserializer in a meter that charges, before the memory is used:
//!
//! - **items**: the elements of every sequence and map, at every depth, counted from
//!   the length a sequence announces *before* its elements are decoded (a sequence
//!   announcing more items than are left is refused before anything is allocated for
//!   it; one announcing more than its body's bytes could hold, which postcard passes
//!   on as no length at all, is counted element by element);
//! - **bytes**: an estimate of what the decoded message holds and what answering it
//!   costs: each element three times the size of its slot (a growing `Vec` holds up
//!   to twice its length, and the call may copy it once) plus [`ITEM_RESERVE`], each
//!   string or byte buffer twice its heap block as the allocator rounds it
//!   ([`heap_block`]; the call may copy it too), and, for a request answered per
//!   item (a batch call), [`ANSWER_RESERVE`] bytes an item for its answer.
//!
//! Both are bounded per message by [`DecodeLimits`]; a server also charges the
//! bytes to a [`DecodePool`] shared by every request it is decoding or answering at
//! once, and holds them (a [`Reservation`]) until the answer is encoded. A message
//! over its limits, or one that cannot get its bytes from the pool in time, is
//! refused with a [`DecodeError`] that tells which, and what it had allocated is
//! freed; nothing is allocated past the limits but, at most, the 1 MiB serde
//! reserves ahead for each sequence being decoded (its `cautious` capacity).

use std::cell::Cell;
use std::fmt;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use serde::de::{self, DeserializeSeed, Deserializer, EnumAccess, MapAccess, SeqAccess, VariantAccess, Visitor};
use serde::Deserialize;

/// Bytes charged for each element on top of its decoded size: the borrowed form a
/// call takes it in (a key lent as a `&str`: 16 bytes), and the allocator's rounding
/// of the vector that holds it.
pub const ITEM_RESERVE: usize = 32;

/// Bytes charged for each item of a request answered per item (a batch call: see
/// `wire::decode_request`): its result and the wire
/// form of that result (up to 72 bytes each), what they hold (a replica list, an
/// error's message), and its share of the encoded answer.
pub const ANSWER_RESERVE: usize = 256;

/// Bytes a [`DecodePool`] hands to one decoding at a time: decodings touch the pool
/// once a grain, not once an element.
const GRAIN: usize = 1 << 20;

/// Bounds on what decoding one message may allocate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeLimits {
    /// Most elements of sequences and maps, all depths together.
    pub max_items: usize,
    /// Most bytes charged (see the [module](self) documentation).
    pub max_bytes: usize,
}

impl DecodeLimits {
    /// A request to a server: 2 Mi items and 256 MiB. A remount of 1 M records with
    /// keys of 20 bytes (32 MB on the wire) is charged 240 MB; a `BatchExists` of
    /// one-byte keys is charged 424 bytes a key and stops at about 630 k keys, and a
    /// 64 MiB frame of them (32 Mi keys) is refused from its announced length.
    pub const REQUEST: Self = Self { max_items: 2 << 20, max_bytes: 256 << 20 };
    /// A response to a client: 4 Mi items and 512 MiB. A client decodes one response
    /// a call, from the server it chose, so it may afford more than a server does for
    /// each of its many clients: a heartbeat's 2 M record updates, or any answer to a
    /// request the server accepted; a 64 MiB frame of one-byte keys is still refused
    /// from its length.
    pub const RESPONSE: Self = Self { max_items: 4 << 20, max_bytes: 512 << 20 };
}

impl Default for DecodeLimits {
    fn default() -> Self {
        Self::REQUEST
    }
}

/// Which bound a message went over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exceeded {
    /// More elements than [`DecodeLimits::max_items`]: `at_least` were announced.
    Items {
        /// Elements announced or decoded so far (at least this many).
        at_least: usize,
        /// The limit.
        limit: usize,
    },
    /// More bytes than [`DecodeLimits::max_bytes`].
    Bytes {
        /// Bytes charged so far (at least this many).
        at_least: usize,
        /// The limit.
        limit: usize,
    },
}

impl fmt::Display for Exceeded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Exceeded::Items { at_least, limit } => {
                write!(f, "at least {at_least} items, over the limit of {limit} items a message")
            }
            Exceeded::Bytes { at_least, limit } => {
                write!(f, "at least {at_least} bytes decoded, over the limit of {limit} bytes a message")
            }
        }
    }
}

/// Why a message was not decoded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The bytes are not a message.
    #[error("malformed body: {0}")]
    Malformed(String),
    /// The message is over its limits.
    #[error("message over the decoding budget: {0}")]
    OverBudget(Exceeded),
    /// The pool had no room for the message in time (other requests hold it).
    #[error("server busy: {pending} bytes of other requests being decoded (of {limit}); try again")]
    Busy {
        /// Bytes the pool had handed out.
        pending: usize,
        /// The pool's size.
        limit: usize,
    },
}

/// Bytes of decoded messages held at once, over every request a server is decoding
/// or answering. A decoding takes its bytes a `GRAIN` at a time; when the pool is
/// full it waits (up to its deadline) for other requests to give theirs back.
#[derive(Debug)]
pub struct DecodePool {
    limit: usize,
    used: Mutex<usize>,
    freed: Condvar,
}

impl DecodePool {
    /// A pool of `limit` bytes.
    pub fn new(limit: usize) -> Self {
        Self { limit, used: Mutex::new(0), freed: Condvar::new() }
    }

    /// The pool's size.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Bytes handed out now.
    pub fn in_use(&self) -> usize {
        *self.used.lock()
    }

    /// Takes `bytes`, waiting until `deadline` for room; `Err(in use)` if none came.
    fn take(&self, bytes: usize, deadline: Option<Instant>) -> Result<(), usize> {
        let mut used = self.used.lock();
        loop {
            if self.limit.saturating_sub(*used) >= bytes {
                *used += bytes;
                return Ok(());
            }
            let Some(deadline) = deadline else { return Err(*used) };
            if self.freed.wait_until(&mut used, deadline).timed_out() && self.limit.saturating_sub(*used) < bytes {
                return Err(*used);
            }
        }
    }

    fn give_back(&self, bytes: usize) {
        if bytes == 0 {
            return;
        }
        let mut used = self.used.lock();
        *used = used.saturating_sub(bytes);
        drop(used);
        self.freed.notify_all();
    }
}

/// Bytes of a [`DecodePool`] held for a decoded message, given back when dropped
/// (once the message is answered).
#[must_use = "the bytes go back to the pool when the reservation is dropped"]
#[derive(Debug)]
pub struct Reservation<'p> {
    pool: Option<&'p DecodePool>,
    bytes: usize,
    charged: usize,
    items: usize,
}

impl Reservation<'_> {
    /// Charges `bytes` more to the message (what answering it will cost), within
    /// `limits` and from the pool, waiting up to `wait` for room. On an error the
    /// reservation is as it was; drop it to give its bytes back.
    pub fn reserve(&mut self, bytes: usize, limits: DecodeLimits, wait: Option<Duration>) -> Result<(), DecodeError> {
        let total = self.charged.saturating_add(bytes);
        if total > limits.max_bytes {
            return Err(DecodeError::OverBudget(Exceeded::Bytes { at_least: total, limit: limits.max_bytes }));
        }
        if let (Some(pool), true) = (self.pool, total > self.bytes) {
            let want = total - self.bytes;
            pool.take(want, wait.map(|w| Instant::now() + w))
                .map_err(|pending| DecodeError::Busy { pending, limit: pool.limit })?;
            self.bytes += want;
        }
        self.charged = total;
        Ok(())
    }

    /// Bytes held in the pool (a whole number of grains, at least the bytes charged).
    pub fn held(&self) -> usize {
        self.bytes
    }

    /// Bytes the message was charged.
    pub fn charged(&self) -> usize {
        self.charged
    }

    /// Items the message was charged.
    pub fn items(&self) -> usize {
        self.items
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if let Some(pool) = self.pool {
            pool.give_back(self.bytes);
        }
    }
}

/// Where a decoding takes its bytes from: a pool, and how long it may wait for room
/// (`None`: not at all).
#[derive(Clone, Copy, Debug)]
pub struct PoolAccess<'p> {
    /// The pool.
    pub pool: &'p DecodePool,
    /// How long to wait for room when the pool is full.
    pub wait: Option<Duration>,
}

/// Decodes a postcard message within `limits`, taking its bytes from `pool` if one
/// is given. On success the message comes with the [`Reservation`] of its bytes,
/// to be dropped once the message is answered.
///
/// ```
/// # // Public only with the `fuzzing` feature (a workspace test enables it).
/// # #[cfg(feature = "fuzzing")] {
/// use mooncake_core::rpc::budget::{decode, DecodeError, DecodeLimits};
/// use mooncake_core::rpc::wire::Request;
///
/// let keys: Vec<String> = (0..1000).map(|i| (i % 10).to_string()).collect();
/// let body = postcard::to_allocvec(&Request::BatchExists { keys: keys.clone() }).unwrap();
/// let (req, _held) = decode::<Request>(&body, DecodeLimits::REQUEST, None).unwrap();
/// assert_eq!(req, Request::BatchExists { keys });
/// // The same message under a bound of 999 items is refused before its keys are.
/// let small = DecodeLimits { max_items: 999, ..DecodeLimits::REQUEST };
/// assert!(matches!(decode::<Request>(&body, small, None), Err(DecodeError::OverBudget(_))));
/// # }
/// ```
pub fn decode<'de, 'p, T: Deserialize<'de>>(
    body: &'de [u8],
    limits: DecodeLimits,
    pool: Option<PoolAccess<'p>>,
) -> Result<(T, Reservation<'p>), DecodeError> {
    let meter = Meter {
        limits,
        items: Cell::new(0),
        bytes: Cell::new(0),
        held: Cell::new(0),
        pool,
        deadline: pool.and_then(|p| p.wait).map(|w| Instant::now() + w),
        stop: Cell::new(None),
    };
    let mut de = postcard::Deserializer::from_bytes(body);
    let result = T::deserialize(Metered { inner: &mut de, meter: &meter });
    let reservation = Reservation {
        pool: pool.map(|p| p.pool),
        bytes: meter.held.get(),
        charged: meter.bytes.get(),
        items: meter.items.get(),
    };
    match result {
        Ok(value) => Ok((value, reservation)),
        // The meter's reason first: the deserializer's error then only says the
        // meter stopped it.
        Err(e) => Err(meter.stop.take().unwrap_or_else(|| DecodeError::Malformed(e.to_string()))),
    }
}

/// Bytes the allocator takes for a heap block of `len` bytes (glibc on 64 bits: 8
/// bytes of header, 16-byte steps, 32 at least; none for an empty one).
pub const fn heap_block(len: usize) -> usize {
    if len == 0 {
        return 0;
    }
    let block = len.saturating_add(8 + 15) & !15;
    if block < 32 {
        32
    } else {
        block
    }
}

/// The count of one decoding.
struct Meter<'p> {
    limits: DecodeLimits,
    items: Cell<usize>,
    bytes: Cell<usize>,
    /// Bytes taken from the pool (ahead of `bytes`, a grain at a time).
    held: Cell<usize>,
    pool: Option<PoolAccess<'p>>,
    deadline: Option<Instant>,
    /// Why the meter stopped the decoding.
    stop: Cell<Option<DecodeError>>,
}

impl Meter<'_> {
    fn fail<E: de::Error>(&self, why: DecodeError) -> E {
        let e = E::custom(&why);
        self.stop.set(Some(why));
        e
    }

    fn items<E: de::Error>(&self, n: usize) -> Result<(), E> {
        let total = self.items.get().saturating_add(n);
        if total > self.limits.max_items {
            return Err(
                self.fail(DecodeError::OverBudget(Exceeded::Items { at_least: total, limit: self.limits.max_items }))
            );
        }
        self.items.set(total);
        Ok(())
    }

    fn bytes<E: de::Error>(&self, n: usize) -> Result<(), E> {
        let total = self.bytes.get().saturating_add(n);
        if total > self.limits.max_bytes {
            return Err(
                self.fail(DecodeError::OverBudget(Exceeded::Bytes { at_least: total, limit: self.limits.max_bytes }))
            );
        }
        self.bytes.set(total);
        if let Some(access) = self.pool {
            let held = self.held.get();
            if total > held {
                // A grain at a time, never past the message's limit (`total` is within it).
                let want = (total - held).max(GRAIN.min(self.limits.max_bytes - held));
                match access.pool.take(want, self.deadline) {
                    Ok(()) => self.held.set(held + want),
                    Err(pending) => {
                        return Err(self.fail(DecodeError::Busy { pending, limit: access.pool.limit }));
                    }
                }
            }
        }
        Ok(())
    }
}

/// A deserializer whose every step is charged to the meter.
struct Metered<'m, 'p, D> {
    inner: D,
    meter: &'m Meter<'p>,
}

/// What a visitor is given to visit, which decides what its elements are charged.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Shape {
    /// A sequence or map: variable length, each element charged.
    Collection,
    /// A tuple, struct or anything of fixed shape: its fields are part of what holds it.
    Fixed,
}

struct MeteredVisitor<'m, 'p, V> {
    inner: V,
    meter: &'m Meter<'p>,
    shape: Shape,
}

struct MeteredSeed<'m, 'p, S> {
    inner: S,
    meter: &'m Meter<'p>,
}

struct MeteredSeq<'m, 'p, A> {
    inner: A,
    meter: &'m Meter<'p>,
    shape: Shape,
    /// The items were counted from the announced length.
    counted: bool,
}

struct MeteredEnum<'m, 'p, A> {
    inner: A,
    meter: &'m Meter<'p>,
}

macro_rules! forward_deserialize {
    ($($method:ident => $shape:ident),* $(,)?) => {
        $(
            fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, D::Error> {
                self.inner.$method(MeteredVisitor { inner: visitor, meter: self.meter, shape: Shape::$shape })
            }
        )*
    };
}

impl<'de, D: Deserializer<'de>> Deserializer<'de> for Metered<'_, '_, D> {
    type Error = D::Error;

    forward_deserialize! {
        deserialize_any => Collection,
        deserialize_bool => Fixed,
        deserialize_i8 => Fixed,
        deserialize_i16 => Fixed,
        deserialize_i32 => Fixed,
        deserialize_i64 => Fixed,
        deserialize_i128 => Fixed,
        deserialize_u8 => Fixed,
        deserialize_u16 => Fixed,
        deserialize_u32 => Fixed,
        deserialize_u64 => Fixed,
        deserialize_u128 => Fixed,
        deserialize_f32 => Fixed,
        deserialize_f64 => Fixed,
        deserialize_char => Fixed,
        deserialize_str => Fixed,
        deserialize_string => Fixed,
        deserialize_bytes => Fixed,
        deserialize_byte_buf => Fixed,
        deserialize_option => Fixed,
        deserialize_unit => Fixed,
        deserialize_seq => Collection,
        deserialize_map => Collection,
        deserialize_identifier => Fixed,
        deserialize_ignored_any => Fixed,
    }

    fn deserialize_unit_struct<V: Visitor<'de>>(self, name: &'static str, visitor: V) -> Result<V::Value, D::Error> {
        self.inner
            .deserialize_unit_struct(name, MeteredVisitor { inner: visitor, meter: self.meter, shape: Shape::Fixed })
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(self, name: &'static str, visitor: V) -> Result<V::Value, D::Error> {
        self.inner
            .deserialize_newtype_struct(name, MeteredVisitor { inner: visitor, meter: self.meter, shape: Shape::Fixed })
    }

    fn deserialize_tuple<V: Visitor<'de>>(self, len: usize, visitor: V) -> Result<V::Value, D::Error> {
        self.inner.deserialize_tuple(len, MeteredVisitor { inner: visitor, meter: self.meter, shape: Shape::Fixed })
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        len: usize,
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.inner.deserialize_tuple_struct(
            name,
            len,
            MeteredVisitor { inner: visitor, meter: self.meter, shape: Shape::Fixed },
        )
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.inner.deserialize_struct(
            name,
            fields,
            MeteredVisitor { inner: visitor, meter: self.meter, shape: Shape::Fixed },
        )
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.inner.deserialize_enum(
            name,
            variants,
            MeteredVisitor { inner: visitor, meter: self.meter, shape: Shape::Fixed },
        )
    }

    fn is_human_readable(&self) -> bool {
        self.inner.is_human_readable()
    }
}

macro_rules! forward_visit {
    ($($method:ident($t:ty)),* $(,)?) => {
        $(
            fn $method<E: de::Error>(self, v: $t) -> Result<Self::Value, E> {
                self.inner.$method(v)
            }
        )*
    };
}

impl<'de, V: Visitor<'de>> Visitor<'de> for MeteredVisitor<'_, '_, V> {
    type Value = V::Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.expecting(f)
    }

    forward_visit! {
        visit_bool(bool),
        visit_i8(i8),
        visit_i16(i16),
        visit_i32(i32),
        visit_i64(i64),
        visit_i128(i128),
        visit_u8(u8),
        visit_u16(u16),
        visit_u32(u32),
        visit_u64(u64),
        visit_u128(u128),
        visit_f32(f32),
        visit_f64(f64),
        visit_char(char),
    }

    // Strings and byte buffers are charged their heap block whether or not the
    // visitor copies them (most do: a `String` field), and once more for a copy the
    // call may make.
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        self.meter.bytes(2 * heap_block(v.len()))?;
        self.inner.visit_str(v)
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
        self.meter.bytes(2 * heap_block(v.len()))?;
        self.inner.visit_borrowed_str(v)
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
        self.meter.bytes(2 * heap_block(v.len()))?;
        self.inner.visit_string(v)
    }

    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Self::Value, E> {
        self.meter.bytes(2 * heap_block(v.len()))?;
        self.inner.visit_bytes(v)
    }

    fn visit_borrowed_bytes<E: de::Error>(self, v: &'de [u8]) -> Result<Self::Value, E> {
        self.meter.bytes(2 * heap_block(v.len()))?;
        self.inner.visit_borrowed_bytes(v)
    }

    fn visit_byte_buf<E: de::Error>(self, v: Vec<u8>) -> Result<Self::Value, E> {
        self.meter.bytes(2 * heap_block(v.len()))?;
        self.inner.visit_byte_buf(v)
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        self.inner.visit_none()
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        self.inner.visit_some(Metered { inner: d, meter: self.meter })
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        self.inner.visit_unit()
    }

    fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        self.inner.visit_newtype_struct(Metered { inner: d, meter: self.meter })
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        // A sequence announces its length before its elements: refuse it before the
        // visitor reserves room for them, or decodes one.
        let counted = match (self.shape, seq.size_hint()) {
            (Shape::Collection, Some(n)) => {
                self.meter.items(n)?;
                true
            }
            _ => false,
        };
        self.inner.visit_seq(MeteredSeq { inner: seq, meter: self.meter, shape: self.shape, counted })
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        let counted = match map.size_hint() {
            Some(n) => {
                self.meter.items(n)?;
                true
            }
            None => false,
        };
        self.inner.visit_map(MeteredSeq { inner: map, meter: self.meter, shape: Shape::Collection, counted })
    }

    fn visit_enum<A: EnumAccess<'de>>(self, data: A) -> Result<Self::Value, A::Error> {
        self.inner.visit_enum(MeteredEnum { inner: data, meter: self.meter })
    }
}

impl<'de, S: DeserializeSeed<'de>> DeserializeSeed<'de> for MeteredSeed<'_, '_, S> {
    type Value = S::Value;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<S::Value, D::Error> {
        self.inner.deserialize(Metered { inner: d, meter: self.meter })
    }
}

impl Meter<'_> {
    /// Charges one element of a collection once it is decoded (before the visitor
    /// keeps it): its slot, the spare room of a growing vector, a copy, and
    /// [`ITEM_RESERVE`].
    fn element<T, E: de::Error>(&self, counted: bool) -> Result<(), E> {
        if !counted {
            self.items(1)?;
        }
        self.bytes(3 * std::mem::size_of::<T>() + ITEM_RESERVE)
    }
}

impl<'de, A: SeqAccess<'de>> SeqAccess<'de> for MeteredSeq<'_, '_, A> {
    type Error = A::Error;

    fn next_element_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> Result<Option<T::Value>, A::Error> {
        let value = self.inner.next_element_seed(MeteredSeed { inner: seed, meter: self.meter })?;
        if value.is_some() && self.shape == Shape::Collection {
            self.meter.element::<T::Value, A::Error>(self.counted)?;
        }
        Ok(value)
    }

    fn size_hint(&self) -> Option<usize> {
        self.inner.size_hint()
    }
}

impl<'de, A: MapAccess<'de>> MapAccess<'de> for MeteredSeq<'_, '_, A> {
    type Error = A::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(&mut self, seed: K) -> Result<Option<K::Value>, A::Error> {
        let key = self.inner.next_key_seed(MeteredSeed { inner: seed, meter: self.meter })?;
        if key.is_some() {
            self.meter.element::<K::Value, A::Error>(self.counted)?;
        }
        Ok(key)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, A::Error> {
        let value = self.inner.next_value_seed(MeteredSeed { inner: seed, meter: self.meter })?;
        // Counted with its key: only its room here.
        self.meter.bytes(3 * std::mem::size_of::<V::Value>())?;
        Ok(value)
    }

    fn size_hint(&self) -> Option<usize> {
        self.inner.size_hint()
    }
}

impl<'de, 'm, 'p, A: EnumAccess<'de>> EnumAccess<'de> for MeteredEnum<'m, 'p, A> {
    type Error = A::Error;
    type Variant = MeteredEnum<'m, 'p, A::Variant>;

    fn variant_seed<S: DeserializeSeed<'de>>(self, seed: S) -> Result<(S::Value, Self::Variant), A::Error> {
        let (value, variant) = self.inner.variant_seed(MeteredSeed { inner: seed, meter: self.meter })?;
        Ok((value, MeteredEnum { inner: variant, meter: self.meter }))
    }
}

impl<'de, A: VariantAccess<'de>> VariantAccess<'de> for MeteredEnum<'_, '_, A> {
    type Error = A::Error;

    fn unit_variant(self) -> Result<(), A::Error> {
        self.inner.unit_variant()
    }

    fn newtype_variant_seed<S: DeserializeSeed<'de>>(self, seed: S) -> Result<S::Value, A::Error> {
        self.inner.newtype_variant_seed(MeteredSeed { inner: seed, meter: self.meter })
    }

    fn tuple_variant<V: Visitor<'de>>(self, len: usize, visitor: V) -> Result<V::Value, A::Error> {
        self.inner.tuple_variant(len, MeteredVisitor { inner: visitor, meter: self.meter, shape: Shape::Fixed })
    }

    fn struct_variant<V: Visitor<'de>>(
        self,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, A::Error> {
        self.inner.struct_variant(fields, MeteredVisitor { inner: visitor, meter: self.meter, shape: Shape::Fixed })
    }
}
