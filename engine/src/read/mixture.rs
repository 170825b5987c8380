//! A mixture: named dataset versions, each with a weight, read as one stream.
//!
//! Opening one opens each source (a name, `name@N` or a manifest id, fixed to the version it
//! names now), concatenates them into one `Dataset` (so the reader, the tier and the origin
//! cache see shards as for any dataset) and builds the `Blend` that orders its positions. Its
//! identity is content: the sources' manifest ids, the weights and their changes, and the
//! epoch's length, so a saved position names exactly what it read.
//!
//! Owns `Mixture`, `MixtureSource`, `EpochLength`. Never: orders records itself (`blend.rs`
//! does) or reads record data.

use std::sync::Arc;

use crate::blend::{Blend, BlendSource};
use crate::error::{Error, Result};
use crate::id::ObjectId;
use crate::plan::Position;
use crate::store::{StorePaths, VersionSpec};

use super::Dataset;

/// How many samples an epoch of a mixture reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EpochLength {
    /// As many as its sources hold together (the default).
    Records,
    /// This many.
    Samples(u64),
    /// As many as make one pass over source `i` at its weight (the first weights): the
    /// smallest count whose share of it is the source's size.
    PassOf(usize),
}

/// One source of a mixture.
#[derive(Clone, Debug, PartialEq)]
pub struct MixtureSource {
    /// `name@version`, or the manifest id's first digits.
    pub label: String,
    /// Its version.
    pub manifest: crate::id::ManifestId,
    /// Its records.
    pub n_records: u64,
    /// Its weight (normalized: the weights add up to 1).
    pub weight: f64,
}

/// An opened mixture.
#[derive(Clone)]
pub struct Mixture {
    dataset: Arc<Dataset>,
    blend: Arc<Blend>,
    sources: Vec<MixtureSource>,
    /// The weights as given, and the epoch's length as asked (to blend other units: windows).
    weights: Vec<f64>,
    epoch: EpochLength,
}

impl Mixture {
    /// Opens `parts` (each a version and its weight) of the store at `paths`.
    pub fn open(paths: &StorePaths, parts: &[(VersionSpec, f64)], epoch: EpochLength) -> Result<Self> {
        let datasets = parts.iter().map(|(spec, _)| Dataset::open(paths, spec)).collect::<Result<Vec<_>>>()?;
        let weights: Vec<f64> = parts.iter().map(|(_, weight)| *weight).collect();
        Self::of(&datasets, &weights, epoch)
    }

    /// A mixture of `datasets` (of one store and one layout) in proportions `weights`.
    pub fn of(datasets: &[Arc<Dataset>], weights: &[f64], epoch: EpochLength) -> Result<Self> {
        let dataset = Arc::new(Dataset::concatenation(datasets)?);
        let keys: Vec<u64> = datasets
            .iter()
            .map(|d| {
                let mut key = [0u8; 8];
                key.copy_from_slice(&d.manifest_id().0.as_bytes()[..8]);
                u64::from_le_bytes(key)
            })
            .collect();
        let sizes: Vec<u64> = datasets.iter().map(|d| d.n_records()).collect();
        let blend = blend_of(&keys, &sizes, weights, epoch)?;
        let total: f64 = weights.iter().filter(|w| w.is_finite()).sum();
        let sources = datasets
            .iter()
            .zip(weights)
            .map(|(d, w)| MixtureSource {
                label: d.label(),
                manifest: d.manifest_id(),
                n_records: d.n_records(),
                weight: w / total,
            })
            .collect();
        Ok(Self { dataset, blend: Arc::new(blend), sources, weights: weights.to_vec(), epoch })
    }

    /// The same mixture over other units of its sources (`sizes[i]` of source `i`: packed
    /// windows, say): the same weights and changes, the epoch's length asked for counted in
    /// those units, each source's passes keyed as its records' are.
    pub fn reblend(&self, sizes: &[u64]) -> Result<Blend> {
        if sizes.len() != self.sources.len() {
            return Err(Error::invalid_input(format!("{} sizes for {} sources", sizes.len(), self.sources.len())));
        }
        let keys: Vec<u64> = self.blend.sources().iter().map(|s| s.key).collect();
        let mut blend = blend_of(&keys, sizes, &self.weights, self.epoch)?;
        for (at, weights) in self.blend.changes().into_iter().skip(1) {
            blend = blend.with_change(at, &weights).map_err(Error::invalid_input)?;
        }
        Ok(blend)
    }

