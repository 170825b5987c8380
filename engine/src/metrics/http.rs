//! The `/metrics` endpoint: a registry's exposition over HTTP/1.1 (hyper), on a tokio runtime
//! of its own or on one the caller already runs (a replication node's).
//!
//! Bounded like the replication port: at most `CONNECTIONS_MAX` connections at once and
//! `CONNECTIONS_PER_ADDRESS_MAX` from one address, request heads of at most `HEAD_BYTES_MAX` bytes
//! that must arrive within `HEAD_TIMEOUT`, a connection kept at most `CONNECTION_TIME_MAX`. When a
//! new connection finds no room, the oldest connection (of its address, when that address is the
//! one full) that is not answering a request right now makes room, those that never sent a request
//! first (`Admission`): clients that open connections and send nothing can hold the slots only
//! until the next scraper arrives, never blind it. Only `GET` and `HEAD` are answered; a request
//! body is never read. Never: parses HTTP itself, or serves anything but the registry's text.
//!
//! Owns: `Endpoint` (bound before `start` returns, stopped when dropped) and `serve`, the admission
//! of connections (`Admission`), and the list of every endpoint's sockets in the process
//! (`SOCKETS`), whose copies a forked child closes.

use std::collections::BTreeSet;
use std::net::{SocketAddr, TcpListener as StdListener, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{ALLOW, CONTENT_TYPE, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::sync::{Notify, Semaphore};

use super::{Format, Registry, global};
use crate::error::{Error, Result};

/// Connections served at once.
const CONNECTIONS_MAX: usize = 64;
/// Connections from one address at once (a node's ranks and its Prometheus share loopback).
const CONNECTIONS_PER_ADDRESS_MAX: usize = 32;
/// The most a request's head may take (hyper's smallest read buffer).
const HEAD_BYTES_MAX: usize = 8192;
/// How long a request's head may take to arrive.
const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// How long one connection is kept, scrapes included (a scraper reconnects).
const CONNECTION_TIME_MAX: Duration = Duration::from_secs(300);

/// The descriptors of every endpoint's listener and connections in this process, for a forked
/// child to close its copies of (`super::after_fork_in_child`). A descriptor leaves the set
/// before it is closed, never after.
static SOCKETS: Mutex<BTreeSet<RawFd>> = Mutex::new(BTreeSet::new());

fn sockets() -> MutexGuard<'static, BTreeSet<RawFd>> {
    SOCKETS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The socket list, held across a fork.
pub(super) struct HeldForFork(MutexGuard<'static, BTreeSet<RawFd>>);

pub(super) fn hold_for_fork() -> HeldForFork {
    HeldForFork(sockets())
}

/// In a forked child: closes the child's copies of the endpoints' sockets.
pub(super) fn close_in_child(mut held: HeldForFork) {
    let fds: Vec<RawFd> = std::mem::take(&mut *held.0).into_iter().collect();
    crate::io::close_in_forked_child(&fds);
}

/// A socket in `SOCKETS` from the moment it exists until it is closed: it is inserted under
/// the same hold of the set as its creation (`bind`, the accept step), and removed under the
/// same hold as its closing, so a fork never finds it open and unlisted.
struct Tracked<S: AsRawFd> {
    /// `None` only while it is being dropped.
    socket: Option<S>,
}

impl<S: AsRawFd> Tracked<S> {
    /// A socket the caller created and inserted under `set`, the one hold of `SOCKETS`.
    fn adopt(socket: S, set: &mut BTreeSet<RawFd>) -> Self {
        set.insert(socket.as_raw_fd());
        Self { socket: Some(socket) }
    }

    fn socket(&mut self) -> std::io::Result<&mut S> {
        self.socket.as_mut().ok_or_else(|| std::io::Error::from(std::io::ErrorKind::NotConnected))
    }
}

impl<S: AsRawFd> Drop for Tracked<S> {
    fn drop(&mut self) {
        let mut set = sockets();
        if let Some(socket) = self.socket.take() {
            set.remove(&socket.as_raw_fd());
            drop(socket);
        }
    }
}

impl tokio::io::AsyncRead for Tracked<tokio::net::TcpStream> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.socket() {
            Ok(socket) => Pin::new(socket).poll_read(cx, buf),
            Err(e) => Poll::Ready(Err(e)),
        }
    }
}

impl tokio::io::AsyncWrite for Tracked<tokio::net::TcpStream> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        match self.socket() {
            Ok(socket) => Pin::new(socket).poll_write(cx, buf),
            Err(e) => Poll::Ready(Err(e)),
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.socket() {
            Ok(socket) => Pin::new(socket).poll_flush(cx),
            Err(e) => Poll::Ready(Err(e)),
        }
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.socket() {
            Ok(socket) => Pin::new(socket).poll_shutdown(cx),
            Err(e) => Poll::Ready(Err(e)),
        }
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        match self.socket() {
            Ok(socket) => Pin::new(socket).poll_write_vectored(cx, bufs),
            Err(e) => Poll::Ready(Err(e)),
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.socket.as_ref().is_some_and(tokio::io::AsyncWrite::is_write_vectored)
    }
}

/// A running endpoint; dropping it stops it (connections being served are cut).
pub struct Endpoint {
    addr: SocketAddr,
    stop: Arc<Notify>,
    /// The runtime's thread, when the endpoint runs one of its own.
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint").field("addr", &self.addr).finish()
    }
}

