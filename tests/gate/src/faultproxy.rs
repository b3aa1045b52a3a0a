//! A userspace TCP fault proxy for one link (loopback only): it forwards bytes
//! both ways, and on command cuts the link (closes every connection and refuses
//! new ones: a partition), delays every chunk (a slow link), holds every answer
//! while requests still pass (a one-way link: what TCP does while one direction
//! drops every packet, until it heals), or holds one chunk in five for 200-600 ms
//! (a lossy link: a lost segment retransmitted, which stalls the stream behind
//! it). It counts what it held, cut and delayed, so a fault can show it took
//! effect. No network namespaces or root needed; nothing leaves 127.0.0.1.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use lockmesh_tests::ports;

/// What the link does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkMode {
    /// Forward.
    Pass,
    /// Partitioned: existing connections are closed, new ones closed at once.
    Cut,
    /// Forward each chunk after this delay.
    Delay(Duration),
    /// Requests (client to server) pass; answers are held until the mode changes.
    OneWay,
    /// Each chunk, with this chance in percent, is held 200-600 ms (a lost segment
    /// retransmitted: the stream stalls behind it).
    Lossy(u8),
}

/// What a proxy held: answers held by [`LinkMode::OneWay`] and chunks "lost" by
/// [`LinkMode::Lossy`], connections a [`LinkMode::Cut`] closed or refused, and
/// chunks a [`LinkMode::Delay`] delayed by at least its delay, since it started.
#[derive(Debug, Default)]
struct Counts {
    held: AtomicU64,
    lost: AtomicU64,
    cut: AtomicU64,
    delayed: AtomicU64,
}

/// One proxied link `127.0.0.1:<port>` → `127.0.0.1:<target>`.
#[derive(Debug)]
pub struct FaultProxy {
    port: u16,
    mode: Arc<watch::Sender<LinkMode>>,
    counts: Arc<Counts>,
    task: JoinHandle<()>,
}

// === impl FaultProxy ===

