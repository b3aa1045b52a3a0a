//! A development PKI with SPIFFE-style identities, generated with `rcgen`.
//!
//! Files written into one directory (all PEM, keys PKCS#8 ECDSA P-256, mode 0600):
//!
//! | Files | What |
//! | --- | --- |
//! | `ca.pem`, `ca-key.pem` | self-signed CA, the only trusted root |
//! | `envoy.pem`, `envoy-key.pem` | server cert of Envoy's downstream listener (DNS `localhost`, IP 127.0.0.1) |
//! | `arbiter.pem`, `arbiter-key.pem` | server cert of the arbiter's gRPC listener (same SANs) |
//! | `envoy-client.pem`, `envoy-client-key.pem` | client cert Envoy presents to the arbiter: `spiffe://<td>/lockmesh/envoy` |
//! | `<ns>_<sa>.pem`, `<ns>_<sa>-key.pem` | workload client cert: `spiffe://<td>/ns/<ns>/sa/<sa>`, CN `<sa>` |
//! | `rogue-ca.pem`, `rogue-ca-key.pem` | a second, untrusted CA |
//! | `rogue.pem`, `rogue-key.pem` | client cert `spiffe://<td>/ns/default/sa/rogue` signed by the rogue CA |
//! | `rogue-<ns>_<sa>.pem`, ... | a rogue cert impersonating a workload ([`DevPki::rogue_as`]) |
//! | `trust-domain` | the trust domain the files were made for |
//!
//! Client certificates carry exactly one URI SAN, as SPIFFE X509-SVIDs do.
//! Generation is idempotent: existing files are kept and the CA is loaded back
//! from disk to sign new workload certs. If the CA is missing or the trust
//! domain changed, every certificate is regenerated.
//!
//! Rotation (issue #16): [`DevPki::generate_with_ttl`] issues every leaf afresh,
//! valid from a minute ago for the given time, under the same CA (short SVIDs, as
//! the SPIFFE helper rotates them). A second CA is another directory's PKI; its
//! `ca.pem` and this one's are joined into one trust bundle by [`write_bundle`]
//! for the overlap of a CA roll.
//!
//! Beside the PKI: [`signing`], the grant signing key, and [`jwt`], an operator
//! token issuer. Nothing here is part of a shipped binary.

#![forbid(unsafe_code)]

pub mod jwt;
pub mod signing;

use std::fs;
use std::io::Write as _;
use std::net::{IpAddr, Ipv4Addr};
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context as _, Result};
use rcgen::{
    date_time_ymd, BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};

/// The SPIFFE path of the identity Envoy presents to the arbiter.
pub const ENVOY_CLIENT_SPIFFE_PATH: &str = "/lockmesh/envoy";

/// The trust domain the test stack uses.
pub const TEST_TRUST_DOMAIN: &str = "lockmesh.test";

const TRUST_DOMAIN_FILE: &str = "trust-domain";

/// A generated PKI directory and the CAs able to sign more certificates.
pub struct DevPki {
    dir: PathBuf,
    trust_domain: String,
    ca: Issuer<'static, KeyPair>,
    rogue_ca: Issuer<'static, KeyPair>,
    /// Validity of leaves issued by this value: `None` until 2100 (and existing
    /// leaves kept), `Some` from a minute ago for that long (every leaf reissued).
    ttl: Option<std::time::Duration>,
}

/// A certificate and its private key on disk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CertPair {
    /// PEM certificate.
    pub cert_path: PathBuf,
    /// PEM PKCS#8 private key.
    pub key_path: PathBuf,
}

/// A client certificate, its key and the SPIFFE ID in its one URI SAN.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientCert {
    /// PEM certificate.
    pub cert_path: PathBuf,
    /// PEM PKCS#8 private key.
    pub key_path: PathBuf,
    /// `spiffe://<trust domain>/...`
    pub spiffe_id: String,
}

/// What a leaf certificate is for.
enum Leaf<'a> {
    /// Server: DNS `localhost` and IP 127.0.0.1.
    Server { cn: &'a str },
    /// Client: one URI SAN.
    Client { cn: &'a str, spiffe_id: &'a str },
}

// === impl DevPki ===

