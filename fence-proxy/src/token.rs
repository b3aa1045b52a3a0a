//! The fencing check: the grant a write carries, and the monotonic mark rule.
//!
//! Order (nothing touches the mark before the grant verified):
//! 1. `x-lock-proof` missing → `grant_required` (428).
//! 2. Oversized, garbage, duplicated, or an `x-lock-token` that differs from the
//!    proof's token → `bad_token` (400).
//! 3. Unknown key id or a signature that does not verify → `bad_proof` (403).
//! 4. A genuine proof of another lock than the one guarding the resource →
//!    `wrong_key` (403). Tokens are comparable across keys, so without this a
//!    higher token of any lock would pass.
//! 5. Mark rule ([`check`]): below the mark, or equal under `strict` → `stale_token`
//!    (409); otherwise the mark advances (or stays, for an allowed equal).

use http::HeaderMap;
use lockmesh_core::{
    headers,
    proof::{GrantProof, ProofError, Verifier},
    FencingToken, LockKey,
};

use crate::{respond::FenceError, route::EqualRule};

/// What the mark rule decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MarkDecision {
    /// Greater than the mark (or no mark): advance to the token, then forward.
    Advance,
    /// Equal and allowed: forward, the mark stays.
    Equal,
    /// Refused: the store never sees it.
    Stale,
}

/// The mark rule: `presented` against the resource's `mark`.
pub fn check(mark: Option<FencingToken>, presented: FencingToken, equal: EqualRule) -> MarkDecision {
    match mark {
        None => MarkDecision::Advance,
        Some(m) if presented > m => MarkDecision::Advance,
        Some(m) if presented == m && equal == EqualRule::Allow => MarkDecision::Equal,
        Some(_) => MarkDecision::Stale,
    }
}

