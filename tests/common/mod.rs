//! Helpers shared by the integration tests.
#![allow(dead_code)]

/// The f32 values of `t` as bits, for exact comparisons.
pub fn f32_bits(t: &fsdp::tensor::Tensor) -> Vec<u32> {
    t.to_vec_f32()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

/// Asserts `|got - want| <= atol + rtol * |want|` elementwise; on failure prints the first
/// differing pairs, the max error and how much of the tolerance it used.
pub fn assert_close(what: &str, got: &[f32], want: &[f32], atol: f32, rtol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    let mut worst = (0.0f32, 0usize);
    let mut bad = Vec::new();
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let tol = atol + rtol * w.abs();
        let err = (g - w).abs();
        if err / tol.max(f32::MIN_POSITIVE) > worst.0 {
            worst = (err / tol.max(f32::MIN_POSITIVE), i);
        }
        if err.is_nan() || err > tol {
            bad.push((i, g, w));
        }
    }
    if !bad.is_empty() {
        panic!(
            "{what}: {} of {} elements differ (atol {atol}, rtol {rtol}); first: {:?}; worst at {} used {:.1}x the tolerance",
            bad.len(),
            got.len(),
            &bad[..bad.len().min(5)],
            worst.1,
            worst.0
        );
    }
}

/// Deterministic values in [-1, 1) from a seed (SplitMix64).
pub fn values(seed: u64, n: usize) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let mut z =
                seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i.wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// A text corpus of `n` bytes made of words drawn from a small vocabulary: learnable, so
/// losses fall, and needs no file from outside the repository.
pub fn corpus(n: usize) -> String {
    const WORDS: &[&str] = &[
        "the ", "king ", "and ", "queen ", "of ", "rome ", "shall ", "speak ", "to ", "me.\n",
        "my ", "lord, ",
    ];
    let v = values(99, n);
    let mut s = String::with_capacity(n + 8);
    let mut i = 0;
    while s.len() < n {
        let k = ((v[i % v.len()] + 1.0) * 6.0) as usize % WORDS.len();
        s.push_str(WORDS[k]);
        i += 1;
    }
    s.truncate(n);
    s
}

/// Linear(7,5) - GELU - Linear(5,7) - GELU - Linear(7,1), no biases: 35 + 35 + 7 = 77
/// parameters, so no unit size (whole model or per Linear) is divisible by 2, 3 or 4.
pub fn uneven_model(seed: u64) -> Box<dyn fsdp::nn::Module> {
    use fsdp::nn::{InitKey, Linear, Sequential, GELU};
    let k = InitKey::new(seed);
    Box::new(Sequential::new(vec![
        Box::new(Linear::new(7, 5, false, &k.child("0")).unwrap()),
        Box::new(GELU::new()),
        Box::new(Linear::new(5, 7, false, &k.child("2")).unwrap()),
        Box::new(GELU::new()),
        Box::new(Linear::new(7, 1, false, &k.child("4")).unwrap()),
    ]))
}

