//! A Redis Cluster's nodes, for the merged `CHECK` calls of each node: which node serves
//! each hash slot (`CLUSTER SLOTS`, read on the shared connection), and a connection of its
//! own per node (see `direct`), on which the cross-slot form of the script runs.
//!
//! Only clusters named by plain `redis://` seeds get them (the nodes are reached with the
//! first seed's credentials); TLS clusters keep a call per hash slot on the shared
//! connection. A node's connection loads the cross-slot script when it connects: a server
//! that refuses it (before Redis 7, which has no script flags) is remembered, and its checks
//! keep a call per hash slot.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use redis::Value;
use tokio::time::Instant;

use crate::keys;
use crate::scripts::check::{cross_slot_script, EncodedCheck};
use crate::transport::direct::{Direct, Login};

/// Hash slots in a Redis Cluster.
const HASH_SLOTS: usize = 16_384;
/// A hash slot no known node serves.
const NO_NODE: u16 = u16::MAX;
/// The least time between two reads of the slot map: while a slot moves, every call that
/// meets it fails, and the map says nothing new until the move ends.
const REFRESH_EVERY: Duration = Duration::from_millis(100);

/// Where a group of a batch's checks goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    /// One call per hash slot, on the shared connection (redis-rs follows redirections).
    HashSlot(u16),
    /// The merged calls of a node, on its own connection, in the cross-slot form.
    Node(u16),
}

/// One node: its address, its connection, and whether the last map names it.
pub(crate) struct Node {
    pub(crate) direct: Arc<Direct>,
    host: String,
    port: u16,
    present: bool,
}

/// The slot map, and every node ever seen (by number: a node keeps its number across maps).
/// A node that leaves the map loses its connection (the table holds a new, unconnected one in
/// its place, made only if it comes back; the old closes once no call holds it), and has no
/// merged calls until it is back.
pub(crate) struct Nodes {
    login: Login,
    connect_timeout: Duration,
    map: RwLock<Option<Arc<SlotMap>>>,
    known: Mutex<Vec<Arc<Node>>>,
    refreshing: AtomicBool,
    last_refresh: Mutex<Option<Instant>>,
}

struct SlotMap {
    /// The number of the node serving each hash slot, or [`NO_NODE`].
    owner: Vec<u16>,
    nodes: Vec<Arc<Node>>,
}

impl Nodes {
    /// The nodes of a cluster reached with `login`; no map until the first
    /// [`refresh`](Self::start_refresh).
    pub(crate) fn new(login: Login, connect_timeout: Duration) -> Self {
        Self {
            login,
            connect_timeout,
            map: RwLock::new(None),
            known: Mutex::new(Vec::new()),
            refreshing: AtomicBool::new(false),
            last_refresh: Mutex::new(None),
        }
    }

    /// `batch`'s checks grouped by where they go, in order of first appearance: by node when
    /// the map names a node that takes the cross-slot form, else by hash slot.
    pub(crate) fn groups(&self, batch: &[EncodedCheck]) -> Vec<(Route, Vec<usize>)> {
        let map = self.map.read().unwrap_or_else(|e| e.into_inner()).clone();
        let mut groups: Vec<(Route, Vec<usize>)> = Vec::new();
        for (i, p) in batch.iter().enumerate() {
            let hash_slot = keys::digest_hash_slot(&p.digest);
            let route = match map.as_deref() {
                Some(map) => match map.owner[usize::from(hash_slot)] {
                    NO_NODE => Route::HashSlot(hash_slot),
                    node if map.nodes[usize::from(node)].direct.refuses_script() => {
                        Route::HashSlot(hash_slot)
                    }
                    node => Route::Node(node),
                },
                None => Route::HashSlot(hash_slot),
            };
            match groups.iter_mut().find(|(r, _)| *r == route) {
                Some((_, g)) => g.push(i),
                None => groups.push((route, vec![i])),
            }
        }
        groups
    }

    /// Node `number`'s connection; `None` for a node the last map does not name (its calls
    /// go by hash slot).
    pub(crate) fn node(&self, number: u16) -> Option<Arc<Direct>> {
        let known = self.known.lock().unwrap_or_else(|e| e.into_inner());
        known
            .get(usize::from(number))
            .filter(|n| n.present)
            .map(|n| Arc::clone(&n.direct))
    }

    /// Whether the map has been read.
    pub(crate) fn mapped(&self) -> bool {
        self.map.read().unwrap_or_else(|e| e.into_inner()).is_some()
    }

    /// Whether a read of the map may start now: none runs, and the last started at least
    /// [`REFRESH_EVERY`] ago. If so, the caller must read it and call
    /// [`finish_refresh`](Self::finish_refresh).
    pub(crate) fn start_refresh(&self) -> bool {
        let now = Instant::now();
        let mut last = self.last_refresh.lock().unwrap_or_else(|e| e.into_inner());
        if last.is_some_and(|at| now < at + REFRESH_EVERY) {
            return false;
        }
        if self.refreshing.swap(true, Ordering::AcqRel) {
            return false;
        }
        *last = Some(now);
        true
    }

