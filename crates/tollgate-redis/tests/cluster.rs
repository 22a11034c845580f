//! The backend against a real Redis Cluster on loopback: exact counts, keys spread over the
//! nodes, and stacked limits in several slots refunded when one refuses.

#![allow(clippy::unwrap_used)]

mod support;

use std::collections::HashSet;
use std::time::Duration;

use support::{admitted, check, check_at, concurrent_admissions, fixed, gcra, sliding};
use tollgate_engine::{Admin, Backend, Check, Limit, Quota, Slots, Status};
use tollgate_testsupport::redis;
use tollgate_testsupport::{until, RedisCluster};

const MIDNIGHT: u64 = 1_728_000_000_000_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_checks_on_two_backends_admit_exactly_the_limit() {
    let cluster = RedisCluster::start(3);
    let backends = [
        support::cluster(cluster.urls()).build().unwrap(),
        support::cluster(cluster.urls()).build().unwrap(),
    ];
    assert!(backends[0].is_cluster());
    let limit = gcra("ten", 10);
    assert_eq!(concurrent_admissions(&backends, &limit, 100).await, 10);
}

#[tokio::test]
async fn keys_of_different_identities_land_on_several_nodes() {
    let cluster = RedisCluster::start(3);
    let backend = support::cluster(cluster.urls()).build().unwrap();
    let limit = gcra("per-ip", 10);
    let mut nodes = HashSet::new();
    for i in 0..20 {
        let ip = format!("198.51.100.{i}");
        assert!(admitted(&backend, &[&limit], ip.as_bytes()).await);
        nodes.insert(cluster.node_of_key(&backend.key_for(&limit, ip.as_bytes())));
    }
    assert!(nodes.len() >= 2, "{nodes:?}");
    let holding = cluster.nodes().iter().filter(|n| n.dbsize() > 0).count();
    assert!(holding >= 2);
    assert_eq!(cluster.dbsize(), 20);
    assert!(backend.ping().await.is_ok());
}

#[tokio::test]
async fn stacked_limits_in_several_slots_are_all_or_nothing() {
    let cluster = RedisCluster::start(3);
    let backend = support::cluster(cluster.urls())
        .deny_cache_capacity(0)
        .build()
        .unwrap();
    let burst = gcra("burst", 2);
    let daily = fixed("daily", Quota::per_day(100).unwrap());
    let key = b"abuser";
    // The two keys sit in different slots: the batch takes two calls and the refund path.
    assert_ne!(
        cluster.slot_of_key(&backend.key_for(&burst, key)),
        cluster.slot_of_key(&backend.key_for(&daily, key))
    );
    let mut last = None;
    for _ in 0..50 {
        last = Some(check(&backend, &[&burst, &daily], key).await);
    }
    let last = last.unwrap();
    assert!(matches!(last[0].status, Status::Denied { .. }));
    assert_eq!((last[1].status, last[1].remaining), (Status::Allowed, 98));
}

/// The state of every key of the cluster, to compare before and after. A sliding log's
/// sequence counter (`:seq`) only makes members unique and is never given back.
fn dump_all(cluster: &RedisCluster) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for node in cluster.nodes() {
        let mut con = node.client();
        let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut con).unwrap();
        for k in keys.into_iter().filter(|k| !k.ends_with(":seq")) {
            let d: Vec<u8> = redis::cmd("DUMP").arg(&k).query(&mut con).unwrap();
            out.push((k, d));
        }
    }
    out.sort();
    out
}

#[tokio::test]
async fn a_refund_undoes_exactly_what_was_written() {
    let cluster = RedisCluster::start(3);
    let backend = support::cluster(cluster.urls()).build().unwrap();
    let g = gcra("g", 10);
    let f = fixed("f", Quota::per_minute(10).unwrap());
    let s = sliding("s", Quota::per_minute(10).unwrap());
    let blocker = gcra("blocker", 1);
    let key = b"alice";
    let now = MIDNIGHT + 1_000_000;
    let slots: HashSet<u16> = [backend.key_for(&g, key), backend.key_for(&blocker, key)]
        .iter()
        .map(|k| cluster.slot_of_key(k))
        .collect();
    assert_eq!(slots.len(), 2);

    assert!(check_at(&backend, &[&blocker], key, now).await[0].is_allowed());
    assert!(check_at(&backend, &[&g, &f, &s], key, now).await[0].is_allowed());
    let before = dump_all(&cluster);

    // Refused by the blocker after g, f and s consumed in their own slots: all refunded.
    for i in 1..=5 {
        let v = check_at(&backend, &[&g, &f, &s, &blocker], key, now + i).await;
        assert!(matches!(v[3].status, Status::Denied { .. }));
        for verdict in &v[..3] {
            assert_eq!((verdict.status, verdict.remaining), (Status::Allowed, 9));
        }
        assert_eq!(dump_all(&cluster), before, "after refused batch {i}");
    }

    // The units are really back: the next admitted batch leaves 8 of each.
    let v = check_at(&backend, &[&g, &f, &s], key, now + 10).await;
    for verdict in &v[..] {
        assert_eq!((verdict.status, verdict.remaining), (Status::Allowed, 8));
    }
}