impl DevPki {
    /// Creates (or completes) the PKI in `dir` for `trust_domain`.
    pub fn generate(dir: impl AsRef<Path>, trust_domain: &str) -> Result<Self> {
        Self::generate_inner(dir.as_ref(), trust_domain, None)
    }

    /// [`DevPki::generate`], but every leaf (the fixed ones now, and those asked
    /// for later through this value) is issued afresh, valid from a minute ago for
    /// `ttl`: a rotation of every certificate under the same CA. The CAs are kept.
    pub fn generate_with_ttl(dir: impl AsRef<Path>, trust_domain: &str, ttl: std::time::Duration) -> Result<Self> {
        ensure!(!ttl.is_zero(), "a ttl must be longer than zero");
        Self::generate_inner(dir.as_ref(), trust_domain, Some(ttl))
    }

    fn generate_inner(dir: &Path, trust_domain: &str, ttl: Option<std::time::Duration>) -> Result<Self> {
        ensure!(
            !trust_domain.is_empty() && trust_domain.chars().all(is_name_char),
            "trust domain {trust_domain:?} must be non-empty [A-Za-z0-9.-]"
        );
        let dir = dir.to_path_buf();
        fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
        let dir = dir.canonicalize()?;

        let td_file = dir.join(TRUST_DOMAIN_FILE);
        let same_td = fs::read_to_string(&td_file).is_ok_and(|t| t.trim() == trust_domain);
        let fresh = !same_td || !dir.join("ca.pem").exists() || !dir.join("rogue-ca.pem").exists();
        if fresh {
            remove_pems(&dir)?;
        }
        let ca = load_or_create_ca(&dir, "ca", &format!("lockmesh dev CA ({trust_domain})"))?;
        let rogue_ca = load_or_create_ca(&dir, "rogue-ca", "rogue CA (untrusted)")?;
        write_atomic(&td_file, format!("{trust_domain}\n").as_bytes(), 0o644)?;

        let pki = Self { dir, trust_domain: trust_domain.to_owned(), ca, rogue_ca, ttl };
        pki.ensure_leaf(&pki.ca, "envoy", Leaf::Server { cn: "envoy" })?;
        pki.ensure_leaf(&pki.ca, "arbiter", Leaf::Server { cn: "lockmesh-extproc" })?;
        let envoy_id = pki.envoy_spiffe_id();
        pki.ensure_leaf(&pki.ca, "envoy-client", Leaf::Client { cn: "envoy", spiffe_id: &envoy_id })?;
        let rogue_id = pki.workload_spiffe_id("default", "rogue");
        pki.ensure_leaf(&pki.rogue_ca, "rogue", Leaf::Client { cn: "rogue", spiffe_id: &rogue_id })?;
        Ok(pki)
    }

    /// The directory holding the files (absolute).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The SPIFFE trust domain.
    pub fn trust_domain(&self) -> &str {
        &self.trust_domain
    }

