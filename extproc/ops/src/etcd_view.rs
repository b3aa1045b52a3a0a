//! The etcd cluster as an operator needs to see it (`lockctl doctor`, the
//! console): every member with its server version, raft position and errors, who
//! leads, whether a quorum of voting members answers, and active alarms.
//!
//! Each member is asked through its own connection (its advertised client URL),
//! so an unreachable member shows as such instead of being hidden by the client's
//! balancing; the caller supplies the connections (`connect`).

use std::time::Duration;

use etcd_client::{AlarmAction, AlarmType, Client};

pub use lockmesh_core::wire::console::{ClusterView, MemberView};

/// Reads the member list through `client`, then each member's status through a
/// connection from `connect(url)`; every call is bounded by `timeout`.
pub async fn cluster_view<F, Fut>(client: &mut Client, timeout: Duration, connect: F) -> ClusterView
where
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = Result<Client, String>>,
{
    let mut view = ClusterView::default();
    let list = match tokio::time::timeout(timeout, client.member_list()).await {
        Ok(Ok(l)) => l,
        Ok(Err(e)) => {
            view.error = Some(format!("member list: {e}"));
            return view;
        }
        Err(_) => {
            view.error = Some(format!("member list: no answer within {timeout:?}"));
            return view;
        }
    };
    view.cluster_id = list.header().map(|h| format!("{:016x}", h.cluster_id()));
    let mut leaders = Vec::new();
    for m in list.members() {
        let mut mv = MemberView {
            id: format!("{:016x}", m.id()),
            name: m.name().to_owned(),
            url: m.client_urls().first().cloned(),
            learner: m.is_learner(),
            reachable: false,
            version: None,
            leader: false,
            raft_term: None,
            raft_index: None,
            db_size: None,
            errors: Vec::new(),
        };
        if let Some(url) = mv.url.clone() {
            let status = async {
                let mut c = tokio::time::timeout(timeout, connect(url.clone()))
                    .await
                    .map_err(|_| format!("connect: no answer within {timeout:?}"))??;
                tokio::time::timeout(timeout, c.status())
                    .await
                    .map_err(|_| format!("status: no answer within {timeout:?}"))?
                    .map_err(|e| format!("status: {e}"))
            };
            match status.await {
                Ok(s) => {
                    mv.reachable = true;
                    mv.version = Some(s.version().to_owned());
                    mv.raft_term = Some(s.raft_term());
                    mv.raft_index = Some(s.raft_index());
                    mv.db_size = Some(s.db_size());
                    mv.errors = s.errors().to_vec();
                    if s.leader() != 0 {
                        leaders.push(s.leader());
                    }
                    mv.leader = s.leader() == m.id();
                }
                Err(e) => mv.errors.push(e),
            }
        } else {
            mv.errors.push("not started (no client URL)".into());
        }
        view.members.push(mv);
    }
    view.voting = view.members.iter().filter(|m| !m.learner).count() as u64;
    view.voting_reachable = view.members.iter().filter(|m| !m.learner && m.reachable).count() as u64;
    leaders.sort_unstable();
    leaders.dedup();
    if let [one] = leaders.as_slice() {
        view.leader = Some(format!("{one:016x}"));
    }
    view.quorum = view.voting > 0 && view.voting_reachable * 2 > view.voting && view.leader.is_some();
    if let Ok(Ok(a)) = tokio::time::timeout(timeout, client.alarm(AlarmAction::Get, AlarmType::None, None)).await {
        view.alarms = a
            .alarms()
            .iter()
            .filter(|a| a.alarm() != AlarmType::None)
            .map(|a| format!("{} on member {:016x}", a.alarm().as_str_name(), a.member_id()))
            .collect();
    }
    view
}

/// How many leases etcd holds (every session, marker, waiter and advertisement
/// lease of every root on this cluster), bounded by `timeout`: `lockctl doctor`
/// reports it beside the database size, because each lease costs etcd memory and
/// a keepalive stream, and a leak of sessions shows here first.
pub async fn lease_count(client: &mut Client, timeout: Duration) -> Result<usize, String> {
    match tokio::time::timeout(timeout, client.leases()).await {
        Ok(Ok(r)) => Ok(r.leases().len()),
        Ok(Err(e)) => Err(format!("lease list: {e}")),
        Err(_) => Err(format!("lease list: no answer within {timeout:?}")),
    }
}

/// A member's database size against the backend quota: `(percent, verdict)` where
/// the verdict is 0 fine, 1 at or above 80 % (compact and defragment soon), 2 at or
/// above 95 % (etcd raises NOSPACE at the quota and then refuses every write).
pub fn quota_use(db_size: i64, quota: u64) -> (u64, u8) {
    let size = u64::try_from(db_size).unwrap_or(0);
    let pct = if quota == 0 { 100 } else { size.saturating_mul(100) / quota };
    (pct, if pct >= 95 { 2 } else { u8::from(pct >= 80) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quota_use_warns_at_80_and_fails_at_95_percent() {
        let gib = 1u64 << 30;
        assert_eq!(quota_use(0, 2 * gib), (0, 0));
        assert_eq!(quota_use(i64::try_from(gib).unwrap(), 2 * gib), (50, 0));
        assert_eq!(quota_use(i64::try_from(gib * 8 / 5).unwrap(), 2 * gib), (80, 1));
        assert_eq!(quota_use(i64::try_from(2 * gib).unwrap(), 2 * gib), (100, 2));
        assert_eq!(quota_use(-1, 2 * gib), (0, 0));
    }
}
