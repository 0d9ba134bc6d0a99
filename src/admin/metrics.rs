//! Metrics for one scrape, in the Prometheus client's registry: counters
//! and gauges read from a service's counters at scrape time, histograms
//! recorded as jobs go. Label sets stay small: a partition number at most,
//! never a key or a tenant.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

/// Bucket bounds of duration histograms, in seconds: 1 ms to 5 minutes.
const SECONDS: [f64; 16] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

/// A histogram of durations, in seconds on the wire. Recording is three
/// relaxed atomic additions and takes no lock, so jobs on many threads can
/// record without waiting on each other. Cheap to clone; clones share the
/// counts.
#[derive(Clone, Debug, Default)]
pub struct Histogram(Arc<Counts>);

#[derive(Debug, Default)]
struct Counts {
    /// Per bucket of [`SECONDS`] (and one past the last), the durations
    /// that fell in it (not cumulative).
    buckets: [AtomicU64; SECONDS.len() + 1],
    count: AtomicU64,
    /// Sum of the durations, in microseconds.
    sum_us: AtomicU64,
}

impl Histogram {
    /// Count one duration of `ms` milliseconds (negative counts as 0).
    pub fn observe_ms(&self, ms: i64) {
        self.observe_us(ms.max(0).saturating_mul(1000) as u64);
    }

    /// Count one duration.
    pub fn observe(&self, d: std::time::Duration) {
        self.observe_us(u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
    }

    /// How many durations were counted, and the upper bounds (ms) of the
    /// buckets holding the 50th and 99th percentiles (`None`: nothing
    /// counted, or beyond the last bound).
    pub fn summary_ms(&self) -> (u64, Option<f64>, Option<f64>) {
        let counts: Vec<u64> = self.0.buckets.iter().map(|n| n.load(Ordering::Relaxed)).collect();
        let total: u64 = counts.iter().sum();
        let at = |q: f64| -> Option<f64> {
            if total == 0 {
                return None;
            }
            let want = (q * total as f64).ceil().max(1.0) as u64;
            let mut seen = 0;
            for (i, n) in counts.iter().enumerate() {
                seen += n;
                if seen >= want {
                    return SECONDS.get(i).map(|b| b * 1000.0);
                }
            }
            None
        };
        (total, at(0.5), at(0.99))
    }

    fn observe_us(&self, us: u64) {
        let secs = us as f64 / 1e6;
        let i = SECONDS.partition_point(|b| *b < secs);
        let c = &self.0;
        c.buckets[i].fetch_add(1, Ordering::Relaxed);
        c.count.fetch_add(1, Ordering::Relaxed);
        c.sum_us.fetch_add(us, Ordering::Relaxed);
    }
}

impl EncodeMetric for Histogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let c = &self.0;
        // Per bucket, not cumulative: the encoder adds them up.
        let buckets: Vec<(f64, u64)> = SECONDS
            .iter()
            .copied()
            .chain([f64::MAX])
            .zip(&c.buckets)
            .map(|(bound, n)| (bound, n.load(Ordering::Relaxed)))
            .collect();
        // The count is the buckets' total, so a scrape during a record never
        // shows a count its buckets do not add up to.
        let count = buckets.iter().map(|(_, n)| n).sum();
        let sum = c.sum_us.load(Ordering::Relaxed) as f64 / 1e6;
        encoder.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

/// The metrics of one scrape, built by a service and rendered as text.
#[derive(Default)]
pub struct Metrics {
    registry: Registry,
}

impl Metrics {
    /// A counter (a total since the process started); `_total` is added
    /// to the name.
    pub fn counter(&mut self, name: &str, help: &str, value: u64) -> &mut Self {
        self.registry
            .register(name, help.trim_end_matches('.'), ConstCounter::new(value));
        self
    }

    /// A gauge (a value now).
    pub fn gauge(&mut self, name: &str, help: &str, value: i64) -> &mut Self {
        self.registry
            .register(name, help.trim_end_matches('.'), ConstGauge::new(value));
        self
    }

    /// A gauge per value of one label (a bounded set, such as partitions).
    pub fn gauge_by(
        &mut self,
        name: &str,
        help: &str,
        label: &str,
        values: impl IntoIterator<Item = (String, i64)>,
    ) -> &mut Self {
        let family = Family::<Vec<(String, String)>, Gauge>::default();
        for (l, v) in values {
            family.get_or_create(&vec![(label.to_string(), l)]).set(v);
        }
        self.registry.register(name, help.trim_end_matches('.'), family);
        self
    }

