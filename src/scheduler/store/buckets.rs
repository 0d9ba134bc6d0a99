//! Time buckets of the far range: level `l` buckets are `1024 * 8^l` ms
//! wide; a far job goes to the widest bucket that starts at or after the
//! partition's cascade point.

/// Level 0 buckets are 2^10 ms wide; each level is 2^3 times wider.
pub(super) const BASE_SHIFT: u32 = 10;
pub(super) const LEVEL_SHIFT: u32 = 3;
/// Levels 0..14: the widest buckets span 2^49 ms (about 17,800 years).
pub(super) const LEVELS: u32 = 14;

pub(super) fn width(level: u32) -> i64 {
    1i64 << (BASE_SHIFT + LEVEL_SHIFT * level)
}

pub(super) fn align_down(ms: i64, w: i64) -> i64 {
    ms.div_euclid(w) * w
}

pub(super) fn align_up(ms: i64, w: i64) -> i64 {
    align_down(ms.saturating_add(w - 1), w)
}

/// The bucket of a far job due at `run_at_ms` when the cascade point is `t`
/// (aligned to level 0, `run_at_ms >= t`): the widest bucket starting at or after `t`.
pub(super) fn bucket_for(run_at_ms: i64, t: i64) -> i64 {
    let mut best = align_down(run_at_ms, width(0));
    for level in 1..LEVELS {
        let b = align_down(run_at_ms, width(level));
        if b < t {
            break;
        }
        best = b;
    }
    best
}

/// The buckets a far job due at `run_at_ms` can sit in when the cascade point is `t`.
pub(super) fn candidate_buckets(run_at_ms: i64, t: i64) -> Vec<i64> {
    let mut out: Vec<i64> = (0..LEVELS)
        .map(|l| align_down(run_at_ms, width(l)))
        .filter(|b| *b >= t)
        .collect();
    out.dedup();
    out
}
