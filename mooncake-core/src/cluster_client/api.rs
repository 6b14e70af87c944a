//! The cluster client's [`MasterApi`], generated from the table of master calls
//! (`master::master_calls!`): each entry's route tag (`by_key`, `by_keys`,
//! `by_segment`, `to_all`, `refused`, `own`) picks how the call is routed (see
//! `routing`), and the request and the answer are the call's wire messages. A call
//! tagged `own` is a hand-written method of the same name (`own`).

use mooncake_alloc::SegmentId;
use mooncake_transfer::RemoteRegion;

use crate::config::ReplicateConfig;
use crate::error::{Error, Result};
use crate::master::{
    master_calls, ClientId, ClientRegistration, DrainProgress, HeldPlacement, MasterApi, MasterStats, MemoryReplica,
    ObjectInfo, ObjectRecord, OffloadPlan, RecordUpdate, ReplicaList, ReplicatePlan, SegmentInfo,
};
use crate::rpc::convert::IntoWire;
use crate::rpc::unexpected;
use crate::rpc::wire::{Request, Response, WireReturn};

use super::ClusterClient;

/// How the answers of every master to a `to_all` call are folded into one.
mod fold {
    use super::MasterStats;

    /// Counts: summed.
    pub(super) fn add<T: std::ops::Add<Output = T>>(a: T, b: T) -> T {
        a + b
    }

    /// Statistics: merged.
    pub(super) fn merge(mut a: MasterStats, b: MasterStats) -> MasterStats {
        a.merge(&b);
        a
    }

    /// Nothing to fold: every master must have answered `Ok`.
    pub(super) fn each(_: (), _: ()) {}

    /// Drains: every master's segments of the node, the node's latest report.
    pub(super) fn drain(
        mut a: crate::master::DrainProgress,
        b: crate::master::DrainProgress,
    ) -> crate::master::DrainProgress {
        a.merge(&b);
        a
    }
}

/// An argument as the request to one master carries it: the caller's id (an argument
/// named `client`) is the one that master knows this client by.
macro_rules! pass_arg {
    (client, $id:ident) => {
        $id
    };
    ($arg:ident, $id:ident) => {
        $arg
    };
}

/// Whether an argument is the caller's id (the router then finds it per master).
macro_rules! names_client {
    (client) => {
        true
    };
    ($arg:ident) => {
        false
    };
}

/// One method of the trait, by its route.
macro_rules! cluster_call {
    (by_key($key:ident) [$($hook:ident)?] $variant:ident => fn $name:ident ( $( $arg:ident : $ty:ty ),* ) -> $ret:ty) => {
        #[allow(unused_variables)]
        fn $name(&self $(, $arg: $ty)*) -> $ret {
            self.on_key(
                $key,
                false $( || names_client!($arg) )*,
                |id| Request::$variant { $( $arg: IntoWire::into_wire(pass_arg!($arg, id)) ),* },
                |response| match response {
                    Response::$variant(wire) => <$ret as WireReturn>::from_wire(wire, None),
                    other => Err(unexpected(other)),
                },
                |addr, answer| { $( if let Ok(v) = answer { self.$hook(addr, v) } )? },
            )
        }
    };
    (by_keys($items:ident) [$($hook:ident)?] $variant:ident => fn $name:ident ( $( $arg:ident : $ty:ty ),* ) -> $ret:ty) => {
        #[allow(unused_variables)]
        fn $name(&self $(, $arg: $ty)*) -> $ret {
            self.on_keys(
                $items,
                false $( || names_client!($arg) )*,
                |id, part| {
                    // The part of the batch that goes to one leader, in place of the batch.
                    let $items = part;
                    Request::$variant { $( $arg: IntoWire::into_wire(pass_arg!($arg, id)) ),* }
                },
                |response, n| match response {
                    Response::$variant(wire) => <$ret as WireReturn>::from_wire(wire, Some(n)),
                    other => <$ret as WireReturn>::failed(unexpected(other), Some(n)),
                },
                |addr, answers| { $( for v in answers.iter().flatten() { self.$hook(addr, v) } )? },
                // Combining: the batches of two requests of this call, one after the
                // other; a combined answer cut back into its parts' answers.
                &|acc, more| {
                    if let (Request::$variant { $items: all, .. }, Request::$variant { $items: tail, .. }) = (acc, more) {
                        all.extend(tail);
                    }
                },
                &|response, lens| match response {
                    Response::$variant(all) => {
                        let mut all = all.into_iter();
                        lens.iter().map(|&n| Response::$variant(all.by_ref().take(n).collect())).collect()
                    }
                    other => lens.iter().map(|_| other.clone()).collect(),
                },
            )
        }
    };
    (by_segment($segment:ident) [] $variant:ident => fn $name:ident ( $( $arg:ident : $ty:ty ),* ) -> $ret:ty) => {
        #[allow(unused_variables)]
        fn $name(&self $(, $arg: $ty)*) -> $ret {
            self.on_segment(
                $segment,
                false $( || names_client!($arg) )*,
                |id| Request::$variant { $( $arg: IntoWire::into_wire(pass_arg!($arg, id)) ),* },
                |response| match response {
                    Response::$variant(wire) => <$ret as WireReturn>::from_wire(wire, None),
                    other => Err(unexpected(other)),
                },
            )
        }
    };
    (to_all($fold:ident) [] $variant:ident => fn $name:ident ( $( $arg:ident : $ty:ty ),* ) -> $ret:ty) => {
        #[allow(unused_variables)]
        fn $name(&self $(, $arg: $ty)*) -> $ret {
            self.to_all(
                false $( || names_client!($arg) )*,
                |id| Request::$variant { $( $arg: IntoWire::into_wire(pass_arg!($arg, id)) ),* },
                |response| match response {
                    Response::$variant(wire) => <$ret as WireReturn>::from_wire(wire, None),
                    other => Err(unexpected(other)),
                },
                fold::$fold,
            )
        }
    };
    (refused() [] $variant:ident => fn $name:ident ( $( $arg:ident : $ty:ty ),* ) -> $ret:ty) => {
        #[allow(unused_variables)]
        fn $name(&self $(, $arg: $ty)*) -> $ret {
            <$ret as WireReturn>::failed(
                Error::InvalidArgument(format!(
                    "{} is not a call of a client of a cluster (extents are mounted per group)",
                    stringify!($name)
                )),
                None,
            )
        }
    };
    (own() [] $variant:ident => fn $name:ident ( $( $arg:ident : $ty:ty ),* ) -> $ret:ty) => {
        fn $name(&self $(, $arg: $ty)*) -> $ret {
            // The inherent method of the same name (`own`): inherent methods come first.
            ClusterClient::$name(self $(, $arg)*)
        }
    };
}

/// Implements every call of the table by its route.
macro_rules! cluster_api {
    ($( $(#[$doc:meta])* $variant:ident => fn $name:ident ( $( $arg:ident : $ty:ty => $wire:ty ),* $(,)? ) -> $ret:ty
        => $route:ident $( ( $($how:tt)* ) )? $( + $hook:ident )?; )*) => {
        impl MasterApi for ClusterClient {
            $( cluster_call! { $route ( $($($how)*)? ) [ $($hook)? ] $variant => fn $name ( $( $arg: $ty ),* ) -> $ret } )*
        }
    };
}

master_calls!(cluster_api);
