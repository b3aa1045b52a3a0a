//! A real S3-compatible server for the S3 fence and archive tests ([`MotoServer`]),
//! and a tiny client for tests ([`S3TestClient`]).
//!
//! The server is moto's (`moto` 5.2.5, PyPI), installed by `scripts/setup`
//! (`scripts/setup.d/s3.sh`) into the venv `<repo>/.tools/s3` (override with
//! `LOCKMESH_S3_VENV`). Each server is its own process on a free loopback port with
//! its state in memory, killed when dropped (and with the test binary).
//!
//! Two ways to run it:
//! - [`MotoServer::start`]: **one request at a time** (Werkzeug's server with
//!   `threaded=False`, moto's app and request handler). moto 5.2.5's `put_object`
//!   checks `If-Match` / `If-None-Match` and then stores the object in separate
//!   steps, with no lock held across them; under `moto_server`'s threads nothing
//!   excludes two PUTs with one `If-Match` both passing the check (none did in 200
//!   rounds of 4 racing PUTs on this machine, which shows the window is short, not
//!   that it is closed). Real S3 promises the conditional write is atomic; serving
//!   one request at a time gives moto that property by construction, so the fence
//!   tests use this.
//! - [`MotoServer::start_threaded`]: `.tools/s3/bin/moto_server` as shipped
//!   (threaded), for tests that do not race conditional writes.
//!
//! moto does not verify request signatures by default (until
//! [`MotoServer::enforce_signatures`]): [`S3TestClient`] sends a
//! SigV4-shaped `Authorization` header with an `s3` credential scope, which is how
//! moto's dispatcher tells an S3 request from another service's, and no signature.
//! It works against moto only; the fence signs for real
//! (`lockmesh_fence_proxy::store::s3`).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context as _, Result};
use tempfile::TempDir;

use crate::paths::{repo_root, temp_dir};
use crate::ports::free_port;
use crate::process::ChildProcess;

/// Access key id and secret the tests use (moto accepts any).
pub const TEST_ACCESS_KEY: &str = "lockmesh-test";
/// The secret that goes with [`TEST_ACCESS_KEY`].
pub const TEST_SECRET_KEY: &str = "lockmesh-test-secret";
/// The region the tests use.
pub const TEST_REGION: &str = "us-east-1";
/// How long startup may take.
pub const MOTO_READY_TIMEOUT: Duration = Duration::from_secs(30);

/// Runs moto's app on one thread: argv[1] is the port.
const SERIAL_SERVER: &str = r#"
import sys
from werkzeug.serving import run_simple
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
app = DomainDispatcherApplication(create_backend_app)
run_simple("127.0.0.1", int(sys.argv[1]), app, threaded=False, request_handler=MotoRequestHandler)
"#;

/// The venv holding moto, or a fix-it error.
pub fn moto_venv() -> Result<PathBuf> {
    let dir = std::env::var_os("LOCKMESH_S3_VENV")
        .filter(|p| !p.is_empty())
        .map_or_else(|| repo_root().join(".tools/s3"), PathBuf::from);
    if !dir.join("bin/moto_server").is_file() {
        bail!(
            "moto not installed: run scripts/setup (no {}; override with LOCKMESH_S3_VENV)",
            dir.join("bin/moto_server").display()
        );
    }
    Ok(dir)
}

/// `.tools/s3/bin/moto_server`.
pub fn moto_server_bin() -> Result<PathBuf> {
    Ok(moto_venv()?.join("bin/moto_server"))
}

/// A running moto server; killed on drop.
#[derive(Debug)]
pub struct MotoServer {
    port: u16,
    process: ChildProcess,
    _dir: TempDir,
}

// === impl MotoServer ===

impl MotoServer {
    /// moto serving one request at a time (atomic conditional writes; see the
    /// module doc).
    pub async fn start() -> Result<Self> {
        let venv = moto_venv()?;
        let port = free_port();
        let args = vec!["-c".to_owned(), SERIAL_SERVER.to_owned(), port.to_string()];
        Self::spawn(venv.join("bin/python"), args, port).await
    }

    /// `moto_server` as shipped (threaded).
    pub async fn start_threaded() -> Result<Self> {
        let port = free_port();
        let args = vec!["-H".to_owned(), "127.0.0.1".to_owned(), "-p".to_owned(), port.to_string()];
        Self::spawn(moto_server_bin()?, args, port).await
    }

