//! The class schema (ADR-11, ADR-24) and the registry lookup.
//!
//! A key's class is decided here, by the longest prefix that covers the key on a `/`
//! boundary, never by the caller. The raw documents (`Raw*`) are what YAML files and
//! the Kubernetes CRDs carry; [`ClassRegistry::try_from_raw`] validates them and
//! reports every error with its field path, not only the first.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::key::{covers, valid_namespace, LockKey};

/// Platform TTL floor (ADR-11).
pub const PLATFORM_MIN_TTL_S: u64 = 5;
/// Platform TTL ceiling (ADR-11).
pub const PLATFORM_MAX_TTL_S: u64 = 300;
/// Platform default TTL (ADR-11).
pub const PLATFORM_DEFAULT_TTL_S: u64 = 15;
/// etcd's own lease floor with default timing: a registry may not go below it.
pub const ETCD_MIN_TTL_S: u64 = 2;

/// A class name: 1-63 characters of `[a-z0-9-]`, starting and ending alphanumeric.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct ClassName(String);

impl ClassName {
    /// Validates a class name.
    pub fn parse(s: &str) -> Result<Self, String> {
        if valid_namespace(s) {
            Ok(Self(s.to_owned()))
        } else {
            Err("must be 1-63 characters of [a-z0-9-], starting and ending alphanumeric".into())
        }
    }
    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ClassName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A registry document as written in YAML.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawRegistry {
    /// Platform limits; production leaves them at the ADR-11 defaults. Test
    /// registries may lower the TTL floor (never below etcd's 2 s).
    #[serde(default)]
    pub platform: RawPlatform,
    /// The classes. Exactly one has `default: true`.
    pub classes: Vec<RawClass>,
}

/// Platform limits.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawPlatform {
    /// Lowest TTL a class may choose, seconds. Default 5.
    pub min_ttl_s: Option<u64>,
    /// Highest TTL a class may choose, seconds. Default 300.
    pub max_ttl_s: Option<u64>,
}

/// One class as written in YAML.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawClass {
    /// Class name, `[a-z0-9-]`.
    pub name: String,
    /// Key prefixes this class governs (`namespace` or `namespace/path`), matched on
    /// `/` boundaries; the longest match across all classes wins.
    #[serde(default)]
    pub prefixes: Vec<String>,
    /// Session TTL in seconds for holds of this class. Default 15.
    pub ttl_s: Option<u64>,
    /// Most holders of one key at once. Default 1 (a mutex).
    pub max_holders: Option<u32>,
    /// The class of keys no prefix covers. Exactly one class sets it.
    #[serde(default)]
    pub default: bool,
}

/// A validated class.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ClassSpec {
    /// Name.
    pub name: ClassName,
    /// Prefixes it governs.
    pub prefixes: Vec<String>,
    /// Session TTL, seconds.
    pub ttl_s: u64,
    /// Most holders of one key.
    pub max_holders: u32,
}

/// One validation error: where and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// Field path, e.g. `classes[2].ttl_s`.
    pub path: String,
    /// What is wrong, naming the value and the limit.
    pub message: String,
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// The validated registry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClassRegistry {
    classes: Vec<ClassSpec>,
    default: usize,
    /// `(prefix, class index)`, longest prefix first.
    prefixes: Vec<(String, usize)>,
}

fn valid_prefix(p: &str) -> bool {
    let mut segs = p.split('/');
    let ns_ok = segs.next().is_some_and(valid_namespace);
    ns_ok && (!p.contains('/') || LockKey::parse(p.as_bytes()).is_ok())
}

// === impl ClassRegistry ===

