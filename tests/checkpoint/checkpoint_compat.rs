//! The checkpoint format across builds. New checkpoints are index version 4 with CRC-32
//! checksums that standard tools reproduce (an independent bitwise CRC-32 here, and
//! Python's `zlib.crc32` when there is a `python3`), and checksums binding each piece to
//! its entry: an edited index (a piece repointed at another tensor's bytes, an edited
//! shape, dtype, offset or index checksum) is refused naming the entry. Checkpoints
//! earlier builds wrote (`tests/golden/checkpoint-v1/`: index version 1, the legacy 64-bit
//! checksums; `tests/golden/checkpoint-v3/`: version 3; see their `README`s) still resume
//! and continue the loss curve, and a corrupted file of one is still found.

use fsdp::checkpoint::{index_text, read_index, save_checkpoint, Index, INDEX_FILE};
use fsdp::distributed::{launch, Group, LaunchOptions};
use fsdp::fsdp::{FsdpConfig, FullyShardedDataParallel, StateDictType};
use fsdp::nn::{InitKey, Linear};
use fsdp::train::{train, Silent, TrainConfig};
use std::path::{Path, PathBuf};

fn golden() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/checkpoint-v1")
}

fn tmp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("fsdp-compat-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The job the golden checkpoint was saved by (`--steps 2 --save-every 2`), run to `steps`.
fn golden_job(world_size: usize, steps: usize) -> TrainConfig {
    TrainConfig {
        data: golden().join("data.txt"),
        world_size,
        steps,
        global_batch: 4,
        seq_len: 8,
        n_layer: 1,
        n_embd: 8,
        n_head: 2,
        warmup_steps: 2,
        eval_every: 0,
        sample_len: 0,
        ..TrainConfig::default()
    }
}

/// CRC-32 (IEEE 802.3, reflected polynomial 0xEDB88320), one bit at a time: the textbook
/// definition, independent of the crc32fast crate the library uses.
fn crc32_reference(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

#[test]
fn the_reference_crc32_is_the_standard_one() {
    // The check value of CRC-32/ISO-HDLC.
    assert_eq!(crc32_reference(b"123456789"), 0xCBF4_3926);
}

/// Resumes `step2` (a checkpoint of [`golden_job`] after 2 steps) at world sizes 2 and 1:
/// steps 3 and 4 equal the uninterrupted run's and what the earlier build printed.
fn resumes_and_continues_the_curve(step2: &Path) {
    let whole = train(&golden_job(2, 4), &Silent).unwrap();
    // What the earlier build printed for this job: steps 3 and 4, resumed or not.
    let printed = [5.5074f32, 5.4903];
    for world in [2, 1] {
        let resumed = train(
            &TrainConfig {
                resume: Some(step2.to_path_buf()),
                ..golden_job(world, 4)
            },
            &Silent,
        )
        .unwrap_or_else(|e| panic!("resuming {} at world {world}: {e}", step2.display()));
        let got: Vec<(usize, f32)> = resumed.records.iter().map(|r| (r.step, r.loss)).collect();
        let want: Vec<(usize, f32)> = whole.records[2..]
            .iter()
            .map(|r| (r.step, r.loss))
            .collect();
        assert_eq!(got.len(), 2, "world {world}: {got:?}");
        for (((s, g), (t, w)), p) in got.iter().zip(&want).zip(printed) {
            assert_eq!(s, t);
            assert!(
                (g - w).abs() <= 1e-5 * w.abs(),
                "world {world} step {s}: {g} vs {w}"
            );
            assert!(
                (g - p).abs() <= 5e-5,
                "world {world} step {s}: {g} vs printed {p}"
            );
        }
    }
}

#[test]
fn an_earlier_builds_version_1_checkpoint_resumes_and_continues_the_curve() {
    let step2 = golden().join("step-00000002");
    let index = read_index(&step2).unwrap();
    assert_eq!(index.version, 1);
    assert_eq!(index.checksum_algorithm, None);
    resumes_and_continues_the_curve(&step2);
}

#[test]
fn an_earlier_builds_version_3_checkpoint_resumes_and_continues_the_curve() {
    let step2 =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/checkpoint-v3/step-00000002");
    let index = read_index(&step2).unwrap();
    assert_eq!(index.version, 3);
    assert_eq!(index.checksum_algorithm.as_deref(), Some("crc32"));
    assert!(index.index_checksum.is_none() && index.model.values().all(|e| e.checksum.is_none()));
    resumes_and_continues_the_curve(&step2);
}

#[test]
fn a_corrupted_file_of_a_version_1_checkpoint_is_found() {
    let dir = tmp_dir("v1-corrupt");
    for e in std::fs::read_dir(golden().join("step-00000002")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    let f = dir.join("rank-00001-g1.safetensors");
    let mut bytes = std::fs::read(&f).unwrap();
    let last = bytes.len() - 3;
    bytes[last] ^= 0x40;
    std::fs::write(&f, bytes).unwrap();
    let err = train(
        &TrainConfig {
            resume: Some(dir.clone()),
            ..golden_job(2, 4)
        },
        &Silent,
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("rank-00001-g1.safetensors") && err.contains("the file is corrupted"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn new_checkpoints_are_version_4_with_crc32_sums_standard_tools_reproduce() {
    let dir = tmp_dir("v4");
    launch(&LaunchOptions::new(2), |pg: Group| {
        let m = Linear::new(5, 3, true, &InitKey::new(11))?;
        let mut m = FullyShardedDataParallel::new(Box::new(m), pg, FsdpConfig::default())?;
        save_checkpoint(
            &dir,
            &mut m,
            None,
            StateDictType::Sharded,
            serde_json::json!({"step": 1}),
        )
    })
    .unwrap();
    let index = read_index(&dir).unwrap();
    assert_eq!(index.version, 4);
    assert_eq!(index.checksum_algorithm.as_deref(), Some("crc32"));
    let text = std::fs::read_to_string(dir.join(INDEX_FILE)).unwrap();
    assert!(text.contains("\"checksum_algorithm\": \"crc32\""), "{text}");
    assert_eq!(index.files.len(), 2);
    let python = std::process::Command::new("python3")
        .arg("--version")
        .output();
    for fe in &index.files {
        let path = dir.join(&fe.name);
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(
            fe.checksum,
            format!("{:08x}", crc32_reference(&bytes)),
            "{}",
            fe.name
        );
        // The header's `fsdp.crc32` covers the data section after it.
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        assert_eq!(
            header["__metadata__"]["fsdp.crc32"],
            serde_json::json!(format!("{:08x}", crc32_reference(&bytes[8 + n..]))),
            "{}",
            fe.name
        );
        assert!(header["__metadata__"].get("fsdp.checksum").is_none());
        if python.as_ref().is_ok_and(|o| o.status.success()) {
            let out = std::process::Command::new("python3")
                .args([
                    "-c",
                    "import sys, zlib; print('%08x' % zlib.crc32(open(sys.argv[1], 'rb').read()))",
                ])
                .arg(&path)
                .output()
                .unwrap();
            assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), fe.checksum);
        } else {
            eprintln!("no python3: zlib.crc32 not compared");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A version-4 checkpoint of [`golden_job`] at world size 1 after 2 steps (one file;
/// `ln_f.weight` and `ln_f.bias` of 8 elements each), in a fresh directory.
fn v4_checkpoint(name: &str) -> PathBuf {
    let root = tmp_dir(name);
    train(
        &TrainConfig {
            save_dir: Some(root.clone()),
            save_every: 2,
            ..golden_job(1, 2)
        },
        &Silent,
    )
    .unwrap();
    root.join("step-00000002")
}

/// A copy of checkpoint `src` whose index `edit` changed: with `reseal`, the entry and
/// index checksums recomputed ([`index_text`], as a careful editor would); else as JSON
/// with the checksums of `src`.
fn edited(src: &Path, name: &str, reseal: bool, edit: impl Fn(&mut Index)) -> PathBuf {
    let dir = tmp_dir(name);
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    let mut index = read_index(src).unwrap();
    edit(&mut index);
    let text = if reseal {
        index_text(&index).unwrap()
    } else {
        serde_json::to_vec_pretty(&index).unwrap()
    };
    std::fs::write(dir.join(INDEX_FILE), text).unwrap();
    dir
}

/// The error of resuming [`golden_job`] from `dir`.
fn resume_error(dir: &Path) -> String {
    train(
        &TrainConfig {
            resume: Some(dir.to_path_buf()),
            ..golden_job(1, 4)
        },
        &Silent,
    )
    .map(|_| ())
    .unwrap_err()
    .to_string()
}

/// An edit of an index.
type Edit = dyn Fn(&mut Index);

/// The piece of `index.model[name]` (one at world size 1).
fn piece<'a>(index: &'a mut Index, name: &str) -> &'a mut fsdp::checkpoint::PieceRef {
    &mut index.model.get_mut(name).unwrap().pieces[0]
}

/// An index edited so that `ln_f.weight` reads the `ln_f.bias` bytes (same size), or with
/// an edited shape, dtype, offset or index checksum, is refused naming the entry and the
/// file: by the entry's checksum when the edit left it stale, by the piece's checksum
/// (which binds the bytes to the entry's name, shape, dtype and offset) when the editor
/// recomputed the index's own checksums. The unedited checkpoint resumes.
#[test]
fn an_edited_index_is_refused_naming_the_entry() {
    let src = v4_checkpoint("v4-src");
    let index = read_index(&src).unwrap();
    assert_eq!(index.version, 4);
    assert!(index.index_checksum.is_some());
    let w = &index.model["ln_f.weight"];
    assert_eq!(w.dtype.as_deref(), Some("F32"));
    assert!(w.checksum.is_some() && w.pieces[0].checksum.is_some());
    assert_eq!(index.model["ln_f.bias"].pieces[0].numel, w.pieces[0].numel);
    // Unedited: resumes (step 3 and 4).
    let ok = train(
        &TrainConfig {
            resume: Some(src.clone()),
            ..golden_job(1, 4)
        },
        &Silent,
    )
    .unwrap();
    assert_eq!(ok.records.len(), 2);

    let repoint = |ix: &mut Index| {
        let bias = piece(ix, "ln_f.bias").key.clone();
        piece(ix, "ln_f.weight").key = bias;
    };
    let reshape = |ix: &mut Index| ix.model.get_mut("ln_f.weight").unwrap().shape = vec![2, 4];
    let retype = |ix: &mut Index| {
        ix.model.get_mut("ln_f.weight").unwrap().dtype = Some("F64".into());
    };
    let shift = |ix: &mut Index| piece(ix, "ln_f.weight").offset = 1;
    let edits: [(&str, &Edit); 4] = [
        ("repoint", &repoint),
        ("shape", &reshape),
        ("dtype", &retype),
        ("offset", &shift),
    ];
    for (what, edit) in edits {
        // Stale checksums: the entry's own is found wrong when the index is read.
        let dir = edited(&src, &format!("{what}-stale"), false, edit);
        let err = read_index(&dir).unwrap_err().to_string();
        assert!(
            err.contains("index.json")
                && err.contains("entry 'ln_f.weight' of the model was edited"),
            "{what}: {err}"
        );
        let resumed = resume_error(&dir);
        assert!(
            resumed.contains("entry 'ln_f.weight' of the model was edited"),
            "{what}: {resumed}"
        );
        // Recomputed index checksums: the piece's checksum is found wrong when it is read.
        let dir = edited(&src, &format!("{what}-resealed"), true, edit);
        read_index(&dir).unwrap();
        let err = resume_error(&dir);
        assert!(
            err.contains("rank-00000-g1.safetensors")
                && err.contains("entry 'ln_f.weight' of the model in the index"),
            "{what}: {err}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    // The index checksum edited, or a field outside the entries edited with it left stale.
    let text = std::fs::read_to_string(src.join(INDEX_FILE)).unwrap();
    let sum = index.index_checksum.clone().unwrap();
    let flipped: String = sum
        .chars()
        .enumerate()
        .map(|(i, c)| {
            if i == 0 {
                if c == '0' {
                    '1'
                } else {
                    '0'
                }
            } else {
                c
            }
        })
        .collect();
    let dir = edited(&src, "index-checksum", false, |_| {});
    // The error of reading the index with its first `from` replaced by `to`.
    let refused = |from: &str, to: &str| {
        assert!(text.contains(from), "{from}");
        std::fs::write(dir.join(INDEX_FILE), text.replacen(from, to, 1)).unwrap();
        let err = read_index(&dir).unwrap_err().to_string();
        assert!(err.contains("index.json"), "{err}");
        err
    };
    let err = refused(&sum, &flipped);
    let want = format!("its index_checksum {flipped} does not match its text");
    assert!(err.contains(&want), "{err}");
    let err = refused("\"world_size\": 1,", "\"world_size\": 2,");
    let want = format!("its index_checksum {sum} does not match its text");
    assert!(err.contains(&want), "{err}");
    // A version-4 index relabelled as version 3 keeps its checksums, and is refused.
    let err = refused("\"version\": 4,", "\"version\": 3,");
    assert!(
        err.contains("version 3 with the checksums only version 4 records"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