#[tokio::test]
async fn a_fresh_gcra_key_refunded_is_gone() {
    let cluster = RedisCluster::start(3);
    let backend = support::cluster(cluster.urls()).build().unwrap();
    let g = gcra("g", 10);
    let blocker = gcra("blocker", 1);
    let now = MIDNIGHT;
    let key = b"bob";
    assert!(check_at(&backend, &[&blocker], key, now).await[0].is_allowed());
    let keys_before = cluster.dbsize();
    let v = check_at(&backend, &[&g, &blocker], key, now).await;
    assert_eq!(
        (v[0].status, v[0].remaining, v[0].reset),
        (Status::Allowed, 10, 0)
    );
    assert_eq!(cluster.dbsize(), keys_before);
}

/// A key whose `a` and `b` limits live on two different nodes.
fn key_on_two_nodes(
    cluster: &RedisCluster,
    backend: &tollgate_redis::RedisBackend,
    a: &Limit,
    b: &Limit,
) -> Vec<u8> {
    (0..1000)
        .map(|i| format!("user-{i}").into_bytes())
        .find(|k| {
            let node = |l| cluster.node_of_key(&backend.key_for(l, k));
            node(a) != node(b)
        })
        .unwrap()
}

/// Holds the writes (and so the scripts) sent to one node until `unpause`.
fn pause_writes(cluster: &RedisCluster, node: usize) {
    let mut c = cluster.nodes()[node].client();
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(30_000)
        .arg("WRITE")
        .query(&mut c)
        .unwrap();
}

