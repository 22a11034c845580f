//! [`Few`]: one value inline, or several in a vector. Most requests make one check and get one
//! answer; what travels with a request between tasks is kept no larger than one of them, and
//! allocates nothing for it.

use std::ops::{Deref, DerefMut};

/// One value held inline, or any number (none included) in a vector; read as a slice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Few<T> {
    One(T),
    Many(Vec<T>),
}

impl<T> Few<T> {
    /// Room for `len` values, none yet (a first one is then held inline).
    pub(crate) fn with_capacity(len: usize) -> Self {
        match len {
            0 | 1 => Self::Many(Vec::new()),
            _ => Self::Many(Vec::with_capacity(len)),
        }
    }

    /// Adds `value` after the others.
    pub(crate) fn push(&mut self, value: T) {
        match self {
            Self::Many(all) if all.capacity() == 0 => *self = Self::One(value),
            Self::Many(all) => all.push(value),
            Self::One(_) => {
                if let Self::One(first) = std::mem::replace(self, Self::Many(Vec::new())) {
                    *self = Self::Many(vec![first, value]);
                }
            }
        }
    }
}

impl<T> Deref for Few<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match self {
            Self::One(value) => std::slice::from_ref(value),
            Self::Many(all) => all,
        }
    }
}

impl<T> DerefMut for Few<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match self {
            Self::One(value) => std::slice::from_mut(value),
            Self::Many(all) => all,
        }
    }
}

impl<T> AsRef<[T]> for Few<T> {
    fn as_ref(&self) -> &[T] {
        self
    }
}

impl<T> FromIterator<T> for Few<T> {
    fn from_iter<I: IntoIterator<Item = T>>(iter: I) -> Self {
        let mut iter = iter.into_iter();
        let Some(first) = iter.next() else {
            return Self::Many(Vec::new());
        };
        let Some(second) = iter.next() else {
            return Self::One(first);
        };
        let mut all = Vec::with_capacity(2 + iter.size_hint().0);
        all.extend([first, second]);
        all.extend(iter);
        Self::Many(all)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_is_inline_and_more_are_in_order() {
        let mut few = Few::with_capacity(1);
        assert!(few.is_empty());
        few.push(1);
        assert_eq!(few, Few::One(1));
        few.push(2);
        few.push(3);
        assert_eq!(&*few, &[1, 2, 3]);
        assert_eq!([7].into_iter().collect::<Few<_>>(), Few::One(7));
        assert_eq!(&*(0..4).collect::<Few<_>>(), &[0, 1, 2, 3]);
        assert!(std::iter::empty::<u8>().collect::<Few<_>>().is_empty());
    }
}
