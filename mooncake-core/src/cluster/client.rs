//! The etcd client of a coordination thread: every request carries a deadline, and
//! every failure becomes an [`Error::Coordination`] naming the endpoints.

use std::future::Future;
use std::time::Duration;

use etcd_client::{Certificate, Client, ConnectOptions, Identity, TlsOptions};

use super::credentials::{EtcdCredentials, EtcdTls};
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
    /// A client of `endpoints` (`host:port` or URLs; bare ones get `https://` with
    /// TLS, else `http://`), authenticating with `credentials` (a wrong user or
    /// password fails here). etcd-client connects lazily, so without a user this
    /// succeeds while etcd is down; the first request tells.
    pub(crate) async fn connect(
        endpoints: &[String],
        timeout: Duration,
        credentials: &EtcdCredentials,
    ) -> Result<Etcd> {
        let scheme = if credentials.uses_tls() { "https" } else { "http" };
        let urls: Vec<String> =
            endpoints.iter().map(|e| if e.contains("://") { e.clone() } else { format!("{scheme}://{e}") }).collect();
        let joined = urls.join(",");
        let mut options = ConnectOptions::new()
            .with_connect_timeout(timeout)
            // HTTP/2 pings find a dead or frozen etcd on an idle watch stream, but no
            // more often than etcd allows: it answers a client that pings an idle
            // connection more often than every `--grpc-keepalive-min-time` (5 s) with
            // GOAWAY "too_many_pings" and closes the connection, which broke every
            // idle watch after about 8 s.
            .with_keep_alive(timeout.max(MIN_PING_INTERVAL), timeout)
            .with_keep_alive_while_idle(true);
        if let Some((user, password)) = &credentials.user {
            options = options.with_user(user.clone(), password.clone());
        }
        if let Some(tls) = &credentials.tls {
            options = options.with_tls(tls_options(tls).map_err(|e| unreachable(&joined, "TLS", e))?);
        }
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

    /// Runs the request `make` builds, trying again (a fresh request each time,
    /// after a pause that doubles up to 1 s) while etcd gives no answer within the
    /// request deadline and `patience` has not run out. For a member's or watcher's
    /// first contact: the first request also opens the connection, and an etcd that
    /// is slow for a moment (a loaded machine, a leader election) must not make a
    /// master exit at start. An answer that is an error (nothing listens, a wrong
    /// password) fails at once.
    pub(crate) async fn call_patiently<T, F>(
        &self,
        what: &str,
        patience: Duration,
        mut make: impl FnMut() -> F,
    ) -> Result<T>
    where
        F: Future<Output = std::result::Result<T, etcd_client::Error>>,
    {
        let give_up = tokio::time::Instant::now() + patience;
        let mut pause = Duration::from_millis(50);
        loop {
            match tokio::time::timeout(self.timeout, make()).await {
                Ok(Ok(v)) => return Ok(v),
                Ok(Err(e)) => return Err(unreachable(&self.endpoints, what, e)),
                Err(_) if tokio::time::Instant::now() + pause < give_up => {
                    tracing::warn!(what, timeout = ?self.timeout, retry_in = ?pause, "etcd did not answer in time; asking again");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(1));
                }
                Err(_) => {
                    let why = format!("no answer within {:?} (asked for {patience:?})", self.timeout);
                    return Err(unreachable(&self.endpoints, what, why));
                }
            }
        }
    }

    /// How long a first contact keeps asking a slow etcd
    /// ([`call_patiently`](Self::call_patiently)): five request deadlines.
    pub(crate) fn first_contact_patience(&self) -> Duration {
        self.timeout * 5
    }

    /// An error about this cluster's etcd.
    pub(crate) fn error(&self, what: &str, why: impl std::fmt::Display) -> Error {
        unreachable(&self.endpoints, what, why)
    }
}

/// The TLS options of `tls`: its PEM files read now (an error names the file).
pub(crate) fn tls_options(tls: &EtcdTls) -> std::result::Result<TlsOptions, String> {
    let read = |p: &std::path::Path| std::fs::read(p).map_err(|e| format!("cannot read {}: {e}", p.display()));
    let mut options = TlsOptions::new().ca_certificate(Certificate::from_pem(read(&tls.ca)?));
    if let Some((cert, key)) = &tls.identity {
        options = options.identity(Identity::from_pem(read(cert)?, read(key)?));
    }
    if let Some(domain) = &tls.domain {
        options = options.domain_name(domain.clone());
    }
    Ok(options)
}

fn unreachable(endpoints: &str, what: &str, why: impl std::fmt::Display) -> Error {
    Error::Coordination(format!("etcd at {endpoints}: {what}: {why}"))
}

/// Whether an etcd error says the lease does not exist (it expired or was revoked).
pub(crate) fn is_lease_not_found(e: &Error) -> bool {
    matches!(e, Error::Coordination(m) if m.contains("requested lease not found"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_options_read_their_files_and_name_a_missing_one() {
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, "-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n").unwrap();
        let mut tls = EtcdTls { ca: ca.clone(), identity: None, domain: Some("etcd.local".into()) };
        assert!(tls_options(&tls).is_ok());
        tls.identity = Some((ca.clone(), dir.path().join("missing-key.pem")));
        let e = tls_options(&tls).unwrap_err();
        assert!(e.contains("missing-key.pem"), "{e}");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn tls_credentials_reach_bare_endpoints_over_https() {
        // Nothing listens on port 1: the error shows the URL the client was built for.
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, "-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n").unwrap();
        let creds = EtcdCredentials { user: None, tls: Some(EtcdTls { ca, identity: None, domain: None }) };
        let e = match Etcd::connect(&["127.0.0.1:1".into()], Duration::from_millis(500), &creds).await {
            Ok(etcd) => etcd.error("probe", "connected lazily"),
            Err(e) => e,
        };
        assert!(e.to_string().contains("https://127.0.0.1:1"), "{e}");
        let e = match Etcd::connect(&["127.0.0.1:1".into()], Duration::from_millis(500), &EtcdCredentials::default())
            .await
        {
            Ok(etcd) => etcd.error("probe", "connected lazily"),
            Err(e) => e,
        };
        assert!(e.to_string().contains("http://127.0.0.1:1"), "{e}");
    }
}
