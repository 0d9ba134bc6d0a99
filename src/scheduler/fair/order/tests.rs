use super::*;

const H: i64 = 10_000;

/// Release `n` jobs, one every `every_ms` from `start_ms`, counting the
/// picks per tenant; returns the counts and the time after the last.
fn run(o: &mut TenantOrder, start_ms: i64, n: usize, every_ms: i64) -> (HashMap<String, usize>, i64) {
    let mut counts: HashMap<String, usize> = HashMap::default();
    let mut now = start_ms;
    for _ in 0..n {
        let p = o.pick().expect("a tenant waits");
        o.charge(&p, now, 1.0);
        *counts.entry(p.tenant.to_string()).or_default() += 1;
        now += every_ms;
    }
    (counts, now)
}

fn weights(pairs: &[(&str, f64)]) -> Weights {
    Weights {
        default: 1.0,
        tenants: pairs.iter().map(|(t, w)| (t.to_string(), *w)).collect(),
    }
}

#[test]
fn a_lone_tenant_gets_every_release_and_nobody_waiting_gets_none() {
    let mut o = TenantOrder::new(Weights::default(), H, 0);
    assert_eq!(o.pick(), None);
    o.set_waiting("a", 1, true);
    let (counts, _) = run(&mut o, 0, 1_000, 1);
    assert_eq!(counts.get("a"), Some(&1_000));
    o.set_waiting("a", 1, false);
    assert_eq!(o.pick(), None);
}

#[test]
fn backlogged_tenants_share_by_weight() {
    let mut o = TenantOrder::new(weights(&[("big", 3.0)]), H, 0);
    o.set_waiting("big", 1, true);
    o.set_waiting("small", 1, true);
    // 10 s of releases at 1,000/s.
    let (counts, _) = run(&mut o, 0, 10_000, 1);
    let ratio = counts["big"] as f64 / counts["small"] as f64;
    assert!((ratio - 3.0).abs() / 3.0 <= 0.05, "3:1 within 5 %: {counts:?}");
    // Three equal tenants share equally.
    let mut o = TenantOrder::new(Weights::default(), H, 0);
    for t in ["x", "y", "z"] {
        o.set_waiting(t, 1, true);
    }
    let (counts, _) = run(&mut o, 0, 9_000, 1);
    for t in ["x", "y", "z"] {
        assert!(counts[t].abs_diff(3_000) <= 1, "{counts:?}");
    }
}

#[test]
fn a_tenant_that_just_ran_a_burst_yields_to_a_newcomer_then_shares_again_after_about_the_half_life() {
    let mut o = TenantOrder::new(Weights::default(), H, 0);
    o.set_waiting("burst", 1, true);
    // Alone for six half-lives at 100 releases/s.
    let (_, now) = run(&mut o, 0, 6_000, 10);
    o.set_waiting("new", 1, true);
    // The first second goes (almost) all to the newcomer.
    let (first, now) = run(&mut o, now, 100, 10);
    assert!(first.get("new").copied().unwrap_or(0) >= 95, "{first:?}");
    // Until about the half-life it keeps the larger share ...
    let (early, now) = run(&mut o, now, 800, 10);
    assert!(
        early["new"] > early.get("burst").copied().unwrap_or(0),
        "{early:?}"
    );
    // ... and from there on they share equally.
    let (later, _) = run(&mut o, now + H / 10, 1_000, 10);
    let new_share = later["new"] as f64 / 1_000.0;
    assert!(
        (new_share - 0.5).abs() <= 0.05,
        "equal share after the half-life: {later:?}"
    );
}

#[test]
fn spreading_jobs_over_keys_buys_nothing_service_is_charged_per_tenant() {
    // The order never sees keys: two tenants, one with a thousand keys'
    // worth of jobs waiting, still alternate.
    let mut o = TenantOrder::new(Weights::default(), H, 0);
    for _key in 0..1_000 {
        o.set_waiting("many-keys", 1, true);
    }
    o.set_waiting("one-key", 1, true);
    let (counts, _) = run(&mut o, 0, 1_000, 1);
    assert_eq!((counts["many-keys"], counts["one-key"]), (500, 500));
}

