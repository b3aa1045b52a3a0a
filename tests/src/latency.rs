//! A TCP proxy on loopback that adds a fixed latency to every byte, both ways,
//! without coalescing: each chunk is written its delay after it was read, and
//! chunks read meanwhile keep their own times (a link with a long round trip,
//! not a stalled one). HTTP/2 pings then take exactly two delays, so a scenario
//! can slow an arbiter's etcd link below the ping timeout. (The release gate's
//! fault proxy, `lockmesh_gate::faultproxy`, sleeps before each read instead:
//! bytes that arrive during a sleep wait up to twice the delay.)

use std::sync::{
    atomic::{AtomicU64, Ordering},
    Arc,
};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

/// A running latency proxy; stops accepting when dropped.
#[derive(Debug)]
pub struct LatencyProxy {
    port: u16,
    /// (to the server, to the client).
    delay: watch::Sender<(Duration, Duration)>,
    delayed: Arc<AtomicU64>,
    accept: tokio::task::JoinHandle<()>,
}

impl LatencyProxy {
    /// Listens on a free loopback port and forwards to `127.0.0.1:target_port`,
    /// with no delay until [`LatencyProxy::set_delay`].
    pub async fn start(target_port: u16) -> std::io::Result<Self> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let port = listener.local_addr()?.port();
        let (delay, rx) = watch::channel((Duration::ZERO, Duration::ZERO));
        let delayed = Arc::new(AtomicU64::new(0));
        let counter = delayed.clone();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(("127.0.0.1", target_port)).await else { continue };
                let _ = (client.set_nodelay(true), server.set_nodelay(true));
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                tokio::spawn(pipe(cr, sw, rx.clone(), counter.clone(), false));
                tokio::spawn(pipe(sr, cw, rx.clone(), counter.clone(), true));
            }
        });
        Ok(Self { port, delay, delayed, accept })
    }

    /// The port to connect to.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The latency each chunk gets from now on, each way.
    pub fn set_delay(&self, d: Duration) {
        self.delay.send_replace((d, d));
    }

    /// The latency of requests (to the server) and of answers (to the client).
    pub fn set_delays(&self, requests: Duration, answers: Duration) {
        self.delay.send_replace((requests, answers));
    }

    /// Chunks forwarded with a non-zero delay so far.
    pub fn delayed(&self) -> u64 {
        self.delayed.load(Ordering::Relaxed)
    }
}

impl Drop for LatencyProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// One direction: a reader stamping each chunk with its due time, a writer
/// writing each at that time, in order.
async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    delay: watch::Receiver<(Duration, Duration)>,
    delayed: Arc<AtomicU64>,
    answers: bool,
) {
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let writer = tokio::spawn(async move {
        while let Some((due, bytes)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            if to.write_all(&bytes).await.is_err() {
                return;
            }
        }
        let _ = to.shutdown().await;
    });
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let d = if answers { delay.borrow().1 } else { delay.borrow().0 };
        if !d.is_zero() {
            delayed.fetch_add(1, Ordering::Relaxed);
        }
        if tx.send((Instant::now() + d, buf[..n].to_vec())).is_err() {
            break;
        }
    }
    drop(tx);
    let _ = writer.await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn each_chunk_arrives_its_delay_after_it_was_sent_without_coalescing_waits() {
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
        let p = LatencyProxy::start(target).await.unwrap();
        p.set_delay(Duration::from_millis(200));
        let mut c = TcpStream::connect(("127.0.0.1", p.port())).await.unwrap();
        let t0 = Instant::now();
        // Two writes 100 ms apart: each echo comes back two delays after its write.
        c.write_all(b"a").await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        c.write_all(b"b").await.unwrap();
        let mut got = Vec::new();
        let mut b = [0u8; 8];
        while got.len() < 2 {
            let n = c.read(&mut b).await.unwrap();
            got.extend_from_slice(&b[..n]);
        }
        let e = t0.elapsed();
        assert_eq!(got, b"ab");
        assert!(e >= Duration::from_millis(500) && e < Duration::from_millis(800), "{e:?}");
        assert!(p.delayed() >= 4);
    }
}