/// Serves the process's registry (`global`) at `http://ADDR/metrics`, on a thread of its own.
/// Port 0 picks a free port (`Endpoint::addr` tells which).
pub fn serve(addr: impl ToSocketAddrs) -> Result<Endpoint> {
    Endpoint::start(addr, global().clone(), None)
}

impl Endpoint {
    /// Serves `registry` at `http://ADDR/metrics`: on `runtime` when given, otherwise on a
    /// one-thread runtime of its own. Binding happens before this returns, so an address in
    /// use is an error here.
    pub fn start(
        addr: impl ToSocketAddrs,
        registry: Registry,
        runtime: Option<&tokio::runtime::Handle>,
    ) -> Result<Endpoint> {
        let addrs: Vec<SocketAddr> =
            addr.to_socket_addrs().map_err(|e| Error::io("metrics endpoint: resolve", "address", e))?.collect();
        // A runtime of its own is built first: it takes time, and no lock.
        let own = match runtime {
            Some(_) => None,
            None => Some(
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(|e| Error::io("metrics endpoint: start the runtime", "tokio", e))?,
            ),
        };
        let handle = match (runtime, &own) {
            (Some(handle), _) => handle.clone(),
            (None, Some(own)) => own.handle().clone(),
            (None, None) => return Err(Error::invalid_input("metrics endpoint: no runtime to run on")),
        };
        let listener = bind(&addrs, &handle)?;
        let addr = listener
            .socket
            .as_ref()
            .map(tokio::net::TcpListener::local_addr)
            .transpose()
            .map_err(|e| Error::io("metrics endpoint: address of", "listener", e))?
            .ok_or_else(|| Error::invalid_input("metrics endpoint: no listener"))?;
        let at = || PathBuf::from(addr.to_string());
        let stop = Arc::new(Notify::new());
        let thread = match own {
            None => {
                handle.spawn(accept(listener, registry, stop.clone()));
                None
            }
            Some(runtime) => {
                let stop = stop.clone();
                let thread = std::thread::Builder::new()
                    .name("granary-metrics".into())
                    .spawn(move || {
                        runtime.block_on(accept(listener, registry, stop));
                        // An encoding under way on the blocking pool is not waited for long.
                        runtime.shutdown_timeout(Duration::from_secs(1));
                    })
                    .map_err(|e| Error::io("metrics endpoint: start the thread", at(), e))?;
                Some(thread)
            }
        };
        Ok(Endpoint { addr, stop, thread })
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        // `notify_one` keeps a permit if the accept loop is not waiting at this moment.
        self.stop.notify_one();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A listener on the first of `addrs` that binds, for `handle`'s runtime, in `SOCKETS` from
/// its creation on.
fn bind(addrs: &[SocketAddr], handle: &tokio::runtime::Handle) -> Result<Tracked<tokio::net::TcpListener>> {
    let _entered = handle.enter();
    let mut last = None;
    for &addr in addrs {
        let at = PathBuf::from(addr.to_string());
        let mut set = sockets();
        match StdListener::bind(addr) {
            Ok(listener) => {
                listener.set_nonblocking(true).map_err(|e| Error::io("metrics endpoint: listen", at.clone(), e))?;
                let listener = tokio::net::TcpListener::from_std(listener)
                    .map_err(|e| Error::io("metrics endpoint: listen", at, e))?;
                return Ok(Tracked::adopt(listener, &mut set));
            }
            Err(e) => last = Some((at, e)),
        }
    }
    Err(match last {
        Some((at, e)) => Error::io("metrics endpoint: listen", at, e),
        None => Error::io(
            "metrics endpoint: resolve",
            "address",
            std::io::Error::new(std::io::ErrorKind::InvalidInput, "the address resolves to nothing"),
        ),
    })
}

/// The connections being served, oldest first, and which of them may make room for a new one.
/// Uses std's `Mutex`, as the rest of `metrics/` does (a fork never finds it held by a thread
/// it did not copy: the lock is never held across an await or a call out).
#[derive(Default)]
struct Admission {
    table: Mutex<AdmissionTable>,
}

#[derive(Default)]
struct AdmissionTable {
    next_id: u64,
    connections: Vec<Admitted>,
}

struct Admitted {
    id: u64,
    ip: std::net::IpAddr,
    /// Whether a request has arrived on it (a scraper's connection).
    requested: Arc<AtomicBool>,
    /// Whether it is answering a request right now (never cut).
    answering: Arc<AtomicBool>,
    evict: Arc<Notify>,
}

/// A connection's place in the table; leaves it on drop.
struct Slot {
    admission: Arc<Admission>,
    id: u64,
    requested: Arc<AtomicBool>,
    answering: Arc<AtomicBool>,
    evict: Arc<Notify>,
}

impl Admission {
    fn table(&self) -> MutexGuard<'_, AdmissionTable> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A slot for a connection from `ip`, making room when the endpoint or the address is
    /// full: the oldest connection there that never sent a request, else the oldest that is
    /// not answering one. `None` (the connection is closed) only when every candidate is
    /// answering a request.
    fn admit(this: &Arc<Self>, ip: std::net::IpAddr) -> Option<Slot> {
        let mut table = this.table();
        assert!(table.connections.len() <= CONNECTIONS_MAX);
        let address_full = table.connections.iter().filter(|c| c.ip == ip).count() >= CONNECTIONS_PER_ADDRESS_MAX;
        if address_full || table.connections.len() >= CONNECTIONS_MAX {
            let candidates = || {
                table
                    .connections
                    .iter()
                    .enumerate()
                    .filter(|(_, c)| (!address_full || c.ip == ip) && !c.answering.load(Ordering::Acquire))
            };
            let at = candidates()
                .find(|(_, c)| !c.requested.load(Ordering::Acquire))
                .or_else(|| candidates().next())
                .map(|(at, _)| at)?;
            let evicted = table.connections.remove(at);
            // A permit is stored if its task is not waiting yet: it finds it when it does.
            evicted.evict.notify_one();
        }
        table.next_id += 1;
        let id = table.next_id;
        let (requested, answering, evict) =
            (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)), Arc::new(Notify::new()));
        table.connections.push(Admitted {
            id,
            ip,
            requested: Arc::clone(&requested),
            answering: Arc::clone(&answering),
            evict: Arc::clone(&evict),
        });
        assert!(table.connections.len() <= CONNECTIONS_MAX);
        assert!(table.connections.iter().filter(|c| c.ip == ip).count() <= CONNECTIONS_PER_ADDRESS_MAX);
        Some(Slot { admission: Arc::clone(this), id, requested, answering, evict })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.admission.table().connections.retain(|c| c.id != self.id);
    }
}

