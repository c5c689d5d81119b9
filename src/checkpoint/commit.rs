//! The commit of a save: the ranks' manifests meet at rank 0, which builds the index once
//! every rank's files are durable and writes it atomically ([`IndexWrite`]), then removes
//! the files of earlier generations.

use super::atomic::sync_dir;
use super::file::CHECKSUM_ALGORITHM;
use super::index::{Entry, Index, OptimIndex, PieceRef, FORMAT, INDEX_FILE, VERSION};
use super::save::{Commit, Manifest, Written};
use crate::distributed::staged;
use crate::error::{Error, Result};
use crate::fsdp::StateDictType;
use std::collections::BTreeMap;
use std::path::Path;

impl Commit {
    /// The second half of a save, on every rank once its writes are done: the manifests
    /// meet at rank 0, which builds the index when every rank's files are durable and, with
    /// `write_now`, writes it; else rank 0 gets it back to write ([`IndexWrite`]). `earlier`
    /// is rank 0's failure to write an earlier save's index, reported here on every rank.
    /// A collective.
    ///
    /// # Errors
    /// As [`save_checkpoint`](super::save_checkpoint), on every rank; a failed write's message (naming the file) on
    /// every rank.
    pub(super) fn commit(
        self,
        pg: &crate::distributed::Group,
        written: Written,
        earlier: Option<String>,
        write_now: bool,
    ) -> Result<Option<IndexWrite>> {
        let Commit {
            dir,
            generation,
            ty,
            extra,
        } = self;
        let dir = dir.as_path();
        let mut manifest = written.0;
        if manifest.error.is_none() {
            manifest.error = earlier;
        }
        let rank = pg.rank();
        let bytes = serde_json::to_vec(&manifest).map_err(|e| Error::Data(e.to_string()))?;
        let all = staged::all_gather_bytes(pg.as_ref(), &bytes)?;
        let result = if rank == 0 {
            build_index(dir, generation, ty, pg.size(), &all, extra).and_then(|w| {
                if write_now {
                    w.write().map(|()| None)
                } else {
                    Ok(Some(w))
                }
            })
        } else {
            Ok(None)
        };
        let failed = super::index::first_failed(pg, result.is_ok())?;
        let job = result?;
        if let Some(e) = manifest.error {
            return Err(Error::Checkpoint {
                path: dir.display().to_string(),
                detail: format!("rank {rank}: {e}; the previous checkpoint is untouched"),
            });
        }
        if let Some(r) = failed {
            // The failed rank's own words when it sent them (a write naming its file).
            let said = all
                .get(r)
                .and_then(|b| serde_json::from_slice::<Manifest>(b).ok())
                .and_then(|m| m.error)
                .map_or_else(String::new, |e| format!(": {e}"));
            return Err(Error::PeerFailed {
                failed_rank: pg.ranks().get(r).copied().unwrap_or(r),
                reason: format!(
                    "could not write its part of checkpoint '{}'{said}; the previous checkpoint is untouched",
                    dir.display()
                ),
            });
        }
        Ok(job)
    }
}

/// Rank 0's index of a save whose files every rank has written, to be written.
pub(super) struct IndexWrite {
    dir: std::path::PathBuf,
    index: Index,
}