fn unpause(cluster: &RedisCluster, node: usize) {
    let mut c = cluster.nodes()[node].client();
    let _: () = redis::cmd("CLIENT").arg("UNPAUSE").query(&mut c).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denial_seen_while_a_refund_was_pending_ends_with_the_refund() {
    let cluster = RedisCluster::start(3);
    let backend = support::cluster(cluster.urls()).build().unwrap();
    let daily = fixed("daily", Quota::per_day(1).unwrap());
    let blocker = gcra("blocker", 1);
    let key = key_on_two_nodes(&cluster, &backend, &daily, &blocker);
    let blocker_node = cluster.node_of_key(&backend.key_for(&blocker, &key));
    let daily_node = cluster.node_of_key(&backend.key_for(&daily, &key));

    // Another replica, without a deny cache, uses the blocker's one unit (and loads the
    // scripts on every node while none is paused).
    let other = support::cluster(cluster.urls())
        .deny_cache_capacity(0)
        .build()
        .unwrap();
    assert!(check(&other, &[&blocker], &key).await[0].is_allowed());
    let warm = check(&other, &[&daily, &blocker], &key).await;
    assert!(matches!(warm[1].status, Status::Denied { .. }));

    // The blocker's node is slow: [daily, blocker] takes daily's only unit and waits for the
    // blocker's refusal before it refunds it.
    pause_writes(&cluster, blocker_node);
    let first = {
        let (backend, daily, blocker, key) =
            (backend.clone(), daily.clone(), blocker.clone(), key.clone());
        tokio::spawn(async move { check(&backend, &[&daily, &blocker], &key).await })
    };
    let daily_keys = || -> Vec<String> {
        let mut c = cluster.nodes()[daily_node].client();
        redis::cmd("KEYS").arg("*:daily:*").query(&mut c).unwrap()
    };
    let waiting = std::time::Instant::now();
    while daily_keys().is_empty() {
        assert!(
            waiting.elapsed() < Duration::from_secs(10),
            "the unit was never taken"
        );
        tokio::task::yield_now().await;
    }
    // Meanwhile Redis refuses another request of the identity, and this replica caches that.
    let during = check(&backend, &[&daily], &key).await;
    assert!(
        matches!(during[0].status, Status::Denied { .. }),
        "{during:?}"
    );

    // The blocker refuses; daily's unit is given back ...
    unpause(&cluster, blocker_node);
    let first = first.await.unwrap();
    assert!(matches!(first[1].status, Status::Denied { .. }));
    assert!(daily_keys().is_empty());
    // ... and the denial cached meanwhile went with it: the next request takes the unit.
    let after = backend.check(&[Check::new(&daily, &key)]).await.unwrap();
    assert_eq!((after[0].status, after[0].remaining), (Status::Allowed, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_shadow_group_leaves_the_enforced_answers_standing() {
    let cluster = RedisCluster::start(3);
    let backend = support::cluster(cluster.urls())
        .deadline(Duration::from_secs(2))
        .deny_cache_capacity(0)
        .build()
        .unwrap();
    let enforced = gcra("per-ip", 1);
    let observed = gcra("observe", 1000).shadow();
    let key = key_on_two_nodes(&cluster, &backend, &enforced, &observed);
    let shadow_node = cluster.node_of_key(&backend.key_for(&observed, &key));

    let both = || [Check::new(&enforced, &key), Check::new(&observed, &key)];
    let first = backend.check(&both()).await.unwrap();
    assert!(first.iter().all(|v| v.is_allowed()), "{first:?}");

    // The shadow limit's node stops answering: the enforced limit's refusal still stands,
    // and the shadow check is reported not checked.
    pause_writes(&cluster, shadow_node);
    let during = backend.check(&both()).await;
    unpause(&cluster, shadow_node);
    let during = during.unwrap();
    assert!(
        matches!(during[0].status, Status::Denied { .. }),
        "{during:?}"
    );
    assert_eq!(during[1].status, Status::NotChecked);
}

/// A leased key's units taken by a group that another group's refusal undoes are given back
/// only while its TAT is the one the take left: a check of the key in between (another
/// replica's) keeps them counted, since other replicas' slices are paced by TATs that count
/// them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leased_keys_refund_applies_only_while_its_tat_is_unmoved() {
    let cluster = RedisCluster::start(3);
    let backend = support::cluster(cluster.urls())
        .deny_cache_capacity(0)
        .build()
        .unwrap();
    let hot = gcra("hot", 100)
        .with_lease(tollgate_engine::Lease::new(10).unwrap())
        .unwrap();
    let blocker = gcra("blocker", 1);
    let key = key_on_two_nodes(&cluster, &backend, &hot, &blocker);
    let blocker_node = cluster.node_of_key(&backend.key_for(&blocker, &key));
    let other = support::cluster(cluster.urls())
        .deny_cache_capacity(0)
        .build()
        .unwrap();
    // The blocker's one unit is used, and the scripts are loaded everywhere.
    assert!(check(&other, &[&blocker], &key).await[0].is_allowed());
    let plain = gcra("hot", 100);
    assert!(check(&other, &[&plain], &key).await[0].is_allowed());

    // [hot, blocker]: hot takes its unit and a slice, then waits for the blocker's refusal.
    pause_writes(&cluster, blocker_node);
    let first = {
        let (backend, hot, blocker, key) =
            (backend.clone(), hot.clone(), blocker.clone(), key.clone());
        tokio::spawn(async move { check(&backend, &[&hot, &blocker], &key).await })
    };
    // Meanwhile another replica checks the key in Redis (unleased): its TAT moves on.
    let mut seen = u64::MAX;
    let waiting = std::time::Instant::now();
    while seen > 90 {
        assert!(waiting.elapsed() < Duration::from_secs(10), "no take");
        seen = other
            .peek(&Check::new(&plain, &key))
            .await
            .unwrap()
            .remaining;
        tokio::task::yield_now().await;
    }
    assert!(check(&other, &[&plain], &key).await[0].is_allowed());
    let before = other
        .peek(&Check::new(&plain, &key))
        .await
        .unwrap()
        .remaining;
    unpause(&cluster, blocker_node);
    let first = first.await.unwrap();
    assert!(matches!(first[1].status, Status::Denied { .. }));
    // The refund found another TAT and did not apply: the units stay counted.
    let after = other
        .peek(&Check::new(&plain, &key))
        .await
        .unwrap()
        .remaining;
    assert_eq!(after, before);
}

/// A leased key's units taken by a group that another group's refusal undoes come back when
/// nothing checked the key in between: the refund requires the TAT the take left, which it
/// still is (though the key's TAT was in the future before the take).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leased_keys_refund_applies_while_its_tat_is_unmoved() {
    let cluster = RedisCluster::start(3);
    let backend = support::cluster(cluster.urls())
        .deny_cache_capacity(0)
        .build()
        .unwrap();
    // One unit every 36 s: the bucket does not refill while the test runs.
    let plain = Limit::gcra("hot", Quota::per_hour(100).unwrap()).unwrap();
    let hot = plain
        .clone()
        .with_lease(tollgate_engine::Lease::new(10).unwrap())
        .unwrap();
    let blocker = gcra("blocker", 1);
    let key = key_on_two_nodes(&cluster, &backend, &hot, &blocker);
    let other = support::cluster(cluster.urls())
        .deny_cache_capacity(0)
        .build()
        .unwrap();
    // The blocker's one unit is used, and the key's TAT is ahead of now.
    assert!(check(&other, &[&blocker], &key).await[0].is_allowed());
    assert!(check(&other, &[&plain], &key).await[0].is_allowed());
    let remaining = |b: &tollgate_redis::RedisBackend| {
        let (b, plain, key) = (b.clone(), plain.clone(), key.clone());
        async move { b.peek(&Check::new(&plain, &key)).await.unwrap().remaining }
    };
    assert_eq!(remaining(&other).await, 99);
    // [hot, blocker]: hot's group takes its unit and a slice, the blocker refuses, and hot's
    // group is refunded.
    let refused = check(&backend, &[&hot, &blocker], &key).await;
    assert!(matches!(refused[1].status, Status::Denied { .. }));
    assert_eq!(backend.leased_units(), 0);
    assert_eq!(remaining(&other).await, 99);
}

/// A shadow concurrency limit whose group answers too late is reported not checked, so the
/// request will not give its slot back: the backend does, once the late call has answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_shadow_groups_slot_is_given_back() {
    let cluster = RedisCluster::start(3);
    let backend = support::cluster(cluster.urls())
        .deadline(Duration::from_secs(2))
        .deny_cache_capacity(0)
        .build()
        .unwrap();
    let enforced = gcra("per-ip", 100);
    let observed = Limit::concurrency("observe-in-flight", 10)
        .unwrap()
        .shadow();
    let key = key_on_two_nodes(&cluster, &backend, &enforced, &observed);
    let slots_key = backend.key_for(&observed, &key);
    let shadow_node = cluster.node_of_key(&slots_key);
    let both = || {
        [
            Check::new(&enforced, &key),
            Check::new(&observed, &key).with_slot(42),
        ]
    };
    // Connected and the scripts loaded on both nodes first.
    let first = backend.check(&both()).await.unwrap();
    assert!(first.iter().all(|v| v.is_allowed()), "{first:?}");
    backend.release(&both()[1..]);
    let held = || -> u64 {
        let mut c = cluster.nodes()[shadow_node].client();
        redis::cmd("ZCARD").arg(&slots_key).query(&mut c).unwrap()
    };
    assert_eq!(until(0, held).await, 0);

    pause_writes(&cluster, shadow_node);
    let during = backend.check(&both()).await.unwrap();
    assert!(during[0].is_allowed(), "{during:?}");
    assert_eq!(during[1].status, Status::NotChecked);
    unpause(&cluster, shadow_node);
    // The late call takes the slot when the node resumes; the backend gives it back.
    assert_eq!(until(0, held).await, 0);
}

/// Script calls (`EVALSHA`) the masters ran since their statistics were last reset.
fn script_calls(cluster: &RedisCluster) -> u64 {
    cluster.nodes().iter().map(|n| n.calls("evalsha")).sum()
}

fn reset_stats(cluster: &RedisCluster) {
    for node in cluster.nodes() {
        node.reset_stats();
    }
}

/// Checks `limits` for `key` `n` times at once: every check is made and first polled before
/// any of them is answered. Returns how many were admitted.
async fn admitted_at_once(
    backend: &tollgate_redis::RedisBackend,
    limits: &[&Limit],
    key: &[u8],
    n: usize,
) -> usize {
    let checks: Vec<Check<'_>> = limits.iter().map(|l| Check::new(l, key)).collect();
    let answers = futures_util::future::join_all((0..n).map(|_| backend.check(&checks))).await;
    answers
        .into_iter()
        .filter(|v| v.as_ref().unwrap().iter().all(|v| v.is_allowed()))
        .count()
}

// Current-thread: the 100 checks are all queued before the task that sends the slot's calls
// runs, so the figures are exact.
#[tokio::test]
async fn concurrent_requests_for_one_slot_share_calls_and_admit_exactly_the_limit() {
    let cluster = RedisCluster::start(3);
    let backend = support::cluster(cluster.urls()).build().unwrap();
    let limit = gcra("hot", 10);
    // One request first, which loads the script on the key's node.
    assert!(admitted(&backend, &[&limit], b"tenant").await);
    reset_stats(&cluster);

    assert_eq!(
        admitted_at_once(&backend, &[&limit], b"tenant", 100).await,
        9
    );
    // 100 requests in 2 calls: 64 (the most one call carries), then the 36 that waited. A
    // call per request would be 100.
    assert_eq!(script_calls(&cluster), 2);
}

#[tokio::test]
async fn merged_requests_in_several_slots_stay_all_or_nothing() {
    let cluster = RedisCluster::start(3);
    let backend = support::cluster(cluster.urls())
        .deny_cache_capacity(0)
        .build()
        .unwrap();
    let burst = gcra("burst", 10);
    let daily = fixed("daily", Quota::per_day(100).unwrap());
    let node = |limit: &Limit, key: &[u8]| cluster.node_of_key(&backend.key_for(limit, key));
    // A key whose two limits' slots are on one node, and one whose are on two.
    let key_on = |same: bool| {
        (0..1000)
            .map(|i| format!("tenant-{i}").into_bytes())
            .find(|k| {
                let (b, d) = (&backend.key_for(&burst, k), &backend.key_for(&daily, k));
                cluster.slot_of_key(b) != cluster.slot_of_key(d)
                    && (node(&burst, k) == node(&daily, k)) == same
            })
            .unwrap()
    };
    // One node: each request's two slots in one call of the node (all-or-nothing in the
    // script), and the 100 requests in 2 calls (64, then 36): no refund.
    // Two nodes: each node's checks go in one merged call; the 41 that the burst refuses have
    // their daily unit given back (one refund call each).
    for (key, requests, calls) in [(key_on(true), 100, 2), (key_on(false), 50, 2 + 41)] {
        assert!(admitted(&backend, &[&burst, &daily], &key).await);
        // A refused batch, to load the refund script on daily's node before the count.
        let blocker = gcra("blocker", 1);
        assert!(admitted(&backend, &[&blocker], &key).await);
        assert!(!admitted(&backend, &[&daily, &blocker], &key).await);
        reset_stats(&cluster);

        assert_eq!(
            admitted_at_once(&backend, &[&burst, &daily], &key, requests).await,
            9
        );
        assert_eq!(script_calls(&cluster), calls);
        let v = check(&backend, &[&daily], &key).await;
        assert_eq!(
            (v[0].status, v[0].remaining),
            (Status::Allowed, 100 - 10 - 1)
        );
    }
}

/// How many `kind` (`ASK`, `MOVED`) redirections `node` answered (`INFO errorstats`).
fn redirections(node: &tollgate_testsupport::RedisServer, kind: &str) -> u64 {
    tollgate_testsupport::server_info(node, "errorstats", &format!("errorstat_{kind}"))
        .and_then(|v| v.strip_prefix("count=")?.trim().parse().ok())
        .unwrap_or(0)
}

fn node_id(node: &tollgate_testsupport::RedisServer) -> String {
    redis::cmd("CLUSTER")
        .arg("MYID")
        .query(&mut node.client())
        .unwrap()
}

fn setslot(node: &tollgate_testsupport::RedisServer, slot: u16, state: &str, id: &str) {
    let _: () = redis::cmd("CLUSTER")
        .arg("SETSLOT")
        .arg(slot)
        .arg(state)
        .arg(id)
        .query(&mut node.client())
        .unwrap();
}

/// The move of `redis_key`'s hash slot from its node to the next, in the steps a cluster
/// operator takes: [`begin`](Self::begin) (`IMPORTING`, `MIGRATING`), [`migrate`] of the keys,
/// [`finish`](Self::finish) (`NODE` on every node).
struct SlotMove<'c> {
    nodes: &'c [tollgate_testsupport::RedisServer],
    slot: u16,
    from: usize,
    to: usize,
    from_id: String,
    to_id: String,
}