impl ClassRegistry {
    /// Validates a raw registry, collecting every error.
    pub fn try_from_raw(raw: &RawRegistry) -> Result<Self, Vec<FieldError>> {
        let mut errs = Vec::new();
        let mut err = |path: String, message: String| errs.push(FieldError { path, message });
        let min_ttl = raw.platform.min_ttl_s.unwrap_or(PLATFORM_MIN_TTL_S);
        let max_ttl = raw.platform.max_ttl_s.unwrap_or(PLATFORM_MAX_TTL_S);
        if min_ttl < ETCD_MIN_TTL_S {
            err("platform.min_ttl_s".into(), format!("{min_ttl}s is below etcd's lease floor {ETCD_MIN_TTL_S}s"));
        }
        if max_ttl < min_ttl {
            err("platform.max_ttl_s".into(), format!("{max_ttl}s is below min_ttl_s {min_ttl}s"));
        }
        let mut classes = Vec::new();
        let mut defaults = Vec::new();
        let mut prefixes: Vec<(String, usize)> = Vec::new();
        for (i, c) in raw.classes.iter().enumerate() {
            let at = |f: &str| format!("classes[{i}].{f}");
            let name = match ClassName::parse(&c.name) {
                Ok(n) => Some(n),
                Err(m) => {
                    err(at("name"), format!("{:?} {m}", c.name));
                    None
                }
            };
            if raw.classes[..i].iter().any(|o| o.name == c.name) {
                err(at("name"), format!("{:?} is defined twice", c.name));
            }
            let ttl_s = c.ttl_s.unwrap_or(PLATFORM_DEFAULT_TTL_S);
            if ttl_s < min_ttl || ttl_s > max_ttl {
                err(at("ttl_s"), format!("{ttl_s}s is outside the platform range {min_ttl}s to {max_ttl}s"));
            }
            let max_holders = c.max_holders.unwrap_or(1);
            if max_holders == 0 {
                err(
                    at("max_holders"),
                    "must be at least 1: 0 would pause every key of the class; remove its grants instead".into(),
                );
            }
            for (j, p) in c.prefixes.iter().enumerate() {
                if !valid_prefix(p) {
                    err(at(&format!("prefixes[{j}]")), format!("{p:?} is not a namespace or namespace/path"));
                } else if let Some((_, other)) = prefixes.iter().find(|(q, _)| q == p) {
                    err(at(&format!("prefixes[{j}]")), format!("{p:?} is already claimed by classes[{other}]"));
                } else {
                    prefixes.push((p.clone(), i));
                }
            }
            if c.default {
                defaults.push(i);
            }
            if let Some(name) = name {
                classes.push(ClassSpec { name, prefixes: c.prefixes.clone(), ttl_s, max_holders });
            }
        }
        match defaults.len() {
            1 => {}
            0 => err("classes".into(), "no class has default: true".into()),
            _ => err("classes".into(), format!("{} classes have default: true; exactly one may", defaults.len())),
        }
        if !errs.is_empty() {
            return Err(errs);
        }
        prefixes.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then_with(|| a.0.cmp(&b.0)));
        Ok(Self { classes, default: defaults[0], prefixes })
    }

    /// The class of `key`: the longest covering prefix, else the default class.
    pub fn class_of(&self, key: &LockKey) -> &ClassSpec {
        let i = self.prefixes.iter().find(|(p, _)| covers(p, key.as_str())).map_or(self.default, |(_, i)| *i);
        &self.classes[i]
    }

    /// A class by name.
    pub fn get(&self, name: &str) -> Option<&ClassSpec> {
        self.classes.iter().find(|c| c.name.as_str() == name)
    }

    /// The default class.
    pub fn default_class(&self) -> &ClassSpec {
        &self.classes[self.default]
    }

    /// Every class.
    pub fn classes(&self) -> &[ClassSpec] {
        &self.classes
    }

    /// True when some class names this namespace in a prefix (metrics label
    /// namespaces from the registry only, never from callers).
    pub fn knows_namespace(&self, ns: &str) -> bool {
        self.prefixes.iter().any(|(p, _)| p.split('/').next() == Some(ns))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(classes: Vec<RawClass>) -> RawRegistry {
        RawRegistry { platform: RawPlatform::default(), classes }
    }

    fn class(name: &str, prefixes: &[&str], ttl: Option<u64>, default: bool) -> RawClass {
        RawClass {
            name: name.into(),
            prefixes: prefixes.iter().map(|s| s.to_string()).collect(),
            ttl_s: ttl,
            max_holders: None,
            default,
        }
    }

    #[test]
    fn longest_prefix_on_segment_boundaries() {
        let r = ClassRegistry::try_from_raw(&raw(vec![
            class("default", &[], None, true),
            class("pay", &["payments"], Some(30), false),
            class("orders", &["payments/orders"], Some(60), false),
        ]))
        .unwrap();
        let of = |k: &str| r.class_of(&LockKey::parse(k.as_bytes()).unwrap()).name.as_str().to_owned();
        assert_eq!(of("payments/orders/1"), "orders");
        assert_eq!(of("payments/orders-archive/1"), "pay");
        assert_eq!(of("payments/x"), "pay");
        assert_eq!(of("other/x"), "default");
        assert!(r.knows_namespace("payments"));
        assert!(!r.knows_namespace("other"));
    }

    #[test]
    fn collects_every_error_with_its_path() {
        let mut bad = class("Bad Name", &["ok", "no//good"], Some(1), true);
        bad.max_holders = Some(0);
        let e = ClassRegistry::try_from_raw(&raw(vec![bad, class("x", &["ok"], Some(400), true)])).unwrap_err();
        let s: Vec<String> = e.iter().map(ToString::to_string).collect();
        assert_eq!(
            s,
            vec![
                "classes[0].name: \"Bad Name\" must be 1-63 characters of [a-z0-9-], starting and ending alphanumeric",
                "classes[0].ttl_s: 1s is outside the platform range 5s to 300s",
                "classes[0].max_holders: must be at least 1: 0 would pause every key of the class; remove its grants instead",
                "classes[0].prefixes[1]: \"no//good\" is not a namespace or namespace/path",
                "classes[1].ttl_s: 400s is outside the platform range 5s to 300s",
                "classes[1].prefixes[0]: \"ok\" is already claimed by classes[0]",
                "classes: 2 classes have default: true; exactly one may",
            ]
        );
    }
}
