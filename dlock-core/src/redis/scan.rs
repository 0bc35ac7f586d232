//! One page of a `SCAN` over every master: the keys an operator lists
//! (`Locker::list`), never `KEYS`, which blocks the server while it walks
//! the whole keyspace. On a cluster each master is scanned in turn, its
//! address in the cursor, so a page resumes on the master it stopped on
//! (or the next one, when that master left).

use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};

use super::connection::Conn;
use super::Client;
use crate::error::{Error, Result};

/// `SCAN` calls one page may make before it returns what it found, so that
/// a sparse match over a large keyspace still answers promptly (with fewer
/// keys and a cursor).
const CALLS_PER_PAGE: usize = 32;

/// The text as a `SCAN MATCH` glob that matches it literally, then anything.
pub(crate) fn starts_with_glob(text: &str) -> String {
    let mut glob = String::with_capacity(text.len() + 4);
    for c in text.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            glob.push('\\');
        }
        glob.push(c);
    }
    glob.push('*');
    glob
}

impl Client {
    /// Keys matching `pattern` from where `cursor` (this function's own,
    /// `None` first) left off, about `limit` of them, and the cursor of the
    /// next page (`None` at the end). A key may come twice (`SCAN`'s own
    /// promise), never a key present throughout is missed.
    pub(crate) async fn scan_page(
        &self,
        pattern: &str,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<(Vec<String>, Option<String>)> {
        let bad = |c: &str| Error::invalid_argument("cursor", format!("`{c}` is not a cursor of this listing"));
        match self.conn() {
            Conn::Cluster(cluster) => {
                let masters = self.masters().await?;
                let (mut at, mut position) = match cursor {
                    None => (0, 0u64),
                    Some(c) => {
                        let (addr, pos) = c.rsplit_once('/').ok_or_else(|| bad(c))?;
                        let pos = pos.parse().map_err(|_| bad(c))?;
                        // That master, or the next in order if it left.
                        match masters.iter().position(|m| m.as_str() >= addr) {
                            Some(i) if masters[i] == addr => (i, pos),
                            Some(i) => (i, 0),
                            None => return Ok((Vec::new(), None)),
                        }
                    }
                };
                let mut keys = Vec::new();
                for _ in 0..CALLS_PER_PAGE {
                    let Some(master) = masters.get(at) else { return Ok((keys, None)) };
                    let (host, port) = master.rsplit_once(':').ok_or_else(|| bad(master))?;
                    let port = port.parse().map_err(|_| bad(master))?;
                    let route =
                        RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress { host: host.to_owned(), port });
                    let value = cluster
                        .clone()
                        .route_command(scan(pattern, position, limit), route)
                        .await
                        .map_err(|e| self.failed(e))?;
                    let (next, found): (u64, Vec<String>) =
                        redis::from_redis_value(value).map_err(|e| self.failed(e.into()))?;
                    keys.extend(found);
                    if next == 0 {
                        (at, position) = (at + 1, 0);
                    } else {
                        position = next;
                    }
                    if keys.len() >= limit {
                        break;
                    }
                }
                let more = masters.get(at).map(|m| format!("{m}/{position}"));
                Ok((keys, more))
            }
            _ => {
                let mut position: u64 = match cursor {
                    None => 0,
                    Some(c) => c.parse().map_err(|_| bad(c))?,
                };
                let mut keys = Vec::new();
                for _ in 0..CALLS_PER_PAGE {
                    let (next, found): (u64, Vec<String>) = self.query(&scan(pattern, position, limit)).await?;
                    keys.extend(found);
                    position = next;
                    if next == 0 {
                        return Ok((keys, None));
                    }
                    if keys.len() >= limit {
                        break;
                    }
                }
                Ok((keys, Some(position.to_string())))
            }
        }
    }

    /// The cluster's masters' `host:port`, in order, from `CLUSTER NODES`
    /// (those not marked failed).
    async fn masters(&self) -> Result<Vec<String>> {
        let nodes: String = self.query(redis::cmd("CLUSTER").arg("NODES")).await?;
        let mut masters: Vec<String> = nodes
            .lines()
            .filter_map(|line| {
                let fields: Vec<&str> = line.split_whitespace().collect();
                let flags = fields.get(2)?;
                let master = flags.split(',').any(|f| f == "master") && !flags.contains("fail");
                // `host:port@cport[,hostname]`
                let addr = fields.get(1)?.split(['@', ',']).next()?;
                (master && !addr.starts_with(':')).then(|| addr.to_owned())
            })
            .collect();
        masters.sort_unstable();
        masters.dedup();
        Ok(masters)
    }
}

fn scan(pattern: &str, cursor: u64, count: usize) -> redis::Cmd {
    let mut cmd = redis::cmd("SCAN");
    cmd.arg(cursor).arg("MATCH").arg(pattern).arg("COUNT").arg(count);
    cmd
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_glob_matches_its_text_literally() {
        assert_eq!(starts_with_glob("dlock:{a*b?[c]\\"), "dlock:{a\\*b\\?\\[c\\]\\\\*");
    }
}
