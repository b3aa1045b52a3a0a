//! `lockmesh-load --renewal HOLDS:SESSIONS`: what renewing many holds costs.
//!
//! Opens SESSIONS sessions through the lock tier, attaches HOLDS/SESSIONS holds of
//! distinct keys to each (acquires with `x-lock-session`), then renews for three
//! renewal intervals (TTL/3 each) with one keepalive per session per interval, and
//! reads etcd's own Prometheus counters before and after that window:
//! `etcd_server_proposals_committed_total` (raft proposals: a keepalive is not one)
//! and `etcd_debugging_lease_renewed_total` (lease renewals etcd served). Holds ride
//! their session's lease, so renewal cost is per session, not per hold.

use std::time::Duration;

use anyhow::{bail, ensure, Context as _, Result};
use futures::{stream, StreamExt};
use tokio::time::Instant;

use crate::stack::Stack;

/// What the renewal window cost.
#[derive(Debug, Clone)]
pub struct RenewalReport {
    /// Holds attached.
    pub holds: usize,
    /// Sessions carrying them.
    pub sessions: usize,
    /// Session TTL, seconds.
    pub ttl_s: u64,
    /// Seconds spent attaching the holds.
    pub setup_s: f64,
    /// Renewal intervals measured.
    pub intervals: u32,
    /// Keepalives sent by the holders (all answered 200).
    pub keepalives: u64,
    /// Raft proposals committed during the window (etcd's counter).
    pub proposals: Option<u64>,
    /// Lease renewals etcd served during the window (etcd's counter).
    pub lease_renewals: Option<u64>,
    /// Holds still present at the end (must be all).
    pub holds_after: usize,
}

/// Sum of the samples of `metric` (any labels) in etcd's `/metrics` text.
fn counter(text: &str, metric: &str) -> Option<u64> {
    let mut found = false;
    let mut sum = 0.0;
    for l in text.lines().filter(|l| !l.starts_with('#')) {
        let name = l.split(['{', ' ']).next().unwrap_or_default();
        if name == metric {
            found = true;
            sum += l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
        }
    }
    found.then_some(sum as u64)
}

async fn etcd_metrics(url: &str) -> Result<String> {
    Ok(reqwest::get(format!("{url}/metrics")).await?.text().await?)
}

/// Runs the measurement on its own stack (one etcd member, one arbiter, the lock tier).
pub async fn run(holds: usize, sessions: usize, progress: bool) -> Result<RenewalReport> {
    ensure!(sessions > 0 && holds >= sessions, "--renewal HOLDS:SESSIONS needs HOLDS >= SESSIONS >= 1");
    let st = Stack::builder("renewal").envoy_config("lock-tier").own_etcd(1).start().await?;
    let c = st.client("load", "renewal")?;
    let etcd_url = st.etcd().endpoints().first().cloned().context("etcd endpoint")?;
    let mut sids = Vec::new();
    let mut ttl_s = 0;
    for _ in 0..sessions {
        let r = c.post("/v1/sessions", &[("x-lock-key", "load/renewal/probe")]).await?;
        ensure!(r.code() == 200, "open session: {} {}", r.code(), r.body);
        ttl_s = r.json["ttl_s"].as_u64().context("ttl_s")?;
        sids.push(r.json["session"].as_str().context("session")?.to_owned());
    }
    let per = holds / sessions;
    let start = Instant::now();
    let done = std::sync::atomic::AtomicUsize::new(0);
    let keeper = {
        // Keep the sessions alive while the holds are attached (it can take longer
        // than a TTL).
        let (c, sids) = (c.clone(), sids.clone());
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(ttl_s * 1000 / 3)).await;
                for s in &sids {
                    let _ = c.post("/v1/sessions/keepalive", &[("x-lock-session", s)]).await;
                }
            }
        })
    };
    let jobs = (0..sessions).flat_map(|s| (0..per).map(move |i| (s, i)));
    let results: Vec<Result<()>> = stream::iter(jobs)
        .map(|(s, i)| {
            let (c, sid, done) = (&c, &sids[s], &done);
            async move {
                let key = format!("load/renewal/s{s}/k{i}");
                let r = c.post("/v1/locks/acquire", &[("x-lock-key", &key), ("x-lock-session", sid)]).await?;
                if r.code() != 200 {
                    bail!("acquire {}: {}", r.code(), r.body);
                }
                let n = done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
                if progress && n % 1000 == 0 {
                    println!("  attached {n} holds ({:.0} s)", start.elapsed().as_secs_f64());
                }
                Ok(())
            }
        })
        .buffer_unordered(32)
        .collect()
        .await;
    keeper.abort();
    for r in results {
        r?;
    }
    let setup_s = start.elapsed().as_secs_f64();
    // The measured window: only renewals (and the arbiter's own 1 s seal check,
    // a read) reach etcd.
    let intervals = 3u32;
    let before = etcd_metrics(&etcd_url).await?;
    let mut keepalives = 0;
    for _ in 0..intervals {
        for s in &sids {
            let r = c.post("/v1/sessions/keepalive", &[("x-lock-session", s)]).await?;
            ensure!(r.code() == 200, "keepalive: {} {}", r.code(), r.body);
            keepalives += 1;
        }
        tokio::time::sleep(Duration::from_millis(ttl_s * 1000 / 3)).await;
    }
    let after = etcd_metrics(&etcd_url).await?;
    let delta = |m: &str| Some(counter(&after, m)?.saturating_sub(counter(&before, m)?));
    let mut etcd = st.etcd().client().await?;
    let prefix = format!("{}/l/", st.root());
    let holds_after =
        etcd.get(prefix, Some(etcd_client::GetOptions::new().with_prefix().with_count_only())).await?.count() as usize;
    Ok(RenewalReport {
        holds: per * sessions,
        sessions,
        ttl_s,
        setup_s,
        intervals,
        keepalives,
        proposals: delta("etcd_server_proposals_committed_total"),
        lease_renewals: delta("etcd_debugging_lease_renewed_total"),
        holds_after,
    })
}

/// The summary.
pub fn render(r: &RenewalReport) -> String {
    let opt = |v: Option<u64>| v.map_or_else(|| "n/a".to_owned(), |v| v.to_string());
    format!(
        "renewal: {} holds on {} sessions (TTL {} s; attached in {:.0} s)\n\
         window: {} renewal intervals of TTL/3: {} keepalives sent ({:.1} per interval)\n\
         etcd during the window: {} raft proposals committed, {} lease renewals served\n\
         holds still present after the window: {} of {}\n",
        r.holds,
        r.sessions,
        r.ttl_s,
        r.setup_s,
        r.intervals,
        r.keepalives,
        r.keepalives as f64 / f64::from(r.intervals),
        opt(r.proposals),
        opt(r.lease_renewals),
        r.holds_after,
        r.holds
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_a_counter_over_its_labels() {
        let t = "# HELP x\nfoo_total{a=\"1\"} 2\nfoo_total{a=\"2\"} 3\nfoo_total_other 9\nbar 1\n";
        assert_eq!(counter(t, "foo_total"), Some(5));
        assert_eq!(counter(t, "baz"), None);
    }
}
