//! What the services say through their admin endpoints: the jobs waiting
//! in the schedulers' stores by when they come due, one pending job by id,
//! and the jobs the workers hold and run. The CLI asks the addresses given,
//! or the one in `[scheduler.admin]` / `[worker.admin]`.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use serde::Serialize;

use crate::admin;
use crate::config::Config;

/// The spans of [`SchedulerFigures::pending_by_due`], in order.
pub use crate::scheduler::DUE_SPANS;

/// The schedulers' figures, summed over the instances that answered.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SchedulerFigures {
    /// Admin endpoints asked.
    pub asked: Vec<String>,
    /// Those that did not answer (with why).
    pub unreachable: Vec<String>,
    /// Jobs pending in the stores of the instances that answered.
    pub pending: u64,
    /// The same by when they come due: already due (`now`), within a
    /// minute, an hour, a day, `later` (the keys of [`DUE_SPANS`]).
    pub pending_by_due: BTreeMap<String, u64>,
    /// The same per work topic, exact, when asked for ([`schedulers`] with
    /// `by_topic`: each scheduler reads every pending job for it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub by_topic: Option<BTreeMap<String, BTreeMap<String, u64>>>,
}

/// The admin endpoints to ask: `given`, or the configured `listen` address
/// (an unspecified address, such as `0.0.0.0`, is asked on loopback).
pub fn admin_addrs(listen: Option<SocketAddr>, given: &[SocketAddr]) -> Vec<SocketAddr> {
    if !given.is_empty() {
        return given.to_vec();
    }
    listen
        .map(|mut a| {
            if a.ip().is_unspecified() {
                a.set_ip(match a.ip() {
                    IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
                    IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
                });
            }
            a
        })
        .into_iter()
        .collect()
}

/// What the workers that answered say: jobs they hold, per work topic those
/// running now.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct WorkerFigures {
    /// Admin endpoints asked.
    pub asked: Vec<String>,
    /// Those that did not answer (with why).
    pub unreachable: Vec<String>,
    /// Jobs read and not yet settled (buffered or running), summed.
    pub open: u64,
    /// Per work topic, handler runs going on now, summed.
    pub running_by_topic: BTreeMap<String, u64>,
}

/// Ask each worker at `addrs` for its `/status`, and sum what they hold.
pub fn workers(cfg: &Config, addrs: &[SocketAddr]) -> WorkerFigures {
    let token = cfg.worker.admin.token.as_deref();
    let mut out = WorkerFigures::default();
    for addr in addrs {
        out.asked.push(addr.to_string());
        match status(*addr, token) {
            Ok(s) => {
                out.open += s["stats"]["open"].as_u64().unwrap_or(0);
                for t in s["by_topic"].as_array().into_iter().flatten() {
                    let topic = t["topic"].as_str().unwrap_or("?").to_string();
                    *out.running_by_topic.entry(topic).or_default() += t["running"].as_u64().unwrap_or(0);
                }
            }
            Err(e) => out.unreachable.push(format!("{addr}: {e}")),
        }
    }
    out
}

/// `GET /status` from an admin endpoint, as JSON.
fn status(addr: SocketAddr, token: Option<&str>) -> Result<serde_json::Value, String> {
    match admin::get(addr, "/status", token) {
        Ok((200, body)) => serde_json::from_str(&body).map_err(|e| e.to_string()),
        Ok((code, body)) => Err(format!("HTTP {code}: {}", body.trim())),
        Err(e) => Err(e.to_string()),
    }
}

/// Ask each scheduler at `addrs` for its `/status` (and, with `by_topic`,
/// its `/pending`), and sum what they hold.
pub fn schedulers(cfg: &Config, addrs: &[SocketAddr], by_topic: bool) -> SchedulerFigures {
    let token = cfg.scheduler.admin.token.as_deref();
    let mut out = SchedulerFigures {
        pending_by_due: DUE_SPANS.iter().map(|d| (d.to_string(), 0)).collect(),
        ..SchedulerFigures::default()
    };
    for addr in addrs {
        out.asked.push(addr.to_string());
        match status(*addr, token) {
            Ok(s) => {
                out.pending += s["stats"]["pending"].as_u64().unwrap_or(0);
                for (span, n) in out.pending_by_due.iter_mut() {
                    *n += s["pending_by_due"][span.as_str()].as_u64().unwrap_or(0);
                }
            }
            Err(e) => out.unreachable.push(format!("{addr}: {e}")),
        }
        if by_topic {
            let per = match admin::get(*addr, "/pending", token) {
                Ok((200, body)) => serde_json::from_str::<BTreeMap<String, BTreeMap<String, u64>>>(&body)
                    .map_err(|e| e.to_string()),
                Ok((code, body)) => Err(format!("HTTP {code}: {}", body.trim())),
                Err(e) => Err(e.to_string()),
            };
            match per {
                Ok(per) => {
                    let all = out.by_topic.get_or_insert_with(BTreeMap::new);
                    for (topic, spans) in per {
                        let t = all.entry(topic).or_default();
                        for (span, n) in spans {
                            *t.entry(span).or_default() += n;
                        }
                    }
                }
                Err(e) => out.unreachable.push(format!("{addr} /pending: {e}")),
            }
        }
    }
    out
}

/// Why a job could not be looked up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum JobLookupError {
    /// No admin endpoint to ask.
    #[error("no scheduler admin endpoint: set [scheduler.admin] listen, or pass --admin ADDR")]
    NoEndpoint,
    /// An endpoint refused the id.
    #[error("{0}")]
    Refused(String),
    /// No endpoint answered.
    #[error("no scheduler answered: {0}")]
    Unreachable(String),
}

/// The pending job `id`, from whichever scheduler at `addrs` owns its
/// partition (`None`: none of those that answered holds it).
pub fn find_job(
    cfg: &Config,
    addrs: &[SocketAddr],
    id: &str,
) -> Result<Option<serde_json::Value>, JobLookupError> {
    if addrs.is_empty() {
        return Err(JobLookupError::NoEndpoint);
    }
    let token = cfg.scheduler.admin.token.as_deref();
    let mut failures = Vec::new();
    for addr in addrs {
        match admin::get(*addr, &format!("/jobs/{id}"), token) {
            Ok((200, body)) => {
                return serde_json::from_str(&body)
                    .map(Some)
                    .map_err(|e| JobLookupError::Refused(e.to_string()))
            }
            Ok((404, _)) => {}
            Ok((400, body)) => {
                let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
                return Err(JobLookupError::Refused(format!(
                    "job id {id:?}: {}",
                    v["error"].as_str().unwrap_or(body.trim())
                )));
            }
            Ok((code, body)) => failures.push(format!("{addr}: HTTP {code}: {}", body.trim())),
            Err(e) => failures.push(format!("{addr}: {e}")),
        }
    }
    if failures.len() == addrs.len() {
        return Err(JobLookupError::Unreachable(failures.join("; ")));
    }
    Ok(None)
}
