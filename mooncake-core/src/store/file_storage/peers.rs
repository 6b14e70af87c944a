//! How any client loads objects that live only on another client's disk:
//! [`DiskPeers`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use mooncake_storage::StorageError;
use mooncake_transfer::{RemoteRegion, SharedSecret, TransferEngine, TransferRequest};
use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::master::{ClientId, MasterApi};
use crate::rpc::wire::{Request, Response};
use crate::rpc::RpcMasterClient;

/// How any client (with or without an SSD tier of its own) loads objects that live
/// only on another client's disk: through that client's load server and the
/// transfer engine.
pub(crate) struct DiskPeers {
    secret: Option<Vec<u8>>,
    /// Connections to other clients' load servers, by address.
    peers: Mutex<HashMap<String, Arc<RpcMasterClient>>>,
    /// Load-server addresses of other clients, by client id.
    peer_endpoints: Mutex<HashMap<ClientId, String>>,
    /// Objects pulled from other clients' disks.
    loads: AtomicU64,
}

impl DiskPeers {
    pub(crate) fn new(secret: Option<&[u8]>) -> Self {
        Self {
            secret: secret.map(<[u8]>::to_vec),
            peers: Mutex::new(HashMap::new()),
            peer_endpoints: Mutex::new(HashMap::new()),
            loads: AtomicU64::new(0),
        }
    }

    /// Objects pulled from other clients' disks so far.
    pub(crate) fn loads(&self) -> u64 {
        self.loads.load(Ordering::Relaxed)
    }

    /// Pulls several objects from the disk of `owner` with one staging round trip and
    /// one transfer batch; each destination must be exactly the object's length.
    /// The outer error is the load server's (nothing was pulled); inner ones are per
    /// object.
    pub(crate) fn load_many(
        &self,
        master: &dyn MasterApi,
        engine: &TransferEngine,
        owner: ClientId,
        requests: &mut [(&str, &mut [u8])],
    ) -> Result<Vec<Result<()>>> {
        let peer = self.peer(master, owner)?;
        let keys = requests.iter().map(|(k, _)| (*k).to_owned()).collect();
        let batch = match peer.call(&Request::BatchGetOffloadObject { keys }) {
            Ok(Response::OffloadBatch(b)) if b.objects.len() == requests.len() => b,
            Ok(Response::Error(e)) => return Err(e.into()),
            Ok(other) => {
                return Err(StorageError::Remote(format!("unexpected answer of a load server: {other:?}")).into())
            }
            Err(e) => {
                // The peer may have moved (restart): ask the master again next time.
                self.peer_endpoints.lock().remove(&owner);
                return Err(e);
            }
        };
        let region = RemoteRegion { endpoint: batch.endpoint.clone(), region: batch.region };
        let mut results: Vec<Result<()>> = Vec::with_capacity(requests.len());
        let mut reads: Vec<TransferRequest<'_>> = Vec::with_capacity(requests.len());
        let mut read_of: Vec<usize> = Vec::with_capacity(requests.len());
        for (i, ((key, dst), staged)) in requests.iter_mut().zip(batch.objects).enumerate() {
            match staged {
                Ok((offset, len)) if len == dst.len() as u64 => {
                    results.push(Ok(()));
                    reads.push(TransferRequest::read(&region, offset, dst));
                    read_of.push(i);
                }
                Ok((_, len)) => results.push(Err(StorageError::Remote(format!(
                    "{key}: {len} bytes staged, the master says {}",
                    dst.len()
                ))
                .into())),
                Err(e) => results.push(Err(e.into())),
            }
        }
        for (res, i) in engine.transfer(&mut reads).into_iter().zip(read_of) {
            if let Err(e) = res {
                results[i] = Err(e.into());
            }
        }
        // Release at once; the GC reclaims the batch should this call be lost.
        let _ = peer.call(&Request::ReleaseOffloadBuffer { batch_id: batch.batch_id });
        let pulled = results.iter().filter(|r| r.is_ok()).count();
        self.loads.fetch_add(pulled as u64, Ordering::Relaxed);
        Ok(results)
    }

    fn peer(&self, master: &dyn MasterApi, owner: ClientId) -> Result<Arc<RpcMasterClient>> {
        let cached = self.peer_endpoints.lock().get(&owner).cloned();
        let endpoint = match cached {
            Some(e) => e,
            None => {
                // The master lists a disk replica it cannot route to: a storage
                // error for this object, not a missing one.
                let e = master.disk_endpoint(owner).map_err(|e| match e {
                    Error::NotFound(m) => StorageError::Remote(format!("cannot load from an SSD: {m}")).into(),
                    e => e,
                })?;
                self.peer_endpoints.lock().insert(owner, e.clone());
                e
            }
        };
        if let Some(p) = self.peers.lock().get(&endpoint) {
            return Ok(p.clone());
        }
        let secret = self.secret.as_deref().map(SharedSecret::new);
        let p = Arc::new(RpcMasterClient::connect_with_timeout(&endpoint, secret, Duration::from_secs(10))?);
        self.peers.lock().insert(endpoint, p.clone());
        Ok(p)
    }
}