    /// `ca.pem`: the only root clients and servers should trust.
    pub fn ca_cert_path(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    /// `rogue-ca.pem`: the untrusted CA.
    pub fn rogue_ca_cert_path(&self) -> PathBuf {
        self.dir.join("rogue-ca.pem")
    }

    /// Envoy's downstream server certificate.
    pub fn envoy_server(&self) -> CertPair {
        self.pair("envoy")
    }

    /// The arbiter's gRPC server certificate.
    pub fn arbiter_server(&self) -> CertPair {
        self.pair("arbiter")
    }

    /// The client certificate Envoy presents to the arbiter.
    pub fn envoy_client(&self) -> ClientCert {
        self.client_cert("envoy-client", self.envoy_spiffe_id())
    }

    /// `spiffe://<td>/lockmesh/envoy`.
    pub fn envoy_spiffe_id(&self) -> String {
        format!("spiffe://{}{ENVOY_CLIENT_SPIFFE_PATH}", self.trust_domain)
    }

    /// `spiffe://<td>/ns/<ns>/sa/<sa>`.
    pub fn workload_spiffe_id(&self, ns: &str, sa: &str) -> String {
        format!("spiffe://{}/ns/{ns}/sa/{sa}", self.trust_domain)
    }

    /// The workload client certificate for namespace `ns` and service account
    /// `sa` (`<ns>_<sa>.pem`), created if missing.
    pub fn client(&self, ns: &str, sa: &str) -> Result<ClientCert> {
        check_ns_sa(ns, sa)?;
        let id = self.workload_spiffe_id(ns, sa);
        self.client_with_id(&format!("{ns}_{sa}"), &id, sa)
    }

    /// A client certificate signed by the real CA with an arbitrary URI SAN
    /// and CN, written as `<stem>.pem`/`<stem>-key.pem` if missing.
    pub fn client_with_id(&self, stem: &str, spiffe_id: &str, cn: &str) -> Result<ClientCert> {
        check_stem(stem)?;
        self.ensure_leaf(&self.ca, stem, Leaf::Client { cn, spiffe_id })?;
        Ok(self.client_cert(stem, spiffe_id.to_owned()))
    }

    /// The default rogue client certificate (signed by the rogue CA).
    pub fn rogue(&self) -> ClientCert {
        self.client_cert("rogue", self.workload_spiffe_id("default", "rogue"))
    }

    /// A rogue certificate claiming a real workload's identity, signed by the
    /// rogue CA: everything is right except the issuer.
    pub fn rogue_as(&self, ns: &str, sa: &str) -> Result<ClientCert> {
        check_ns_sa(ns, sa)?;
        let stem = format!("rogue-{ns}_{sa}");
        let id = self.workload_spiffe_id(ns, sa);
        self.ensure_leaf(&self.rogue_ca, &stem, Leaf::Client { cn: sa, spiffe_id: &id })?;
        Ok(self.client_cert(&stem, id))
    }

    /// Every file in the directory, sorted.
    pub fn files(&self) -> Result<Vec<PathBuf>> {
        let mut files = Vec::new();
        for entry in fs::read_dir(&self.dir)? {
            let path = entry?.path();
            if path.is_file() {
                files.push(path);
            }
        }
        files.sort();
        Ok(files)
    }

    fn pair(&self, stem: &str) -> CertPair {
        CertPair { cert_path: self.dir.join(format!("{stem}.pem")), key_path: self.dir.join(format!("{stem}-key.pem")) }
    }

    fn client_cert(&self, stem: &str, spiffe_id: String) -> ClientCert {
        let CertPair { cert_path, key_path } = self.pair(stem);
        ClientCert { cert_path, key_path, spiffe_id }
    }

    /// Writes `<stem>.pem` and `<stem>-key.pem` signed by `issuer` unless both
    /// exist (with a ttl: always, valid from a minute ago for the ttl).
    fn ensure_leaf(&self, issuer: &Issuer<'_, KeyPair>, stem: &str, leaf: Leaf<'_>) -> Result<()> {
        let CertPair { cert_path, key_path } = self.pair(stem);
        if self.ttl.is_none() && cert_path.exists() && key_path.exists() {
            return Ok(());
        }
        let mut params = CertificateParams::default();
        match self.ttl {
            None => {
                params.not_before = date_time_ymd(2020, 1, 1);
                params.not_after = date_time_ymd(2100, 1, 1);
            }
            Some(ttl) => {
                let now = time::OffsetDateTime::now_utc();
                params.not_before = now - time::Duration::minutes(1);
                params.not_after = now + time::Duration::try_from(ttl).context("ttl too long")?;
            }
        }
        params.use_authority_key_identifier_extension = true;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.distinguished_name.remove(DnType::CommonName);
        match leaf {
            Leaf::Server { cn } => {
                params.distinguished_name.push(DnType::CommonName, cn);
                params.subject_alt_names = vec![
                    SanType::DnsName("localhost".try_into()?),
                    SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)),
                ];
                params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
            }
            Leaf::Client { cn, spiffe_id } => {
                ensure!(spiffe_id.starts_with("spiffe://"), "{spiffe_id:?} is not a spiffe:// URI");
                params.distinguished_name.push(DnType::CommonName, cn);
                params.subject_alt_names = vec![SanType::URI(spiffe_id.try_into()?)];
                params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
            }
        }
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, issuer).with_context(|| format!("sign {stem}"))?;
        // Key first: the cert's presence is what marks the pair complete.
        write_atomic(&key_path, key.serialize_pem().as_bytes(), 0o600)?;
        write_atomic(&cert_path, cert.pem().as_bytes(), 0o644)?;
        Ok(())
    }
}