#[test]
fn a_higher_class_goes_first_and_a_lower_one_waiting_is_served_once_every_guard() {
    let mut o = TenantOrder::new(Weights::default(), H, 0);
    o.set_waiting("low", 2, true);
    let (counts, _) = run(&mut o, 0, 10, 1);
    assert_eq!(counts["low"], 10, "alone, the low class gets everything");
    o.set_waiting("high", 0, true);
    assert_eq!(
        o.pick().map(|p| (p.tenant.to_string(), p.class)),
        Some(("high".into(), 0))
    );
    let n = 17 * 100;
    let (counts, _) = run(&mut o, 10, n, 1);
    let low = counts.get("low").copied().unwrap_or(0);
    assert_eq!(low, n / (STARVATION_GUARD as usize + 1), "{counts:?}");
    // A tenant's classes are tracked apart: its high jobs done, its low
    // ones still wait.
    o.set_waiting("high", 2, true);
    o.set_waiting("high", 0, false);
    let p = o.pick().unwrap();
    assert_eq!(p.class, 2);
}

#[test]
fn idle_tenants_are_forgotten_once_their_service_has_decayed() {
    let mut o = TenantOrder::new(Weights::default(), H, 0);
    for i in 0..1_000 {
        o.set_waiting(&format!("t{i}"), 1, true);
    }
    run(&mut o, 0, 1_000, 1);
    for i in 0..1_000 {
        o.set_waiting(&format!("t{i}"), 1, false);
    }
    o.set_waiting("still-waiting", 1, true);
    assert_eq!(o.sweep(1_000), 1_001, "recent service is remembered");
    // One unit decays below 1e-3 in log2(1000) ≈ 10 half-lives.
    assert_eq!(o.sweep(11 * H), 1, "only the tenant waiting is left");
    assert_eq!(o.recent_service("t1", 11 * H), None);
}

#[test]
fn the_order_holds_over_many_half_lives_and_weights_can_change() {
    let mut o = TenantOrder::new(weights(&[("a", 2.0)]), 100, 0);
    o.set_waiting("a", 1, true);
    o.set_waiting("b", 1, true);
    // Half-life 100 ms, one release per ms for a million ms (10,000
    // half-lives): the inflation would overflow f64 without rebasing.
    let (counts, now) = run(&mut o, 0, 1_000_000, 1);
    for t in ["a", "b"] {
        let s = o.recent_service(t, now).unwrap();
        assert!(s.is_finite(), "{t}: {s}");
    }
    let ratio = counts["a"] as f64 / counts["b"] as f64;
    assert!((ratio - 2.0).abs() <= 0.1, "{counts:?}");
    o.set_weights(weights(&[("b", 2.0)]));
    let (counts, _) = run(&mut o, now, 3_000, 1);
    let ratio = counts["b"] as f64 / counts["a"] as f64;
    assert!((ratio - 2.0).abs() <= 0.1, "{counts:?}");
}

#[test]
fn a_known_tenant_is_found_by_name_as_the_one_shared_name_until_it_is_forgotten() {
    let mut o = TenantOrder::new(Weights::default(), H, 0);
    assert!(o.name("a").is_none(), "unknown");
    o.set_waiting("a", 1, true);
    let pick = o.pick().expect("a waits");
    let name = o.name("a").expect("known while waiting").clone();
    assert!(
        Arc::ptr_eq(&name, &pick.tenant),
        "the same allocation as the order's"
    );
    o.charge(&pick, 0, 1.0);
    o.set_waiting("a", 1, false);
    assert!(o.name("a").is_some(), "recently served: still known");
    o.sweep(100 * H);
    assert!(o.name("a").is_none(), "forgotten once its service decayed away");
}
