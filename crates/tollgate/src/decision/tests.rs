#![allow(clippy::unwrap_used)]
use super::*;

fn part(name: &str, remaining: u64) -> LimitDecision {
    LimitDecision::new(
        name.into(),
        Quota::per_minute(10).unwrap(),
        Outcome::Allowed {
            remaining,
            reset: Duration::from_secs(6),
        },
        Source::Backend,
        false,
    )
}

#[test]
fn one_part_or_many_read_the_same() {
    let one = Decision::new(vec![part("a", 3)]);
    assert_eq!(one.limits(), [part("a", 3)]);
    assert_eq!(one.remaining(), Some(3));
    // Collected from an iterator whose length is not known in advance.
    let filtered: Decision = [part("a", 3), part("b", 1)]
        .into_iter()
        .filter(|p| p.name() == "a")
        .collect();
    assert_eq!(filtered, one);
    for n in [0, 2, 3] {
        let parts: Vec<_> = (0..n).map(|i| part(&format!("l{i}"), i)).collect();
        let many = Decision::new(parts.clone());
        assert_eq!(many.limits(), parts.as_slice());
        let collected: Decision = parts.iter().filter(|_| true).cloned().collect();
        assert_eq!(collected.limits(), parts.as_slice());
    }
    assert_eq!(
        format!("{:?}", Decision::new(vec![])),
        "Decision { limits: [] }"
    );
    assert_eq!(one.clone(), one);
}
