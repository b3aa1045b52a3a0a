//! RFC 6902 JSON Patch from two JSON documents, for the webhook's response.
//!
//! Objects are diffed key by key (`add`, `remove`, `replace`); arrays and
//! scalars that differ are replaced whole. Whole-array replacement keeps the
//! patch independent of index arithmetic: applied to the object the webhook saw,
//! it yields exactly the injected object.

use serde::Serialize;
use serde_json::Value;

/// One RFC 6902 operation (only the three the diff needs).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "op", rename_all = "lowercase")]
pub enum Operation {
    /// Add a member that did not exist.
    Add {
        /// JSON Pointer (RFC 6901) of the new member.
        path: String,
        value: Value,
    },
    /// Remove a member.
    Remove {
        /// JSON Pointer of the removed member.
        path: String,
    },
    /// Replace an existing value.
    Replace {
        /// JSON Pointer of the replaced value.
        path: String,
        /// The new value.
        value: Value,
    },
}

/// The operations turning `before` into `after` (empty when equal).
pub fn diff(before: &Value, after: &Value) -> Vec<Operation> {
    let mut ops = Vec::new();
    diff_at(before, after, String::new(), &mut ops);
    ops
}

fn diff_at(before: &Value, after: &Value, path: String, ops: &mut Vec<Operation>) {
    match (before, after) {
        (Value::Object(b), Value::Object(a)) => {
            for (k, bv) in b {
                let p = format!("{path}/{}", escape(k));
                match a.get(k) {
                    Some(av) => diff_at(bv, av, p, ops),
                    None => ops.push(Operation::Remove { path: p }),
                }
            }
            for (k, av) in a {
                if !b.contains_key(k) {
                    ops.push(Operation::Add { path: format!("{path}/{}", escape(k)), value: av.clone() });
                }
            }
        }
        _ if before == after => {}
        _ => ops.push(Operation::Replace { path, value: after.clone() }),
    }
}

/// Escapes one reference token per RFC 6901 (`~` as `~0`, `/` as `~1`).
pub(crate) fn escape(token: &str) -> String {
    token.replace('~', "~0").replace('/', "~1")
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn equal_documents_give_no_operations() {
        let v = json!({"a": [1, 2], "b": {"c": null}});
        assert!(diff(&v, &v).is_empty());
    }

    #[test]
    fn keys_with_slashes_and_tildes_are_escaped() {
        let ops = diff(&json!({"m": {}}), &json!({"m": {"lockmesh.io/x~y": "1"}}));
        let text = serde_json::to_string(&ops).unwrap();
        assert_eq!(text, r#"[{"op":"add","path":"/m/lockmesh.io~1x~0y","value":"1"}]"#);
    }

    #[test]
    fn arrays_are_replaced_whole_and_members_removed() {
        let ops = diff(&json!({"a": [1], "gone": true}), &json!({"a": [1, 2]}));
        assert_eq!(
            ops,
            [
                Operation::Replace { path: "/a".into(), value: json!([1, 2]) },
                Operation::Remove { path: "/gone".into() }
            ]
        );
    }
}
