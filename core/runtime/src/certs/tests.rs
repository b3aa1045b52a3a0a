//! Reload behaviour of [`ReloadingCerts`] over real rustls handshakes (in memory,
//! over a tokio duplex pipe), with the files laid down as the SPIFFE helper and
//! Kubernetes secret volumes do it: `dir/{cert,key,ca}.pem` symlinks through a
//! `..data` link renamed onto a new directory.

use std::{os::unix::fs::symlink, path::Path, sync::Arc, time::Duration};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
    SanType,
};
use rustls::pki_types::ServerName;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;

struct Ca {
    pem: String,
    issuer: Issuer<'static, KeyPair>,
}

fn ca(cn: &str) -> Ca {
    let mut p = CertificateParams::default();
    p.distinguished_name.push(DnType::CommonName, cn);
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let key = KeyPair::generate().unwrap();
    let pem = p.self_signed(&key).unwrap().pem();
    Ca { pem, issuer: Issuer::new(p, key) }
}

/// A leaf for `localhost` with a SPIFFE ID, valid for client and server use;
/// `expired` puts its validity in the past.
fn leaf(ca: &Ca, sa: &str, expired: bool) -> (String, String) {
    let mut p = CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
    p.subject_alt_names.push(SanType::URI(format!("spiffe://td/ns/test/sa/{sa}").try_into().unwrap()));
    p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    if expired {
        p.not_before = rcgen::date_time_ymd(2020, 1, 1);
        p.not_after = rcgen::date_time_ymd(2020, 1, 2);
    }
    let key = KeyPair::generate().unwrap();
    let cert = p.signed_by(&key, &ca.issuer).unwrap();
    (cert.pem(), key.serialize_pem())
}

/// A secret-volume style directory: `..data` → `..gen-N`, the three names
/// symlinked through `..data`.
struct Volume {
    dir: PathBuf,
    n: u32,
}

impl Volume {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("lm-certs-{tag}-{}-{:x}", std::process::id(), rand_u32()));
        std::fs::create_dir_all(&dir).unwrap();
        for name in ["cert.pem", "key.pem", "ca.pem"] {
            symlink(Path::new("..data").join(name), dir.join(name)).unwrap();
        }
        Self { dir, n: 0 }
    }

    fn files(&self) -> CertFiles {
        CertFiles { cert: self.dir.join("cert.pem"), key: self.dir.join("key.pem"), ca: self.dir.join("ca.pem") }
    }

    /// Writes a new generation directory and flips `..data` onto it atomically
    /// (a symlink renamed over the old one).
    fn swap(&mut self, cert: &str, key: &str, ca: &str) {
        self.n += 1;
        let gen = format!("..gen-{}", self.n);
        std::fs::create_dir(self.dir.join(&gen)).unwrap();
        std::fs::write(self.dir.join(&gen).join("cert.pem"), cert).unwrap();
        std::fs::write(self.dir.join(&gen).join("key.pem"), key).unwrap();
        std::fs::write(self.dir.join(&gen).join("ca.pem"), ca).unwrap();
        let tmp = self.dir.join("..data_tmp");
        symlink(&gen, &tmp).unwrap();
        std::fs::rename(&tmp, self.dir.join("..data")).unwrap();
    }
}

impl Drop for Volume {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn rand_u32() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(std::time::SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos() as u64);
    h.finish() as u32
}

fn spiffe_of(der: &CertificateDer<'_>) -> String {
    crate::spiffe_id_of(der.as_ref()).unwrap()
}

/// One handshake between `client` and `server` and a byte each way: the SPIFFE
/// IDs each side saw of the other, or the error of the side that failed.
async fn handshake(
    server: Arc<rustls::ServerConfig>,
    client: Arc<rustls::ClientConfig>,
) -> Result<(String, Option<String>), String> {
    let (a, b) = tokio::io::duplex(64 * 1024);
    let srv = tokio::spawn(async move {
        let mut tls = tokio_rustls::TlsAcceptor::from(server).accept(a).await.map_err(|e| format!("server: {e}"))?;
        let peer = tls.get_ref().1.peer_certificates().and_then(|c| c.first().map(spiffe_of));
        let mut byte = [0u8; 1];
        tls.read_exact(&mut byte).await.map_err(|e| format!("server read: {e}"))?;
        tls.write_all(&byte).await.map_err(|e| format!("server write: {e}"))?;
        tls.flush().await.map_err(|e| format!("server flush: {e}"))?;
        Ok::<_, String>(peer)
    });
    let name = ServerName::try_from("localhost").unwrap();
    let cli = async {
        let mut tls =
            tokio_rustls::TlsConnector::from(client).connect(name, b).await.map_err(|e| format!("client: {e}"))?;
        let seen = spiffe_of(&tls.get_ref().1.peer_certificates().unwrap()[0]);
        tls.write_all(b"x").await.map_err(|e| format!("client write: {e}"))?;
        let mut byte = [0u8; 1];
        tls.read_exact(&mut byte).await.map_err(|e| format!("client read: {e}"))?;
        Ok::<_, String>(seen)
    };
    let seen = cli.await;
    let peer = srv.await.unwrap();
    match (seen, peer) {
        (Ok(s), Ok(p)) => Ok((s, p)),
        (Err(e), _) | (_, Err(e)) => Err(e),
    }
}

