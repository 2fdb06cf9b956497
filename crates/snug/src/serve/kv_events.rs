//! KV-cache events for routers, in vLLM's wire format over ZeroMQ
//! (`--kv-events`).
//!
//! A router that knows which replica holds which prompt prefix can send a
//! request where its prefix is cached. vLLM publishes what enters and
//! leaves its prefix cache for such routers (Dynamo's and llm-d's among
//! them), and snug publishes its own cache's changes the same way:
//!
//! - a PUB socket sends each batch as three frames: the topic, the batch's
//!   sequence number (8 bytes, big-endian, from 0) and the MessagePack
//!   payload;
//! - the payload is `[ts, [event, ...], data_parallel_rank]`, where an
//!   event is a map with a `type` key (`BlockStored`, `BlockRemoved`,
//!   `AllBlocksCleared`), or, with `--kv-events-format array`, the
//!   positional array older vLLM releases sent (`["BlockStored",
//!   block_hashes, parent_block_hash, token_ids, block_size, lora_id,
//!   medium]`);
//! - with `--kv-events-replay`, a ROUTER socket answers a request of a
//!   starting sequence number (8 bytes, big-endian) with every kept batch
//!   from there, as `[seq, payload]` messages, then `[-1, ""]`.
//!
//! A block is one KV page (`block_size` = `--kv-page` tokens). Its hash is
//! the first 8 bytes, big-endian, of the prefix cache's SHA-256 key of the
//! page, which covers every token before the page's end: replicas serving
//! one model name the same prefix alike, so a router indexing several of
//! them sees one prefix wherever it is held. `medium` is `CPU` where pages
//! live in RAM and `GPU` on a CUDA device.
//!
//! The engine loop hands its events to this module's thread through a
//! bounded channel and never waits on it: when the thread falls behind by
//! [`QUEUE`] batches, later ones are dropped and counted, and a router
//! sees the gap in the sequence numbers.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use snug_core::prefix::{CacheEvent, Key};

/// Batches the engine loop may be ahead of the publishing thread.
pub const QUEUE: usize = 4096;
/// Batches kept for replay.
pub const REPLAY_KEPT: usize = 10_000;

/// How each event is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WireFormat {
    /// A map with a `type` key and named fields (vLLM's current form).
    Map,
    /// A positional array led by the type's name (vLLM's older form).
    Array,
}

impl WireFormat {
    pub fn parse(s: &str) -> Option<WireFormat> {
        match s {
            "map" => Some(WireFormat::Map),
            "array" => Some(WireFormat::Array),
            _ => None,
        }
    }
}

/// What `--kv-events` and its companions asked for.
#[derive(Clone, Debug)]
pub struct EventsConfig {
    /// The PUB socket's endpoint: bound where it names a wildcard host
    /// (`tcp://*:5557`), an `ipc://` path or `inproc://`, connected
    /// otherwise (as vLLM does).
    pub endpoint: String,
    pub replay: Option<String>,
    pub topic: String,
    pub format: WireFormat,
    /// `CPU` or `GPU`.
    pub medium: &'static str,
}

/// The events of one turn of the engine loop.
pub struct Batch {
    pub block_size: usize,
    pub events: Vec<CacheEvent>,
}

/// The engine loop's end of the publisher.
#[derive(Clone)]
pub struct Sender {
    tx: SyncSender<Batch>,
    dropped: Arc<AtomicU64>,
}

impl Sender {
    /// Queues a batch for publishing, never waiting: a full queue drops it.
    pub fn send(&self, batch: Batch) {
        if batch.events.is_empty() {
            return;
        }
        match self.tx.try_send(batch) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Batches dropped so far.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

/// The hash a router sees for a page keyed `key`.
pub fn block_hash(key: &Key) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&key[..8]);
    u64::from_be_bytes(b)
}

#[derive(Serialize)]
#[serde(tag = "type")]
enum MapEvent<'a> {
    BlockStored {
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: &'a [u32],
        block_size: usize,
        lora_id: Option<u32>,
        medium: &'a str,
        lora_name: Option<&'a str>,
    },
    BlockRemoved {
        block_hashes: Vec<u64>,
        medium: &'a str,
    },
    AllBlocksCleared {},
}

