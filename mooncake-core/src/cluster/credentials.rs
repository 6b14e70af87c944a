//! How masters, nodes and clients authenticate to etcd when it asks: a user and
//! password (etcd's own authentication), and TLS (the CA that signed etcd's
//! certificate, and a client certificate and key for mutual TLS).

use std::path::PathBuf;

use crate::error::{Error, Result};

/// The environment variable the binaries read the etcd password from (a password on
/// the command line would show in every process listing).
pub const ETCD_PASSWORD_ENV: &str = "MOONCAKE_ETCD_PASSWORD";

/// Credentials for etcd: none by default (an etcd without authentication).
#[derive(Clone, Default, PartialEq, Eq)]
pub struct EtcdCredentials {
    /// User name and password: every request carries the token etcd gives for them.
    pub user: Option<(String, String)>,
    /// TLS: endpoints are reached over `https://` and etcd's certificate is checked.
    pub tls: Option<EtcdTls>,
}

impl std::fmt::Debug for EtcdCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the password.
        f.debug_struct("EtcdCredentials")
            .field("user", &self.user.as_ref().map(|(u, _)| u))
            .field("tls", &self.tls)
            .finish()
    }
}

/// TLS to etcd: PEM files read when the client connects.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EtcdTls {
    /// The CA certificate(s) etcd's certificate must chain to. Required: this build
    /// trusts no system roots for etcd.
    pub ca: PathBuf,
    /// A client certificate and its private key, for an etcd that requires client
    /// certificates (`--client-cert-auth`).
    pub identity: Option<(PathBuf, PathBuf)>,
    /// The name etcd's certificate must carry (default: the endpoint's host).
    pub domain: Option<String>,
}

impl EtcdCredentials {
    /// Credentials from command-line flags: `user` with the password from
    /// [`ETCD_PASSWORD_ENV`], and TLS when `ca` is given (with `cert` and `key`
    /// together, or neither). An error names what is missing.
    pub fn from_flags(
        user: Option<&str>,
        ca: Option<PathBuf>,
        cert: Option<PathBuf>,
        key: Option<PathBuf>,
    ) -> Result<Self> {
        let user = match user {
            None => None,
            Some("") => return Err(Error::InvalidArgument("--etcd-user is empty".into())),
            Some(u) => match std::env::var(ETCD_PASSWORD_ENV) {
                Ok(p) if !p.is_empty() => Some((u.to_owned(), p)),
                _ => {
                    return Err(Error::InvalidArgument(format!(
                        "--etcd-user {u} needs its password in {ETCD_PASSWORD_ENV}"
                    )))
                }
            },
        };
        let identity = match (cert, key) {
            (Some(c), Some(k)) => Some((c, k)),
            (None, None) => None,
            _ => return Err(Error::InvalidArgument("--etcd-cert and --etcd-key go together".into())),
        };
        let tls = match (ca, identity) {
            (Some(ca), identity) => Some(EtcdTls { ca, identity, domain: None }),
            (None, Some(_)) => {
                return Err(Error::InvalidArgument(
                    "--etcd-cert/--etcd-key need --etcd-ca (the CA of etcd's certificate)".into(),
                ))
            }
            (None, None) => None,
        };
        Ok(Self { user, tls })
    }

    /// Whether endpoints are reached over TLS.
    pub fn uses_tls(&self) -> bool {
        self.tls.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_make_credentials_and_name_what_is_missing() {
        assert_eq!(EtcdCredentials::from_flags(None, None, None, None).unwrap(), EtcdCredentials::default());
        let tls = EtcdCredentials::from_flags(None, Some("ca.pem".into()), Some("c.pem".into()), Some("k.pem".into()))
            .unwrap()
            .tls
            .unwrap();
        assert_eq!(tls.ca, PathBuf::from("ca.pem"));
        assert_eq!(tls.identity, Some(("c.pem".into(), "k.pem".into())));
        let e = EtcdCredentials::from_flags(None, None, Some("c.pem".into()), None).unwrap_err();
        assert!(e.to_string().contains("go together"), "{e}");
        let e = EtcdCredentials::from_flags(None, None, Some("c.pem".into()), Some("k.pem".into())).unwrap_err();
        assert!(e.to_string().contains("need --etcd-ca"), "{e}");
        assert!(EtcdCredentials::from_flags(Some(""), None, None, None).is_err());
    }

    #[test]
    fn debug_never_shows_the_password() {
        let c = EtcdCredentials { user: Some(("root".into(), "hunter2".into())), tls: None };
        let d = format!("{c:?}");
        assert!(d.contains("root") && !d.contains("hunter2"), "{d}");
    }
}
