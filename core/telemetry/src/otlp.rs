//! Tracing spans exported to an OpenTelemetry collector over OTLP/HTTP with the
//! JSON encoding (`telemetry.otlp_endpoint`; off by default), `docs/OPERATIONS.md`.
//!
//! The project's own small exporter rather than the `opentelemetry` crates: a
//! [`tracing_subscriber::Layer`] that records only spans of the target
//! [`TARGET`], and a thread that posts them in batches as
//! `ExportTraceServiceRequest` JSON (OTLP/JSON: lowerCamelCase field names, hex
//! trace and span ids, 64-bit integers as decimal strings, enums as numbers). It
//! adds no crate to the build (reqwest and serde_json are already in it).
//!
//! # Redaction
//! A span exports only attributes named in [`ALLOWED`]: class, namespace, tier,
//! outcome, wait time, the etcd operation, the short key digest, a route and a
//! refusal code. Any other field of a span is dropped here, whatever the code
//! that opened the span put in it, so a token, a raw lock key, a session or an
//! identity can never reach the collector. Spans of other targets (tonic, h2,
//! etcd-client) are never exported.
//!
//! # Spans
//! | name | where | attributes |
//! |---|---|---|
//! | `lockmesh.acquire` | an acquire, receipt to answer | `class`, `namespace`, `tier`, `key_digest`, `outcome`, `wait_ms` |
//! | `lockmesh.release` | a release | `class`, `namespace`, `tier`, `key_digest`, `outcome` |
//! | `lockmesh.etcd` | an etcd call made for a caller under its deadline; `op=txn` under an acquire is the grant transaction | `op`, `outcome` |
//! | `lockmesh.audit_commit` | the audit tailer's commit of a batch with its checkpoint | `events`, `outcome` |

use std::{
    sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TrySendError},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use serde::Deserialize;
use serde_json::{json, Value};
use tracing::{
    field::{Field, Visit},
    span, Subscriber,
};
use tracing_subscriber::{layer::Context, registry::LookupSpan, Layer};

/// The `tracing` target of every exported span.
pub(crate) const TARGET: &str = "lockmesh_otel";

/// The only span fields that are exported (see the module docs).
pub const ALLOWED: &[&str] =
    &["class", "namespace", "tier", "outcome", "wait_ms", "op", "key_digest", "route", "code", "attempts", "events"];

/// Default `telemetry.export_interval_ms`.
pub(crate) const DEFAULT_EXPORT_INTERVAL_MS: u64 = 1000;
/// Spans buffered for export; beyond it new spans are dropped (and counted).
const QUEUE: usize = 8192;
/// Spans per request to the collector.
const BATCH: usize = 512;

/// `telemetry:` as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTelemetry {
    /// The collector's OTLP/HTTP traces URL, e.g. `http://otel-collector:4318`
    /// (`/v1/traces` is added when the URL has no path). Without it nothing is
    /// exported.
    pub otlp_endpoint: Option<String>,
    /// `service.name` of the exported spans. Default: the component's name.
    pub(crate) service_name: Option<String>,
    /// How often spans are sent, ms. Default 1000.
    pub export_interval_ms: Option<u64>,
}

/// Validated `telemetry`.
#[derive(Debug, Clone)]
pub struct Telemetry {
    /// The traces URL.
    pub url: String,
    /// `service.name`.
    pub(crate) service_name: String,
    /// How often spans are sent (`export_interval_ms`).
    pub interval: Duration,
}

/// Validates `telemetry` (errors `file: telemetry.field: why`); `None` when no
/// endpoint is configured.
pub fn validate(
    raw: Option<&RawTelemetry>,
    default_service: &str,
    name: &str,
    errs: &mut Vec<String>,
) -> Option<Telemetry> {
    let raw = raw?;
    let ep = raw.otlp_endpoint.as_deref()?;
    let Some(rest) = ep.strip_prefix("http://").or_else(|| ep.strip_prefix("https://")) else {
        errs.push(format!("{name}: telemetry.otlp_endpoint: {ep:?} must be an http:// or https:// URL"));
        return None;
    };
    let (host, path) = rest.split_once('/').map_or((rest, ""), |(h, p)| (h, p));
    if host.is_empty() || path.contains(['?', '#']) {
        errs.push(format!("{name}: telemetry.otlp_endpoint: {ep:?} must be scheme://host[:port][/path]"));
        return None;
    }
    let url = if path.is_empty() { format!("{}/v1/traces", ep.trim_end_matches('/')) } else { ep.to_owned() };
    let ms = raw.export_interval_ms.unwrap_or(DEFAULT_EXPORT_INTERVAL_MS);
    if !(100..=60_000).contains(&ms) {
        errs.push(format!("{name}: telemetry.export_interval_ms: {ms} is outside 100 to 60000"));
    }
    let service_name = raw.service_name.clone().unwrap_or_else(|| default_service.to_owned());
    if service_name.is_empty() {
        errs.push(format!("{name}: telemetry.service_name: must not be empty"));
    }
    Some(Telemetry { url, service_name, interval: Duration::from_millis(ms) })
}