/// Verifies the grant of a write against the key that guards its resource and
/// returns the token.
pub fn verify_grant(headers: &HeaderMap, verifier: &Verifier, guard: &LockKey) -> Result<FencingToken, FenceError> {
    let mut proofs = headers.get_all(headers::PROOF).iter();
    let raw = match (proofs.next(), proofs.next()) {
        (None, _) => return Err(FenceError::GrantRequired),
        (Some(_), Some(_)) => return Err(FenceError::BadToken(format!("{} appears more than once", headers::PROOF))),
        (Some(v), None) => v.as_bytes(),
    };
    let proof = GrantProof::parse(raw).map_err(|e| FenceError::BadToken(format!("{}: {e}", headers::PROOF)))?;
    let mut tokens = headers.get_all(headers::TOKEN).iter();
    match (tokens.next(), tokens.next()) {
        (None, _) => {}
        (Some(t), None) => {
            let t = headers::parse_token(t.as_bytes()).map_err(|e| FenceError::BadToken(e.to_string()))?;
            if t != proof.claims().token {
                return Err(FenceError::BadToken(format!("{} differs from the proof's token", headers::TOKEN)));
            }
        }
        _ => return Err(FenceError::BadToken(format!("{} appears more than once", headers::TOKEN))),
    }
    let claims = verifier.verify(&proof).map_err(|e| match e {
        ProofError::TooLong(_) | ProofError::Malformed(_) => FenceError::BadToken(e.to_string()),
        ProofError::UnknownKeyId | ProofError::BadSignature => FenceError::BadProof(e.to_string()),
    })?;
    if claims.key != guard.digest() {
        return Err(FenceError::WrongKey);
    }
    Ok(claims.token)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ed25519_dalek::SigningKey;
    use lockmesh_core::{
        proof::{sign, GrantClaims, KeyId},
        ClassName,
    };
    use proptest::prelude::*;

    fn tok(v: u64) -> FencingToken {
        FencingToken::from_packed(v).unwrap()
    }

    #[test]
    fn strict_and_allow_rules() {
        use MarkDecision::*;
        for eq in [EqualRule::Strict, EqualRule::Allow] {
            assert_eq!(check(None, tok(5), eq), Advance);
            assert_eq!(check(Some(tok(5)), tok(6), eq), Advance);
            assert_eq!(check(Some(tok(5)), tok(4), eq), Stale);
        }
        assert_eq!(check(Some(tok(5)), tok(5), EqualRule::Strict), Stale);
        assert_eq!(check(Some(tok(5)), tok(5), EqualRule::Allow), Equal);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1024))]
        /// Applying any sequence of tokens, the mark never decreases, every forwarded
        /// token is at least the mark before it, and under strict no token is
        /// forwarded twice.
        #[test]
        fn the_mark_is_monotonic(seq in proptest::collection::vec(1u64..50, 1..60), allow in any::<bool>()) {
            let eq = if allow { EqualRule::Allow } else { EqualRule::Strict };
            let mut mark: Option<FencingToken> = None;
            let mut forwarded = Vec::new();
            for v in seq {
                let t = tok(v);
                match check(mark, t, eq) {
                    MarkDecision::Advance => { prop_assert!(mark.is_none_or(|m| t > m)); mark = Some(t); forwarded.push(t) }
                    MarkDecision::Equal => { prop_assert_eq!(Some(t), mark); forwarded.push(t) }
                    MarkDecision::Stale => prop_assert!(mark.is_some_and(|m| t <= m)),
                }
            }
            let ordered = forwarded.windows(2).all(|w| if allow { w[0] <= w[1] } else { w[0] < w[1] });
            prop_assert!(ordered, "forwarded tokens out of order");
        }
    }

    fn setup() -> (SigningKey, Verifier) {
        let k = SigningKey::from_bytes(&[9; 32]);
        let mut v = Verifier::new();
        v.insert(KeyId::parse("k1").unwrap(), k.verifying_key());
        (k, v)
    }

    fn proof(k: &SigningKey, key: &str, t: u64) -> String {
        let c =
            GrantClaims::new(&LockKey::parse(key.as_bytes()).unwrap(), tok(t), ClassName::parse("default").unwrap());
        sign(k, &KeyId::parse("k1").unwrap(), &c)
    }

    fn hdrs(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (n, v) in pairs {
            h.append(*n, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn grant_errors_in_order() {
        let (k, v) = setup();
        let guard = LockKey::parse(b"ns/a").unwrap();
        assert_eq!(verify_grant(&hdrs(&[]), &v, &guard), Err(FenceError::GrantRequired));
        assert_eq!(verify_grant(&hdrs(&[("x-lock-token", "5")]), &v, &guard), Err(FenceError::GrantRequired));
        assert!(matches!(verify_grant(&hdrs(&[("x-lock-proof", "junk")]), &v, &guard), Err(FenceError::BadToken(_))));
        let good = proof(&k, "ns/a", 5);
        assert_eq!(verify_grant(&hdrs(&[("x-lock-proof", &good)]), &v, &guard), Ok(tok(5)));
        assert_eq!(verify_grant(&hdrs(&[("x-lock-proof", &good), ("x-lock-token", "5")]), &v, &guard), Ok(tok(5)));
        assert!(matches!(
            verify_grant(&hdrs(&[("x-lock-proof", &good), ("x-lock-token", "6")]), &v, &guard),
            Err(FenceError::BadToken(_))
        ));
        assert!(matches!(
            verify_grant(&hdrs(&[("x-lock-proof", &good), ("x-lock-proof", &good)]), &v, &guard),
            Err(FenceError::BadToken(_))
        ));
        let other = proof(&k, "ns/b", 99);
        assert_eq!(verify_grant(&hdrs(&[("x-lock-proof", &other)]), &v, &guard), Err(FenceError::WrongKey));
        let forged = proof(&SigningKey::from_bytes(&[1; 32]), "ns/a", 99);
        assert!(matches!(verify_grant(&hdrs(&[("x-lock-proof", &forged)]), &v, &guard), Err(FenceError::BadProof(_))));
    }
}
