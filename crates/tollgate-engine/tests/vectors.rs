//! The engine's pure functions reproduce every line of the shared vector file
//! (`tests/vectors.txt` at the workspace root).

#![allow(clippy::unwrap_used)]

use tollgate_engine::algorithm::{self, WindowState};
use tollgate_engine::Verdict;
use tollgate_testsupport::vectors::{self, Algo, State, Vector};

fn run(v: &Vector) -> Verdict {
    let q = v.quota();
    match (v.algo, &v.state) {
        (Algo::Gcra, State::None) => algorithm::gcra_delayed(&q, None, v.now, v.cost, v.delay).0,
        (Algo::Gcra, State::Tat(t)) => {
            algorithm::gcra_delayed(&q, Some(*t), v.now, v.cost, v.delay).0
        }
        (Algo::Gcra, State::TatUnder { tat, interval }) => {
            let tat = algorithm::gcra_carry(*tat, v.now, *interval, q.emission_interval());
            algorithm::gcra_delayed(&q, Some(tat), v.now, v.cost, v.delay).0
        }
        (Algo::Fixed, State::None) => algorithm::fixed_window(&q, None, v.now, v.cost).0,
        (Algo::Fixed, State::Window { end, count }) => {
            let state = WindowState::new(*end, *count);
            algorithm::fixed_window(&q, Some(state), v.now, v.cost).0
        }
        (Algo::Sliding, State::None) => algorithm::sliding_log(&q, &[], v.now, v.cost).0,
        (Algo::Sliding, State::Log(log)) => algorithm::sliding_log(&q, log, v.now, v.cost).0,
        (algo, state) => panic!("{v}: state {state:?} does not fit {algo:?}"),
    }
}

#[test]
fn the_core_reproduces_every_vector() {
    let all = vectors::load();
    assert!(all.len() >= 45, "only {} vectors", all.len());
    let failures: Vec<String> = all
        .iter()
        .filter_map(|v| {
            let (got, want) = (run(v), v.expected());
            (got != want).then(|| format!("{v}: got {got:?}, want {want:?}"))
        })
        .collect();
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
    assert!(all.iter().filter(|v| v.delay > 0).count() >= 10);
}

#[test]
fn a_delay_of_zero_is_gcra_itself() {
    for v in vectors::load().iter().filter(|v| v.algo == Algo::Gcra) {
        let q = v.quota();
        let tat = match v.state {
            State::Tat(t) => Some(t),
            _ => None,
        };
        assert_eq!(
            algorithm::gcra(&q, tat, v.now, v.cost),
            algorithm::gcra_delayed(&q, tat, v.now, v.cost, 0),
            "{v}"
        );
    }
}
