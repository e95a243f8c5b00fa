use super::*;

#[test]
fn the_ratio_bound_follows_the_rate() {
    assert_eq!(ratio_bound(0.0), 0);
    assert_eq!(ratio_bound(-1.0), 0);
    assert_eq!(ratio_bound(1.0), u64::MAX);
    assert_eq!(ratio_bound(0.5), 1 << 62);
    // No trace id is sampled at 0, every one at 1.
    assert!((u64::MAX >> 1) < ratio_bound(1.0));
    assert_eq!(ratio_bound(0.0), 0, "not even the smallest trace id");
}