impl FaultProxy {
    /// Starts a proxy to `target_port` on a free loopback port.
    pub async fn start(target_port: u16) -> Result<Self> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let port = listener.local_addr()?.port();
        ports::reserve(port);
        let (tx, _) = watch::channel(LinkMode::Pass);
        let mode = Arc::new(tx);
        let m = mode.clone();
        let counts = Arc::new(Counts::default());
        let c = counts.clone();
        let task = tokio::spawn(async move {
            while let Ok((down, _)) = listener.accept().await {
                let rx = m.subscribe();
                tokio::spawn(serve(down, target_port, rx, c.clone()));
            }
        });
        Ok(Self { port, mode, counts, task })
    }

    /// Answers held by a one-way link and chunks a lossy link held, so far.
    pub fn held(&self) -> (u64, u64) {
        (self.counts.held.load(Ordering::Relaxed), self.counts.lost.load(Ordering::Relaxed))
    }

    /// Connections a cut closed or refused, so far.
    pub fn cut(&self) -> u64 {
        self.counts.cut.load(Ordering::Relaxed)
    }

    /// Chunks a delayed link held for at least its delay, so far.
    pub fn delayed(&self) -> u64 {
        self.counts.delayed.load(Ordering::Relaxed)
    }

    /// The proxy's port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Changes the link's behaviour (applies to open connections at once).
    pub fn set(&self, mode: LinkMode) {
        self.mode.send_replace(mode);
    }

    /// The current mode.
    pub fn mode(&self) -> LinkMode {
        *self.mode.borrow()
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(down: TcpStream, target: u16, mut mode: watch::Receiver<LinkMode>, counts: Arc<Counts>) {
    if *mode.borrow() == LinkMode::Cut {
        counts.cut.fetch_add(1, Ordering::Relaxed);
        return;
    }
    let Ok(up) = TcpStream::connect(("127.0.0.1", target)).await else { return };
    let _ = down.set_nodelay(true);
    let _ = up.set_nodelay(true);
    let (dr, dw) = down.into_split();
    let (ur, uw) = up.into_split();
    let a = pump(dr, uw, mode.clone(), counts.clone(), false);
    let b = pump(ur, dw, mode.clone(), counts.clone(), true);
    let cut = async {
        loop {
            if *mode.borrow_and_update() == LinkMode::Cut {
                return;
            }
            if mode.changed().await.is_err() {
                return std::future::pending().await;
            }
        }
    };
    tokio::select! {
        _ = a => {}
        _ = b => {}
        () = cut => {}
    }
    if *mode.borrow() == LinkMode::Cut {
        counts.cut.fetch_add(1, Ordering::Relaxed);
    }
}

/// Forwards one direction (`answers`: server to client), counting what it held.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut mode: watch::Receiver<LinkMode>,
    c: Arc<Counts>,
    answers: bool,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let m = *mode.borrow_and_update();
        match m {
            LinkMode::Cut => return,
            LinkMode::Delay(d) => {
                let since = tokio::time::Instant::now();
                tokio::time::sleep(d).await;
                if since.elapsed() >= d {
                    c.delayed.fetch_add(1, Ordering::Relaxed);
                }
            }
            LinkMode::Pass => {}
            LinkMode::OneWay => {
                if answers {
                    c.held.fetch_add(1, Ordering::Relaxed);
                    // Held until the link heals (or is cut).
                    while *mode.borrow_and_update() == LinkMode::OneWay {
                        if mode.changed().await.is_err() {
                            return;
                        }
                    }
                    if *mode.borrow() == LinkMode::Cut {
                        return;
                    }
                }
            }
            LinkMode::Lossy(pct) => {
                if rand::random_range(0..100u8) < pct {
                    c.lost.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(rand::random_range(200..600))).await;
                }
            }
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn forwards_cuts_and_heals() {
        let echo = TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
        let target = echo.local_addr().unwrap().port();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = echo.accept().await {
                tokio::spawn(async move {
                    let mut b = [0u8; 64];
                    while let Ok(n) = s.read(&mut b).await {
                        if n == 0 || s.write_all(&b[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        let p = FaultProxy::start(target).await.unwrap();
        let mut c = TcpStream::connect(("127.0.0.1", p.port())).await.unwrap();
        c.write_all(b"hi").await.unwrap();
        let mut b = [0u8; 2];
        c.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"hi");
        p.set(LinkMode::Cut);
        let mut one = [0u8; 1];
        let r = tokio::time::timeout(Duration::from_secs(2), c.read(&mut one)).await.unwrap();
        assert!(matches!(r, Ok(0) | Err(_)), "the open connection is closed by a cut");
        let mut c2 = TcpStream::connect(("127.0.0.1", p.port())).await.unwrap();
        let _ = c2.write_all(b"x").await;
        let r = tokio::time::timeout(Duration::from_secs(2), c2.read(&mut one)).await.unwrap();
        assert!(matches!(r, Ok(0) | Err(_)), "a new connection is refused while cut");
        assert!(p.cut() >= 2, "the cut and the refused connection were counted: {}", p.cut());
        p.set(LinkMode::Pass);
        let mut c3 = TcpStream::connect(("127.0.0.1", p.port())).await.unwrap();
        c3.write_all(b"ok").await.unwrap();
        c3.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"ok");
        // One way: the request passes, its answer is held until the link heals.
        p.set(LinkMode::OneWay);
        c3.write_all(b"1w").await.unwrap();
        let r = tokio::time::timeout(Duration::from_millis(500), c3.read(&mut one)).await;
        assert!(r.is_err(), "an answer passed a one-way link");
        p.set(LinkMode::Pass);
        c3.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"1w");
        assert_eq!(p.held().0, 1, "the held answer was counted");
        // Lossy: everything arrives, in order, some of it late.
        p.set(LinkMode::Lossy(100));
        c3.write_all(b"lo").await.unwrap();
        c3.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"lo");
        assert!(p.held().1 >= 1, "no chunk was held by the lossy link");
        // Delayed: each chunk waits at least the delay, and is counted.
        p.set(LinkMode::Delay(Duration::from_millis(50)));
        c3.write_all(b"dl").await.unwrap();
        c3.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"dl");
        assert!(p.delayed() >= 2, "the delayed chunks were not counted: {}", p.delayed());
    }
}
