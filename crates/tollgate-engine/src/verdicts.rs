//! The verdicts of one batch, with where each admitted check's units went.
//!
//! A small vector written for the purpose: three inline, one allocation past them. What it
//! saves over a fixed array of [`MAX_CHECKS`] and over `smallvec`: see `docs/benchmarks.md`,
//! section "Hand-written parts of the core, and what each saves", "A batch's answer".

use std::fmt;
use std::ops::Deref;

use crate::bounds::MAX_CHECKS;
use crate::check::{Check, Receipt};
use crate::verdict::{Status, Verdict};

/// How many verdicts a [`Verdicts`] holds without allocating: the one to three limits of most
/// layers (three stacked limits is the common case of a public API: per IP, per tenant, per
/// principal). A batch of more checks keeps its verdicts in one allocation of [`MAX_CHECKS`].
const INLINE: usize = 3;

/// The verdicts of one batch, in the order of its checks.
///
/// Up to three are stored inline, so that the answer of a batch of up to three limits allocates
/// nothing and stays small to move; more are stored in one allocation.
#[derive(Clone)]
pub struct Verdicts {
    len: u8,
    /// Bit `i`: the `i`-th check was admitted from a leased slice held locally.
    from_lease: u8,
    storage: Storage,
}

#[derive(Clone)]
enum Storage {
    Inline {
        items: [Verdict; INLINE],
        receipts: [Receipt; INLINE],
    },
    Spilled(Box<Spilled>),
}

#[derive(Clone)]
struct Spilled {
    items: [Verdict; MAX_CHECKS],
    receipts: [Receipt; MAX_CHECKS],
}

impl Verdicts {
    /// No verdicts.
    #[inline]
    pub const fn new() -> Self {
        Self {
            len: 0,
            from_lease: 0,
            storage: Storage::Inline {
                items: [Verdict::EMPTY; INLINE],
                receipts: [Receipt::new(0); INLINE],
            },
        }
    }

    #[inline]
    fn parts(&self) -> (&[Verdict], &[Receipt]) {
        let len = usize::from(self.len);
        match &self.storage {
            Storage::Inline { items, receipts } => (&items[..len], &receipts[..len]),
            Storage::Spilled(s) => (&s.items[..len], &s.receipts[..len]),
        }
    }

    #[inline]
    fn parts_mut(&mut self) -> (&mut [Verdict], &mut [Receipt]) {
        let len = usize::from(self.len);
        match &mut self.storage {
            Storage::Inline { items, receipts } => (&mut items[..len], &mut receipts[..len]),
            Storage::Spilled(s) => (&mut s.items[..len], &mut s.receipts[..len]),
        }
    }

    /// Whether the `i`-th check was admitted from a slice of a leased quota held by this
    /// process, without asking the shared backend (see [`Lease`](crate::Lease)).
    #[inline]
    pub fn from_lease(&self, i: usize) -> bool {
        i < usize::from(self.len) && self.from_lease & (1 << i) != 0
    }

    /// Marks the `i`-th check as admitted from a leased slice; ignored past the end. Only
    /// [`Leased`](crate::leased::Leased) answers from slices.
    #[inline]
    pub(crate) fn set_from_lease(&mut self, i: usize) {
        if i < usize::from(self.len) {
            self.from_lease |= 1 << i;
        }
    }

    /// Where the `i`-th check's units went, for a later settle (the default receipt if the
    /// backend records none, or past the end).
    #[inline]
    pub fn receipt(&self, i: usize) -> Receipt {
        self.parts().1.get(i).copied().unwrap_or_default()
    }

    /// Records where the `i`-th check's units went; ignored past the end.
    #[inline]
    pub fn set_receipt(&mut self, i: usize, receipt: Receipt) {
        if let Some(slot) = self.parts_mut().1.get_mut(i) {
            *slot = receipt;
        }
    }

