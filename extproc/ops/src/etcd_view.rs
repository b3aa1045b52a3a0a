//! The etcd cluster as an operator needs to see it (`lockctl doctor`, the
//! console): every member with its server version, raft position and errors, who
//! leads, whether a quorum of voting members answers, and active alarms.
//!
//! Each member is asked through its own connection (its advertised client URL),
//! so an unreachable member shows as such instead of being hidden by the client's
//! balancing; the caller supplies the connections (`connect`).

use std::time::Duration;

use etcd_client::{AlarmAction, AlarmType, Client};

use crate::etcd_retry::Etcd;

pub use lockmesh_core::wire::console::{ClusterView, MemberView};

/// What a member's view says when `Status` was refused to a non-root user.
pub const STATUS_ROOT_ONLY: &str =
    "status: etcd 3.5 serves it to root only: version, raft position and leader id are not visible to this user";

/// A lease id no one holds (the same probe as the seal check's, `lockmesh_lock::epoch`): its
/// lookup reaches the leader and answers "not found".
const PROBE_LEASE: i64 = -1;

/// Reads the member list through `client`, then each member's status through a
/// connection from `connect(url)`; every call is bounded by `timeout`.
pub async fn cluster_view<F, Fut>(client: &mut Client, timeout: Duration, connect: F) -> ClusterView
where
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = Result<Client, String>>,
{
    let mut view = ClusterView::default();
    let list = match tokio::time::timeout(timeout, Etcd::of(client).member_list()).await {
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
    // Members that refused `Status` to this user but answered it: etcd 3.5 serves
    // Status to root only, and no lockmesh component logs in as root.
    let mut refused = 0usize;
    let mut led_by_someone = false;
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
                let c = tokio::time::timeout(timeout, connect(url.clone()))
                    .await
                    .map_err(|_| format!("connect: no answer within {timeout:?}"))??;
                tokio::time::timeout(timeout, Etcd::of(&c).status())
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
                Err(e) if e.contains("permission denied") => {
                    // The member answered (it checked the token): it is reachable.
                    // A lease lookup is forwarded to the leader, so an answer (or
                    // "not found") shows that a leader exists, though not which.
                    mv.reachable = true;
                    refused += 1;
                    mv.errors.push(STATUS_ROOT_ONLY.into());
                    if let Ok(c) = connect(url.clone()).await {
                        led_by_someone |=
                            match tokio::time::timeout(timeout, Etcd::of(&c).lease_time_to_live(PROBE_LEASE, None))
                                .await
                            {
                                Ok(Ok(_)) => true,
                                Ok(Err(etcd_client::Error::GRpcStatus(st))) => {
                                    st.message().contains("requested lease not found")
                                }
                                _ => false,
                            };
                    }
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
    let leader_seen = view.leader.is_some() || (refused > 0 && leaders.is_empty() && led_by_someone);
    view.quorum = view.voting > 0 && view.voting_reachable * 2 > view.voting && leader_seen;
    if let Ok(Ok(a)) = tokio::time::timeout(timeout, Etcd::of(client).alarm(AlarmAction::Get, AlarmType::None)).await {
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
    match tokio::time::timeout(timeout, Etcd::of(client).leases()).await {
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
        // The boundaries, on a quota that divides evenly: 79 % is fine, 80 % warns,
        // 94 % still warns, 95 % fails.
        assert_eq!(quota_use(799, 1000), (79, 0));
        assert_eq!(quota_use(800, 1000), (80, 1));
        assert_eq!(quota_use(949, 1000), (94, 1));
        assert_eq!(quota_use(950, 1000), (95, 2));
        assert_eq!(quota_use(1, 0), (100, 2));
        assert_eq!(quota_use(i64::try_from(2 * gib).unwrap(), 2 * gib), (100, 2));
        assert_eq!(quota_use(-1, 2 * gib), (0, 0));
    }
}