    /// Takes the answer to `CLUSTER SLOTS` as the new map (an unreadable one keeps the old).
    pub(crate) fn finish_refresh(&self, slots: Option<&Value>) {
        if let Some(ranges) = slots.and_then(parse_slots) {
            let mut owner = vec![NO_NODE; HASH_SLOTS];
            let mut known = self.known.lock().unwrap_or_else(|e| e.into_inner());
            let mut present = vec![false; known.len()];
            for (from, to, host, port) in ranges {
                let number = match known.iter().position(|n| n.host == host && n.port == port) {
                    Some(i) => i,
                    None if known.len() < usize::from(NO_NODE) => {
                        let direct = self.connection(&host, port);
                        known.push(Arc::new(Node {
                            direct: Arc::new(direct),
                            host,
                            port,
                            present: true,
                        }));
                        present.push(true);
                        known.len() - 1
                    }
                    None => continue,
                };
                present[number] = true;
                for slot in &mut owner[from..=to] {
                    // At most `NO_NODE` nodes are numbered, so the number fits.
                    *slot = u16::try_from(number).unwrap_or(NO_NODE);
                }
            }
            for (node, present) in known.iter_mut().zip(present) {
                if node.present == present {
                    continue;
                }
                // A node that left gets a new connection in place of its own, which closes
                // once no call holds it; one that came back keeps that one.
                let direct = if present {
                    Arc::clone(&node.direct)
                } else {
                    Arc::new(self.connection(&node.host, node.port))
                };
                *node = Arc::new(Node {
                    direct,
                    host: node.host.clone(),
                    port: node.port,
                    present,
                });
            }
            let map = SlotMap {
                owner,
                nodes: known.clone(),
            };
            *self.map.write().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(map));
        }
        self.refreshing.store(false, Ordering::Release);
    }

    /// A connection to the node at `host`:`port`, made at its first call.
    fn connection(&self, host: &str, port: u16) -> Direct {
        Direct::for_node(
            host,
            port,
            &self.login,
            self.connect_timeout,
            cross_slot_script(),
        )
    }

    /// Drops every node's connection (the breaker opened): the next call connects again.
    pub(crate) fn replace(&self) {
        for node in self.known.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            node.direct.replace();
        }
    }
}

/// A read of the slot map under way: finished with its answer, or, dropped unfinished (its
/// task's runtime shut down), with none, so that the next call may read it again.
pub(crate) struct Refresh(Option<Arc<Nodes>>);

impl Refresh {
    pub(crate) fn new(nodes: Arc<Nodes>) -> Self {
        Self(Some(nodes))
    }

    /// Ends the read with `CLUSTER SLOTS`' answer, if any.
    pub(crate) fn finish(mut self, answer: Option<&Value>) {
        if let Some(nodes) = self.0.take() {
            nodes.finish_refresh(answer);
        }
    }
}

impl Drop for Refresh {
    fn drop(&mut self) {
        if let Some(nodes) = self.0.take() {
            nodes.finish_refresh(None);
        }
    }
}

/// The checks `indices` of `batch` grouped by hash slot, in order of first appearance.
pub(crate) fn hash_slot_groups(
    batch: &[EncodedCheck],
    indices: impl IntoIterator<Item = usize>,
) -> Vec<(Route, Vec<usize>)> {
    let mut groups: Vec<(Route, Vec<usize>)> = Vec::new();
    for i in indices {
        let route = Route::HashSlot(keys::digest_hash_slot(&batch[i].digest));
        match groups.iter_mut().find(|(r, _)| *r == route) {
            Some((_, g)) => g.push(i),
            None => groups.push((route, vec![i])),
        }
    }
    groups
}

/// The ranges of hash slots in a `CLUSTER SLOTS` answer, each with its master's host and
/// port; `None` if it is not one. A range whose master has no address is left out (its
/// slots keep a call per hash slot).
fn parse_slots(value: &Value) -> Option<Vec<(usize, usize, String, u16)>> {
    let Value::Array(entries) = value else {
        return None;
    };
    let mut ranges = Vec::with_capacity(entries.len());
    for entry in entries {
        let Value::Array(fields) = entry else {
            return None;
        };
        let (Some(Value::Int(from)), Some(Value::Int(to)), Some(Value::Array(master))) =
            (fields.first(), fields.get(1), fields.get(2))
        else {
            return None;
        };
        let from = usize::try_from(*from).ok().filter(|&s| s < HASH_SLOTS)?;
        let to = usize::try_from(*to)
            .ok()
            .filter(|&s| s < HASH_SLOTS && s >= from)?;
        let host = match master.first() {
            Some(Value::BulkString(b)) => String::from_utf8(b.clone()).ok()?,
            Some(Value::SimpleString(s)) => s.clone(),
            _ => return None,
        };
        let Some(Value::Int(port)) = master.get(1) else {
            return None;
        };
        let port = u16::try_from(*port).ok()?;
        if host.is_empty() || host == "?" || port == 0 {
            continue;
        }
        ranges.push((from, to, host, port));
    }
    Some(ranges)
}