impl<'c> SlotMove<'c> {
    fn of(cluster: &'c RedisCluster, redis_key: &str) -> Self {
        let nodes = cluster.nodes();
        let from = cluster.node_of_key(redis_key);
        let to = (from + 1) % 3;
        Self {
            nodes,
            slot: cluster.slot_of_key(redis_key),
            from,
            to,
            from_id: node_id(&nodes[from]),
            to_id: node_id(&nodes[to]),
        }
    }

    fn begin(&self) {
        setslot(&self.nodes[self.to], self.slot, "IMPORTING", &self.from_id);
        setslot(&self.nodes[self.from], self.slot, "MIGRATING", &self.to_id);
    }

    fn finish(&self) {
        for node in [self.to, self.from, 3 - self.to - self.from] {
            setslot(&self.nodes[node], self.slot, "NODE", &self.to_id);
        }
    }
}

/// Has `backend` check a key of `limit` on node `node`, so that the scripts are loaded there.
async fn load_scripts_on(
    cluster: &RedisCluster,
    backend: &tollgate_redis::RedisBackend,
    limit: &Limit,
    node: usize,
) {
    let elsewhere = (0..1000)
        .map(|i| format!("other-{i}").into_bytes())
        .find(|k| cluster.node_of_key(&backend.key_for(limit, k)) == node)
        .unwrap();
    assert!(admitted(backend, &[limit], &elsewhere).await);
}

