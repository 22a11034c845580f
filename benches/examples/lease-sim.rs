//! The accuracy of quota leases, simulated: replicas that lease a hot key's quota, each a
//! `tollgate_engine::leased::Leased` over one shared in-memory backend on a simulated clock
//! (`tollgate_testsupport::leases`; a test holds the Redis backend's leases to the same
//! answers).
//!
//! ```text
//! cargo run --release -p tollgate-bench --example lease-sim [-- --seed N]
//! ```
//!
//! Deterministic for a seed. For 2 to 16 replicas, uniform and skewed traffic (skewed: replica
//! `i` sends in proportion to `1 / (i+1)²`, and every 2 s each replica falls silent for the
//! next 2 s with probability 0.3), GCRA and fixed windows, demand of 0.5 and 1.5 times the
//! quota's rate, leases off and on, it sends the same requests (for 60 simulated seconds) and
//! prints per configuration:
//!
//! - **over**: admissions beyond the quota. Fixed window: beyond the limit in a window. GCRA:
//!   admissions that a GCRA of the same quota, run on the admission times themselves, would
//!   refuse.
//! - **under**: admissions short of the same requests without leases, and its **bound**: the
//!   units that slices took and no request used (given back, expired, or still held at the
//!   end).
//! - **calls/req**: calls to the shared backend (checks and give-backs) per request: a Redis
//!   backend makes one script call for each.
//!
//! The last line is `over-admission: 0 in K configurations` when no configuration admitted
//! beyond its quota; otherwise the program exits with status 1.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use tollgate_engine::{algorithm, Algorithm, Check, FakeClock, Lease, Limit, Micros, Quota};
use tollgate_testsupport::leases::{self, splitmix, Replica};

const S: Micros = 1_000_000;
/// The start of a UTC day: windows start here.
const T0: Micros = 1_728_000_000_000_000;
const SECONDS: Micros = 60;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Traffic {
    Uniform,
    Skewed,
}

struct Row {
    algorithm: &'static str,
    demand: f64,
    replicas: usize,
    traffic: &'static str,
    leased: bool,
    requests: u64,
    admitted: u64,
    from_lease: u64,
    over: u64,
    under: i64,
    bound: u64,
    calls: u64,
}

/// A uniform draw in [0, 1).
fn unit(state: &mut u64) -> f64 {
    (splitmix(state) >> 11) as f64 / (1u64 << 53) as f64
}

/// The requests of one configuration: (time, replica), in time order.
fn requests(seed: u64, replicas: usize, traffic: Traffic, rate: f64) -> Vec<(Micros, usize)> {
    let mut state = seed;
    let weights: Vec<f64> = (0..replicas)
        .map(|i| match traffic {
            Traffic::Uniform => 1.0,
            Traffic::Skewed => 1.0 / ((i + 1) * (i + 1)) as f64,
        })
        .collect();
    let mut silent = vec![false; replicas];
    let mut phase = u64::MAX;
    let mut out = Vec::new();
    let mut t = 0.0f64;
    let end = (SECONDS * S) as f64;
    loop {
        // Exponential gaps: a Poisson stream of `rate` requests a second.
        t += -(1.0 - unit(&mut state)).ln() / rate * S as f64;
        if t >= end {
            return out;
        }
        let now = T0 + t as Micros;
        let p = (t as Micros) / (2 * S);
        if traffic == Traffic::Skewed && p != phase {
            phase = p;
            for s in &mut silent {
                *s = unit(&mut state) < 0.3;
            }
            if silent.iter().all(|s| *s) {
                silent[0] = false;
            }
        }
        let total: f64 = (0..replicas)
            .filter(|&i| !silent[i])
            .map(|i| weights[i])
            .sum();
        let mut pick = unit(&mut state) * total;
        let mut who = 0;
        for i in (0..replicas).filter(|&i| !silent[i]) {
            who = i;
            if pick < weights[i] {
                break;
            }
            pick -= weights[i];
        }
        out.push((now, who));
    }
}

/// Admission times, admissions from slices, calls to the shared backend, units taken into
/// slices.
fn run(limit: &Limit, reqs: &[(Micros, usize)], replicas: usize) -> (Vec<Micros>, u64, u64, u64) {
    let clock = FakeClock::new(T0);
    let memory = leases::memory(&clock);
    let replicas: Vec<Replica> = (0..replicas)
        .map(|_| leases::replica(&memory, &clock))
        .collect();
    let mut admitted = Vec::new();
    let mut from_lease = 0;
    for &(now, who) in reqs {
        clock.set(now);
        let v = replicas[who]
            .check_now(&[Check::new(limit, b"hot")])
            .unwrap();
        if v[0].is_allowed() {
            admitted.push(now);
            from_lease += u64::from(v.from_lease(0));
        }
    }
    let calls = replicas.iter().map(|r| r.inner().calls()).sum();
    let taken = replicas.iter().map(|r| r.inner().sliced()).sum();
    (admitted, from_lease, calls, taken)
}

