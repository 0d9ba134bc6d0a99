//! The admin endpoint of a scheduler or a worker, for operators and their
//! monitoring: `GET /metrics` (Prometheus, OpenMetrics text), `/healthz`
//! (the process is alive), `/readyz` (it owns partitions and can work them)
//! and `/status` (what it holds and has done, as JSON); a scheduler also
//! `/jobs/{id}`, `/pending`, `/schedules` (its recurring schedules) and
//! `/dlq`.
//!
//! Off unless `[scheduler.admin] listen` or `[worker.admin] listen` is set.
//! It serves 127.0.0.1 (or another loopback address) as it is; any other
//! address needs a bearer token (`token`, or the environment variable
//! `KAIROS_SCHEDULER__ADMIN__TOKEN` / `KAIROS_WORKER__ADMIN__TOKEN`), and a
//! request without `Authorization: Bearer <token>` is refused with 401.
//! With a token set, every path needs it, on loopback too, except the
//! dashboard's own files (`/`, `/page.js`, `/page.css`), which hold no data.

mod metrics;

pub use metrics::{Histogram, Metrics};

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing;
use axum::Router;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::AdminConfig;

/// What a service shows on its admin endpoint.
pub trait Source: Send + Sync + 'static {
    /// Its metrics, filled in for a scrape.
    fn metrics(&self) -> Metrics;
    /// What it holds and has done, for `/status`.
    fn status(&self) -> serde_json::Value;
    /// Whether it can work now (answers `/readyz`).
    fn ready(&self) -> bool;
    /// The pending job with this id, if this process holds it (answers
    /// `/jobs/{id}`); an error for an id that cannot be one.
    fn job(&self, id: &str) -> Result<Option<serde_json::Value>, String> {
        let _ = id;
        Ok(None)
    }
    /// Pending jobs per work topic, by when they come due (answers
    /// `GET /pending`; reads every pending job).
    fn pending_by_topic(&self) -> Result<serde_json::Value, String> {
        Err("no pending jobs here".into())
    }
    /// The recurring schedules this process runs, with their next and
    /// last occurrences (answers `GET /schedules`).
    fn schedules(&self) -> Result<serde_json::Value, String> {
        Err("no recurring schedules here".into())
    }
    /// The dashboard served at `/`, if this process has one.
    fn page(&self) -> Option<Page> {
        None
    }
    /// The dead-letter topic's records, newest last (answers `GET /dlq`).
    fn dead_letters(&self) -> Result<serde_json::Value, String> {
        Err("no dead letters here".into())
    }
    /// Replay the dead jobs written since the last replay (answers `POST
    /// /dlq/replay`).
    fn replay_dead_letters(&self) -> Result<serde_json::Value, String> {
        Err("no dead letters here".into())
    }
}

/// A dashboard: a page, its script and its style sheet, served at `/`,
/// `/page.js` and `/page.css`. They hold no data (the script reads the
/// JSON endpoints), so they are served without the token; the page's
/// Content-Security-Policy lets only these files run or style it.
#[derive(Clone, Copy, Debug)]
pub struct Page {
    /// The HTML, with no inline script or style.
    pub html: &'static str,
    /// The script (`/page.js`).
    pub script: &'static str,
    /// The style sheet (`/page.css`).
    pub style: &'static str,
}

/// The policy sent with every answer: nothing runs, loads or styles but
/// the endpoint's own files (no inline script, so markup that reached the
/// page from data could not run), and no other site may frame it.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// The header a `POST` must carry (any value): a cross-site form cannot set
/// it, so a page elsewhere cannot make a browser on this machine replay.
pub const ACTION_HEADER: &str = "x-kairos-action";

/// Why the admin endpoint did not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AdminError {
    /// The address could not be bound (in use, not local, no permission).
    #[error("admin endpoint: cannot listen on {addr}: {source}")]
    Bind {
        /// The configured address.
        addr: SocketAddr,
        /// The error.
        source: std::io::Error,
    },
}

/// An admin endpoint bound to its address, not yet serving.
pub struct Admin {
    listener: std::net::TcpListener,
    token: Option<String>,
}