/// Writes a 20 kB synthetic corpus to a fresh temporary folder and returns its path.
pub fn corpus_file(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("fsdp-test-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("corpus.txt");
    std::fs::write(&p, corpus(20_000)).unwrap();
    p
}

/// A small, fast job: 2 layers x 32 wide, 8 rows of 16 tokens, 30 steps, no eval, no sample.
pub fn small_job(data: std::path::PathBuf, world_size: usize) -> fsdp::train::TrainConfig {
    fsdp::train::TrainConfig {
        data,
        world_size,
        steps: 30,
        global_batch: 8,
        seq_len: 16,
        n_layer: 2,
        n_head: 4,
        n_embd: 32,
        lr: 3e-3,
        warmup_steps: 0,
        eval_every: 0,
        eval_batches: 1,
        sample_len: 0,
        ..fsdp::train::TrainConfig::default()
    }
}

/// [`small_job`] under `--strategy no-shard`, 10 steps of 12 rows (every world size 1 to 4
/// divides them), with `--zero-redundancy-optimizer` when `zero`.
pub fn no_shard_job(
    data: &std::path::Path,
    world_size: usize,
    zero: bool,
) -> fsdp::train::TrainConfig {
    fsdp::train::TrainConfig {
        steps: 10,
        strategy: fsdp::fsdp::ShardingStrategy::NoShard,
        zero_redundancy_optimizer: zero,
        global_batch: 12,
        ..small_job(data.to_path_buf(), world_size)
    }
}

/// Ranks per node the hybrid-strategy tests use at a world size: 2 nodes when the world
/// splits in two (4 = 2 x 2, 2 = 2 nodes x 1), else one rank per node.
pub fn hybrid_ranks_per_node(world: usize) -> usize {
    if world % 2 == 0 {
        world / 2
    } else {
        1
    }
}

/// The small GPT the FSDP tests train: vocab 29, block 6, width 12, 3 heads, seed 3.
pub fn small_gpt(n_layer: usize) -> Box<dyn fsdp::nn::Module> {
    let cfg = fsdp::nn::GptConfig {
        vocab_size: 29,
        block_size: 6,
        n_layer,
        n_head: 3,
        n_embd: 12,
    };
    Box::new(fsdp::nn::GPT::new(cfg, 3).unwrap())
}

/// Forward + backward of rows `lo..hi` of step `step`'s 12-row batch of 6-token sequences
/// for [`small_gpt`] (mean cross-entropy).
pub fn gpt_step(
    m: &mut dyn fsdp::nn::Module,
    step: usize,
    lo: usize,
    hi: usize,
) -> fsdp::Result<()> {
    use fsdp::nn::{loss, Context};
    let (x, y) = gpt_batch(step, lo, hi)?;
    let logits = m.forward(&x, &Context::train())?;
    let (_, g) = loss::cross_entropy(&logits, &y)?;
    m.backward(&g, &Context::train())?;
    Ok(())
}

/// Rows `lo..hi` of step `step`'s 12-row batch for [`small_gpt`]: `(input, target)` token
/// ids, `(hi - lo, 6)` i32 each (the target is the input shifted by one token).
pub fn gpt_batch(
    step: usize,
    lo: usize,
    hi: usize,
) -> fsdp::Result<(fsdp::tensor::Tensor, fsdp::tensor::Tensor)> {
    use fsdp::tensor::Tensor;
    let t = 6;
    let toks: Vec<i32> = values(400 + step as u64, 12 * (t + 1))
        .iter()
        .map(|v| ((v + 1.0) * 14.4) as i32 % 29)
        .collect();
    let (mut x, mut y) = (Vec::new(), Vec::new());
    for r in lo..hi {
        x.extend_from_slice(&toks[r * (t + 1)..r * (t + 1) + t]);
        y.extend_from_slice(&toks[r * (t + 1) + 1..(r + 1) * (t + 1)]);
    }
    Ok((
        Tensor::from_vec(x, &[hi - lo, t])?,
        Tensor::from_vec(y, &[hi - lo, t])?,
    ))
}

/// Plain SGD (no momentum) at `lr`.
pub fn sgd(lr: f32) -> fsdp::optim::SGD {
    fsdp::optim::SGD::new(fsdp::optim::SgdConfig {
        lr,
        ..Default::default()
    })
}

/// Runs `f(rank)` on `n` threads (as `n` processes would run) and returns every thread's
/// result in rank order.
pub fn on_threads<T: Send>(
    n: usize,
    f: impl Fn(usize) -> fsdp::Result<T> + Sync,
) -> Vec<fsdp::Result<T>> {
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                let f = &f;
                s.spawn(move || f(r))
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    })
}

/// A localhost port nothing listens on right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The dialer's side of the job handshake (`distributed/auth.rs`) done by hand, as a
/// process outside the job would: says it is `role` of job `job_id`, answers the challenge
/// with `proof` (any bytes: it does not know the secret) and returns the acceptor's verdict
/// (accepted, reason).
pub fn raw_handshake(
    s: &mut std::net::TcpStream,
    role: &str,
    job_id: &str,
    proof: &[u8],
) -> std::io::Result<(bool, String)> {
    use std::io::{Read, Write};
    fn msg(fields: &[&[u8]]) -> Vec<u8> {
        let mut body = Vec::new();
        for f in fields {
            body.extend_from_slice(&(f.len() as u32).to_le_bytes());
            body.extend_from_slice(f);
        }
        let mut out = (body.len() as u32).to_le_bytes().to_vec();
        out.extend_from_slice(&body);
        out
    }
    fn read(s: &mut std::net::TcpStream) -> std::io::Result<Vec<Vec<u8>>> {
        let mut len = [0u8; 4];
        s.read_exact(&mut len)?;
        let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
        s.read_exact(&mut body)?;
        let (mut rest, mut fields) = (&body[..], Vec::new());
        while rest.len() >= 4 {
            let n = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
            fields.push(rest[4..4 + n].to_vec());
            rest = &rest[4 + n..];
        }
        Ok(fields)
    }
    s.write_all(&msg(&[
        b"fsdp-auth/1",
        role.as_bytes(),
        job_id.as_bytes(),
        &[7u8; 32],
    ]))?;
    let challenge = read(s)?;
    assert_eq!(
        challenge.len(),
        5,
        "challenge: magic, job id, secured, nonce, proof"
    );
    s.write_all(&msg(&[proof]))?;
    let verdict = read(s)?;
    Ok((
        verdict[0] == [1],
        String::from_utf8_lossy(&verdict[1]).into_owned(),
    ))
}

