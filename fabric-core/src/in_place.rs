//! Appending to a `Vec` without a stack copy of the element.
//!
//! `Vec::push` of a struct of several fields (a [`Completion`](crate::Completion), a
//! planned write) compiles to building the struct on the stack with narrow stores, then
//! copying it with 16-byte loads that straddle those stores: each such load waits for
//! the stores to drain (a failed store-to-load forward), about 10 ns per element. The
//! hot paths push millions of elements a second, so they build them in place instead.

/// Appends `make()` to `v`, built directly in `v`'s spare capacity: `make` runs after
/// room is made, so nothing (no call to the allocator) sits between building the element
/// and storing it, and the compiler need not build it elsewhere first.
#[inline(always)]
pub(crate) fn push<T>(v: &mut Vec<T>, make: impl FnOnce() -> T) {
    v.reserve(1);
    let len = v.len();
    v.spare_capacity_mut()[0].write(make());
    // SAFETY: `reserve` made room for one more element and the one at `len` was just
    // initialised.
    unsafe { v.set_len(len + 1) };
}

#[cfg(test)]
mod tests {
    #[test]
    fn pushes_like_push() {
        let mut v: Vec<String> = Vec::new();
        for i in 0..100 {
            super::push(&mut v, || i.to_string());
        }
        assert_eq!(v, (0..100).map(|i| i.to_string()).collect::<Vec<_>>());
    }
}