impl Admin {
    /// Bind the configured address; `None` when the endpoint is off. Binding
    /// happens here, so that a port in use is reported at build time and a
    /// port 0 is known before the service runs ([`Admin::local_addr`]).
    pub fn bind(cfg: &AdminConfig) -> Result<Option<Admin>, AdminError> {
        let Some(addr) = cfg.listen else {
            return Ok(None);
        };
        let bind = |source| AdminError::Bind { addr, source };
        let listener = std::net::TcpListener::bind(addr).map_err(bind)?;
        listener.set_nonblocking(true).map_err(bind)?;
        Ok(Some(Admin {
            listener,
            token: cfg.token.clone().filter(|t| !t.is_empty()),
        }))
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("a bound listener has an address")
    }

    /// Serve `source` until `stop` is cancelled. Must be called inside a
    /// tokio runtime.
    pub fn serve(self, source: Arc<dyn Source>, stop: CancellationToken) -> tokio::task::JoinHandle<()> {
        let addr = self.local_addr();
        let state = Arc::new(Served {
            source,
            token: self.token,
        });
        // The dashboard's files carry no data: a browser loads them without
        // the token (it keeps the token in the address's fragment).
        let files = Router::new()
            .route("/", routing::get(page))
            .route("/page.js", routing::get(page_script))
            .route("/page.css", routing::get(page_style));
        let app = Router::new()
            .route("/metrics", routing::get(metrics_page))
            .route("/healthz", routing::get(|| async { "ok\n" }))
            .route("/readyz", routing::get(readyz))
            .route("/status", routing::get(status))
            .route("/jobs/{id}", routing::get(job))
            .route("/dlq", routing::get(dead_letters))
            .route("/pending", routing::get(pending))
            .route("/schedules", routing::get(schedules))
            .route("/dlq/replay", routing::post(replay))
            .layer(middleware::from_fn_with_state(state.clone(), authorize))
            .merge(files)
            .layer(middleware::from_fn(secure))
            .with_state(state);
        let listener = self.listener;
        tokio::spawn(async move {
            let listener = match tokio::net::TcpListener::from_std(listener) {
                Ok(l) => l,
                Err(e) => {
                    warn!(%addr, error = %e, "admin endpoint not served");
                    return;
                }
            };
            info!(%addr, "admin endpoint serving / /metrics /healthz /readyz /status /jobs/ID /pending /schedules /dlq");
            let served = axum::serve(listener, app)
                .with_graceful_shutdown(async move { stop.cancelled().await })
                .await;
            if let Err(e) = served {
                warn!(%addr, error = %e, "admin endpoint stopped");
            }
        })
    }
}

/// `GET path` from an admin endpoint, with the bearer token if one is
/// given: the status code and the body. A minimal HTTP/1.1 client for the
/// command line, the demo and tests (one request per connection).
pub fn get(addr: SocketAddr, path: &str, token: Option<&str>) -> std::io::Result<(u16, String)> {
    use std::io::{Error, ErrorKind, Read, Write};
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))?;
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n{auth}\r\n"
    )?;
    let mut raw = String::new();
    s.read_to_string(&mut raw)?;
    let status = raw
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| Error::new(ErrorKind::InvalidData, format!("not an HTTP response: {raw:?}")))?;
    let body = raw.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_string();
    Ok((status, body))
}

struct Served {
    source: Arc<dyn Source>,
    token: Option<String>,
}

/// Refuse a request without the bearer token, when one is set.
async fn authorize(State(s): State<Arc<Served>>, req: Request, next: Next) -> Response {
    match &s.token {
        Some(token) if !bearer_matches(req.headers(), token) => (
            StatusCode::UNAUTHORIZED,
            [(header::WWW_AUTHENTICATE, "Bearer")],
            "a bearer token is required\n",
        )
            .into_response(),
        _ => next.run(req).await,
    }
}

/// Add the content policy and `nosniff` to every answer.
async fn secure(req: Request, next: Next) -> Response {
    let mut resp = next.run(req).await;
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        header::HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        header::HeaderValue::from_static("nosniff"),
    );
    resp
}