impl IndexWrite {
    /// Writes the index atomically, then removes the files of earlier generations. No
    /// collective.
    ///
    /// # Errors
    /// `Io` naming the index file or the directory.
    pub(super) fn write(&self) -> Result<()> {
        let (dir, index) = (&self.dir, &self.index);
        let text = super::seal::index_text(index)?;
        super::atomic::write_atomic(&dir.join(INDEX_FILE), &text)?;
        // The new index is durable: files of earlier generations, and of this one that it
        // does not name (a crashed save's), are garbage now; later ones belong to a save
        // under way.
        let keep: Vec<&str> = index.files.iter().map(|f| f.name.as_str()).collect();
        let generation_of = |n: &str| {
            n.strip_suffix(".safetensors")
                .and_then(|s| s.rsplit_once("-g"))
                .and_then(|(_, g)| g.parse::<u64>().ok())
        };
        if let Ok(rd) = std::fs::read_dir(dir) {
            for e in rd.flatten() {
                let n = e.file_name().to_string_lossy().into_owned();
                let stale = generation_of(&n).is_some_and(|g| {
                    g < index.generation || (g == index.generation && !keep.contains(&n.as_str()))
                });
                if stale {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        sync_dir(dir)
    }
}

/// Rank 0: builds the index from every rank's manifest.
fn build_index(
    dir: &Path,
    generation: u64,
    ty: StateDictType,
    world_size: usize,
    manifests: &[Vec<u8>],
    extra: serde_json::Value,
) -> Result<IndexWrite> {
    let mut index = Index {
        index_checksum: None,
        format: FORMAT.into(),
        version: VERSION,
        checksum_algorithm: Some(CHECKSUM_ALGORITHM.into()),
        state_dict_type: ty,
        world_size,
        generation,
        files: Vec::new(),
        model: BTreeMap::new(),
        optim: None,
        extra,
        rank_extra: None,
    };
    let mut optim: Option<OptimIndex> = None;
    let mut rank_extra: Vec<Option<serde_json::Value>> = Vec::new();
    for (r, bytes) in manifests.iter().enumerate() {
        let m: Manifest = serde_json::from_slice(bytes)
            .map_err(|e| Error::Data(format!("rank {r}'s checkpoint manifest: {e}")))?;
        if let Some(e) = m.error {
            return Err(Error::Checkpoint {
                path: dir.display().to_string(),
                detail: format!(
                    "rank {r} could not write its file: {e}; the index was not replaced"
                ),
            });
        }
        if m.rank_extra.len() > 1 {
            return Err(Error::Data(format!(
                "rank {r}'s checkpoint manifest holds {} per-rank values, not one",
                m.rank_extra.len()
            )));
        }
        rank_extra.push(m.rank_extra.into_iter().next());
        let base = index.files.len();
        index.files.extend(m.files);
        if let Some((kind, hyper, steps)) = m.optim {
            let o = optim.get_or_insert_with(|| OptimIndex {
                kind,
                hyperparams: hyper.into_iter().collect(),
                ..OptimIndex::default()
            });
            if o.param_groups.is_empty() {
                o.param_groups = m.optim_groups;
            }
            for (n, s) in steps {
                let e = o.steps.entry(n).or_insert(s);
                *e = (*e).max(s);
            }
        }
        let dtypes = m.entry_dtypes.into_iter().chain(std::iter::repeat(None));
        for ((section, name, shape), dtype) in m.entries.into_iter().zip(dtypes) {
            let map = section_map(&mut index.model, &mut optim, &section);
            let e = map.entry(name).or_insert_with(|| Entry {
                shape,
                ..Entry::default()
            });
            if e.dtype.is_none() {
                e.dtype = dtype;
            }
        }
        let sums = m
            .piece_sums
            .into_iter()
            .map(Some)
            .chain(std::iter::repeat(None));
        for ((section, name, file, key, offset, numel), checksum) in m.pieces.into_iter().zip(sums)
        {
            let map = section_map(&mut index.model, &mut optim, &section);
            let e = map.entry(name).or_default();
            // Replicas (ignored modules' parameters) are kept once.
            if !e
                .pieces
                .iter()
                .any(|p| p.offset == offset && p.numel == numel)
            {
                e.pieces.push(PieceRef {
                    file: base + file,
                    key,
                    offset,
                    numel,
                    rank: r,
                    checksum,
                });
            }
        }
    }
    index.optim = optim;
    index.rank_extra = gather_rank_extra(dir, rank_extra)?;
    Ok(IndexWrite {
        dir: dir.to_path_buf(),
        index,
    })
}

/// Every rank's per-rank value, or `None` when no rank gave one.
///
/// # Errors
/// `Checkpoint` when some ranks gave one and others did not.
fn gather_rank_extra(
    dir: &Path,
    values: Vec<Option<serde_json::Value>>,
) -> Result<Option<Vec<serde_json::Value>>> {
    let given = values.iter().filter(|v| v.is_some()).count();
    if given == 0 {
        return Ok(None);
    }
    if given < values.len() {
        let without: Vec<usize> = (0..values.len()).filter(|&r| values[r].is_none()).collect();
        return Err(Error::Checkpoint {
            path: dir.display().to_string(),
            detail: format!(
                "ranks {without:?} saved no per-rank extra state while the others did (call save_checkpoint_with_rank_extra on every rank); the index was not replaced"
            ),
        });
    }
    Ok(Some(values.into_iter().flatten().collect()))
}

fn section_map<'a>(
    model: &'a mut BTreeMap<String, Entry>,
    optim: &'a mut Option<OptimIndex>,
    section: &str,
) -> &'a mut BTreeMap<String, Entry> {
    if section == "model" {
        model
    } else {
        optim
            .get_or_insert_with(OptimIndex::default)
            .buffers
            .entry(section.to_string())
            .or_default()
    }
}