impl std::fmt::Debug for DevPki {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevPki")
            .field("dir", &self.dir)
            .field("trust_domain", &self.trust_domain)
            .finish_non_exhaustive()
    }
}

/// Writes the CA certificates of `cas` (PEM files, each one or more
/// certificates) into one bundle at `out`, in order: the trust bundle of a CA
/// roll's overlap, old and new CA both trusted. Fails if a file holds no
/// certificate.
pub fn write_bundle(out: &Path, cas: &[PathBuf]) -> Result<()> {
    ensure!(!cas.is_empty(), "a bundle needs at least one CA file");
    let mut bundle = String::new();
    for ca in cas {
        let pem = fs::read_to_string(ca).with_context(|| format!("read {}", ca.display()))?;
        ensure!(pem.contains("-----BEGIN CERTIFICATE-----"), "{}: no CERTIFICATE block", ca.display());
        bundle.push_str(pem.trim_end());
        bundle.push('\n');
    }
    write_atomic(out, bundle.as_bytes(), 0o644)
}

/// Loads `<stem>.pem`/`<stem>-key.pem` as an issuer, or creates a new CA there.
fn load_or_create_ca(dir: &Path, stem: &str, cn: &str) -> Result<Issuer<'static, KeyPair>> {
    let cert_path = dir.join(format!("{stem}.pem"));
    let key_path = dir.join(format!("{stem}-key.pem"));
    if cert_path.exists() {
        let key_pem = fs::read_to_string(&key_path).with_context(|| {
            format!(
                "{} exists but its key {} cannot be read; delete the directory to regenerate",
                cert_path.display(),
                key_path.display()
            )
        })?;
        let key = KeyPair::from_pem(&key_pem)?;
        let cert_pem = fs::read_to_string(&cert_path)?;
        return Issuer::from_ca_cert_pem(&cert_pem, key).with_context(|| format!("load CA {}", cert_path.display()));
    }
    let mut params = CertificateParams::default();
    params.not_before = date_time_ymd(2020, 1, 1);
    params.not_after = date_time_ymd(2100, 1, 1);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    params.distinguished_name.remove(DnType::CommonName);
    params.distinguished_name.push(DnType::OrganizationName, "lockmesh");
    params.distinguished_name.push(DnType::CommonName, cn);
    let key = KeyPair::generate()?;
    let cert = params.self_signed(&key)?;
    write_atomic(&key_path, key.serialize_pem().as_bytes(), 0o600)?;
    write_atomic(&cert_path, cert.pem().as_bytes(), 0o644)?;
    Ok(Issuer::new(params, key))
}

/// Removes every `*.pem` in `dir`: certificates of an old CA must not be reused.
fn remove_pems(dir: &Path) -> Result<()> {
    for entry in fs::read_dir(dir)? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "pem") {
            fs::remove_file(&path).with_context(|| format!("remove {}", path.display()))?;
        }
    }
    Ok(())
}

/// Writes via a temporary file and rename, so readers never see half a file.
pub(crate) fn write_atomic(path: &Path, contents: &[u8], mode: u32) -> Result<()> {
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    let mut file = fs::File::options()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&tmp)
        .with_context(|| format!("create {}", tmp.display()))?;
    file.write_all(contents)?;
    file.sync_all()?;
    fs::rename(&tmp, path).with_context(|| format!("rename to {}", path.display()))?;
    Ok(())
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '-' || c == '.'
}

fn check_ns_sa(ns: &str, sa: &str) -> Result<()> {
    for (what, v) in [("namespace", ns), ("service account", sa)] {
        if v.is_empty() || !v.chars().all(is_name_char) {
            bail!("{what} {v:?} must be non-empty [A-Za-z0-9.-]");
        }
    }
    Ok(())
}