/// Marks a connection as answering a request for as long as it lives.
struct Answering(Arc<AtomicBool>);

impl Answering {
    fn start(requested: &AtomicBool, answering: &Arc<AtomicBool>) -> Self {
        requested.store(true, Ordering::Release);
        answering.store(true, Ordering::Release);
        Self(Arc::clone(answering))
    }
}

impl Drop for Answering {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

async fn accept(mut listener: Tracked<tokio::net::TcpListener>, registry: Registry, stop: Arc<Notify>) {
    let admission = Arc::new(Admission::default());
    // One scrape is encoded at a time, off the runtime's workers (a node's runtime also runs
    // its heartbeats); the others wait their turn without holding a worker.
    let encoding = Arc::new(Semaphore::new(1));
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let (stream, peer) = tokio::select! {
            _ = stop.notified() => break,
            // The accepted socket goes into `SOCKETS` under the hold of the accept itself.
            accepted = std::future::poll_fn(|cx| {
                let mut set = sockets();
                match listener.socket() {
                    Ok(socket) => match socket.poll_accept(cx) {
                        Poll::Ready(Ok((stream, peer))) => Poll::Ready(Ok((Tracked::adopt(stream, &mut set), peer))),
                        Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
                        Poll::Pending => Poll::Pending,
                    },
                    Err(e) => Poll::Ready(Err(e)),
                }
            }) => match accepted {
                Ok(accepted) => accepted,
                // Out of descriptors or a connection reset before accept: try the next one
                // after a pause, so a full table does not spin.
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        // Reap finished connections so the set does not grow.
        while connections.try_join_next().is_some() {}
        let Some(slot) = Admission::admit(&admission, peer.ip()) else {
            drop(stream);
            continue;
        };
        let registry = registry.clone();
        let encoding = encoding.clone();
        connections.spawn(async move {
            let (requested, answering) = (Arc::clone(&slot.requested), Arc::clone(&slot.answering));
            let service = hyper::service::service_fn(move |request| {
                let registry = registry.clone();
                let encoding = encoding.clone();
                let answering = Answering::start(&requested, &answering);
                async move {
                    let response = respond(registry, encoding, &request).await;
                    drop(answering);
                    Ok::<_, std::convert::Infallible>(response)
                }
            });
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder.timer(TokioTimer::new()).header_read_timeout(HEAD_TIMEOUT).max_buf_size(HEAD_BYTES_MAX);
            let connection = builder.serve_connection(TokioIo::new(stream), service);
            tokio::select! {
                _ = slot.evict.notified() => {}
                _ = tokio::time::timeout(CONNECTION_TIME_MAX, connection) => {}
            }
            drop(slot);
        });
    }
    connections.abort_all();
}

async fn respond(registry: Registry, encoding: Arc<Semaphore>, request: &Request<Incoming>) -> Response<Full<Bytes>> {
    let head = request.method() == Method::HEAD;
    if request.method() != Method::GET && !head {
        let mut response = text(StatusCode::METHOD_NOT_ALLOWED, "only GET and HEAD are served\n");
        response.headers_mut().insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
        return response;
    }
    match request.uri().path() {
        "/metrics" => {
            // OpenMetrics to whoever asks for it (Prometheus does), the older text format to
            // everyone else.
            let asks_openmetrics = request
                .headers()
                .get_all(hyper::header::ACCEPT)
                .iter()
                .any(|value| value.to_str().is_ok_and(|v| v.contains("application/openmetrics-text")));
            let format = if asks_openmetrics { Format::OpenMetrics } else { Format::Prometheus };
            // HEAD too: hyper sends the length of the body it leaves out.
            let body = {
                // The turn goes with the encoding: a client that gives up does not let the next
                // encoding start while this one runs.
                let Ok(turn) = encoding.acquire_owned().await else {
                    return text(StatusCode::SERVICE_UNAVAILABLE, "the endpoint is stopping\n");
                };
                let encode = move || {
                    let body = registry.encode(format);
                    drop(turn);
                    body
                };
                match tokio::task::spawn_blocking(encode).await {
                    Ok(body) => body,
                    Err(_) => return text(StatusCode::INTERNAL_SERVER_ERROR, "encoding the metrics failed\n"),
                }
            };
            let mut response = Response::new(Full::new(Bytes::from(body)));
            response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(format.content_type()));
            response
        }
        "/" => text(StatusCode::OK, "granary: metrics at /metrics\n"),
        _ => text(StatusCode::NOT_FOUND, "not found: metrics are at /metrics\n"),
    }
}

fn text(status: StatusCode, body: &'static str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
    response
}
