//! Model checks: random changes to the store against a plain map of the
//! pending jobs, at every step.

use super::*;

/// Pending jobs as they should be, and random changes to them.
struct Model {
    rng: rand::rngs::StdRng,
    jobs: HashMap<JobId, StoredJob>,
    ids: Vec<JobId>,
    seq: u64,
}

impl Model {
    fn new(seed: u64) -> Model {
        Model {
            rng: rand::rngs::StdRng::seed_from_u64(seed),
            jobs: HashMap::default(),
            ids: Vec::new(),
            seq: 0,
        }
    }

    /// `n` changes due in `now + span`: 8% cancels and 8% replaces of
    /// ids seen before, new jobs otherwise; the model follows them.
    fn changes(&mut self, n: usize, now: i64, span: std::ops::Range<i64>) -> Vec<Change> {
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            self.seq += 1;
            let roll = self.rng.gen_range(0..100);
            let ms = now + self.rng.gen_range(span.clone());
            let known = (!self.ids.is_empty()).then(|| self.ids[self.rng.gen_range(0..self.ids.len())]);
            match known {
                Some(id) if roll < 8 => {
                    self.jobs.remove(&id);
                    out.push(Change::Delete(id));
                    continue;
                }
                Some(id) if roll < 16 => {
                    let sj = StoredJob {
                        job: job("r", ms).id(id),
                        seq: self.seq,
                    };
                    self.jobs.insert(id, sj.clone());
                    out.push(Change::Put(sj));
                    continue;
                }
                _ => {}
            }
            let sj = StoredJob {
                job: job("k", ms),
                seq: self.seq,
            };
            self.ids.push(sj.job.id);
            self.jobs.insert(sj.job.id, sj.clone());
            out.push(Change::Put(sj));
        }
        out
    }
}

/// Near runs under random puts (before, between and after existing
/// runs), replaces, cancels and partial fires: the near range always
/// scans as the model sorted by (run-at, seq), and stays a few entries.
#[test]
fn near_runs_model_check() {
    let (_d, s) = open();
    let mut m = Model::new(11);
    let mut now = 1_700_000_000_000i64;
    cascade_to(&s, 0, now + 1_000_000_000); // everything below is near
    for round in 0..60 {
        let n = m.rng.gen_range(1..400);
        s.apply(0, &m.changes(n, now, -2_000..60_000), None).unwrap();
        now += m.rng.gen_range(0..2_000);
        // Fire part of what is due, in order, as a capacity-bound window would.
        let limit = m.rng.gen_range(0..300);
        let due = s.scan_due(0, None, now, limit).unwrap();
        let (model, ids) = (&mut m.jobs, &m.ids);
        for (k, j) in &due {
            assert!(k.run_at_ms <= now, "round {round}: early");
            assert_eq!(model.remove(&j.job.id).map(|m| DueKey::of(0, &m)), Some(*k));
        }
        let fires: Vec<Change> = due.iter().map(|(k, j)| Change::Fired(j.job.id, *k)).collect();
        s.apply(0, &fires, None).unwrap();
        let mut want: Vec<(DueKey, JobId)> = model.values().map(|j| (DueKey::of(0, j), j.job.id)).collect();
        want.sort();
        let got: Vec<(DueKey, JobId)> = s
            .scan_due(0, None, i64::MAX, usize::MAX)
            .unwrap()
            .into_iter()
            .map(|(k, j)| (k, j.job.id))
            .collect();
        assert_eq!(got, want, "round {round}");
        assert_eq!(s.checkpoint(0).unwrap().pending, model.len() as u64);
        for id in ids.iter().step_by(17) {
            assert_eq!(s.current(0, id).unwrap(), model.get(id).cloned(), "round {round}");
        }
    }
    let model = &m.jobs;
    assert!(model.len() > 2_000);
    assert!(
        s.count(N, 0) * 16 < model.len(),
        "{} near runs for {} jobs",
        s.count(N, 0),
        model.len()
    );
}

/// Random puts, replaces, cancels and fires over a month, checked against
/// a model at every step: nothing lost, nothing early, counts right, and
/// few entries for many jobs.
#[test]
fn model_check_over_a_month_of_cascades() {
    let (d, mut s) = open();
    s.log.set_segment_bytes(32 << 10);
    let mut m = Model::new(7);
    let month = 30 * 86_400_000i64;
    let mut now = 1_700_000_000_000i64;
    cascade_to(&s, 0, now);
    let mut fired = 0usize;
    for round in 0..40 {
        s.apply(0, &m.changes(250, now, -1000..month), None).unwrap();
        // Time moves; fire everything due, as the dispatcher would.
        now += m.rng.gen_range(0..month / 20);
        let (model, ids) = (&mut m.jobs, &m.ids);
        cascade_to(&s, 0, now + 1);
        let due = s.scan_due(0, None, now, usize::MAX).unwrap();
        let fires: Vec<Change> = due.iter().map(|(k, j)| Change::Fired(j.job.id, *k)).collect();
        for (k, j) in &due {
            let m = model
                .remove(&j.job.id)
                .expect("fired job is pending in the model");
            assert_eq!(
                (m.seq, m.job.run_at.timestamp_millis()),
                (k.seq, k.run_at_ms),
                "round {round}"
            );
            assert!(k.run_at_ms <= now);
        }
        fired += due.len();
        s.apply(0, &fires, None).unwrap();
        assert!(
            model.values().all(|j| j.job.run_at.timestamp_millis() > now),
            "round {round}: a due job was missed"
        );
        assert_eq!(
            s.checkpoint(0).unwrap().pending,
            model.len() as u64,
            "round {round}"
        );
        for id in ids.iter().step_by(37) {
            assert_eq!(s.current(0, id).unwrap(), model.get(id).cloned(), "round {round}");
        }
        // The value log: compacted now and then, reopened now and then
        // (as after a kill: whatever was flushed).
        s.check_log();
        if round % 3 == 0 {
            s.compact(64 << 10).unwrap();
            s.check_log();
        }
        s.flush().unwrap();
        if round % 7 == 6 {
            drop(s);
            s = reopen(d.path()).unwrap();
            s.log.set_segment_bytes(32 << 10);
            s.check_log();
        }
    }
    assert!(fired > 1000);
    let model = &m.jobs;
    let entries = s.count(N, 0) + s.count(B, 0) + s.count(J, 0);
    assert!(
        entries * 4 < model.len(),
        "{entries} entries for {} pending jobs",
        model.len()
    );
    // Everything left fires, in order, once.
    cascade_to(&s, 0, i64::MAX / 2);
    let rest: BTreeMap<DueKey, JobId> = s
        .scan_due(0, None, i64::MAX, usize::MAX)
        .unwrap()
        .into_iter()
        .map(|(k, j)| (k, j.job.id))
        .collect();
    assert_eq!(rest.len(), model.len());
    assert!(rest.values().all(|id| model.contains_key(id)));
}