/// An attribute value.
#[derive(Debug, Clone, PartialEq)]
enum Attr {
    Str(String),
    Int(i64),
    Bool(bool),
    F64(f64),
}

/// One span as it is exported.
#[derive(Debug, Clone)]
struct SpanData {
    trace_id: u128,
    span_id: u64,
    parent: Option<u64>,
    name: &'static str,
    start_ns: u64,
    end_ns: u64,
    attrs: Vec<(&'static str, Attr)>,
}

struct Fields<'a>(&'a mut Vec<(&'static str, Attr)>);

impl Fields<'_> {
    fn put(&mut self, field: &Field, v: Attr) {
        let Some(key) = ALLOWED.iter().find(|k| **k == field.name()) else { return };
        match self.0.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1 = v,
            None => self.0.push((key, v)),
        }
    }
}

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.put(field, Attr::Str(format!("{value:?}")));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.put(field, Attr::Str(value.to_owned()));
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.put(field, Attr::Int(value));
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.put(field, Attr::Int(i64::try_from(value).unwrap_or(i64::MAX)));
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.put(field, Attr::Bool(value));
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.put(field, Attr::F64(value));
    }
}

fn now_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

fn nonzero<T: Default + PartialEq>(f: impl Fn() -> T) -> T {
    loop {
        let v = f();
        if v != T::default() {
            return v;
        }
    }
}

/// Where closed spans go: the exporter started by [`start`] (the binaries), or a
/// channel of the caller's (tests).
enum Sink {
    Global,
    #[cfg_attr(not(test), allow(dead_code))]
    Fixed(SyncSender<SpanData>),
}

/// The exporter's queue, set once by [`start`].
static SINK: std::sync::OnceLock<SyncSender<SpanData>> = std::sync::OnceLock::new();

/// The layer: records [`TARGET`] spans and hands each closed one to the exporter.
/// Installed by every binary at startup (it costs nothing until [`start`]: its
/// filter admits no span before).
pub struct OtlpLayer {
    sink: Sink,
    dropped: std::sync::atomic::AtomicU64,
}

impl OtlpLayer {
    fn sender(&self) -> Option<&SyncSender<SpanData>> {
        match &self.sink {
            Sink::Global => SINK.get(),
            Sink::Fixed(tx) => Some(tx),
        }
    }
}

