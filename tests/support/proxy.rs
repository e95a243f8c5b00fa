//! A TCP proxy a test controls, in front of a server: it forwards bytes
//! both ways, or stops forwarding them while every connection stays open
//! (a black hole: a partition without a reset), or resets every connection
//! (and each new one at once), until told to forward again.
//!
//! Bytes are never lost: a black-holed connection simply stops being read,
//! as TCP retransmits through a partition, so what a client wrote during
//! the cut reaches the server once the network heals.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

/// What the proxy does with its connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Forward,
    /// Accepts and keeps connections, forwards nothing.
    BlackHole,
    /// Resets every connection, open or new (RST, not FIN).
    Reset,
}

/// A proxy listening on a free loopback port; stops (dropping every
/// connection) when dropped.
pub struct Proxy {
    pub addr: SocketAddr,
    mode: watch::Sender<Mode>,
    task: JoinHandle<()>,
}

impl Proxy {
    /// Forwards connections made to [`Proxy::addr`] to `upstream`.
    pub async fn start(upstream: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy");
        let addr = listener.local_addr().expect("proxy address");
        let (mode, watching) = watch::channel(Mode::Forward);
        let task = tokio::spawn(accept(listener, upstream, watching));
        Proxy { addr, mode, task }
    }

    /// `redis://` URL of the proxy.
    pub fn redis_url(&self) -> String {
        format!("redis://{}/", self.addr)
    }

    pub fn set(&self, mode: Mode) {
        self.mode.send_replace(mode);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn accept(listener: TcpListener, upstream: SocketAddr, mode: watch::Receiver<Mode>) {
    // Owned here, so aborting this task drops every connection.
    let mut connections = JoinSet::new();
    loop {
        let Ok((client, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(5)).await;
            continue;
        };
        // Every close is a reset: a proxy dropping its sockets is what the
        // reset mode does, and nothing else closes them in these tests.
        let _ = client.set_zero_linger();
        while connections.try_join_next().is_some() {}
        if *mode.borrow() == Mode::Reset {
            drop(client);
            continue;
        }
        let mode = mode.clone();
        connections.spawn(async move {
            let Ok(server) = TcpStream::connect(upstream).await else {
                return;
            };
            let _ = server.set_zero_linger();
            relay(client, server, mode).await;
        });
    }
}

/// Both directions until either side closes or the mode turns to reset;
/// both sockets are dropped then.
async fn relay(client: TcpStream, server: TcpStream, mut mode: watch::Receiver<Mode>) {
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let up = pump(client_read, server_write, mode.clone());
    let down = pump(server_read, client_write, mode.clone());
    tokio::select! {
        _ = async { tokio::join!(up, down) } => {}
        _ = mode.wait_for(|it| *it == Mode::Reset) => {}
    }
}

/// Copies `from` to `to` while the mode is Forward; reads nothing
/// otherwise, so no byte read is ever dropped.
async fn pump(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, mut mode: watch::Receiver<Mode>) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        if mode.wait_for(|it| *it == Mode::Forward).await.is_err() {
            return;
        }
        // Reading is cancel-safe: when the mode changes first, nothing
        // has been taken from the socket.
        let n = tokio::select! {
            biased;
            () = async { let _ = mode.wait_for(|it| *it != Mode::Forward).await; } => continue,
            n = from.read(&mut buf) => n,
        };
        match n {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                if to.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
        }
    }
}