    async fn spawn(program: PathBuf, args: Vec<String>, port: u16) -> Result<Self> {
        let dir = temp_dir("moto-")?;
        let log = dir.path().join("moto.log");
        let process = ChildProcess::new("moto", program, args, &log)
            .env("MOTO_PORT", port.to_string())
            .env("AWS_DEFAULT_REGION", TEST_REGION)
            .env("PYTHONUNBUFFERED", "1");
        process.start()?;
        let server = Self { port, process, _dir: dir };
        let client = server.client();
        server
            .process
            .wait_ready(MOTO_READY_TIMEOUT, async || {
                let r = client.request(reqwest::Method::GET, "", "", &[], Vec::new()).await?;
                if r.status != 200 {
                    bail!("ListBuckets answered {}", r.status);
                }
                Ok(())
            })
            .await?;
        Ok(server)
    }

    /// `http://127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn pid(&self) -> Option<u32> {
        self.process.pid()
    }

    /// A client for this server.
    pub fn client(&self) -> S3TestClient {
        S3TestClient::new(&self.endpoint())
    }

    /// The environment an AWS client needs for this server: test credentials,
    /// region and `AWS_ENDPOINT_URL_S3`.
    pub fn aws_env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ACCESS_KEY_ID", TEST_ACCESS_KEY.to_owned()),
            ("AWS_SECRET_ACCESS_KEY", TEST_SECRET_KEY.to_owned()),
            ("AWS_REGION", TEST_REGION.to_owned()),
            ("AWS_ENDPOINT_URL_S3", self.endpoint()),
        ]
    }

    /// From now on, moto checks every request's SigV4 signature (botocore's
    /// `S3SigV4Auth` over the request as received) and the caller's IAM policy.
    /// Creates IAM user `lockmesh-fence` with an access key allowed `s3:*` and
    /// returns the key id and secret. Create buckets first: [`S3TestClient`] does
    /// not sign, so its requests are refused afterwards.
    pub async fn enforce_signatures(&self) -> Result<(String, String)> {
        let iam = |params: Vec<(&'static str, String)>| {
            let mut form = vec![("Version", "2010-05-08".to_owned())];
            form.extend(params);
            let http = reqwest::Client::new();
            let url = format!("{}/", self.endpoint());
            async move {
                let r = http
                    .post(url)
                    .header(
                        "authorization",
                        format!(
                            "AWS4-HMAC-SHA256 Credential={TEST_ACCESS_KEY}/20260101/{TEST_REGION}/iam/aws4_request, \
                             SignedHeaders=host, Signature=0"
                        ),
                    )
                    .form(&form)
                    .send()
                    .await
                    .context("IAM request")?;
                let (status, text) = (r.status().as_u16(), r.text().await.unwrap_or_default());
                if status != 200 {
                    bail!("IAM {:?} answered {status}: {text}", form.get(1));
                }
                Ok::<_, anyhow::Error>(text)
            }
        };
        let user = || ("UserName", "lockmesh-fence".to_owned());
        iam(vec![("Action", "CreateUser".into()), user()]).await?;
        let policy = r#"{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Action":"s3:*","Resource":"*"}]}"#;
        iam(vec![
            ("Action", "PutUserPolicy".into()),
            user(),
            ("PolicyName", "s3".into()),
            ("PolicyDocument", policy.into()),
        ])
        .await?;
        let key = iam(vec![("Action", "CreateAccessKey".into()), user()]).await?;
        let field = |tag: &str| {
            key.split_once(&format!("<{tag}>"))
                .and_then(|(_, rest)| rest.split_once(&format!("</{tag}>")))
                .map(|(v, _)| v.to_owned())
                .with_context(|| format!("no {tag} in CreateAccessKey's answer"))
        };
        let (id, secret) = (field("AccessKeyId")?, field("SecretAccessKey")?);
        let r = reqwest::Client::new()
            .post(format!("{}/moto-api/reset-auth", self.endpoint()))
            .body("0")
            .send()
            .await
            .context("moto-api/reset-auth")?;
        if r.status() != 200 {
            bail!("moto-api/reset-auth answered {}", r.status());
        }
        Ok((id, secret))
    }

    /// Creates `bucket`.
    pub async fn create_bucket(&self, bucket: &str) -> Result<()> {
        self.client().create_bucket(bucket, false).await
    }

    /// Creates `bucket` with object lock enabled (and so versioning).
    pub async fn create_locked_bucket(&self, bucket: &str) -> Result<()> {
        self.client().create_bucket(bucket, true).await
    }
}

