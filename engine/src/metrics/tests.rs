//! The registry's own rules: label sets that add up, retired totals, encoding, histograms.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::*;

/// A source with one counter and one gauge, labelled by rank.
struct Fake {
    rank: u32,
    count: AtomicU64,
    ended: AtomicBool,
}

impl Fake {
    fn new(rank: u32) -> Arc<Self> {
        Arc::new(Self { rank, count: AtomicU64::new(0), ended: AtomicBool::new(false) })
    }
}

impl Source for Fake {
    fn collect(&self, out: &mut Samples) {
        let labels = vec![("rank", self.rank.to_string())];
        out.counter(
            "granary_test_reads",
            "Reads.",
            Unit::None,
            labels.clone(),
            self.count.load(Ordering::Relaxed) as f64,
        );
        out.gauge("granary_test_depth", "Depth.", Unit::None, labels, 3.0);
    }

    fn ended(&self) -> bool {
        self.ended.load(Ordering::Relaxed)
    }
}

#[test]
fn counters_of_one_label_set_add_up_and_survive_their_source() {
    let registry = Registry::default();
    let first = Fake::new(0);
    let other = Fake::new(1);
    registry.register(first.clone());
    registry.register(other.clone());
    first.count.store(5, Ordering::Relaxed);
    other.count.store(2, Ordering::Relaxed);
    let samples = registry.gather();
    assert_eq!(samples.value("granary_test_reads", &[("rank", "0")]), Some(5.0));
    assert_eq!(samples.value("granary_test_reads", &[("rank", "1")]), Some(2.0));

    // The first loader of rank 0 ends; its successor starts from zero.
    first.ended.store(true, Ordering::Relaxed);
    let second = Fake::new(0);
    second.count.store(4, Ordering::Relaxed);
    registry.register(second.clone());
    let samples = registry.gather();
    assert_eq!(samples.value("granary_test_reads", &[("rank", "0")]), Some(9.0), "monotonic across loaders");
    assert_eq!(samples.value("granary_test_depth", &[("rank", "0")]), Some(3.0), "only the live gauge");
    // Asked once more: the retired counts are not added twice.
    assert_eq!(registry.gather().value("granary_test_reads", &[("rank", "0")]), Some(9.0));
    assert_eq!(registry.lock().sources.len(), 2);
}

#[test]
fn the_exposition_is_openmetrics_text() {
    let registry = Registry::default();
    let source = Fake::new(7);
    source.count.store(12, Ordering::Relaxed);
    registry.register(source);
    let text = registry.encode(Format::OpenMetrics);
    assert!(text.contains("# TYPE granary_test_reads counter\n"), "{text}");
    assert!(text.contains("granary_test_reads_total{rank=\"7\"} 12\n"), "{text}");
    assert!(text.contains("granary_test_depth{rank=\"7\"} 3"), "{text}");
    assert!(text.ends_with("# EOF\n"), "{text}");
    let text = registry.encode(Format::Prometheus);
    assert!(text.contains("# TYPE granary_test_reads_total counter\n"), "{text}");
    assert!(text.contains("granary_test_reads_total{rank=\"7\"} 12\n"), "{text}");
    assert!(!text.contains("# EOF"), "{text}");
}

#[test]
fn histograms_are_cumulative_with_their_sum() {
    static BOUNDS: [f64; 3] = [0.001, 0.01, 0.1];
    let histogram = AtomicHistogram::new(&BOUNDS);
    for v in [0.0005, 0.005, 0.005, 0.05, 3.0] {
        histogram.observe(v);
    }
    let value = histogram.value();
    assert_eq!(value.count, 5);
    assert_eq!(value.buckets, vec![(0.001, 1), (0.01, 2), (0.1, 1), (f64::INFINITY, 1)]);
    assert!((value.sum - 3.0605).abs() < 1e-6, "{}", value.sum);

    let mut samples = Samples::default();
    samples.histogram("granary_test_wait", "Waits.", Unit::Seconds, vec![], value.clone());
    samples.histogram("granary_test_wait", "Waits.", Unit::Seconds, vec![], value);
    let both = samples.histogram_value("granary_test_wait", &[]).expect("the histogram");
    assert_eq!(both.count, 10);
    assert_eq!(both.buckets[1], (0.01, 4));

    let registry = Registry::default();
    struct One(HistogramValue);
    impl Source for One {
        fn collect(&self, out: &mut Samples) {
            out.histogram("granary_test_wait", "Waits.", Unit::Seconds, vec![], self.0.clone());
        }
    }
    registry.register(Arc::new(One(histogram.value())));
    let text = registry.encode(Format::OpenMetrics);
    assert!(text.contains("granary_test_wait_seconds_bucket{le=\"0.01\"} 3\n"), "{text}");
    assert!(text.contains("granary_test_wait_seconds_count 5\n"), "{text}");
}
