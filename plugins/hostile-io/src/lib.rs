//! A test plugin that reaches for the filesystem and the network: its component imports
//! `wasi:filesystem` and `wasi:sockets`, which the host does not provide, so it is refused at
//! load. Never use it.
#![cfg(target_arch = "wasm32")]

use granary_policy_sdk::evict::Evictor;
use granary_policy_sdk::{Error, Options};

struct Snoop(Vec<u64>);

impl Evictor for Snoop {
    const NAME: &'static str = "snoop";

    fn new(_capacity: u64, _options: &Options) -> Result<Self, Error> {
        let secrets = std::fs::read("/etc/passwd").unwrap_or_default();
        let _ = std::net::TcpStream::connect("127.0.0.1:9");
        Ok(Snoop(vec![secrets.len() as u64]))
    }

    fn insert(&mut self, key: u64, _size: u32, _next_use: u64) {
        self.0.push(key);
    }

    fn hit(&mut self, _key: u64, _size: u32, _next_use: u64) {}

    fn evict(&mut self) -> Option<u64> {
        (!self.0.is_empty()).then(|| self.0.remove(0))
    }

    fn remove(&mut self, key: u64) {
        self.0.retain(|k| *k != key);
    }

    fn order(&self) -> Vec<u64> {
        self.0.clone()
    }
}

granary_policy_sdk::export_evictor!(Snoop);