impl<S> Layer<S> for OtlpLayer
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &span::Attributes<'_>, id: &span::Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else { return };
        let parent = span.parent().and_then(|p| p.extensions().get::<SpanData>().map(|d| (d.trace_id, d.span_id)));
        let mut data = SpanData {
            trace_id: parent.map_or_else(|| nonzero(rand::random::<u128>), |p| p.0),
            span_id: nonzero(rand::random::<u64>),
            parent: parent.map(|p| p.1),
            name: attrs.metadata().name(),
            start_ns: now_ns(),
            end_ns: 0,
            attrs: Vec::new(),
        };
        attrs.record(&mut Fields(&mut data.attrs));
        span.extensions_mut().insert(data);
    }

    fn on_record(&self, id: &span::Id, values: &span::Record<'_>, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id) {
            if let Some(data) = span.extensions_mut().get_mut::<SpanData>() {
                values.record(&mut Fields(&mut data.attrs));
            }
        }
    }

    fn on_close(&self, id: span::Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(&id) else { return };
        let Some(mut data) = span.extensions_mut().remove::<SpanData>() else { return };
        data.end_ns = now_ns();
        if let Some(Err(TrySendError::Full(_))) = self.sender().map(|tx| tx.try_send(data)) {
            self.dropped.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

/// The layer every binary installs, filtered to [`TARGET`] spans and to the time
/// after [`start`] (before it, or without `telemetry.otlp_endpoint`, no span is
/// even created).
pub fn layer<S>() -> impl Layer<S>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    let on = tracing_subscriber::filter::filter_fn(|m| m.target() == TARGET && SINK.get().is_some());
    OtlpLayer { sink: Sink::Global, dropped: Default::default() }.with_filter(on)
}

/// The log layer's filter: `RUST_LOG` (default `info`) without [`TARGET`] spans,
/// which never show in log lines.
pub fn log_filter<S>() -> impl tracing_subscriber::layer::Filter<S> {
    use tracing_subscriber::filter::FilterExt;
    let env = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    env.and(tracing_subscriber::filter::filter_fn(|m| m.target() != TARGET))
}

/// A running exporter: flushes what is queued when [`Exporter::shutdown`] is
/// called (or gives up after 2 s).
pub struct Exporter {
    stop: SyncSender<()>,
    done: Receiver<()>,
}

impl Exporter {
    /// Flushes the queued spans and stops the export thread.
    pub fn shutdown(self) {
        let _ = self.stop.try_send(());
        let _ = self.done.recv_timeout(Duration::from_secs(2));
    }
}

/// Starts exporting to `cfg.url` (once per process; a second call returns
/// `None`): from now on [`layer`] records spans.
pub fn start(cfg: &Telemetry) -> Option<Exporter> {
    let (tx, rx) = sync_channel(QUEUE);
    if SINK.set(tx).is_err() {
        return None;
    }
    let (stop_tx, stop_rx) = sync_channel(1);
    let (done_tx, done_rx) = sync_channel(1);
    let service = cfg.service_name.clone();
    let cfg = cfg.clone();
    let spawned = std::thread::Builder::new().name("otlp-export".into()).spawn(move || {
        export_loop(&cfg, &rx, &stop_rx);
        let _ = done_tx.send(());
    });
    match spawned {
        // The URL is not logged: it may carry credentials.
        Ok(_) => tracing::info!(service = %service, "exporting spans over OTLP/HTTP"),
        Err(e) => tracing::warn!(error = %e, "could not start the OTLP export thread; spans are dropped"),
    }
    Some(Exporter { stop: stop_tx, done: done_rx })
}

fn export_loop(cfg: &Telemetry, rx: &Receiver<SpanData>, stop: &Receiver<()>) {
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("otlp exporter: cannot start its runtime: {e}");
            return;
        }
    };
    let http = match reqwest::Client::builder().timeout(Duration::from_secs(10)).build() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("otlp exporter: {e}");
            return;
        }
    };
    let mut warned_at: Option<tokio::time::Instant> = None;
    let mut batch = Vec::new();
    loop {
        let deadline = tokio::time::Instant::now() + cfg.interval;
        let stopping = loop {
            if stop.try_recv().is_ok() {
                break true;
            }
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() || batch.len() >= BATCH {
                break false;
            }
            match rx.recv_timeout(left.min(Duration::from_millis(100))) {
                Ok(s) => batch.push(s),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break true,
            }
        };
        if stopping {
            batch.extend(rx.try_iter());
        }
        for chunk in batch.chunks(BATCH) {
            let body = encode(&cfg.service_name, chunk).to_string();
            let sent = rt.block_on(async {
                let r = http.post(&cfg.url).header("content-type", "application/json").body(body).send().await;
                match r {
                    Ok(r) if r.status().is_success() => Ok(()),
                    Ok(r) => Err(format!("collector answered {}", r.status())),
                    Err(e) => Err(e.to_string()),
                }
            });
            if let Err(e) = sent {
                // At most one warning a minute; the spans of a failed post are dropped.
                if warned_at.is_none_or(|t| t.elapsed() > Duration::from_secs(60)) {
                    tracing::warn!(error = %e, spans = chunk.len(), "could not export spans to the OTLP collector");
                    warned_at = Some(tokio::time::Instant::now());
                }
            }
        }
        batch.clear();
        if stopping {
            return;
        }
    }
}