/// Moves `key` from node `from` to node `to` (`MIGRATE`).
fn migrate(
    from: &tollgate_testsupport::RedisServer,
    to: &tollgate_testsupport::RedisServer,
    key: &str,
) {
    let _: () = redis::cmd("MIGRATE")
        .arg("127.0.0.1")
        .arg(to.port())
        .arg(key)
        .arg(0)
        .arg(5000)
        .query(&mut from.client())
        .unwrap();
}

#[tokio::test]
async fn a_slot_that_moves_mid_run_loses_and_doubles_no_request() {
    let cluster = RedisCluster::start(3);
    let backend = support::cluster(cluster.urls())
        .deny_cache_capacity(0)
        .build()
        .unwrap();
    // An hour's quota: no unit comes back while the test runs.
    let limit = Limit::gcra("moving", Quota::per_hour(10).unwrap()).unwrap();
    let key = b"tenant";
    let redis_key = backend.key_for(&limit, key);
    let moving = SlotMove::of(&cluster, &redis_key);
    let (nodes, slot, from, to) = (moving.nodes, moving.slot, moving.from, moving.to);
    load_scripts_on(&cluster, &backend, &limit, to).await;

    let mut total = 0;
    let before = admitted_at_once(&backend, &[&limit], key, 4).await;
    assert_eq!(before, 4);
    total += before;

    // The move starts: the key is still on its node, which keeps serving it.
    moving.begin();
    let migrating = admitted_at_once(&backend, &[&limit], key, 3).await;
    assert_eq!(migrating, 3);
    total += migrating;

    // The key moves: its old node answers ASK, and the new one serves it after ASKING.
    let keys: Vec<String> = redis::cmd("CLUSTER")
        .arg("GETKEYSINSLOT")
        .arg(slot)
        .arg(100)
        .query(&mut nodes[from].client())
        .unwrap();
    assert_eq!(keys, std::slice::from_ref(&redis_key));
    migrate(&nodes[from], &nodes[to], &redis_key);
    let asked = admitted_at_once(&backend, &[&limit], key, 2).await;
    assert_eq!(asked, 2);
    total += asked;
    assert!(redirections(&nodes[from], "ASK") >= 1);
    assert!(nodes[to].calls("asking") >= 1);

    // The slot is the new node's: the old one answers MOVED.
    moving.finish();
    let after = admitted_at_once(&backend, &[&limit], key, 20).await;
    assert_eq!(after, 1);
    total += after;
    assert!(redirections(&nodes[from], "MOVED") >= 1);
    assert_eq!(total, 10);
    assert_eq!(cluster.node_of_key(&redis_key), to);
    assert_eq!(nodes[from].dbsize(), 0);
}