    /// The same mixture with `weights` in force from `at` on (a curriculum's step).
    pub fn with_change(mut self, at: Position, weights: &[f64]) -> Result<Self> {
        let blend = (*self.blend).clone().with_change(at, weights).map_err(Error::invalid_input)?;
        self.blend = Arc::new(blend);
        Ok(self)
    }

    /// The dataset of every source's records, sources in order (what a loader reads).
    pub fn dataset(&self) -> &Arc<Dataset> {
        &self.dataset
    }

    /// The order of its positions.
    pub fn blend(&self) -> &Arc<Blend> {
        &self.blend
    }

    /// Its sources, in order.
    pub fn sources(&self) -> &[MixtureSource] {
        &self.sources
    }

    /// Its identity: a digest of the sources' versions, the weights and their changes, and the
    /// epoch's length (64 hex digits).
    pub fn id(&self) -> String {
        let mut digest = blake3::Hasher::new();
        digest.update(b"granary mixture 1");
        for source in &self.sources {
            digest.update(source.manifest.0.as_bytes());
        }
        digest.update(&self.blend.epoch_samples().to_le_bytes());
        for (at, _) in self.blend.changes() {
            digest.update(&at.epoch.to_le_bytes());
            digest.update(&at.cursor.to_le_bytes());
            for unit in self.blend.units_at(at) {
                digest.update(&unit.to_le_bytes());
            }
        }
        ObjectId::from_hash(digest.finalize()).to_string()
    }

    /// Each source's draws in epochs `0..epochs` (what `granary mix` shows); refused when one
    /// passes a `u64`.
    pub fn drawn(&self, epochs: u64) -> Result<Vec<u64>> {
        self.blend.drawn(epochs).ok_or_else(|| {
            Error::invalid_input(format!(
                "{epochs} epochs of {} samples: a source's draws pass what a u64 counts",
                self.blend.epoch_samples()
            ))
        })
    }
}

/// The blend of sources of `sizes` (keyed by `keys`) in proportions `weights`, `epoch` long.
fn blend_of(keys: &[u64], sizes: &[u64], weights: &[f64], epoch: EpochLength) -> Result<Blend> {
    let mut start = 0;
    let sources: Vec<BlendSource> = keys
        .iter()
        .zip(sizes)
        .map(|(&key, &n)| {
            let source = BlendSource { start, n_records: n, key };
            start += n;
            source
        })
        .collect();
    let total: f64 = weights.iter().filter(|w| w.is_finite()).sum();
    let samples = match epoch {
        EpochLength::Records => start,
        EpochLength::Samples(n) => n,
        EpochLength::PassOf(i) => {
            let (Some(&n), Some(&w)) = (sizes.get(i), weights.get(i)) else {
                return Err(Error::invalid_input(format!("an epoch of source {i}'s pass: no source {i}")));
            };
            if w.is_nan() || w <= 0.0 || total.is_nan() || total <= 0.0 {
                return Err(Error::invalid_input(format!("an epoch of source {i}'s pass: its weight is 0")));
            }
            let samples = (n as f64 * total / w).ceil();
            if samples >= u64::MAX as f64 {
                return Err(Error::invalid_input(format!(
                    "an epoch of source {i}'s pass: at its weight ({w} of {total}) a pass over its {n} records takes \
                     more than 2^64 samples"
                )));
            }
            samples as u64
        }
    };
    let blend = Blend::new(sources, weights, samples).map_err(Error::invalid_input)?;
    if let EpochLength::PassOf(i) = epoch
        && blend.units_at(crate::plan::Position::default()).get(i) == Some(&0)
    {
        // Below the weights' fixed point it is never drawn: no epoch passes over it.
        return Err(Error::invalid_input(format!(
            "an epoch of source {i}'s pass: its weight is below 1 / 2^32 of the total, so it is never drawn"
        )));
    }
    Ok(blend)
}

impl std::fmt::Debug for Mixture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mixture")
            .field("sources", &self.sources)
            .field("epoch_samples", &self.blend.epoch_samples())
            .finish()
    }
}
