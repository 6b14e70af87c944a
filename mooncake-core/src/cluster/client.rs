//! The etcd client of a coordination thread: every request carries a deadline, and
//! every failure becomes an [`Error::Coordination`] naming the endpoints.

use std::future::Future;
use std::time::Duration;

use etcd_client::{Client, ConnectOptions};

use crate::error::{Error, Result};

/// Shortest interval between two HTTP/2 pings to etcd: twice etcd's default
/// `--grpc-keepalive-min-time`, so that no delay of a ping makes two look too close.
const MIN_PING_INTERVAL: Duration = Duration::from_secs(10);

/// An etcd client with the request deadline of its owner.
#[derive(Clone)]
pub(crate) struct Etcd {
    /// The client (cheap to clone: it shares one channel).
    pub client: Client,
    endpoints: String,
    timeout: Duration,
}

impl Etcd {
    /// A client of `endpoints` (`host:port` or URLs). etcd-client connects lazily, so
    /// this succeeds while etcd is down; the first request tells.
    pub(crate) async fn connect(endpoints: &[String], timeout: Duration) -> Result<Etcd> {
        let urls: Vec<String> =
            endpoints.iter().map(|e| if e.contains("://") { e.clone() } else { format!("http://{e}") }).collect();
        let joined = urls.join(",");
        let options = ConnectOptions::new()
            .with_connect_timeout(timeout)
            // HTTP/2 pings find a dead or frozen etcd on an idle watch stream, but no
            // more often than etcd allows: it answers a client that pings an idle
            // connection more often than every `--grpc-keepalive-min-time` (5 s) with
            // GOAWAY "too_many_pings" and closes the connection, which broke every
            // idle watch after about 8 s.
            .with_keep_alive(timeout.max(MIN_PING_INTERVAL), timeout)
            .with_keep_alive_while_idle(true);
        let client = tokio::time::timeout(timeout, Client::connect(&urls, Some(options)))
            .await
            .map_err(|_| unreachable(&joined, "connect", "timed out"))?
            .map_err(|e| unreachable(&joined, "connect", e))?;
        Ok(Etcd { client, endpoints: joined, timeout })
    }

    /// Runs one request under the deadline.
    pub(crate) async fn call<T, F>(&self, what: &str, request: F) -> Result<T>
    where
        F: Future<Output = std::result::Result<T, etcd_client::Error>>,
    {
        match tokio::time::timeout(self.timeout, request).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(unreachable(&self.endpoints, what, e)),
            Err(_) => Err(unreachable(&self.endpoints, what, format!("no answer within {:?}", self.timeout))),
        }
    }

    /// An error about this cluster's etcd.
    pub(crate) fn error(&self, what: &str, why: impl std::fmt::Display) -> Error {
        unreachable(&self.endpoints, what, why)
    }
}

fn unreachable(endpoints: &str, what: &str, why: impl std::fmt::Display) -> Error {
    Error::Coordination(format!("etcd at {endpoints}: {what}: {why}"))
}

/// Whether an etcd error says the lease does not exist (it expired or was revoked).
pub(crate) fn is_lease_not_found(e: &Error) -> bool {
    matches!(e, Error::Coordination(m) if m.contains("requested lease not found"))
}