    /// A counter per combination of labels (a bounded set, such as work
    /// topics and outcomes); `_total` is added to the name.
    pub fn counter_by(
        &mut self,
        name: &str,
        help: &str,
        labels: &[&str],
        values: impl IntoIterator<Item = (Vec<String>, u64)>,
    ) -> &mut Self {
        let family = Family::<Vec<(String, String)>, Counter>::default();
        for (ls, v) in values {
            let set: Vec<(String, String)> = labels.iter().map(|l| l.to_string()).zip(ls).collect();
            family.get_or_create(&set).inc_by(v);
        }
        self.registry.register(name, help.trim_end_matches('.'), family);
        self
    }

    /// `kairos_<service>_rebalances_total{kind}`: partition assignments
    /// (`assigned`) and revocations (`revoked`) a consumer served.
    pub fn rebalances(&mut self, service: &str, assigned: u64, revoked: u64) -> &mut Self {
        self.counter_by(
            &format!("kairos_{service}_rebalances"),
            "Partition assignments and revocations served.",
            &["kind"],
            [
                (vec!["assigned".to_string()], assigned),
                (vec!["revoked".to_string()], revoked),
            ],
        )
    }

    /// A histogram of durations in seconds.
    pub fn histogram(&mut self, name: &str, help: &str, h: &Histogram) -> &mut Self {
        self.registry
            .register(name, help.trim_end_matches('.'), h.clone());
        self
    }

    /// The OpenMetrics text of everything added.
    pub fn render(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::new();
        encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_histogram_summary_names_the_buckets_of_its_percentiles() {
        let h = Histogram::default();
        assert_eq!(h.summary_ms(), (0, None, None));
        for _ in 0..98 {
            h.observe_ms(3); // the 5 ms bucket
        }
        h.observe_ms(40); // 50 ms
        h.observe_ms(700); // 1 s
        assert_eq!(h.summary_ms(), (100, Some(5.0), Some(50.0)));
        h.observe_ms(600_000); // beyond the last bound
        assert_eq!(h.summary_ms().0, 101);
    }

    #[test]
    fn counters_gauges_and_histograms_render_as_openmetrics() {
        let h = Histogram::default();
        h.observe_ms(3);
        h.observe_ms(-5);
        h.observe(std::time::Duration::from_secs(2));
        let mut m = Metrics::default();
        m.counter("kairos_test_fired", "Jobs fired.", 7)
            .gauge("kairos_test_pending", "Jobs pending.", 3)
            .gauge_by(
                "kairos_test_owned",
                "Jobs per partition.",
                "partition",
                [("0".into(), 2), ("4".into(), 1)],
            )
            .counter_by(
                "kairos_test_jobs",
                "Jobs by topic and outcome.",
                &["topic", "outcome"],
                [(vec!["mail".into(), "done".into()], 5)],
            )
            .histogram("kairos_test_lateness_seconds", "Lateness.", &h);
        let text = m.render().unwrap();
        assert!(text.contains("kairos_test_fired_total 7\n"), "{text}");
        assert!(text.contains("kairos_test_pending 3\n"), "{text}");
        assert!(
            text.contains("kairos_test_jobs_total{topic=\"mail\",outcome=\"done\"} 5\n"),
            "{text}"
        );
        assert!(text.contains("kairos_test_owned{partition=\"4\"} 1\n"), "{text}");
        assert!(text.contains("kairos_test_lateness_seconds_count 3\n"), "{text}");
        assert!(
            text.contains("kairos_test_lateness_seconds_bucket{le=\"0.001\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("kairos_test_lateness_seconds_bucket{le=\"0.005\"} 2\n"),
            "{text}"
        );
        assert!(
            text.contains("kairos_test_lateness_seconds_bucket{le=\"+Inf\"} 3\n"),
            "{text}"
        );
        assert!(
            text.contains("kairos_test_lateness_seconds_sum 2.003\n"),
            "{text}"
        );
        assert!(text.contains("# HELP kairos_test_fired Jobs fired.\n"), "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
    }
}