/// One answer.
#[derive(Clone, Debug)]
pub struct S3Resp {
    pub status: u16,
    /// The `ETag` header, quotes included.
    pub etag: Option<String>,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

// === impl S3Resp ===

impl S3Resp {
    /// A header's value (name in lower case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    /// The body as text (lossy).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// A path-style S3 client for moto (no signature; see the module doc).
#[derive(Clone, Debug)]
pub struct S3TestClient {
    endpoint: String,
    http: reqwest::Client,
}

// === impl S3TestClient ===

impl S3TestClient {
    pub fn new(endpoint: &str) -> Self {
        let http = reqwest::Client::builder().timeout(Duration::from_secs(30)).build().unwrap_or_default();
        Self { endpoint: endpoint.trim_end_matches('/').to_owned(), http }
    }

    /// `method /<bucket>/<key>` (an empty bucket: `/`; an empty key: the bucket)
    /// with `headers` and `body`.
    pub async fn request(
        &self,
        method: reqwest::Method,
        bucket: &str,
        key: &str,
        headers: &[(&str, &str)],
        body: Vec<u8>,
    ) -> Result<S3Resp> {
        let mut url = format!("{}/{bucket}", self.endpoint);
        if !key.is_empty() {
            url.push('/');
            url.push_str(key);
        }
        let mut req = self
            .http
            .request(method.clone(), &url)
            .header(
                "authorization",
                format!(
                    "AWS4-HMAC-SHA256 Credential={TEST_ACCESS_KEY}/20260101/{TEST_REGION}/s3/aws4_request, \
                     SignedHeaders=host, Signature=0"
                ),
            )
            .header("content-type", "application/octet-stream")
            .body(body);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let r = req.send().await.with_context(|| format!("{method} {url}"))?;
        let status = r.status().as_u16();
        let headers: Vec<(String, String)> = r
            .headers()
            .iter()
            .map(|(k, v)| (k.as_str().to_owned(), String::from_utf8_lossy(v.as_bytes()).into_owned()))
            .collect();
        let etag = headers.iter().find(|(k, _)| k == "etag").map(|(_, v)| v.clone());
        let body = r.bytes().await.with_context(|| format!("{method} {url}: body"))?.to_vec();
        Ok(S3Resp { status, etag, headers, body })
    }

    /// Creates a bucket (object lock enabled when `object_lock`).
    pub async fn create_bucket(&self, bucket: &str, object_lock: bool) -> Result<()> {
        let lock: &[(&str, &str)] = if object_lock { &[("x-amz-bucket-object-lock-enabled", "true")] } else { &[] };
        let r = self.request(reqwest::Method::PUT, bucket, "", lock, Vec::new()).await?;
        if r.status != 200 {
            bail!("CreateBucket {bucket} answered {}: {}", r.status, r.text());
        }
        Ok(())
    }

    /// PutObject with extra headers (`If-Match`, object lock, metadata...).
    pub async fn put(&self, bucket: &str, key: &str, body: &[u8], headers: &[(&str, &str)]) -> Result<S3Resp> {
        self.request(reqwest::Method::PUT, bucket, key, headers, body.to_vec()).await
    }

    /// GetObject: the bytes and ETag, `None` on 404.
    pub async fn get(&self, bucket: &str, key: &str) -> Result<Option<S3Resp>> {
        let r = self.request(reqwest::Method::GET, bucket, key, &[], Vec::new()).await?;
        match r.status {
            200 => Ok(Some(r)),
            404 => Ok(None),
            s => bail!("GetObject {bucket}/{key} answered {s}: {}", r.text()),
        }
    }

    /// DeleteObject with extra headers; the answer as it came.
    pub async fn delete(&self, bucket: &str, key: &str, headers: &[(&str, &str)]) -> Result<S3Resp> {
        self.request(reqwest::Method::DELETE, bucket, key, headers, Vec::new()).await
    }
}