fn check_stem(stem: &str) -> Result<()> {
    ensure!(
        !stem.is_empty() && stem.chars().all(|c| is_name_char(c) || c == '_'),
        "file stem {stem:?} must be non-empty [A-Za-z0-9._-]"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generate_is_idempotent_and_signs_with_the_loaded_ca() {
        let dir = tempfile::tempdir().unwrap();
        let pki = DevPki::generate(dir.path(), "lockmesh.test").unwrap();
        let ca_before = fs::read(pki.ca_cert_path()).unwrap();
        let envoy_before = fs::read(pki.envoy_server().cert_path).unwrap();
        let worker = pki.client("payments", "worker").unwrap();
        assert_eq!(worker.spiffe_id, "spiffe://lockmesh.test/ns/payments/sa/worker");
        assert!(worker.cert_path.ends_with("payments_worker.pem"));

        let again = DevPki::generate(dir.path(), "lockmesh.test").unwrap();
        assert_eq!(fs::read(again.ca_cert_path()).unwrap(), ca_before);
        assert_eq!(fs::read(again.envoy_server().cert_path).unwrap(), envoy_before);
        let worker_pem = fs::read(&worker.cert_path).unwrap();
        assert_eq!(again.client("payments", "worker").unwrap(), worker);
        assert_eq!(fs::read(&worker.cert_path).unwrap(), worker_pem);
        // A new client from the reloaded CA.
        again.client("billing", "job").unwrap();

        // A different trust domain regenerates everything.
        let other = DevPki::generate(dir.path(), "other.test").unwrap();
        assert_ne!(fs::read(other.ca_cert_path()).unwrap(), ca_before);
        assert!(!worker.cert_path.exists());
    }

    #[test]
    fn a_ttl_reissues_every_leaf_short_under_the_same_ca_and_a_bundle_joins_two_cas() {
        let dir = tempfile::tempdir().unwrap();
        let pki = DevPki::generate(dir.path(), "lockmesh.test").unwrap();
        let ca = fs::read(pki.ca_cert_path()).unwrap();
        let worker = fs::read(pki.client("payments", "worker").unwrap().cert_path).unwrap();
        let envoy = fs::read(pki.envoy_server().cert_path).unwrap();
        let ttl = std::time::Duration::from_secs(600);
        let short = DevPki::generate_with_ttl(dir.path(), "lockmesh.test", ttl).unwrap();
        assert_eq!(fs::read(short.ca_cert_path()).unwrap(), ca, "the CA is kept");
        let envoy2 = fs::read_to_string(short.envoy_server().cert_path).unwrap();
        assert_ne!(envoy2.as_bytes(), envoy.as_slice(), "fixed leaves are reissued");
        let worker2 = fs::read_to_string(short.client("payments", "worker").unwrap().cert_path).unwrap();
        assert_ne!(worker2.as_bytes(), worker.as_slice(), "asked-for leaves are reissued");
        for pem in [&envoy2, &worker2] {
            let (_, der) = x509_parser::pem::parse_x509_pem(pem.as_bytes()).unwrap();
            let cert = der.parse_x509().unwrap();
            let left = cert.validity().not_after.timestamp() - time::OffsetDateTime::now_utc().unix_timestamp();
            assert!((590..=600).contains(&left), "{left}");
        }
        assert!(DevPki::generate_with_ttl(dir.path(), "lockmesh.test", std::time::Duration::ZERO).is_err());

        let second = tempfile::tempdir().unwrap();
        let new = DevPki::generate(second.path(), "lockmesh.test").unwrap();
        let bundle = dir.path().join("bundle.pem");
        write_bundle(&bundle, &[pki.ca_cert_path(), new.ca_cert_path()]).unwrap();
        let text = fs::read_to_string(&bundle).unwrap();
        assert_eq!(text.matches("-----BEGIN CERTIFICATE-----").count(), 2);
        assert!(text.starts_with(fs::read_to_string(pki.ca_cert_path()).unwrap().trim_end()));
        assert!(write_bundle(&bundle, &[pki.envoy_server().key_path]).is_err(), "a key is no CA");
    }

    #[test]
    fn rejects_bad_names() {
        let dir = tempfile::tempdir().unwrap();
        let pki = DevPki::generate(dir.path(), "lockmesh.test").unwrap();
        assert!(pki.client("a/b", "c").is_err());
        assert!(pki.client("a", "").is_err());
        assert!(pki.client("a_b", "c").is_err());
        assert!(DevPki::generate(dir.path(), "bad/td").is_err());
    }
}