/// Admissions beyond the quota.
fn over(limit: &Limit, admitted: &[Micros]) -> u64 {
    let quota = limit.quota();
    match limit.algorithm() {
        Algorithm::FixedWindow => {
            let mut over = 0;
            let mut i = 0;
            while i < admitted.len() {
                let w = algorithm::window_index(quota, admitted[i]);
                let n = admitted[i..]
                    .iter()
                    .take_while(|&&t| algorithm::window_index(quota, t) == w)
                    .count();
                over += (n as u64).saturating_sub(u64::from(quota.limit()));
                i += n;
            }
            over
        }
        _ => {
            let mut tat = None;
            let mut over = 0;
            for &t in admitted {
                match algorithm::gcra(quota, tat, t, 1) {
                    (v, Some(next)) if v.is_allowed() => tat = Some(next),
                    _ => over += 1,
                }
            }
            over
        }
    }
}

fn main() {
    let mut seed = 0x7011_6a7e_u64;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        match flag.as_str() {
            "--seed" => seed = args.next().unwrap().parse().unwrap(),
            other => panic!("unknown flag {other}"),
        }
    }
    let quota = Quota::new(5_000, Duration::from_secs(10)).unwrap();
    let lease = Lease::new(100)
        .unwrap()
        .with_divisor(16)
        .unwrap()
        .with_lifetime(Duration::from_millis(250))
        .unwrap();
    let mut rows = Vec::new();
    for (name, limit) in [
        ("gcra", Limit::gcra("hot", quota).unwrap()),
        ("fixed", Limit::fixed_window("hot", quota).unwrap()),
    ] {
        for (demand, replicas) in [0.5, 1.5]
            .into_iter()
            .flat_map(|d| [2, 4, 8, 16].map(|r| (d, r)))
        {
            // Requests a second: `demand` times the quota's rate.
            let rate = demand * 5_000.0 / 10.0;
            for (traffic, tname) in [(Traffic::Uniform, "uniform"), (Traffic::Skewed, "skewed")] {
                let reqs = requests(seed ^ replicas as u64, replicas, traffic, rate);
                let (base, _, _, _) = run(&limit, &reqs, replicas);
                for leased in [false, true] {
                    let limit = if leased {
                        limit.clone().with_lease(lease).unwrap()
                    } else {
                        limit.clone()
                    };
                    let (admitted, from_lease, calls, taken) = run(&limit, &reqs, replicas);
                    // Units that slices took and no request used: every slice unit is either
                    // admitted locally or left unused (given back, expired, or still held).
                    let bound = taken - from_lease;
                    rows.push(Row {
                        algorithm: name,
                        demand,
                        replicas,
                        traffic: tname,
                        leased,
                        requests: reqs.len() as u64,
                        admitted: admitted.len() as u64,
                        from_lease,
                        over: over(&limit, &admitted),
                        under: base.len() as i64 - admitted.len() as i64,
                        bound,
                        calls,
                    });
                }
            }
        }
    }
    println!(
        "quota 5000 per 10 s; lease: slices of at most 100, remaining / 16, living 250 ms; \
         demand 0.5 or 1.5 times the quota's rate, for {SECONDS} s; seed {seed}"
    );
    println!();
    println!(
        "| algorithm | demand | replicas | traffic | lease | requests | admitted | from slices | over | under | bound | under <= bound | calls/req |"
    );
    println!("|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---|---:|");
    for r in &rows {
        println!(
            "| {} | {}x | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.3} |",
            r.algorithm,
            r.demand,
            r.replicas,
            r.traffic,
            if r.leased { "on" } else { "off" },
            r.requests,
            r.admitted,
            r.from_lease,
            r.over,
            r.under,
            r.bound,
            if r.under <= r.bound as i64 {
                "yes"
            } else {
                "no"
            },
            r.calls as f64 / r.requests as f64,
        );
    }
    println!();
    let bad = rows.iter().filter(|r| r.over > 0).count();
    if bad > 0 {
        println!("over-admission in {bad} of {} configurations", rows.len());
        std::process::exit(1);
    }
    println!("over-admission: 0 in {} configurations", rows.len());
}
