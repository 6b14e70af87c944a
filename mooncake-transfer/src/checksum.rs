//! The crc32c of bytes moved: one definition for the whole stack (objects carry it,
//! transports take it while the bytes pass through their hands).

/// crc32c (Castagnoli) of `data`, with the widest instructions the CPU has
/// (AVX-512 carry-less multiply on recent x86-64: about twice the speed of the
/// `crc32` instruction loop).
pub fn crc32c(data: &[u8]) -> u32 {
    crc_fast::crc32_iscsi(data)
}

/// crc32c of `a`'s bytes followed by `b`'s, from their sums and `b`'s length.
///
/// Appending `len_b` bytes multiplies `a`'s remainder by `x^(8 len_b)` modulo the
/// polynomial before `b`'s is added. That power is built from a table of `x^(2^k)`
/// by square-and-multiply: about 35 carry-less multiplications of 32-bit values, under
/// a microsecond. (The `crc32c` and `crc-fast` crates' combine took 17-18 µs here,
/// which made every object of several parts pay that per part.)
pub fn crc32c_combine(crc_a: u32, crc_b: u32, len_b: usize) -> u32 {
    if len_b == 0 {
        // Nothing appended (an empty `b` sums to 0 anyway).
        return crc_a;
    }
    gf2::mul(gf2::x_pow_8n(len_b as u64), crc_a) ^ crc_b
}

/// Arithmetic on polynomials over GF(2) modulo crc32c's, in the CRC's bit-reflected
/// form: bit 31 holds the coefficient of `x^0`, bit 0 that of `x^31`.
mod gf2 {
    /// crc32c's polynomial (Castagnoli), reflected, without its `x^32` term.
    const POLY: u32 = 0x82F6_3B78;

    /// `x^0` in the reflected form.
    const ONE: u32 = 1 << 31;

    /// `a * b mod POLY`.
    pub(super) const fn mul(a: u32, mut b: u32) -> u32 {
        let mut product = 0;
        // Walk `a` from its x^0 coefficient up, with `b` multiplied by x at each step.
        let mut bit = ONE;
        while bit != 0 {
            if a & bit != 0 {
                product ^= b;
            }
            // b * x: one step towards the high powers is a right shift; x^32 folds
            // back in as the polynomial.
            b = if b & 1 != 0 { (b >> 1) ^ POLY } else { b >> 1 };
            bit >>= 1;
        }
        product
    }

    /// `x^(2^k) mod POLY` for k = 0..64.
    const X_POW_2K: [u32; 64] = {
        let mut table = [0u32; 64];
        let mut p = ONE >> 1; // x^1
        let mut k = 0;
        while k < 64 {
            table[k] = p;
            p = mul(p, p);
            k += 1;
        }
        table
    };

    /// `x^n mod POLY`.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(super) const fn x_pow(n: u64) -> u32 {
        mul(x_pow_8n(n / 8), ONE >> (n % 8))
    }

    /// `x^(8 n) mod POLY`: the factor that shifts a remainder past `n` bytes.
    pub(super) const fn x_pow_8n(n: u64) -> u32 {
        // 8 n = n << 3: start at the table entry for 2^3.
        let mut result = ONE;
        let mut k = 3;
        let mut n = n;
        while n != 0 {
            if n & 1 != 0 {
                result = mul(X_POW_2K[k], result);
            }
            n >>= 1;
            k += 1;
        }
        result
    }
}

/// The two 64-bit factors that fold a 128-bit piece of a message `bits` further
/// along it with carry-less multiplications (`stream_copy.rs`): a piece whose low
/// half (the first 8 bytes in memory, the higher powers of the message polynomial)
/// is `h` and high half `l` is congruent, `bits` later, to `clmul(h, first) ^
/// clmul(l, second)`. A reflected carry-less product is the polynomial product times
/// `x`, so the factors are `x^(bits + 63)` and `x^(bits - 1)` modulo the polynomial
/// (32 bits each, in the upper half of their 64: the reflected 64-bit form of a
/// polynomial of degree 31 or less).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) const fn fold_factors(bits: u64) -> (u64, u64) {
    ((gf2::x_pow(bits + 63) as u64) << 32, (gf2::x_pow(bits - 1) as u64) << 32)
}

/// The crc32c of bytes given piece by piece (as [`crc32c`] of their concatenation,
/// with no combine per piece): for a sum taken while the bytes pass through.
pub(crate) struct Crc32cDigest(crc_fast::Digest);

impl Crc32cDigest {
    /// The sum of no bytes yet.
    pub(crate) fn new() -> Self {
        Self(crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi))
    }

    /// Adds `data` after the bytes given so far.
    pub(crate) fn update(&mut self, data: &[u8]) {
        self.0.update(data);
    }

    /// The crc32c of every byte given.
    pub(crate) fn finish(self) -> u32 {
        self.0.finalize() as u32
    }
}

/// crc32c of pieces laid end to end, each given as (its crc32c, its length).
pub fn crc32c_concat(pieces: impl IntoIterator<Item = (u32, usize)>) -> u32 {
    pieces.into_iter().fold(None, |acc, (crc, len)| Some(acc.map_or(crc, |a| crc32c_combine(a, crc, len)))).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn known_value() {
        // The check value of CRC-32/ISCSI.
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(crc32c(&[]), 0);
        assert_eq!(crc32c_concat([]), 0);
    }

    #[test]
    fn combine_is_fast_and_exact_at_large_lengths() {
        // Lengths beyond any buffer: checked against the `crc32c` crate's combine.
        for len in [0usize, 1, 255, 1 << 20, (1 << 32) + 7, usize::MAX >> 3] {
            for (a, b) in [(0u32, 0u32), (0xdead_beef, 0x1234_5678), (u32::MAX, 1)] {
                assert_eq!(crc32c_combine(a, b, len), crc32c::crc32c_combine(a, b, len), "len {len}");
            }
        }
        // With nothing appended the first sum is kept.
        assert_eq!(crc32c_combine(0xabcd_ef01, 0, 0), 0xabcd_ef01);
    }

    proptest! {
        #[test]
        fn combine_matches_the_crc32c_crate(a in any::<u32>(), b in any::<u32>(), len in 0usize..(1 << 40)) {
            prop_assert_eq!(crc32c_combine(a, b, len), crc32c::crc32c_combine(a, b, len));
        }

        #[test]
        fn matches_the_reference_implementation_and_combines(
            data in proptest::collection::vec(any::<u8>(), 0..5000),
            cuts in proptest::collection::vec(0usize..5000, 0..6),
        ) {
            prop_assert_eq!(crc32c(&data), crc32c::crc32c(&data));
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(data.len())).collect();
            cuts.push(0);
            cuts.push(data.len());
            cuts.sort_unstable();
            let pieces = cuts.windows(2).map(|w| (crc32c(&data[w[0]..w[1]]), w[1] - w[0]));
            prop_assert_eq!(crc32c_concat(pieces), crc32c(&data));
        }
    }
}