/// A static client: its own pair and trust bundle, in a volume of its own.
fn client(vol: &mut Volume, ca_pem: &str, pair: &(String, String)) -> Arc<ReloadingCerts> {
    vol.swap(&pair.0, &pair.1, ca_pem);
    ReloadingCerts::watch(vol.files(), Duration::ZERO).unwrap()
}

#[test]
fn the_first_load_refuses_missing_unparsable_or_mismatched_files() {
    let ca1 = ca("ca1");
    let (cert, key) = leaf(&ca1, "a", false);
    let (_, other_key) = leaf(&ca1, "b", false);
    let mut vol = Volume::new("first");
    // Nothing behind the symlinks yet.
    assert!(matches!(ReloadingCerts::watch(vol.files(), Duration::ZERO), Err(CertError::Read { what: "cert", .. })));
    vol.swap("not pem", &key, &ca1.pem);
    assert!(matches!(ReloadingCerts::watch(vol.files(), Duration::ZERO), Err(CertError::Parse { what: "cert", .. })));
    vol.swap(&cert, &key, "");
    assert!(matches!(ReloadingCerts::watch(vol.files(), Duration::ZERO), Err(CertError::Parse { what: "ca", .. })));
    vol.swap(&cert, &other_key, &ca1.pem);
    let e = ReloadingCerts::watch(vol.files(), Duration::ZERO).unwrap_err();
    assert!(matches!(e, CertError::KeyMismatch { .. }), "{e}");
    // The error names files, never the key's content.
    assert!(!e.to_string().contains("PRIVATE KEY"), "{e}");
    vol.swap(&cert, &key, &ca1.pem);
    let c = ReloadingCerts::watch(vol.files(), Duration::ZERO).unwrap();
    assert_eq!(c.generation(), 1);
    assert_eq!(spiffe_of(&c.leaf().unwrap()), "spiffe://td/ns/test/sa/a");
    assert!(c.not_after() > SystemTime::now());
}

#[tokio::test]
async fn a_directory_swap_changes_what_new_handshakes_present_and_a_bad_set_is_ignored() {
    let ca1 = ca("ca1");
    let mut vol = Volume::new("swap");
    let first = leaf(&ca1, "server-1", false);
    vol.swap(&first.0, &first.1, &ca1.pem);
    let server = ReloadingCerts::watch(vol.files(), Duration::ZERO).unwrap();
    let cfg = server.server_config(ClientAuth::Required, &[b"h2"]);
    let mut cvol = Volume::new("swap-client");
    let cli = client(&mut cvol, &ca1.pem, &leaf(&ca1, "client", false)).client_config(&[b"h2"]);

    let (seen, peer) = handshake(cfg.clone(), cli.clone()).await.unwrap();
    assert_eq!(seen, "spiffe://td/ns/test/sa/server-1");
    assert_eq!(peer.as_deref(), Some("spiffe://td/ns/test/sa/client"));
    assert!(!server.reload_now().unwrap(), "unchanged files are not a reload");

    let second = leaf(&ca1, "server-2", false);
    vol.swap(&second.0, &second.1, &ca1.pem);
    assert!(server.reload_now().unwrap());
    assert_eq!(server.generation(), 2);
    // The same ServerConfig value: its resolver reads the new identity.
    assert_eq!(handshake(cfg.clone(), cli.clone()).await.unwrap().0, "spiffe://td/ns/test/sa/server-2");

    // A set caught half-way (the new certificate, the old key) is refused and the
    // current one kept.
    let third = leaf(&ca1, "server-3", false);
    vol.swap(&third.0, &second.1, &ca1.pem);
    assert!(matches!(server.reload_now(), Err(CertError::KeyMismatch { .. })));
    assert_eq!(server.generation(), 2);
    assert_eq!(handshake(cfg.clone(), cli.clone()).await.unwrap().0, "spiffe://td/ns/test/sa/server-2");
    // Refused once, not re-tried until the content changes again.
    assert!(!server.reload_now().unwrap());
    vol.swap(&third.0, &third.1, &ca1.pem);
    assert!(server.reload_now().unwrap());
    assert_eq!(handshake(cfg, cli).await.unwrap().0, "spiffe://td/ns/test/sa/server-3");
}

