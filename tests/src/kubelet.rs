//! Directories laid out as the kubelet lays out a mounted Secret or ConfigMap,
//! and updated the way it updates them (its "atomic writer"): every file lives in
//! a timestamped generation directory `..<stamp>`, `..data` is a symlink to the
//! current generation, and each visible name is a symlink `<name> -> ..data/<name>`.
//! An update writes a new generation, renames a new `..data` link over the old
//! one (one `rename(2)`: a reader sees the old set or the new one, never a mix),
//! adds links for new names, unlinks names the new set drops and removes the old
//! generation. The SPIFFE helper's certificate directory and cert-manager's
//! Secret volumes rotate certificates this way; components that watch files
//! (Envoy's SDS `watched_directory`, the arbiter's and tailer's certificate
//! reload, the registry directory) are tested against it.

use std::collections::BTreeMap;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};

/// The kubelet's name for the link to the current generation.
pub const DATA_LINK: &str = "..data";

/// File name → content of one set of files.
pub type Files = BTreeMap<String, Vec<u8>>;

/// A directory in the kubelet's layout.
#[derive(Clone, Debug)]
pub struct SecretDir {
    dir: PathBuf,
}

// === impl SecretDir ===

impl SecretDir {
    /// `dir` (created if missing; it must hold no visible files) with `files`
    /// as its first generation.
    pub fn create(dir: impl Into<PathBuf>, files: &Files) -> Result<Self> {
        let d = SecretDir { dir: dir.into() };
        std::fs::create_dir_all(&d.dir).with_context(|| format!("create {}", d.dir.display()))?;
        d.replace(files)?;
        Ok(d)
    }

    /// Turns `dir`, a directory of plain files, into the kubelet's layout in
    /// place: the files move into a first generation and each name becomes a
    /// link through `..data` (each replaced by one rename, so a reader of the
    /// directory never finds a name missing).
    pub fn adopt(dir: impl Into<PathBuf>) -> Result<Self> {
        let d = SecretDir { dir: dir.into() };
        let files = read_plain_files(&d.dir)?;
        let generation = d.write_generation(&files)?;
        symlink(&generation, d.dir.join(DATA_LINK))?;
        for name in files.keys() {
            d.link(name)?;
        }
        Ok(d)
    }

