//! The cluster address clients and nodes are given instead of one master's:
//! `etcd://H:P[,H:P...]/NAME`.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

const SCHEME: &str = "etcd://";

/// Longest cluster name.
pub const MAX_CLUSTER_NAME: usize = 64;

/// Where a cluster's coordination lives: etcd endpoints and the cluster's name, parsed
/// from `etcd://H:P[,H:P...]/NAME`.
///
/// ```
/// use mooncake_core::cluster::EtcdAddress;
/// let a: EtcdAddress = "etcd://10.0.0.1:2379,10.0.0.2:2379/prod".parse()?;
/// assert_eq!(a.endpoints, ["10.0.0.1:2379", "10.0.0.2:2379"]);
/// assert_eq!(a.cluster, "prod");
/// assert!(EtcdAddress::is_etcd("etcd://h:1/x") && !EtcdAddress::is_etcd("127.0.0.1:50051"));
/// # Ok::<(), mooncake_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EtcdAddress {
    /// etcd client endpoints, each `host:port` (an IPv6 host in brackets).
    pub endpoints: Vec<String>,
    /// The cluster's name: `[A-Za-z0-9_.-]{1,64}`.
    pub cluster: String,
}

impl EtcdAddress {
    /// Whether `s` names a cluster (starts with `etcd://`) rather than one master.
    pub fn is_etcd(s: &str) -> bool {
        s.starts_with(SCHEME)
    }

    /// The endpoints as URLs for an etcd client (`http://host:port`).
    pub fn urls(&self) -> Vec<String> {
        self.endpoints.iter().map(|e| format!("http://{e}")).collect()
    }
}

/// Checks a cluster name: 1 to 64 of `[A-Za-z0-9_.-]`, so it is safe as an etcd key
/// component.
pub fn validate_cluster_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= MAX_CLUSTER_NAME
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
    if !ok {
        return Err(Error::InvalidArgument(format!(
            "cluster name {name:?}: must be 1 to {MAX_CLUSTER_NAME} of A-Z a-z 0-9 _ . -"
        )));
    }
    Ok(())
}

/// Checks one `host:port` endpoint (`[v6]:port` for IPv6) and returns it as given.
pub fn validate_endpoint(endpoint: &str) -> Result<()> {
    let bad = |why: &str| Error::InvalidArgument(format!("etcd endpoint {endpoint:?}: {why}"));
    let (host, port) = if let Some(rest) = endpoint.strip_prefix('[') {
        let (host, port) = rest.split_once("]:").ok_or_else(|| bad("expected [ipv6]:port"))?;
        if host.parse::<std::net::Ipv6Addr>().is_err() {
            return Err(bad("not an IPv6 address between the brackets"));
        }
        (host, port)
    } else {
        endpoint.rsplit_once(':').ok_or_else(|| bad("expected host:port"))?
    };
    if host.is_empty() {
        return Err(bad("empty host"));
    }
    if !endpoint.starts_with('[') && !host.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'))
    {
        return Err(bad("the host may hold only letters, digits, '.', '-' and '_'"));
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 && port.bytes().all(|b| b.is_ascii_digit()) => Ok(()),
        _ => Err(bad("the port must be a number in 1..=65535")),
    }
}

impl FromStr for EtcdAddress {
    type Err = Error;

    fn from_str(s: &str) -> Result<EtcdAddress> {
        let bad = |why: String| Error::InvalidArgument(format!("cluster address {s:?}: {why}"));
        let rest = s.strip_prefix(SCHEME).ok_or_else(|| bad(format!("expected {SCHEME}H:P[,H:P...]/NAME")))?;
        let (hosts, cluster) =
            rest.split_once('/').ok_or_else(|| bad("missing /NAME after the endpoints".to_string()))?;
        if hosts.is_empty() {
            return Err(bad("no etcd endpoint".to_string()));
        }
        let endpoints: Vec<String> = hosts.split(',').map(str::to_string).collect();
        for e in &endpoints {
            validate_endpoint(e).map_err(|e| bad(e.to_string()))?;
        }
        validate_cluster_name(cluster).map_err(|e| bad(e.to_string()))?;
        Ok(EtcdAddress { endpoints, cluster: cluster.to_string() })
    }
}