fn encode_event(e: &CacheEvent, block_size: usize, format: WireFormat, medium: &str) -> Vec<u8> {
    let hashes = |keys: &[Key]| keys.iter().map(block_hash).collect::<Vec<u64>>();
    let r = match (format, e) {
        (WireFormat::Map, CacheEvent::Stored { parent, keys, tokens }) => {
            rmp_serde::to_vec_named(&MapEvent::BlockStored {
                block_hashes: hashes(keys),
                parent_block_hash: parent.as_ref().map(block_hash),
                token_ids: tokens,
                block_size,
                lora_id: None,
                medium,
                lora_name: None,
            })
        }
        (WireFormat::Map, CacheEvent::Removed { keys }) => rmp_serde::to_vec_named(&MapEvent::BlockRemoved {
            block_hashes: hashes(keys),
            medium,
        }),
        (WireFormat::Map, CacheEvent::Cleared) => rmp_serde::to_vec_named(&MapEvent::AllBlocksCleared {}),
        (WireFormat::Array, CacheEvent::Stored { parent, keys, tokens }) => rmp_serde::to_vec(&(
            "BlockStored",
            hashes(keys),
            parent.as_ref().map(block_hash),
            tokens,
            block_size,
            None::<u32>,
            medium,
        )),
        (WireFormat::Array, CacheEvent::Removed { keys }) => rmp_serde::to_vec(&("BlockRemoved", hashes(keys), medium)),
        (WireFormat::Array, CacheEvent::Cleared) => rmp_serde::to_vec(&("AllBlocksCleared",)),
    };
    r.expect("plain data always encodes")
}

/// The payload of one batch: `[ts, [event, ...], 0]`.
pub fn encode_batch(b: &Batch, ts: f64, format: WireFormat, medium: &str) -> Vec<u8> {
    let mut out = Vec::new();
    // Writes into a Vec cannot fail.
    let _ = rmp::encode::write_array_len(&mut out, 3);
    let _ = rmp::encode::write_f64(&mut out, ts);
    let _ = rmp::encode::write_array_len(&mut out, b.events.len() as u32);
    for e in &b.events {
        out.extend_from_slice(&encode_event(e, b.block_size, format, medium));
    }
    let _ = rmp::encode::write_uint(&mut out, 0);
    out
}

/// Whether vLLM's rule binds this endpoint (else it connects).
fn binds(endpoint: &str) -> bool {
    endpoint.contains('*')
        || endpoint.contains("::")
        || endpoint.starts_with("ipc://")
        || endpoint.starts_with("inproc://")
}

/// Opens the sockets (so that an endpoint in use is an error now) and
/// starts the publishing thread. The thread ends when every [`Sender`] is
/// gone.
pub fn start(cfg: EventsConfig) -> Result<Sender, String> {
    let ctx = zmq::Context::new();
    let publisher = ctx.socket(zmq::PUB).map_err(|e| e.to_string())?;
    publisher.set_sndhwm(100_000).map_err(|e| e.to_string())?;
    publisher.set_linger(1000).map_err(|e| e.to_string())?;
    let r = if binds(&cfg.endpoint) {
        publisher.bind(&cfg.endpoint)
    } else {
        publisher.connect(&cfg.endpoint)
    };
    r.map_err(|e| format!("--kv-events {}: {e}", cfg.endpoint))?;
    let replay = match &cfg.replay {
        Some(ep) => {
            let s = ctx.socket(zmq::ROUTER).map_err(|e| e.to_string())?;
            s.set_linger(0).map_err(|e| e.to_string())?;
            s.bind(ep).map_err(|e| format!("--kv-events-replay {ep}: {e}"))?;
            Some(s)
        }
        None => None,
    };
    let (tx, rx) = sync_channel(QUEUE);
    std::thread::Builder::new()
        .name("snug-kv-events".into())
        .spawn(move || publish_loop(&cfg, &publisher, replay.as_ref(), &rx))
        .map_err(|e| e.to_string())?;
    Ok(Sender {
        tx,
        dropped: Arc::new(AtomicU64::new(0)),
    })
}

fn publish_loop(cfg: &EventsConfig, publisher: &zmq::Socket, replay: Option<&zmq::Socket>, rx: &Receiver<Batch>) {
    let mut kept: VecDeque<(u64, Vec<u8>)> = VecDeque::new();
    let mut seq: u64 = 0;
    let topic = cfg.topic.as_bytes();
    loop {
        if let Some(r) = replay {
            while r.poll(zmq::POLLIN, 0).is_ok_and(|n| n > 0) {
                serve_replay(r, &kept);
            }
        }
        let batch = match rx.recv_timeout(Duration::from_millis(if replay.is_some() { 20 } else { 200 })) {
            Ok(b) => b,
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => return,
        };
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let payload = encode_batch(&batch, ts, cfg.format, cfg.medium);
        let seq_bytes = seq.to_be_bytes();
        // A PUB socket drops what a slow subscriber cannot take; an error
        // here is the socket closing, and the next batch tries again.
        let _ = publisher.send_multipart([topic, &seq_bytes[..], &payload[..]], 0);
        if replay.is_some() {
            if kept.len() == REPLAY_KEPT {
                kept.pop_front();
            }
            kept.push_back((seq, payload));
        }
        seq += 1;
    }
}