    /// Appends a verdict.
    ///
    /// # Errors
    ///
    /// Gives the verdict back when [`MAX_CHECKS`] are already held.
    #[inline]
    pub fn push(&mut self, verdict: Verdict) -> Result<(), Verdict> {
        let len = usize::from(self.len);
        if let Storage::Inline { items, receipts } = &self.storage {
            if len == INLINE {
                let mut spilled = Box::new(Spilled {
                    items: [Verdict::EMPTY; MAX_CHECKS],
                    receipts: [Receipt::default(); MAX_CHECKS],
                });
                spilled.items[..INLINE].copy_from_slice(items);
                spilled.receipts[..INLINE].copy_from_slice(receipts);
                self.storage = Storage::Spilled(spilled);
            }
        }
        let slot = match &mut self.storage {
            Storage::Inline { items, .. } => items.get_mut(len),
            Storage::Spilled(s) => s.items.get_mut(len),
        };
        *slot.ok_or(verdict)? = verdict;
        self.len += 1;
        Ok(())
    }

    /// The verdicts as a mutable slice.
    #[inline]
    pub(crate) fn as_mut_slice(&mut self) -> &mut [Verdict] {
        self.parts_mut().0
    }

    /// Whether every enforced check of `checks` was admitted (and no check was denied by
    /// hand: [`Status::Denylisted`] refuses under a shadow limit too).
    #[inline]
    pub fn admits(&self, checks: &[Check<'_>]) -> bool {
        // A deny by hand refuses under a shadow limit too: it is an operator's decision.
        self.iter().zip(checks).all(|(v, c)| {
            v.is_allowed() || (!c.enforce && !matches!(v.status, Status::Denylisted { .. }))
        })
    }
}

impl Default for Verdicts {
    fn default() -> Self {
        Self::new()
    }
}

impl Deref for Verdicts {
    type Target = [Verdict];

    #[inline]
    fn deref(&self) -> &[Verdict] {
        self.parts().0
    }
}

impl fmt::Debug for Verdicts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl FromIterator<Verdict> for Verdicts {
    /// Collects at most [`MAX_CHECKS`] verdicts; further ones are dropped.
    fn from_iter<I: IntoIterator<Item = Verdict>>(iter: I) -> Self {
        let mut out = Self::new();
        for v in iter.into_iter().take(MAX_CHECKS) {
            let _ = out.push(v);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verdict::Status;

    fn allowed(remaining: u64) -> Verdict {
        Verdict {
            status: Status::Allowed,
            remaining,
            reset: 0,
        }
    }

    #[test]
    fn verdicts_past_the_inline_ones_keep_their_order_receipts_and_lease_marks() {
        let mut v = Verdicts::new();
        for i in 0..2 {
            v.push(allowed(i)).unwrap();
            v.set_receipt(
                usize::try_from(i).unwrap(),
                Receipt {
                    at: 10 + i,
                    mark: i,
                },
            );
        }
        v.set_from_lease(1);
        for i in 2..MAX_CHECKS as u64 {
            v.push(allowed(i)).unwrap();
        }
        assert_eq!(v.push(allowed(99)), Err(allowed(99)));
        assert_eq!(v.len(), MAX_CHECKS);
        let remaining: Vec<u64> = v.iter().map(|x| x.remaining).collect();
        assert_eq!(remaining, (0..MAX_CHECKS as u64).collect::<Vec<_>>());
        assert_eq!(v.receipt(1), Receipt { at: 11, mark: 1 });
        assert_eq!(v.receipt(5), Receipt::default());
        v.set_receipt(7, Receipt { at: 7, mark: 7 });
        assert_eq!(v.receipt(7), Receipt { at: 7, mark: 7 });
        assert!(v.from_lease(1) && !v.from_lease(0) && !v.from_lease(7));
        v.as_mut_slice()[6].remaining = 60;
        let copy = v.clone();
        assert_eq!(copy[6].remaining, 60);
        assert_eq!(copy.receipt(0), Receipt { at: 10, mark: 0 });
    }

    #[test]
    fn past_the_end_reads_the_default_and_writes_nothing() {
        let mut v = Verdicts::new();
        v.push(allowed(3)).unwrap();
        v.set_receipt(1, Receipt { at: 1, mark: 1 });
        v.set_from_lease(1);
        assert_eq!(v.receipt(1), Receipt::default());
        assert!(!v.from_lease(1));
        assert_eq!(v.len(), 1);
        let collected: Verdicts = (0..20).map(allowed).collect();
        assert_eq!(collected.len(), MAX_CHECKS);
    }
}