impl fmt::Display for EtcdAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{SCHEME}{}/{}", self.endpoints.join(","), self.cluster)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn parses_good_addresses() {
        let a: EtcdAddress = "etcd://127.0.0.1:2379/c".parse().unwrap();
        assert_eq!(a, EtcdAddress { endpoints: vec!["127.0.0.1:2379".into()], cluster: "c".into() });
        assert_eq!(a.urls(), ["http://127.0.0.1:2379"]);
        let a: EtcdAddress = "etcd://etcd-0.svc:2379,[::1]:2380,h_1:1/my.cluster-2_x".parse().unwrap();
        assert_eq!(a.endpoints, ["etcd-0.svc:2379", "[::1]:2380", "h_1:1"]);
        assert_eq!(a.cluster, "my.cluster-2_x");
        assert_eq!(a.to_string(), "etcd://etcd-0.svc:2379,[::1]:2380,h_1:1/my.cluster-2_x");
        let long = "x".repeat(64);
        assert!(format!("etcd://h:1/{long}").parse::<EtcdAddress>().is_ok());
    }

    #[test]
    fn refuses_bad_addresses_with_a_reason() {
        let cases = [
            ("127.0.0.1:2379/c", "expected etcd://"),
            ("http://h:1/c", "expected etcd://"),
            ("etcd://h:1", "missing /NAME"),
            ("etcd:///c", "no etcd endpoint"),
            ("etcd://h:1/", "cluster name"),
            ("etcd://h:1/a/b", "cluster name"),
            ("etcd://h:1/a b", "cluster name"),
            ("etcd://h:1/a:b", "cluster name"),
            ("etcd://h/c", "expected host:port"),
            ("etcd://h:/c", "port"),
            ("etcd://h:0/c", "port"),
            ("etcd://h:65536/c", "port"),
            ("etcd://h:+1/c", "port"),
            ("etcd://:1/c", "empty host"),
            ("etcd://h:1,,g:2/c", "expected host:port"),
            ("etcd://h:1,/c", "expected host:port"),
            ("etcd://[::1/c", "ipv6"),
            ("etcd://[zz]:1/c", "IPv6"),
            ("etcd://h h:1/c", "host may hold"),
        ];
        for (input, why) in cases {
            match input.parse::<EtcdAddress>() {
                Err(Error::InvalidArgument(m)) => assert!(m.contains(why), "{input}: {m}"),
                other => panic!("{input}: {other:?}"),
            }
        }
        let long = "x".repeat(65);
        assert!(format!("etcd://h:1/{long}").parse::<EtcdAddress>().is_err());
    }

    proptest! {
        #[test]
        fn display_round_trips(
            hosts in proptest::collection::vec(("[a-z0-9.-]{1,12}", 1u16..), 1..4),
            name in "[A-Za-z0-9_.-]{1,64}",
        ) {
            let a = EtcdAddress {
                endpoints: hosts.iter().map(|(h, p)| format!("{h}:{p}")).collect(),
                cluster: name,
            };
            prop_assert_eq!(a.to_string().parse::<EtcdAddress>().unwrap(), a);
        }

        #[test]
        fn whatever_parses_round_trips(s in "[a-z0-9:,/\\[\\]. _-]{0,40}") {
            // Any input is an address or a typed error, never a panic; an address
            // prints back to itself.
            match format!("etcd://{s}").parse::<EtcdAddress>() {
                Ok(a) => prop_assert_eq!(a.to_string().parse::<EtcdAddress>().unwrap(), a),
                Err(e) => prop_assert!(matches!(e, Error::InvalidArgument(_))),
            }
        }
    }
}
