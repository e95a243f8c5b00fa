use super::*;

#[test]
fn result_slots_follow_all() {
    for (idx, result) in MetricResult::ALL.into_iter().enumerate() {
        assert_eq!(result.slot(), idx, "{result:?}");
    }
}
