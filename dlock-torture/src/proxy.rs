//! A TCP fault proxy: forwards a client's connections to a server and, when
//! told, holds every byte in both directions (a partition shorter than TCP's
//! retransmission give-up: the packets arrive late, after the heal, which
//! is exactly when a late renewal could resurrect a lock).
//!
//! Chosen over network namespaces because it needs no root, runs in CI and
//! cuts exactly one worker's path to the lock server while leaving its path
//! to the resource intact.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A running proxy; stops accepting when dropped.
#[derive(Debug)]
pub(crate) struct FaultProxy {
    port: u16,
    cut: Arc<AtomicBool>,
    accept: tokio::task::JoinHandle<()>,
}

impl FaultProxy {
    /// Listens on a free loopback port and forwards to `upstream_port`.
    pub(crate) async fn start(upstream_port: u16) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let cut = Arc::new(AtomicBool::new(false));
        let cut2 = cut.clone();
        let accept = tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let cut = cut2.clone();
                tokio::spawn(async move {
                    wait_healed(&cut).await;
                    let Ok(outbound) = TcpStream::connect(("127.0.0.1", upstream_port)).await else { return };
                    let (ri, wi) = inbound.into_split();
                    let (ro, wo) = outbound.into_split();
                    tokio::spawn(pipe(ri, wo, cut.clone()));
                    tokio::spawn(pipe(ro, wi, cut));
                });
            }
        });
        Ok(FaultProxy { port, cut, accept })
    }

    pub(crate) fn port(&self) -> u16 {
        self.port
    }

    /// Holds all traffic until [`heal`](Self::heal).
    pub(crate) fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
    }

    pub(crate) fn heal(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn wait_healed(cut: &AtomicBool) {
    while cut.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

async fn pipe(mut from: tokio::net::tcp::OwnedReadHalf, mut to: tokio::net::tcp::OwnedWriteHalf, cut: Arc<AtomicBool>) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        wait_healed(&cut).await;
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