/// The spread form of the test above: a key per request, each checked once per phase, in
/// calls merged per node (the lean script's cross-slot form) that carry a key of the moving
/// slot among keys of other slots of the same node. Each phase takes one of a key's four
/// units, so a check run twice would leave its key none for the fourth phase.
#[tokio::test]
async fn a_slot_that_moves_under_a_spread_load_loses_and_doubles_no_request() {
    let cluster = RedisCluster::start(3);
    let backend = support::cluster(cluster.urls())
        .deny_cache_capacity(0)
        .build()
        .unwrap();
    // Four units an hour per key: the first four phases take them, the last finds none.
    let limit = Limit::gcra("spread", Quota::per_hour(4).unwrap()).unwrap();
    let mover = b"mover".to_vec();
    let redis_key = backend.key_for(&limit, &mover);
    let moving = SlotMove::of(&cluster, &redis_key);
    let (nodes, slot, from, to) = (moving.nodes, moving.slot, moving.from, moving.to);
    // 30 more keys on the mover's node, in other slots.
    let mut keys: Vec<Vec<u8>> = (0..100_000)
        .map(|i| format!("client-{i}").into_bytes())
        .filter(|k| {
            let key = backend.key_for(&limit, k);
            cluster.node_of_key(&key) == from && cluster.slot_of_key(&key) != slot
        })
        .take(30)
        .collect();
    keys.push(mover.clone());
    load_scripts_on(&cluster, &backend, &limit, to).await;
    let phase = || async {
        let answers = futures_util::future::join_all(
            keys.iter()
                .map(|k| backend.check(std::slice::from_ref(&Check::new(&limit, k)))),
        )
        .await;
        answers
            .into_iter()
            .filter(|v| v.as_ref().unwrap()[0].is_allowed())
            .count()
    };

    let mut total = phase().await;
    assert_eq!(total, 31);

    // The move starts: the keys are still on their node, which serves them in one call.
    moving.begin();
    reset_stats(&cluster);
    let migrating = phase().await;
    assert_eq!(migrating, 31);
    assert_eq!(nodes[from].calls("evalsha"), 1);
    total += migrating;

    // The mover's key moves: the node's merged call meets a key it no longer holds, runs the
    // other requests and not the mover's, which is sent again by hash slot (after ASK).
    migrate(&nodes[from], &nodes[to], &redis_key);
    reset_stats(&cluster);
    let asked = phase().await;
    assert_eq!(asked, 31);
    assert!(redirections(&nodes[from], "ASK") >= 1);
    // One call on each node: the merged one, and the mover's by hash slot.
    assert_eq!(nodes[from].calls("evalsha"), 1);
    assert_eq!(nodes[to].calls("evalsha"), 1);
    total += asked;

    // The slot is the new node's: the old one answers MOVED, and the slot map is read again.
    moving.finish();
    let moved = phase().await;
    assert_eq!(moved, 31);
    total += moved;
    // Every key has used its four units, each once.
    assert_eq!(phase().await, 0);
    assert_eq!(total, 124);
    assert_eq!(cluster.node_of_key(&redis_key), to);
    // The mover's units are still counted, on its new node.
    let tat: Option<String> = redis::cmd("GET")
        .arg(&redis_key)
        .query(&mut nodes[to].client())
        .unwrap();
    assert!(tat.is_some());
}