/// The background poll picks a swap up by itself; with polling off (the planted
/// failure: `every` of zero) the same wait sees generation 1 and the old leaf, so
/// the assertion on the reloaded identity fails.
#[tokio::test]
async fn the_background_poll_reloads_and_without_it_the_old_identity_stays() {
    let ca1 = ca("ca1");
    for (every, reloads) in [(Duration::from_millis(50), true), (Duration::ZERO, false)] {
        let mut vol = Volume::new("poll");
        let first = leaf(&ca1, "one", false);
        vol.swap(&first.0, &first.1, &ca1.pem);
        let certs = ReloadingCerts::watch(vol.files(), every).unwrap();
        let mut changes = certs.changes();
        let second = leaf(&ca1, "two", false);
        vol.swap(&second.0, &second.1, &ca1.pem);
        let waited = tokio::time::timeout(Duration::from_secs(2), changes.changed()).await;
        assert_eq!(waited.is_ok(), reloads, "every {every:?}");
        let want = if reloads { (2, "spiffe://td/ns/test/sa/two") } else { (1, "spiffe://td/ns/test/sa/one") };
        assert_eq!((certs.generation(), spiffe_of(&certs.leaf().unwrap()).as_str()), want, "every {every:?}");
    }
}

#[tokio::test]
async fn expired_and_untrusted_peers_are_refused_and_a_ca_roll_keeps_both_then_only_the_new() {
    let (old, new) = (ca("old"), ca("new"));
    let both = format!("{}{}", old.pem, new.pem);
    let mut vol = Volume::new("roll");
    let s1 = leaf(&old, "server", false);
    vol.swap(&s1.0, &s1.1, &old.pem);
    let server = ReloadingCerts::watch(vol.files(), Duration::ZERO).unwrap();
    let required = server.server_config(ClientAuth::Required, &[]);
    let optional = server.server_config(ClientAuth::Optional, &[]);

    let mut v = Volume::new("roll-c1");
    let old_client = client(&mut v, &both, &leaf(&old, "old-client", false)).client_config(&[]);
    let mut v2 = Volume::new("roll-c2");
    let new_client = client(&mut v2, &both, &leaf(&new, "new-client", false)).client_config(&[]);
    let mut v3 = Volume::new("roll-c3");
    let expired = client(&mut v3, &both, &leaf(&old, "expired", true)).client_config(&[]);

    assert!(handshake(required.clone(), old_client.clone()).await.is_ok());
    // The new CA is not trusted yet.
    assert!(handshake(required.clone(), new_client.clone()).await.is_err());
    // An expired certificate is refused, also where a certificate is optional.
    let e = handshake(required.clone(), expired.clone()).await.unwrap_err();
    assert!(e.contains("xpired"), "{e}");
    assert!(handshake(optional.clone(), expired.clone()).await.is_err());

    // Step 1: both CAs trusted; the server moves to a new-CA leaf.
    let s2 = leaf(&new, "server", false);
    vol.swap(&s2.0, &s2.1, &both);
    assert!(server.reload_now().unwrap());
    assert!(handshake(required.clone(), old_client.clone()).await.is_ok());
    assert!(handshake(required.clone(), new_client.clone()).await.is_ok());
    // Step 2: the old CA removed: its leaves are refused from the next handshake.
    vol.swap(&s2.0, &s2.1, &new.pem);
    assert!(server.reload_now().unwrap());
    assert!(handshake(required.clone(), old_client).await.is_err());
    assert!(handshake(required, new_client).await.is_ok());

    // A client verifying servers: the old-CA-only bundle refuses the new server.
    let mut v4 = Volume::new("roll-c4");
    let old_only = client(&mut v4, &old.pem, &leaf(&old, "c", false)).client_config(&[]);
    let e = handshake(server.server_config(ClientAuth::None, &[]), old_only).await.unwrap_err();
    assert!(e.contains("client"), "{e}");
}