/// Answers one replay request: `[identity, "", start]` in, each kept batch
/// from `start` on out, then the end marker.
fn serve_replay(r: &zmq::Socket, kept: &VecDeque<(u64, Vec<u8>)>) {
    let Ok(frames) = r.recv_multipart(zmq::DONTWAIT) else {
        return;
    };
    let [id, empty, start] = frames.as_slice() else {
        return;
    };
    let Ok(start) = <[u8; 8]>::try_from(start.as_slice()) else {
        return;
    };
    let start = u64::from_be_bytes(start);
    for (seq, payload) in kept.iter().filter(|(s, _)| *s >= start) {
        let s = seq.to_be_bytes();
        if r.send_multipart([&id[..], &empty[..], &s[..], &payload[..]], zmq::DONTWAIT)
            .is_err()
        {
            return;
        }
    }
    let _ = r.send_multipart([&id[..], &empty[..], &(-1i64).to_be_bytes()[..], b""], zmq::DONTWAIT);
}

#[cfg(test)]
mod tests {
    use super::*;
    use snug_core::prefix;

    fn stored() -> (Batch, Vec<Key>) {
        let tokens: Vec<u32> = (0..8).collect();
        let keys = prefix::keys(&tokens, 4, usize::MAX);
        let b = Batch {
            block_size: 4,
            events: vec![
                CacheEvent::Stored {
                    parent: None,
                    keys: keys.clone(),
                    tokens,
                },
                CacheEvent::Removed { keys: vec![keys[1]] },
                CacheEvent::Cleared,
            ],
        };
        (b, keys)
    }

    #[test]
    fn a_map_batch_names_its_fields() {
        let (b, keys) = stored();
        let bytes = encode_batch(&b, 1.5, WireFormat::Map, "CPU");
        let v: rmpv::Value = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
        let outer = v.as_array().unwrap();
        assert_eq!(outer.len(), 3);
        assert_eq!(outer[0].as_f64(), Some(1.5));
        assert_eq!(outer[2].as_u64(), Some(0));
        let events = outer[1].as_array().unwrap();
        let field = |e: &rmpv::Value, name: &str| {
            e.as_map()
                .unwrap()
                .iter()
                .find(|(k, _)| k.as_str() == Some(name))
                .map(|(_, v)| v.clone())
        };
        assert_eq!(field(&events[0], "type").unwrap().as_str(), Some("BlockStored"));
        let hashes: Vec<u64> = field(&events[0], "block_hashes")
            .unwrap()
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h.as_u64().unwrap())
            .collect();
        assert_eq!(hashes, vec![block_hash(&keys[0]), block_hash(&keys[1])]);
        assert!(field(&events[0], "parent_block_hash").unwrap().is_nil());
        assert_eq!(field(&events[0], "token_ids").unwrap().as_array().unwrap().len(), 8);
        assert_eq!(field(&events[0], "block_size").unwrap().as_u64(), Some(4));
        assert_eq!(field(&events[0], "medium").unwrap().as_str(), Some("CPU"));
        assert_eq!(field(&events[1], "type").unwrap().as_str(), Some("BlockRemoved"));
        assert_eq!(field(&events[2], "type").unwrap().as_str(), Some("AllBlocksCleared"));
    }

    #[test]
    fn an_array_batch_keeps_the_old_positions() {
        let (b, keys) = stored();
        let bytes = encode_batch(&b, 2.0, WireFormat::Array, "GPU");
        let v: rmpv::Value = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
        let events = v.as_array().unwrap()[1].as_array().unwrap().clone();
        let s = events[0].as_array().unwrap();
        assert_eq!(s.len(), 7);
        assert_eq!(s[0].as_str(), Some("BlockStored"));
        assert_eq!(s[1].as_array().unwrap()[1].as_u64(), Some(block_hash(&keys[1])));
        assert!(s[2].is_nil() && s[5].is_nil());
        assert_eq!(s[4].as_u64(), Some(4));
        assert_eq!(s[6].as_str(), Some("GPU"));
        assert_eq!(events[1].as_array().unwrap()[0].as_str(), Some("BlockRemoved"));
        assert_eq!(events[2].as_array().unwrap().len(), 1);
    }

    #[test]
    fn a_hash_depends_on_every_token_before_the_page_end() {
        let a: Vec<u32> = (0..8).collect();
        let mut b = a.clone();
        b[0] = 7;
        let (ka, kb) = (prefix::keys(&a, 4, 2), prefix::keys(&b, 4, 2));
        assert_ne!(block_hash(&ka[1]), block_hash(&kb[1]));
        assert_eq!(
            block_hash(&ka[1]),
            block_hash(&prefix::keys(&a, 4, 2)[1]),
            "the same tokens, the same hash"
        );
    }

    #[test]
    fn a_full_queue_drops_and_counts() {
        let (tx, _rx) = sync_channel(1);
        let s = Sender {
            tx,
            dropped: Arc::new(AtomicU64::new(0)),
        };
        s.send(stored().0);
        s.send(stored().0);
        s.send(Batch {
            block_size: 4,
            events: Vec::new(),
        });
        assert_eq!(
            s.dropped(),
            1,
            "the second waits for no one; an empty batch is not sent"
        );
    }
}