/// A sliding log's two keys (`:log`, `:seq`) move one at a time. While the mover's `:seq`
/// has moved and its `:log` has not, a merged call (the cross-slot form) that carries it among
/// 30 other sliding logs of the node fails before it writes anything (it reads every key it
/// would write first), and is sent again by hash slot: each other key counts its unit once,
/// and the mover none. Exact counts per key, in each key's log.
#[tokio::test]
async fn a_sliding_log_whose_sequence_moved_first_counts_no_unit_twice() {
    let cluster = RedisCluster::start(3);
    let backend = support::cluster(cluster.urls())
        .deny_cache_capacity(0)
        .build()
        .unwrap();
    let limit = Limit::sliding_log("log-move", Quota::per_hour(10).unwrap()).unwrap();
    let mover = b"mover".to_vec();
    let log_key = backend.key_for(&limit, &mover);
    let seq_key = format!("{}:seq", log_key.strip_suffix(":log").unwrap());
    let moving = SlotMove::of(&cluster, &log_key);
    let (nodes, slot, from, to) = (moving.nodes, moving.slot, moving.from, moving.to);
    let mut keys: Vec<Vec<u8>> = (0..100_000)
        .map(|i| format!("client-{i}").into_bytes())
        .filter(|k| {
            let key = backend.key_for(&limit, k);
            cluster.node_of_key(&key) == from && cluster.slot_of_key(&key) != slot
        })
        .take(30)
        .collect();
    // Last: the others' writes come before the mover's in the merged call.
    keys.push(mover.clone());
    load_scripts_on(&cluster, &backend, &limit, to).await;
    let phase = || async {
        let answers = futures_util::future::join_all(
            keys.iter()
                .map(|k| backend.check(std::slice::from_ref(&Check::new(&limit, k)))),
        )
        .await;
        answers
            .iter()
            .map(|v| v.as_ref().is_ok_and(|v| v[0].is_allowed()))
            .collect::<Vec<bool>>()
    };
    let units = |node: usize, key: &[u8]| -> u64 {
        redis::cmd("ZCARD")
            .arg(backend.key_for(&limit, key))
            .query(&mut nodes[node].client())
            .unwrap()
    };
    let others = |node: usize| -> Vec<u64> { keys[..30].iter().map(|k| units(node, k)).collect() };

    assert_eq!(phase().await, [true; 31]);
    moving.begin();
    // Only the mover's sequence has moved: its request is not run, the others' once each.
    migrate(&nodes[from], &nodes[to], &seq_key);
    let mut expected = [true; 31];
    expected[30] = false;
    assert_eq!(phase().await, expected);
    assert_eq!(others(from), [2; 30]);
    assert_eq!(units(from, &mover), 1);
    // The log follows: the mover is checked on its new node (after ASK).
    migrate(&nodes[from], &nodes[to], &log_key);
    assert_eq!(phase().await, [true; 31]);
    moving.finish();
    assert_eq!(phase().await, [true; 31]);
    assert_eq!(others(from), [4; 30]);
    assert_eq!(units(to, &mover), 3);
}

