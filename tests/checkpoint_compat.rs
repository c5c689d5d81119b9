//! The checkpoint format across builds. New checkpoints are index version 3 with CRC-32
//! checksums that standard tools reproduce (an independent bitwise CRC-32 here, and
//! Python's `zlib.crc32` when there is a `python3`). A checkpoint an earlier build wrote
//! (`tests/golden/checkpoint-v1/`: index version 1, the legacy 64-bit checksums, saved by
//! `fsdp train` before the change, see its `README`) still resumes and continues the loss
//! curve, and a corrupted file of it is still found.

use fsdp::checkpoint::{read_index, save_checkpoint, INDEX_FILE};
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

#[test]
fn an_earlier_builds_version_1_checkpoint_resumes_and_continues_the_curve() {
    let step2 = golden().join("step-00000002");
    let index = read_index(&step2).unwrap();
    assert_eq!(index.version, 1);
    assert_eq!(index.checksum_algorithm, None);
    let whole = train(&golden_job(2, 4), &Silent).unwrap();
    // What the earlier build printed for this job: steps 3 and 4, resumed or not.
    let printed = [5.5074f32, 5.4903];
    for world in [2, 1] {
        let resumed = train(
            &TrainConfig {
                resume: Some(step2.clone()),
                ..golden_job(world, 4)
            },
            &Silent,
        )
        .unwrap_or_else(|e| panic!("resuming the version-1 checkpoint at world {world}: {e}"));
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
fn new_checkpoints_are_version_3_with_crc32_sums_standard_tools_reproduce() {
    let dir = tmp_dir("v3");
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
    assert_eq!(index.version, 3);
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
