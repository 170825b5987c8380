//! `granary serve`, `granary replicate`, `granary status` and `granary cluster-key`: a node of a
//! training job and the commands that talk to it.
//!
//! Owns: the arguments of these commands (`ServeArgs`, `ReplicateArgs`, `StatusArgs`,
//! `ClusterKeyArgs`) and `KeyArgs` (where a command finds the cluster secret: `--cluster-key FILE`,
//! else `GRANARY_CLUSTER_KEY`), turning them into a `NodeConfig` or a `NodeClient`, and writing a
//! new secret file (mode 0600). Never: prints a cluster secret, overwrites an existing key file, or
//! starts a node whose configuration has not passed `NodeConfig::check`.

use std::io::Write;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;
use granary::erasure::Coding;
use granary::policy::{Limits, PolicyHost};
use granary::replication::frame::{Goal, ReplicateMode};
use granary::replication::{ClusterKey, Faults, Membership, Node, NodeClient, NodeConfig};

use super::parse_size;

/// Where a command finds the cluster secret.
#[derive(Args, Clone)]
pub(crate) struct KeyArgs {
    /// A file holding the job's cluster secret (or set GRANARY_CLUSTER_KEY to the secret).
    #[arg(long, value_name = "FILE")]
    cluster_key: Option<PathBuf>,
}

impl KeyArgs {
    pub(crate) fn key(&self) -> Result<ClusterKey> {
        match &self.cluster_key {
            Some(path) => Ok(ClusterKey::from_file(path)?),
            None => ClusterKey::from_env()?
                .context("no cluster key: pass --cluster-key FILE or set GRANARY_CLUSTER_KEY (`granary cluster-key --out FILE` makes one)"),
        }
    }

    /// The key, when one is given at all.
    pub(crate) fn key_if_given(&self) -> Result<Option<ClusterKey>> {
        match &self.cluster_key {
            Some(path) => Ok(Some(ClusterKey::from_file(path)?)),
            None => Ok(ClusterKey::from_env()?),
        }
    }
}

#[derive(Args)]
pub(crate) struct ServeArgs {
    /// Where to listen for peers and clients (HOST:PORT).
    #[arg(long, value_name = "ADDR")]
    listen: String,
    /// The other nodes (HOST:PORT,...). Without it, under torchrun (WORLD_SIZE, MASTER_ADDR),
    /// node 0 is the rendezvous where the nodes exchange addresses.
    #[arg(long, value_delimiter = ',', value_name = "ADDRS")]
    peers: Vec<String>,
    #[command(flatten)]
    key: KeyArgs,
    /// This node's id (default: the launcher's node rank, else one derived from --listen).
    #[arg(long)]
    node_id: Option<u32>,
    /// This node's relative capacity for placement.
    #[arg(long, default_value_t = 1)]
    weight: u32,
    /// This node's failure domain (nodes that fail together share one; default: its id).
    #[arg(long)]
    failure_domain: Option<u32>,
    /// Bound on the bytes of shards fetched for reads and not placed here (0: no bound).
    #[arg(long, default_value = "0", value_parser = parse_size)]
    cache_bytes: u64,
    /// The evictor plugin of that cache (a built-in name or a .wasm file).
    #[arg(long)]
    evictor: Option<String>,
    /// The evictor's options, KEY=VALUE,... (the built-ins take none).
    #[arg(long, value_delimiter = ',')]
    evictor_options: Vec<String>,
    /// The replicator plugin (a built-in name or a .wasm file).
    #[arg(long)]
    replicator: Option<String>,
    /// The replicator's options, KEY=VALUE,... (for the built-in: mode=sync|async, buckets=N).
    #[arg(long, value_delimiter = ',')]
    replicator_options: Vec<String>,
    /// How often each peer is probed, in milliseconds.
    #[arg(long, default_value_t = 500)]
    heartbeat_ms: u64,
    /// A peer silent for this long is down, in milliseconds.
    #[arg(long, default_value_t = 2000)]
    down_after_ms: u64,
    /// The window shard reads are counted over for hot copies (the replicator's `adapt`,
    /// with `--replicator-options hot-replicas=N`), in milliseconds.
    #[arg(long, default_value_t = 30_000)]
    heat_window_ms: u64,
    /// Compiled plugins are cached here (default: ROOT/replication/plugin-cache).
    #[arg(long)]
    plugin_cache: Option<PathBuf>,
    /// Serve Prometheus metrics at http://ADDR/metrics (HOST:PORT).
    #[arg(long, value_name = "ADDR")]
    metrics: Option<String>,
}

fn socket_addr(text: &str) -> Result<SocketAddr> {
    text.to_socket_addrs()
        .with_context(|| format!("address {text:?}"))?
        .next()
        .with_context(|| format!("address {text:?} resolves to nothing"))
}

fn options(list: &[String]) -> Result<Vec<(String, String)>> {
    list.iter()
        .filter(|o| !o.is_empty())
        .map(|o| {
            o.split_once('=')
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .with_context(|| format!("option {o:?} is not KEY=VALUE"))
        })
        .collect()
}

