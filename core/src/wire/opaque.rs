//! [`Opaque`]: a JSON value carried without being interpreted, for the few fields
//! whose shape belongs to another crate (an audit event's `detail` is an etcd record
//! of `lockmesh-keyspace`, a policy or a gap range). Core has no serde_json outside
//! its tests, so this is its own small JSON value.

use std::{collections::BTreeMap, fmt};

use serde::{
    de::{self, MapAccess, SeqAccess, Visitor},
    ser::{SerializeMap, SerializeSeq},
    Deserialize, Deserializer, Serialize, Serializer,
};

/// Any JSON value. Objects keep their keys sorted (as serde_json's `Value` does
/// without its `preserve_order` feature, which this workspace does not enable), so
/// a value read and written again has the same bytes. Numbers keep their kind: an
/// unsigned or negative integer, or a float (JSON has no NaN or infinity, so the
/// `Eq` below holds).
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Opaque {
    /// `null`.
    #[default]
    Null,
    /// `true` or `false`.
    Bool(bool),
    /// A non-negative integer.
    U64(u64),
    /// A negative integer.
    I64(i64),
    /// A number with a fraction or an exponent.
    F64(f64),
    /// A string.
    String(String),
    /// An array.
    Array(Vec<Opaque>),
    /// An object, keys sorted.
    Object(BTreeMap<String, Opaque>),
}

impl Eq for Opaque {}

// === impl Opaque ===

impl Opaque {
    /// The member `key` of an object; `None` for a missing member or a non-object.
    pub fn get(&self, key: &str) -> Option<&Opaque> {
        match self {
            Opaque::Object(m) => m.get(key),
            _ => None,
        }
    }

    /// The string, if this is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Opaque::String(s) => Some(s),
            _ => None,
        }
    }

    /// The integer, if this is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Opaque::U64(n) => Some(n),
            _ => None,
        }
    }

    /// The integer, if this is an integer that fits an `i64`.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Opaque::U64(n) => i64::try_from(n).ok(),
            Opaque::I64(n) => Some(n),
            _ => None,
        }
    }

    /// The boolean, if this is one.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Opaque::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// Whether this is `null`.
    pub fn is_null(&self) -> bool {
        matches!(self, Opaque::Null)
    }
}

impl Serialize for Opaque {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Opaque::Null => s.serialize_unit(),
            Opaque::Bool(b) => s.serialize_bool(*b),
            Opaque::U64(n) => s.serialize_u64(*n),
            Opaque::I64(n) => s.serialize_i64(*n),
            Opaque::F64(n) => s.serialize_f64(*n),
            Opaque::String(v) => s.serialize_str(v),
            Opaque::Array(items) => {
                let mut seq = s.serialize_seq(Some(items.len()))?;
                for i in items {
                    seq.serialize_element(i)?;
                }
                seq.end()
            }
            Opaque::Object(m) => {
                let mut map = s.serialize_map(Some(m.len()))?;
                for (k, v) in m {
                    map.serialize_entry(k, v)?;
                }
                map.end()
            }
        }
    }
}

impl<'de> Deserialize<'de> for Opaque {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(OpaqueVisitor)
    }
}

struct OpaqueVisitor;

impl<'de> Visitor<'de> for OpaqueVisitor {
    type Value = Opaque;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_unit<E>(self) -> Result<Opaque, E> {
        Ok(Opaque::Null)
    }

    fn visit_none<E>(self) -> Result<Opaque, E> {
        Ok(Opaque::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Opaque, D::Error> {
        Opaque::deserialize(d)
    }

    fn visit_bool<E>(self, b: bool) -> Result<Opaque, E> {
        Ok(Opaque::Bool(b))
    }

    fn visit_u64<E>(self, n: u64) -> Result<Opaque, E> {
        Ok(Opaque::U64(n))
    }

    fn visit_i64<E>(self, n: i64) -> Result<Opaque, E> {
        // A non-negative integer is always `U64`, whichever the format reported.
        Ok(u64::try_from(n).map_or(Opaque::I64(n), Opaque::U64))
    }

    fn visit_f64<E>(self, n: f64) -> Result<Opaque, E> {
        Ok(Opaque::F64(n))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Opaque, E> {
        Ok(Opaque::String(v.to_owned()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Opaque, E> {
        Ok(Opaque::String(v))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Opaque, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1024));
        while let Some(i) = seq.next_element()? {
            items.push(i);
        }
        Ok(Opaque::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Opaque, A::Error> {
        let mut m = BTreeMap::new();
        while let Some((k, v)) = map.next_entry::<String, Opaque>()? {
            m.insert(k, v);
        }
        Ok(Opaque::Object(m))
    }
}
