//! Cross-checks of an index against the files it lists, before anything is loaded: an
//! edited `world_size` or `generation`, or files from another save, are reported naming the
//! field, both values and the index, instead of being trusted.
//!
//! Data files carry the writer's rank and the save's generation in their names
//! (`rank-<R>-g<G>.safetensors`, `model-g<G>.safetensors`, `optim-g<G>.safetensors`), and
//! every piece records the rank that wrote it.

use super::index::{Index, INDEX_FILE};
use crate::error::{Error, Result};
use crate::fsdp::StateDictType;
use std::collections::BTreeMap;
use std::path::Path;

/// `(writer rank, generation)` from a data file name; the rank is `None` for the files of
/// a full checkpoint. `None` for another name.
pub(super) fn parse_data_file_name(name: &str) -> Option<(Option<usize>, u64)> {
    let stem = name.strip_suffix(".safetensors")?;
    let number = |s: &str| {
        (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
            .then(|| s.parse::<u64>().ok())
            .flatten()
    };
    let generation = |s: &str| s.strip_prefix('g').and_then(number);
    if let Some(rest) = stem.strip_prefix("rank-") {
        let (r, g) = rest.split_once('-')?;
        return Some((Some(number(r)? as usize), generation(g)?));
    }
    let g = stem
        .strip_prefix("model-")
        .or_else(|| stem.strip_prefix("optim-"))?;
    Some((None, generation(g)?))
}

/// Checks that the index's `generation`, `world_size` and layout agree with the names of
/// its data files and the ranks its pieces record: every file of this generation, rank
/// files only in a sharded checkpoint and only of ranks below `world_size`, at most one per
/// rank, each piece in the file of the rank that wrote it.
///
/// # Errors
/// `Checkpoint` naming `dir/index.json`, the field, the two values and the file.
pub(super) fn check_index_files(dir: &Path, index: &Index) -> Result<()> {
    let bad = |detail: String| {
        Err(Error::Checkpoint {
            path: dir.join(INDEX_FILE).display().to_string(),
            detail,
        })
    };
    let mut rank_of_file: Vec<Option<usize>> = Vec::with_capacity(index.files.len());
    let mut files_of_rank: BTreeMap<usize, &str> = BTreeMap::new();
    for f in &index.files {
        // Other names are the loader's to judge (it refuses names outside the directory).
        let Some((rank, generation)) = parse_data_file_name(&f.name) else {
            rank_of_file.push(None);
            continue;
        };
        if generation != index.generation {
            return bad(format!(
                "generation {} disagrees with file '{}', of generation {generation}: the index was edited or the file belongs to another save",
                index.generation, f.name
            ));
        }
        match (index.state_dict_type, rank) {
            (StateDictType::Sharded, Some(r)) => {
                if r >= index.world_size {
                    return bad(format!(
                        "world_size {} disagrees with file '{}', written by rank {r}: the index was edited or the files come from a save at another world size",
                        index.world_size, f.name
                    ));
                }
                if let Some(other) = files_of_rank.insert(r, &f.name) {
                    return bad(format!(
                        "lists two files of rank {r}: '{other}' and '{}'",
                        f.name
                    ));
                }
            }
            (StateDictType::Sharded, None) | (_, Some(_)) => {
                return bad(format!(
                    "state_dict_type {:?} disagrees with file '{}', which belongs to the other layout",
                    index.state_dict_type, f.name
                ));
            }
            _ => {}
        }
        rank_of_file.push(rank);
    }
    let sections =
        std::iter::once(&index.model).chain(index.optim.iter().flat_map(|o| o.buffers.values()));
    for map in sections {
        for (name, e) in map {
            for p in &e.pieces {
                if p.rank >= index.world_size {
                    return bad(format!(
                        "world_size {} disagrees with a piece of '{name}' written by rank {}",
                        index.world_size, p.rank
                    ));
                }
                let file_rank = rank_of_file.get(p.file).copied().flatten();
                if let Some(fr) = file_rank.filter(|&fr| fr != p.rank) {
                    return bad(format!(
                        "a piece of '{name}' says rank {} wrote it, but it lies in '{}', rank {fr}'s file",
                        p.rank, index.files[p.file].name
                    ));
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_data_file_name;

    #[test]
    fn data_file_names() {
        assert_eq!(
            parse_data_file_name("rank-00003-g7.safetensors"),
            Some((Some(3), 7))
        );
        assert_eq!(
            parse_data_file_name("optim-g2.safetensors"),
            Some((None, 2))
        );
        assert_eq!(parse_data_file_name("rank-3.safetensors"), None);
        assert_eq!(parse_data_file_name("index.json"), None);
    }
}