fn attr_json(v: &Attr) -> Value {
    match v {
        Attr::Str(s) => json!({ "stringValue": s }),
        // OTLP/JSON: 64-bit integers are decimal strings.
        Attr::Int(i) => json!({ "intValue": i.to_string() }),
        Attr::Bool(b) => json!({ "boolValue": b }),
        Attr::F64(f) => json!({ "doubleValue": f }),
    }
}

/// `ExportTraceServiceRequest` in OTLP/JSON.
fn encode(service: &str, spans: &[SpanData]) -> Value {
    let spans: Vec<Value> = spans
        .iter()
        .map(|s| {
            let error = s.attrs.iter().any(|(k, v)| {
                *k == "outcome" && matches!(v, Attr::Str(o) if matches!(o.as_str(), "error" | "unavailable"))
            });
            let mut v = json!({
                "traceId": format!("{:032x}", s.trace_id),
                "spanId": format!("{:016x}", s.span_id),
                "name": s.name,
                // SPAN_KIND_SERVER for a caller's request, SPAN_KIND_CLIENT for an etcd call.
                "kind": if s.name == "lockmesh.etcd" { 3 } else { 2 },
                "startTimeUnixNano": s.start_ns.to_string(),
                "endTimeUnixNano": s.end_ns.to_string(),
                "attributes": s.attrs.iter().map(|(k, v)| json!({ "key": k, "value": attr_json(v) })).collect::<Vec<_>>(),
                // STATUS_CODE_ERROR for errors; UNSET otherwise (a refusal is not a fault).
                "status": { "code": if error { 2 } else { 0 } },
            });
            if let Some(p) = s.parent {
                v["parentSpanId"] = json!(format!("{p:016x}"));
            }
            v
        })
        .collect();
    json!({ "resourceSpans": [{
        "resource": { "attributes": [
            { "key": "service.name", "value": { "stringValue": service } },
            { "key": "service.version", "value": { "stringValue": env!("CARGO_PKG_VERSION") } },
        ] },
        "scopeSpans": [{ "scope": { "name": "lockmesh", "version": env!("CARGO_PKG_VERSION") }, "spans": spans }],
    }] })
}

/// The span of one acquire (`lockmesh.acquire`), its outcome and wait recorded by
/// [`finish`]. Its fields are all in [`ALLOWED`]: the class, namespace and tier
/// labels of the metrics and the short digest, never the key, a token or an
/// identity. Labels are computed only when the span is exported.
pub fn acquire_span(reg: &lockmesh_core::ClassRegistry, key: &lockmesh_core::LockKey) -> tracing::Span {
    use tracing::field::Empty;
    let span = tracing::info_span!(target: TARGET, "lockmesh.acquire",
        class = Empty, namespace = Empty, tier = Empty, key_digest = Empty, outcome = Empty, wait_ms = Empty);
    label(&span, reg, key);
    span
}

/// The span of one release (`lockmesh.release`).
pub fn release_span(reg: &lockmesh_core::ClassRegistry, key: &lockmesh_core::LockKey) -> tracing::Span {
    use tracing::field::Empty;
    let span = tracing::info_span!(target: TARGET, "lockmesh.release",
        class = Empty, namespace = Empty, tier = Empty, key_digest = Empty, outcome = Empty);
    label(&span, reg, key);
    span
}

fn label(span: &tracing::Span, reg: &lockmesh_core::ClassRegistry, key: &lockmesh_core::LockKey) {
    if span.is_disabled() {
        return;
    }
    let l = crate::labels::lock_labels(reg, key);
    span.record("class", l.class.as_str());
    span.record("namespace", l.namespace.as_str());
    span.record("tier", l.tier);
    let d = key.digest();
    span.record("key_digest", d.short());
}

/// Records a span's outcome (a bounded label) and, for an acquire, its wait.
pub fn finish(span: &tracing::Span, outcome: &str, waited: Option<Duration>) {
    span.record("outcome", outcome);
    if let Some(w) = waited {
        span.record("wait_ms", u64::try_from(w.as_millis()).unwrap_or(u64::MAX));
    }
}

/// The span of the audit tailer's commit of `events` events with its checkpoint
/// (`lockmesh.audit_commit`).
pub fn audit_commit_span(events: usize) -> tracing::Span {
    tracing::info_span!(target: TARGET, "lockmesh.audit_commit", events, outcome = tracing::field::Empty)
}