/// Whether a node's `CHECK` in the cross-slot form failed without running, or before it
/// wrote anything, because a hash slot of its keys is not (or no longer wholly) the node's:
/// a redirection of its declared key, or a key the script read that the node does not serve.
/// Its checks may then be sent again, by hash slot.
pub(crate) fn slot_moved(e: &redis::RedisError) -> bool {
    use redis::{ErrorKind, ServerErrorKind};
    match e.kind() {
        ErrorKind::Server(
            ServerErrorKind::Moved | ServerErrorKind::Ask | ServerErrorKind::TryAgain,
        ) => true,
        ErrorKind::Server(ServerErrorKind::ResponseError) => {
            let text = e.to_string();
            text.contains("non local key") || text.contains("do not hash to the same slot")
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    /// A `CLUSTER SLOTS` answer: the hash slots evenly over masters at `ports`.
    fn slots_of(ports: &[i64]) -> Value {
        let share = HASH_SLOTS as i64 / ports.len() as i64;
        let ranges = ports.iter().enumerate().map(|(i, &port)| {
            let from = i as i64 * share;
            let to = if i + 1 == ports.len() {
                HASH_SLOTS as i64 - 1
            } else {
                from + share - 1
            };
            Value::Array(vec![
                Value::Int(from),
                Value::Int(to),
                Value::Array(vec![bulk("127.0.0.1"), Value::Int(port)]),
            ])
        });
        Value::Array(ranges.collect())
    }

    /// A node that leaves the map loses its connection, which the table no longer holds, and
    /// has none to lend; back, it gets a new one, under its old number.
    #[test]
    fn a_departed_node_loses_its_connection_and_a_returning_one_gets_a_new_one() {
        let nodes = Nodes::new(Login::default(), Duration::from_secs(1));
        nodes.finish_refresh(Some(&slots_of(&[7000, 7001, 7002])));
        let held = nodes.node(2).unwrap();
        assert_eq!(
            Arc::strong_count(&held),
            2,
            "the table's node and this test"
        );
        nodes.finish_refresh(Some(&slots_of(&[7000, 7001])));
        assert!(nodes.node(2).is_none());
        assert!(nodes.node(0).is_some() && nodes.node(1).is_some());
        assert_eq!(Arc::strong_count(&held), 1, "only this test holds it");
        nodes.finish_refresh(Some(&slots_of(&[7000, 7001, 7002])));
        let back = nodes.node(2).unwrap();
        assert!(!Arc::ptr_eq(&back, &held));
        assert_eq!(nodes.known.lock().unwrap().len(), 3);
    }

    #[test]
    fn the_slot_map_is_read_from_cluster_slots() {
        let answer = Value::Array(vec![
            Value::Array(vec![
                Value::Int(0),
                Value::Int(5460),
                Value::Array(vec![bulk("127.0.0.1"), Value::Int(7000), bulk("id-a")]),
                Value::Array(vec![bulk("127.0.0.1"), Value::Int(7003), bulk("id-d")]),
            ]),
            Value::Array(vec![
                Value::Int(5461),
                Value::Int(16383),
                Value::Array(vec![bulk(""), Value::Int(7001), bulk("id-b")]),
            ]),
        ]);
        let ranges = parse_slots(&answer).unwrap();
        assert_eq!(ranges, [(0, 5460, "127.0.0.1".to_owned(), 7000)]);
        assert!(parse_slots(&Value::Int(1)).is_none());
        let bad = Value::Array(vec![Value::Array(vec![
            Value::Int(10),
            Value::Int(20_000),
            Value::Array(vec![bulk("h"), Value::Int(1)]),
        ])]);
        assert!(parse_slots(&bad).is_none());
    }

    #[test]
    fn redirections_and_non_local_keys_are_moved_slots_and_nothing_else_is() {
        let moved = redis::parse_redis_value(b"-MOVED 3999 127.0.0.1:6381\r\n")
            .unwrap()
            .extract_error()
            .unwrap_err();
        assert!(slot_moved(&moved));
        let non_local = redis::parse_redis_value(
            b"-ERR Script attempted to access a non local key in a cluster node script: x\r\n",
        )
        .unwrap()
        .extract_error()
        .unwrap_err();
        assert!(slot_moved(&non_local));
        let other = redis::parse_redis_value(b"-ERR something else\r\n")
            .unwrap()
            .extract_error()
            .unwrap_err();
        assert!(!slot_moved(&other));
        let io = redis::RedisError::from((redis::ErrorKind::Io, "closed"));
        assert!(!slot_moved(&io));
    }
}
