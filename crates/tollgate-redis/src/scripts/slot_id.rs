//! A concurrency slot's id as the scripts carry it.

/// A slot id's 128 bits as three integers of at most 43 bits, each exact in a Lua double.
pub(crate) fn parts(id: u128) -> [u64; 3] {
    const MASK: u128 = (1 << 43) - 1;
    [
        (id >> 86) as u64,
        ((id >> 43) & MASK) as u64,
        (id & MASK) as u64,
    ]
}

/// The member under which a slot is held in its sorted set: its three parts in decimal,
/// joined by `-` (what the scripts write from the parts).
pub(crate) fn member(id: u128) -> String {
    let [a, b, c] = parts(id);
    format!("{a}-{b}-{c}")
}