/// The span of one etcd call (`lockmesh.etcd`); `op` names the operation by
/// its response type (`txn`, `get`, `put`, ...).
pub fn etcd_span<T>() -> tracing::Span {
    let ty = std::any::type_name::<T>();
    let op = match ty.rsplit("::").next().unwrap_or_default() {
        "TxnResponse" => "txn",
        "GetResponse" => "get",
        "PutResponse" => "put",
        "DeleteResponse" => "delete",
        "LeaseGrantResponse" => "lease_grant",
        "LeaseKeepAliveResponse" | "LeaseTimeToLiveResponse" => "lease",
        _ => "other",
    };
    tracing::info_span!(target: TARGET, "lockmesh.etcd", op, outcome = tracing::field::Empty)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing_subscriber::layer::SubscriberExt;

    #[test]
    fn endpoints_are_validated_and_get_the_traces_path() {
        let raw =
            |ep: &str| RawTelemetry { otlp_endpoint: Some(ep.into()), service_name: None, export_interval_ms: None };
        let mut errs = Vec::new();
        let t = validate(Some(&raw("http://collector:4318")), "arb", "a.yaml", &mut errs).unwrap();
        assert_eq!((t.url.as_str(), t.service_name.as_str()), ("http://collector:4318/v1/traces", "arb"));
        let t = validate(Some(&raw("https://c/otlp/v1/traces")), "arb", "a.yaml", &mut errs).unwrap();
        assert_eq!(t.url, "https://c/otlp/v1/traces");
        assert!(errs.is_empty(), "{errs:?}");
        assert!(validate(Some(&raw("grpc://c:4317")), "arb", "a.yaml", &mut errs).is_none());
        assert!(errs[0].starts_with("a.yaml: telemetry.otlp_endpoint:"), "{errs:?}");
        let off = RawTelemetry { otlp_endpoint: None, service_name: None, export_interval_ms: Some(5) };
        assert!(validate(Some(&off), "arb", "a.yaml", &mut errs).is_none(), "no endpoint: off");
    }

    /// Only allowed fields reach a span's data, whatever the span carries.
    #[test]
    fn spans_keep_only_allowed_fields_and_nest() {
        let (tx, rx) = sync_channel(16);
        let layer = OtlpLayer { sink: Sink::Fixed(tx), dropped: Default::default() };
        let ours = tracing_subscriber::filter::Targets::new().with_target(TARGET, tracing::Level::TRACE);
        let sub = tracing_subscriber::registry().with(layer.with_filter(ours));
        tracing::subscriber::with_default(sub, || {
            let outer = tracing::info_span!(target: TARGET, "lockmesh.acquire", class = "c", token = "281474976710659",
                key = "payments/secret", identity = "spiffe://td/ns/a/sa/b", outcome = tracing::field::Empty);
            outer.in_scope(|| {
                // The op is named by the response type's last path segment.
                struct TxnResponse;
                let inner = etcd_span::<TxnResponse>();
                inner.in_scope(|| tracing::info!("inside"));
            });
            finish(&outer, "granted", None);
            drop(outer);
            // Another target is never recorded.
            let _ = tracing::info_span!("not.ours", class = "x").entered();
        });
        let spans: Vec<SpanData> = rx.try_iter().collect();
        assert_eq!(spans.iter().map(|s| s.name).collect::<Vec<_>>(), ["lockmesh.etcd", "lockmesh.acquire"]);
        let (etcd, acq) = (&spans[0], &spans[1]);
        assert_eq!((etcd.trace_id, etcd.parent), (acq.trace_id, Some(acq.span_id)));
        assert_eq!(etcd.attrs, [("op", Attr::Str("txn".into()))]);
        assert_eq!(acq.attrs, [("class", Attr::Str("c".into())), ("outcome", Attr::Str("granted".into()))]);
        let body = encode("arb", &spans).to_string();
        for secret in ["281474976710659", "payments/secret", "spiffe://"] {
            assert!(!body.contains(secret), "{secret} exported: {body}");
        }
        let v: Value = serde_json::from_str(&body).unwrap();
        let s = &v["resourceSpans"][0]["scopeSpans"][0]["spans"][1];
        assert_eq!(s["traceId"].as_str().unwrap().len(), 32);
        assert_eq!(s["spanId"].as_str().unwrap().len(), 16);
        assert!(s["startTimeUnixNano"].as_str().unwrap().parse::<u64>().unwrap() > 0);
    }
}