/// A GCRA unit taken by a group that another group's refusal undoes comes back as one unit of
/// whatever plan the key's TAT is counted in when the refund lands: a check of another plan in
/// between carries the TAT to its own interval, and the refund gives back one of those.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_after_another_plans_check_gives_back_one_unit_of_that_plan() {
    let cluster = RedisCluster::start(3);
    let backend = support::cluster(cluster.urls())
        .deny_cache_capacity(0)
        .build()
        .unwrap();
    let rate = gcra("rate", 10);
    let blocker = gcra("blocker", 1);
    let key = key_on_two_nodes(&cluster, &backend, &rate, &blocker);
    let blocker_node = cluster.node_of_key(&backend.key_for(&blocker, &key));
    let other = support::cluster(cluster.urls())
        .deny_cache_capacity(0)
        .build()
        .unwrap();
    // The blocker's one unit is used, and the scripts are loaded everywhere.
    assert!(check(&other, &[&blocker], &key).await[0].is_allowed());
    let pro = Quota::per_minute(100).unwrap();
    let peek_pro = || async {
        other
            .peek(&Check::new(&rate, &key).with_quota(pro))
            .await
            .unwrap()
            .remaining
    };
    assert_eq!(peek_pro().await, 100);

    // [rate at 10 a minute, blocker]: rate takes one unit (6 s of TAT), then waits for the
    // blocker's refusal.
    pause_writes(&cluster, blocker_node);
    let first = {
        let (backend, rate, blocker, key) =
            (backend.clone(), rate.clone(), blocker.clone(), key.clone());
        tokio::spawn(async move { check(&backend, &[&rate, &blocker], &key).await })
    };
    let waiting = std::time::Instant::now();
    while peek_pro().await == 100 {
        assert!(waiting.elapsed() < Duration::from_secs(10), "no take");
        tokio::task::yield_now().await;
    }
    // Meanwhile a request of the 100-a-minute plan: the key's TAT is carried to 0.6 s a unit,
    // two units used.
    let pro_check = other
        .check(&[Check::new(&rate, &key).with_quota(pro)])
        .await
        .unwrap();
    assert!(pro_check[0].is_allowed());
    assert_eq!(peek_pro().await, 98);
    unpause(&cluster, blocker_node);
    let first = first.await.unwrap();
    assert!(matches!(first[1].status, Status::Denied { .. }));
    // One unit given back, counted in the plan the TAT is under: the pro request's stays.
    assert_eq!(peek_pro().await, 99);
}