pub(crate) fn serve(root: &Path, args: &ServeArgs) -> Result<()> {
    let key = args.key.key()?;
    let listen = socket_addr(&args.listen)?;
    let membership = if !args.peers.is_empty() {
        Membership::peers(&args.peers)?
    } else {
        Membership::from_launcher_env()?.unwrap_or(Membership::Peers(Vec::new()))
    };
    let mut config = NodeConfig::new(root, listen, membership, key);
    config.node_id = args.node_id;
    config.weight = args.weight;
    config.failure_domain = args.failure_domain;
    config.cache_bytes_max = args.cache_bytes;
    config.evictor = args.evictor.clone();
    config.evictor_options = options(&args.evictor_options)?;
    config.replicator = args.replicator.clone();
    config.replicator_options = options(&args.replicator_options)?;
    config.heartbeat = Duration::from_millis(args.heartbeat_ms.max(10));
    config.down_after = Duration::from_millis(args.down_after_ms.max(args.heartbeat_ms));
    config.heat_window = Duration::from_millis(args.heat_window_ms.max(100));
    config.faults = Faults::from_env();
    config.metrics_listen = args.metrics.as_deref().map(socket_addr).transpose()?;
    let cache_dir = args.plugin_cache.clone().unwrap_or_else(|| root.join("replication").join("plugin-cache"));
    let host = PolicyHost::new(Limits::default(), Some(cache_dir))?;
    // Everything the node is given is checked before the store is made or anything listens.
    config.check(&host)?;
    // A node that joins a job may start with nothing: its store is made now.
    if !root.join("granary-store").exists() {
        drop(granary::Granary::create(root)?);
    }
    let node = Node::start(config, &host)?;
    // A node serves whatever became of its stdout (a closed pipe, a full disk): the line is a
    // courtesy, the listen file under replication/ is what tools read.
    let _ = outln!("granary node {} serving {} on {}", node.id(), root.display(), node.listen_addr());
    if let Some(addr) = node.metrics_addr() {
        let _ = outln!("metrics at http://{addr}/metrics");
    }
    node.run_until_signal();
    Ok(())
}

#[derive(Args)]
pub(crate) struct ReplicateArgs {
    /// The dataset: NAME or NAME@N.
    dataset: String,
    /// Copies wanted of each shard.
    #[arg(long, required_unless_present = "ec", conflicts_with = "ec")]
    replicas: Option<u32>,
    /// Instead of copies: each shard cut into K data and M parity fragments (Reed-Solomon), one
    /// per node, any K of which rebuild it: the shards survive any M lost nodes at (K+M)/K their
    /// size (`4+2`: 1.5 x). Fragment i goes to the i-th node the replicator places the shard on.
    /// Whole copies go once every fragment is placed (unless a copies goal places them); a node
    /// with a read cache (`serve --cache-bytes`) keeps them as cache entries until it needs room.
    #[arg(long, value_name = "K+M")]
    ec: Option<String>,
    /// For this call: `sync` returns once every copy (or fragment) is verified on its node,
    /// `async` once they are scheduled (default: the node's replicator setting, `serve
    /// --replicator-options mode=...`).
    #[arg(long, value_enum)]
    mode: Option<ModeArg>,
    /// The node to ask (default: the one serving --root).
    #[arg(long, value_name = "ADDR")]
    node: Option<String>,
    #[command(flatten)]
    key: KeyArgs,
}

/// `replicate --mode`.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub(crate) enum ModeArg {
    /// Wait for every copy.
    Sync,
    /// Schedule the copies and return.
    Async,
}

fn client(root: &Path, node: Option<&str>, key: ClusterKey) -> Result<NodeClient> {
    Ok(match node {
        Some(addr) => NodeClient::new(socket_addr(addr)?, key),
        None => NodeClient::for_store(root, key)?,
    })
}

pub(crate) fn replicate(root: &Path, args: &ReplicateArgs) -> Result<()> {
    let client = client(root, args.node.as_deref(), args.key.key()?)?;
    let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let mode = match args.mode {
        None => ReplicateMode::Node,
        Some(ModeArg::Sync) => ReplicateMode::Synchronous,
        Some(ModeArg::Async) => ReplicateMode::Asynchronous,
    };
    let goal = match (&args.ec, args.replicas) {
        (Some(coding), _) => Goal::Coded(Coding::parse(coding)?),
        (None, Some(0)) => bail!("--replicas must be at least 1"),
        (None, Some(replicas)) => Goal::Replicas(replicas),
        (None, None) => bail!("replicate needs --replicas R or --ec K+M"),
    };
    let report = client.replicate(&args.dataset, goal, mode, move |done, total| {
        if tty {
            err!("\rreplicating: {done}/{total} shards confirmed");
            if done == total {
                errln!();
            }
        }
    })?;
    outln!("{report}")?;
    Ok(())
}

#[derive(Args)]
pub(crate) struct StatusArgs {
    /// The node to ask (default: the one serving --root).
    #[arg(long, value_name = "ADDR")]
    node: Option<String>,
    /// Print the report as JSON, for scripts (its keys stay stable).
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    key: KeyArgs,
}

pub(crate) fn status(root: &Path, args: &StatusArgs) -> Result<()> {
    let client = client(root, args.node.as_deref(), args.key.key()?)?;
    let status = client.status()?;
    if args.json {
        outln!("{}", status.to_json_pretty())?;
    } else {
        out!("{status}")?;
    }
    Ok(())
}

#[derive(Args)]
pub(crate) struct ClusterKeyArgs {
    /// Where to write the new secret (created with mode 0600; an existing file is kept).
    #[arg(long, value_name = "FILE")]
    out: PathBuf,
}

pub(crate) fn cluster_key(args: &ClusterKeyArgs) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let secret = ClusterKey::generate_secret()?;
    let mut file = match std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&args.out) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            bail!("{} exists; remove it first to make a new key", args.out.display())
        }
        Err(e) => return Err(e).with_context(|| format!("create {}", args.out.display())),
    };
    writeln!(file, "{secret}")
        .and_then(|()| file.sync_all())
        .with_context(|| format!("write {}", args.out.display()))?;
    outln!("wrote a new cluster secret to {}: give every node of the job the same file", args.out.display())?;
    Ok(())
}