/// Whether `headers` carry `Authorization: Bearer <token>`, compared in time
/// that does not depend on where they differ.
fn bearer_matches(headers: &HeaderMap, token: &str) -> bool {
    let Some(given) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
    else {
        return false;
    };
    let (a, b) = (given.as_bytes(), token.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Run `f` on the source off the runtime threads (it may read the store).
async fn blocking<T: Send + 'static>(
    s: &Arc<Served>,
    f: impl FnOnce(&dyn Source) -> T + Send + 'static,
) -> Result<T, Response> {
    let source = s.source.clone();
    tokio::task::spawn_blocking(move || f(&*source))
        .await
        .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")).into_response())
}

async fn metrics_page(State(s): State<Arc<Served>>) -> Response {
    let rendered = match blocking(&s, |src| src.metrics().render()).await {
        Ok(r) => r,
        Err(resp) => return resp,
    };
    match rendered {
        Ok(text) => (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            text,
        )
            .into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")).into_response(),
    }
}

async fn readyz(State(s): State<Arc<Served>>) -> Response {
    if s.source.ready() {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n").into_response()
    }
}

fn json_response(code: StatusCode, v: &serde_json::Value) -> Response {
    let body = serde_json::to_string_pretty(v).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"));
    (code, [(header::CONTENT_TYPE, "application/json")], body + "\n").into_response()
}

async fn status(State(s): State<Arc<Served>>) -> Response {
    match blocking(&s, |src| src.status()).await {
        Ok(v) => json_response(StatusCode::OK, &v),
        Err(resp) => resp,
    }
}

async fn job(State(s): State<Arc<Served>>, axum::extract::Path(id): axum::extract::Path<String>) -> Response {
    let found = match blocking(&s, move |src| src.job(&id)).await {
        Ok(f) => f,
        Err(resp) => return resp,
    };
    match found {
        Ok(Some(v)) => json_response(StatusCode::OK, &v),
        Ok(None) => json_response(
            StatusCode::NOT_FOUND,
            &serde_json::json!({"error": "no pending job with this id in the partitions this process owns"}),
        ),
        Err(e) => json_response(StatusCode::BAD_REQUEST, &serde_json::json!({ "error": e })),
    }
}

/// One of the dashboard's files, with its content type.
fn page_file(s: &Served, content_type: &'static str, file: fn(&Page) -> &'static str) -> Response {
    match s.source.page() {
        Some(page) => ([(header::CONTENT_TYPE, content_type)], file(&page)).into_response(),
        None => (StatusCode::NOT_FOUND, "no dashboard here\n").into_response(),
    }
}

async fn page(State(s): State<Arc<Served>>) -> Response {
    page_file(&s, "text/html; charset=utf-8", |p| p.html)
}

async fn page_script(State(s): State<Arc<Served>>) -> Response {
    page_file(&s, "text/javascript; charset=utf-8", |p| p.script)
}

async fn page_style(State(s): State<Arc<Served>>) -> Response {
    page_file(&s, "text/css; charset=utf-8", |p| p.style)
}

/// Answer with what `f` returns as JSON (an error: 500 with the reason).
async fn json_from(
    s: &Arc<Served>,
    f: impl FnOnce(&dyn Source) -> Result<serde_json::Value, String> + Send + 'static,
) -> Response {
    match blocking(s, f).await {
        Ok(Ok(v)) => json_response(StatusCode::OK, &v),
        Ok(Err(e)) => json_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            &serde_json::json!({ "error": e }),
        ),
        Err(resp) => resp,
    }
}

async fn pending(State(s): State<Arc<Served>>) -> Response {
    json_from(&s, |src| src.pending_by_topic()).await
}

async fn schedules(State(s): State<Arc<Served>>) -> Response {
    json_from(&s, |src| src.schedules()).await
}

async fn dead_letters(State(s): State<Arc<Served>>) -> Response {
    json_from(&s, |src| src.dead_letters()).await
}

async fn replay(State(s): State<Arc<Served>>, headers: HeaderMap) -> Response {
    if !headers.contains_key(ACTION_HEADER) {
        let e = format!("a replay needs the {ACTION_HEADER} header");
        return json_response(StatusCode::BAD_REQUEST, &serde_json::json!({ "error": e }));
    }
    json_from(&s, |src| src.replay_dead_letters()).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn only_the_exact_bearer_token_passes() {
        let with = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::AUTHORIZATION, HeaderValue::from_str(v).unwrap());
            h
        };
        assert!(bearer_matches(&with("Bearer s3cret"), "s3cret"));
        assert!(!bearer_matches(&with("Bearer s3cre"), "s3cret"));
        assert!(!bearer_matches(&with("Bearer s3cretX"), "s3cret"));
        assert!(!bearer_matches(&with("Basic s3cret"), "s3cret"));
        assert!(!bearer_matches(&HeaderMap::new(), "s3cret"));
    }
}
