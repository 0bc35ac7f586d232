//! The percentile every report of the torture harness and the benchmark
//! gives, defined once so their figures mean the same thing.

/// The nearest-rank `q`-quantile (`q` in 0..=1) of `values`, in any order:
/// the smallest value with at least `q` of all values at or below it, so
/// `q = 0.5` of 1..=100 is 50, `q = 0.99` is 99 and `q = 1.0` the maximum.
/// `None` when `values` is empty; values that do not compare (NaN) count
/// as equal to everything.
///
/// ```
/// let waits_ns = [30, 10, 20, 40];
/// assert_eq!(dlock_testing::percentile(&waits_ns, 0.5), Some(20));
/// assert_eq!(dlock_testing::percentile(&waits_ns, 1.0), Some(40));
/// assert_eq!(dlock_testing::percentile::<f64>(&[], 0.99), None);
/// ```
pub fn percentile<T: Copy + PartialOrd>(values: &[T], q: f64) -> Option<T> {
    if values.is_empty() {
        return None;
    }
    // A rank from 1 to len: ceil(q × len), which `as` saturates for q out of range.
    let rank = ((q * values.len() as f64).ceil() as usize).clamp(1, values.len());
    let mut v = values.to_vec();
    let (_, nth, _) = v.select_nth_unstable_by(rank - 1, |a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    Some(*nth)
}

#[cfg(test)]
mod tests {
    use super::percentile;

    #[test]
    fn percentiles_use_nearest_rank() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&v, 0.50), Some(50));
        assert_eq!(percentile(&v, 0.99), Some(99));
        assert_eq!(percentile(&[7000u64], 0.99), Some(7000));
        assert_eq!(percentile::<u64>(&[], 0.5), None);
    }

    #[test]
    fn order_and_signs_do_not_matter() {
        let v = [3.0, -1.5, 2.0, -7.25, 0.0];
        assert_eq!(percentile(&v, 0.0), Some(-7.25), "q = 0 is the minimum");
        assert_eq!(percentile(&v, 0.5), Some(0.0));
        assert_eq!(percentile(&v, 1.0), Some(3.0));
        assert_eq!(percentile(&v, 1.5), Some(3.0), "q above 1 is the maximum");
        let mut reversed: Vec<u64> = (1..=100).rev().collect();
        assert_eq!(percentile(&reversed, 0.99), Some(99));
        reversed.truncate(1);
        assert_eq!(percentile(&reversed, 0.01), Some(100));
    }
}