/// Every sharding strategy, in PyTorch's order.
pub const STRATEGIES: [fsdp::fsdp::ShardingStrategy; 5] = [
    fsdp::fsdp::ShardingStrategy::FullShard,
    fsdp::fsdp::ShardingStrategy::ShardGradOp,
    fsdp::fsdp::ShardingStrategy::NoShard,
    fsdp::fsdp::ShardingStrategy::HybridShard,
    fsdp::fsdp::ShardingStrategy::HybridShardZero2,
];

/// `(name, values)` of every parameter below `m`, in `named_parameters()` order.
pub fn named_values(m: &mut dyn fsdp::nn::Module) -> Vec<(String, Vec<f32>)> {
    let mut out = Vec::new();
    fsdp::nn::visit_parameters(m, "", false, &mut |n, p| {
        out.push((n.to_string(), p.data().unwrap().to_vec_f32().unwrap()));
        Ok(())
    })
    .unwrap();
    out
}

/// What torchrun sets for rank `rank` of `world` on one node, meeting at 127.0.0.1:`port`.
pub fn torchrun_env(port: u16, world: usize, rank: usize) -> Vec<(&'static str, String)> {
    vec![
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("LOCAL_RANK", rank.to_string()),
        ("LOCAL_WORLD_SIZE", world.to_string()),
        ("MASTER_ADDR", "127.0.0.1".to_string()),
        ("MASTER_PORT", port.to_string()),
    ]
}

/// The folder of the PyTorch-made module references (`tests/torch_ref/make_module_refs.py`).
pub const MODULE_REFS: &str = "tests/torch_ref/modules";

/// `module_refs.json` of [`MODULE_REFS`].
pub fn module_refs() -> serde_json::Value {
    let path = std::path::Path::new(MODULE_REFS).join("module_refs.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path:?}: {e}"))
}

/// A JSON array of numbers as f32 (PyTorch's `tolist()` of an f32 tensor).
pub fn json_f32s(v: &serde_json::Value) -> Vec<f32> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_f64())
                .map(|x| x as f32)
                .collect()
        })
        .unwrap_or_default()
}

/// Spawns `cmd`, waits until it prints the `FSDP_CKPT_STALL` hook's stall line on stderr
/// (5 minutes at most), kills it and returns that line.
pub fn kill_mid_save(mut cmd: std::process::Command) -> String {
    let mut child = cmd
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            let _ = tx.send(line);
        }
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(300);
    let mut seen = String::new();
    loop {
        match rx.recv_timeout(std::time::Duration::from_millis(200)) {
            Ok(l) if l.contains("FSDP_CKPT_STALL: stalled writing") => {
                child.kill().unwrap();
                child.wait().unwrap();
                return l;
            }
            Ok(l) => seen.push_str(&(l + "\n")),
            Err(_) => {}
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!("child exited ({status}) before stalling: {seen}");
        }
        assert!(
            std::time::Instant::now() < deadline,
            "child never stalled: {seen}"
        );
    }
}

/// The name the test harness gives test function `name` of the module whose
/// `module_path!()` is `module` (`ops::kernels` and `f` give `kernels::f`: the path without
/// the crate's name), for running that one test again in a child process with `--exact`.
pub fn test_name(module: &str, name: &str) -> String {
    match module.split_once("::") {
        Some((_, path)) => format!("{path}::{name}"),
        None => name.to_string(),
    }
}

/// Whether this process should run the body of test `name` (of the module whose
/// `module_path!()` is `module`): true in the child that runs it alone (environment
/// variable `env` set); otherwise runs this test binary again with only that test and
/// `env=1`, prints its output, asserts that it passed, and returns false. For checks that
/// other tests of the binary would disturb (a graph capture, the emulator's deferral).
#[allow(dead_code)] // not every test binary runs a test alone
pub fn run_alone(module: &str, name: &str, env: &str) -> bool {
    if std::env::var_os(env).is_some() {
        return true;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", &test_name(module, name)])
        .args(["--nocapture", "--test-threads", "1"])
        .env(env, "1")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{text}");
    assert!(
        out.status.success() && text.contains("1 passed"),
        "{name} run alone in a child process failed"
    );
    false
}