/// A bundle alone ([`ReloadingCerts::watch_ca`], the etcd clients with `tls.ca`
/// only): it presents no certificate, verifies servers against the bundle of the
/// moment through one unchanged `ClientConfig`, keeps its bundle over a bad one,
/// and follows a CA roll (old, old and new, new).
#[tokio::test]
async fn a_bundle_alone_follows_a_ca_roll_and_keeps_its_bundle_over_a_bad_one() {
    let (old, new) = (ca("old"), ca("new"));
    let serve = |ca: &Ca, sa: &str, tag: &str| {
        let mut vol = Volume::new(tag);
        let pair = leaf(ca, sa, false);
        vol.swap(&pair.0, &pair.1, &old.pem);
        let certs = ReloadingCerts::watch(vol.files(), Duration::ZERO).unwrap();
        (vol, certs.server_config(ClientAuth::Optional, &[b"h2"]))
    };
    let (_v1, old_server) = serve(&old, "old-server", "bundle-s1");
    let (_v2, new_server) = serve(&new, "new-server", "bundle-s2");

    let mut vol = Volume::new("bundle");
    // Nothing behind the link, then no certificate in it: refused at the first load.
    assert!(matches!(
        ReloadingCerts::watch_ca(vol.files().ca, Duration::ZERO),
        Err(CertError::Read { what: "ca", .. })
    ));
    vol.swap("", "", "not pem");
    assert!(matches!(
        ReloadingCerts::watch_ca(vol.files().ca, Duration::ZERO),
        Err(CertError::Parse { what: "ca", .. })
    ));
    // Only the bundle is read: no certificate or key file is needed.
    vol.swap("", "", &old.pem);
    let bundle = ReloadingCerts::watch_ca(vol.files().ca, Duration::ZERO).unwrap();
    assert!(bundle.files().is_none() && bundle.leaf().is_none());
    assert_eq!(bundle.ca_file(), vol.files().ca);
    let cfg = bundle.client_config(&[b"h2"]);

    let (seen, peer) = handshake(old_server.clone(), cfg.clone()).await.unwrap();
    assert_eq!((seen.as_str(), peer), ("spiffe://td/ns/test/sa/old-server", None), "no client certificate");
    let e = handshake(new_server.clone(), cfg.clone()).await.unwrap_err();
    assert!(e.starts_with("client"), "a server of the new CA is not trusted yet: {e}");

    // Step 1: old and new.
    vol.swap("", "", &format!("{}{}", old.pem, new.pem));
    assert!(bundle.reload_now().unwrap());
    assert_eq!(bundle.generation(), 2);
    assert!(handshake(old_server.clone(), cfg.clone()).await.is_ok());
    assert!(handshake(new_server.clone(), cfg.clone()).await.is_ok());
    // A bad bundle is refused and the current one kept.
    vol.swap("", "", "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n");
    assert!(matches!(bundle.reload_now(), Err(CertError::Parse { what: "ca", .. })));
    assert_eq!(bundle.generation(), 2);
    assert!(handshake(new_server.clone(), cfg.clone()).await.is_ok());
    // Step 3: the new CA only; a server of the old CA is refused.
    vol.swap("", "", &new.pem);
    assert!(bundle.reload_now().unwrap());
    assert_eq!(bundle.generation(), 3);
    assert!(handshake(old_server, cfg.clone()).await.is_err());
    assert!(handshake(new_server, cfg).await.is_ok());
}

/// The background poll picks a bundle swap up by itself; with polling off (the
/// planted failure: `every` of zero, the CA read once as before) it does not.
#[tokio::test]
async fn the_background_poll_reloads_a_bundle_and_without_it_the_old_bundle_stays() {
    let (old, new) = (ca("old"), ca("new"));
    for (every, reloads) in [(Duration::from_millis(50), true), (Duration::ZERO, false)] {
        let mut vol = Volume::new("bundle-poll");
        vol.swap("", "", &old.pem);
        let bundle = ReloadingCerts::watch_ca(vol.files().ca, every).unwrap();
        let mut changes = bundle.changes();
        vol.swap("", "", &new.pem);
        let waited = tokio::time::timeout(Duration::from_secs(2), changes.changed()).await;
        assert_eq!((waited.is_ok(), bundle.generation()), (reloads, if reloads { 2 } else { 1 }), "every {every:?}");
    }
}
