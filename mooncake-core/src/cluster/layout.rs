//! Where a cluster's coordination state lives in etcd, and the values stored there.
//!
//! Everything sits under `/mooncake/<cluster>/`:
//!
//! | key | value | lease |
//! |---|---|---|
//! | `config` | `{"groups":G}`, created once by the first member | none |
//! | `masters/<member-id>` | `{"addr":"...","led":n}` | the member's |
//! | `assign/<g>` | the member id the scheduler gave group `g` to | none |
//! | `leaders/<g>` | `{"master":"<id>","addr":"..."}`; its create revision is the epoch | the leader's |
//! | `scheduler` | the id of the member that runs the scheduler | the scheduler's |

use serde::{Deserialize, Serialize};

/// The keys of one cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    prefix: String,
}

/// A key of the cluster, parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum ClusterKey {
    /// `config`
    Config,
    /// `masters/<id>`
    Master(String),
    /// `assign/<g>`
    Assign(u32),
    /// `leaders/<g>`
    Leader(u32),
    /// `scheduler`
    Scheduler,
}

impl Layout {
    /// The layout of cluster `name` (a name already checked to be key-safe).
    pub(crate) fn new(name: &str) -> Layout {
        Layout { prefix: format!("/mooncake/{name}/") }
    }

    /// The prefix every key of the cluster starts with.
    pub(crate) fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The cluster's configuration key.
    pub(crate) fn config(&self) -> String {
        format!("{}config", self.prefix)
    }

    /// A member's registration key.
    pub(crate) fn master(&self, id: &str) -> String {
        format!("{}masters/{id}", self.prefix)
    }

    /// The scheduler's assignment of group `g`.
    pub(crate) fn assign(&self, g: u32) -> String {
        format!("{}assign/{g}", self.prefix)
    }

    /// The leadership key of group `g`.
    pub(crate) fn leader(&self, g: u32) -> String {
        format!("{}leaders/{g}", self.prefix)
    }

    /// The scheduler election key.
    pub(crate) fn scheduler(&self) -> String {
        format!("{}scheduler", self.prefix)
    }

    /// Parses a key of this cluster; `None` for keys outside it or unknown ones (left
    /// alone, so a newer version may add keys).
    pub(crate) fn parse(&self, key: &[u8]) -> Option<ClusterKey> {
        let rest = std::str::from_utf8(key).ok()?.strip_prefix(self.prefix.as_str())?;
        match rest {
            "config" => return Some(ClusterKey::Config),
            "scheduler" => return Some(ClusterKey::Scheduler),
            _ => {}
        }
        let (dir, name) = rest.split_once('/')?;
        match dir {
            "masters" if !name.is_empty() && !name.contains('/') => Some(ClusterKey::Master(name.to_string())),
            "assign" => parse_group(name).map(ClusterKey::Assign),
            "leaders" => parse_group(name).map(ClusterKey::Leader),
            _ => None,
        }
    }
}

/// A group number in canonical decimal (no sign, no leading zero).
fn parse_group(s: &str) -> Option<u32> {
    let g: u32 = s.parse().ok()?;
    (g.to_string() == s).then_some(g)
}

/// The value of `config`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ConfigValue {
    /// Slot groups of the cluster.
    pub groups: u32,
}

#[cfg(any(feature = "etcd", feature = "fuzzing"))]
impl Layout {
    /// The slot group count the value of `config` sets: an error names the key and
    /// says what is wrong (not JSON of a config, or a count out of range).
    pub(crate) fn config_groups(&self, value: &[u8]) -> crate::error::Result<u32> {
        let config: ConfigValue = serde_json::from_slice(value).map_err(|e| {
            crate::error::Error::Coordination(format!("malformed cluster config {}: {e}", self.config()))
        })?;
        super::slots::validate_groups(config.groups)
            .map_err(|e| crate::error::Error::Coordination(format!("cluster config {}: {e}", self.config())))?;
        Ok(config.groups)
    }
}

/// The value of `masters/<id>`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct MasterValue {
    /// The master's RPC address.
    pub addr: String,
    /// Groups it leads (informational; the scheduler counts `leaders/` itself).
    #[serde(default)]
    pub led: u32,
}

/// The value of `leaders/<g>`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct LeaderValue {
    /// The leader's member id.
    pub master: String,
    /// The leader's RPC address.
    pub addr: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_through_parse() {
        let l = Layout::new("c1");
        assert_eq!(l.prefix(), "/mooncake/c1/");
        assert_eq!(l.config(), "/mooncake/c1/config");
        assert_eq!(l.parse(l.config().as_bytes()), Some(ClusterKey::Config));
        assert_eq!(l.parse(l.scheduler().as_bytes()), Some(ClusterKey::Scheduler));
        assert_eq!(l.parse(l.master("ab12").as_bytes()), Some(ClusterKey::Master("ab12".into())));
        assert_eq!(l.parse(l.assign(7).as_bytes()), Some(ClusterKey::Assign(7)));
        assert_eq!(l.parse(l.leader(1023).as_bytes()), Some(ClusterKey::Leader(1023)));
        for foreign in [
            "/mooncake/c2/config",
            "/mooncake/c1/leaders/07",
            "/mooncake/c1/leaders/-1",
            "/mooncake/c1/leaders/",
            "/mooncake/c1/leaders/x",
            "/mooncake/c1/masters/",
            "/mooncake/c1/masters/a/b",
            "/mooncake/c1/other/1",
            "/mooncake/c1/configx",
        ] {
            assert_eq!(l.parse(foreign.as_bytes()), None, "{foreign}");
        }
        assert_eq!(l.parse(&[0xff, 0xfe]), None);
    }

    #[test]
    fn values_are_the_documented_json() {
        assert_eq!(serde_json::to_string(&ConfigValue { groups: 16 }).unwrap(), r#"{"groups":16}"#);
        let m: MasterValue = serde_json::from_str(r#"{"addr":"h:1"}"#).unwrap();
        assert_eq!(m, MasterValue { addr: "h:1".into(), led: 0 });
        let v = LeaderValue { master: "ab".into(), addr: "h:1".into() };
        assert_eq!(serde_json::to_string(&v).unwrap(), r#"{"master":"ab","addr":"h:1"}"#);
    }
}