    /// An existing directory in the kubelet's layout.
    pub fn open(dir: impl Into<PathBuf>) -> Self {
        SecretDir { dir: dir.into() }
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// The set `..data` points at now. A read that races a swap (which removes
    /// the generation the link pointed at) fails: read again.
    pub fn current(&self) -> Result<Files> {
        // The link once, then every file of that generation: one consistent set.
        let generation = std::fs::read_link(self.dir.join(DATA_LINK))?;
        read_plain_files(&self.dir.join(generation))
    }

    /// Updates to the current set overlaid with `files`: names `files` lacks keep
    /// their content.
    pub fn swap(&self, files: &Files) -> Result<()> {
        let mut all = self.current()?;
        all.extend(files.iter().map(|(k, v)| (k.clone(), v.clone())));
        self.replace(&all)
    }

    /// Updates to exactly `files`: names it lacks disappear.
    pub fn replace(&self, files: &Files) -> Result<()> {
        let data = self.dir.join(DATA_LINK);
        let old = std::fs::read_link(&data).ok();
        let generation = self.write_generation(files)?;
        let tmp = self.dir.join("..data_tmp");
        let _ = std::fs::remove_file(&tmp);
        symlink(&generation, &tmp)?;
        std::fs::rename(&tmp, &data).with_context(|| format!("swap {}", data.display()))?;
        for entry in std::fs::read_dir(&self.dir)? {
            let name = entry?.file_name().to_string_lossy().into_owned();
            if !name.starts_with("..") && !files.contains_key(&name) {
                std::fs::remove_file(self.dir.join(&name))?;
            }
        }
        for name in files.keys() {
            if std::fs::symlink_metadata(self.dir.join(name)).is_err() {
                self.link(name)?;
            }
        }
        if let Some(old) = old.filter(|o| *o != generation) {
            let _ = std::fs::remove_dir_all(self.dir.join(old));
        }
        Ok(())
    }

    /// Writes `files` into a new generation directory; returns its name.
    fn write_generation(&self, files: &Files) -> Result<PathBuf> {
        // The kubelet names a generation by its time (`..2026_12_01_20_00_00.<n>`);
        // readers never look at the name, only at `..data`.
        let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let mut n = 1u32;
        while self.dir.join(format!("..{stamp}.{n}")).exists() {
            n += 1;
        }
        let name = PathBuf::from(format!("..{stamp}.{n}"));
        let at = self.dir.join(&name);
        std::fs::create_dir(&at).with_context(|| format!("create {}", at.display()))?;
        for (file, content) in files {
            std::fs::write(at.join(file), content).with_context(|| format!("write {file}"))?;
        }
        Ok(name)
    }

    /// Points `name` at `..data/name`, replacing whatever is there in one rename.
    fn link(&self, name: &str) -> Result<()> {
        let tmp = self.dir.join(format!("..{name}.link"));
        let _ = std::fs::remove_file(&tmp);
        symlink(Path::new(DATA_LINK).join(name), &tmp)?;
        std::fs::rename(&tmp, self.dir.join(name))?;
        Ok(())
    }
}

/// Every regular file directly in `dir`, symlinks followed, names starting
/// with `..` (the layout's own) left out.
pub fn read_plain_files(dir: &Path) -> Result<Files> {
    let mut files = Files::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("read {}", dir.display()))? {
        let path = entry?.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()).map(str::to_owned) else { continue };
        if name.starts_with("..") || !path.is_file() {
            continue;
        }
        files.insert(name, std::fs::read(&path).with_context(|| format!("read {}", path.display()))?);
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(v: &str) -> Files {
        [("a.pem".to_owned(), v.as_bytes().to_vec()), ("b.pem".to_owned(), b"b".to_vec())].into()
    }

    #[test]
    fn swaps_as_a_secret_update_does() {
        let root = tempfile::tempdir().unwrap();
        let d = SecretDir::create(root.path().join("tls"), &set("one")).unwrap();
        let tls = d.path();
        assert_eq!(std::fs::read_link(tls.join("a.pem")).unwrap(), Path::new("..data/a.pem"));
        assert_eq!(std::fs::read_to_string(tls.join("a.pem")).unwrap(), "one");
        let first = std::fs::read_link(tls.join(DATA_LINK)).unwrap();
        d.swap(&[("a.pem".to_owned(), b"two".to_vec())].into()).unwrap();
        assert_eq!(std::fs::read_to_string(tls.join("a.pem")).unwrap(), "two");
        assert_eq!(std::fs::read_to_string(tls.join("b.pem")).unwrap(), "b", "a swap overlays");
        assert_ne!(std::fs::read_link(tls.join(DATA_LINK)).unwrap(), first);
        assert!(!tls.join(&first).exists(), "the old generation is removed");
        assert_eq!(read_plain_files(tls).unwrap(), set("two"), "only the linked names, not the generations");
        d.replace(&[("c.pem".to_owned(), b"c".to_vec())].into()).unwrap();
        let names: Vec<String> = read_plain_files(tls).unwrap().into_keys().collect();
        assert_eq!(names, ["c.pem"], "a replace drops the names it lacks");
    }

    #[test]
    fn adopts_plain_files_in_place() {
        let root = tempfile::tempdir().unwrap();
        std::fs::write(root.path().join("a.pem"), "one").unwrap();
        let d = SecretDir::adopt(root.path()).unwrap();
        assert!(std::fs::symlink_metadata(root.path().join("a.pem")).unwrap().file_type().is_symlink());
        assert_eq!(d.current().unwrap()["a.pem"], b"one");
    }
}
