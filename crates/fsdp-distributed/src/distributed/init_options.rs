//! [`InitOptions`], the arguments of `init_process_group`, and what they resolve to
//! ([`Rendezvous`]): the backend, the rendezvous key and this rank's place, read from the
//! options and the torchrun environment variables.
//! [`init_process_group`](super::init_process_group) resolves them and hands the
//! `Rendezvous` to a backend's join (`rendezvous.rs`, `tcp`, `nccl`); nothing here joins
//! anything.

use crate::error::{Error, Result};
use std::collections::HashMap;
use std::time::Duration;

/// The torchrun environment variables [`init_process_group`](super::init_process_group)
/// reads.
pub const TORCHRUN_ENV_VARS: [&str; 6] = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
];

/// Seconds of the rendezvous and collective timeout when [`InitOptions::timeout`] is not
/// given (`fsdp launch --timeout` sets it for its ranks); default
/// [`DEFAULT_TIMEOUT`](super::threads::DEFAULT_TIMEOUT).
pub const TIMEOUT_VAR: &str = "FSDP_TIMEOUT";

/// Seconds of the heartbeat timeout when [`InitOptions::heartbeat_timeout`] is not given
/// (`fsdp launch --heartbeat-timeout` sets it for its ranks); default
/// [`DEFAULT_HEARTBEAT_TIMEOUT`].
pub const HEARTBEAT_TIMEOUT_VAR: &str = "FSDP_HEARTBEAT_TIMEOUT";

/// How long a rank process of the `tcp` or `nccl` backend may go without a heartbeat
/// before its peers name it failed: 60 s, well under the collective timeout (300 s). PyTorch's NCCL heartbeat
/// monitor waits 8 min (`TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`), but it watches its own
/// process's watchdog thread, not the peers.
pub const DEFAULT_HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(60);

/// Arguments of [`init_process_group`](super::init_process_group), named as
/// `torch.distributed.init_process_group`'s.
///
/// Explicit fields win over the environment; a field left `None` is read from the torchrun
/// variable of the same name.
#[derive(Debug, Clone)]
pub struct InitOptions {
    /// `"threads"` (ranks are threads of this process) or `"tcp"` (ranks are processes
    /// that meet through a TCP store; `"gloo"` is an alias, as PyTorch users write
    /// `backend="gloo"` for CPU tensors). `"nccl"` (one process per GPU, CUDA tensors;
    /// needs the `cuda` feature and libnccl) is `Unsupported` in a build without `cuda`;
    /// `"mpi"` and `"ucc"` always are. Case-insensitive, as torch's
    /// `Backend`.
    pub backend: String,
    /// How ranks find each other: `None` or `"env://"` (torch's default) reads
    /// `MASTER_ADDR` and `MASTER_PORT`; `"tcp://HOST:PORT"` names the address directly;
    /// `"threads://NAME"` is an in-process name (this crate's addition). Ranks that give the
    /// same address or name join the same world.
    pub init_method: Option<String>,
    /// Number of ranks; `None` reads `WORLD_SIZE` (required then).
    pub world_size: Option<usize>,
    /// This rank, `0..world_size`; `None` reads `RANK` (required then).
    pub rank: Option<usize>,
    /// Rank within this node; `None` reads `LOCAL_RANK` (optional).
    pub local_rank: Option<usize>,
    /// Ranks on this node; `None` reads `LOCAL_WORLD_SIZE` (optional).
    pub local_world_size: Option<usize>,
    /// How long the rendezvous and then every collective of the world may wait for the
    /// other ranks (`init_process_group(timeout=)`); `None` reads [`TIMEOUT_VAR`]
    /// (`FSDP_TIMEOUT`, seconds), else 300 s (torch's `default_pg_timeout` is 30 min, and
    /// 10 min for NCCL). The first rank to join sets it for the world.
    pub timeout: Option<Duration>,
    /// How long a peer process of the `tcp` or `nccl` backend may send no heartbeat before
    /// this rank names it failed (a process stopped with SIGSTOP, or hung); `None` reads
    /// [`HEARTBEAT_TIMEOUT_VAR`] (`FSDP_HEARTBEAT_TIMEOUT`, seconds), else
    /// [`DEFAULT_HEARTBEAT_TIMEOUT`]. Unused by the `threads` backend.
    pub heartbeat_timeout: Option<Duration>,
    /// Where the torchrun variables come from: `None` is the process environment;
    /// `Some(map)` is that map alone (a launcher giving each rank thread its own `RANK`,
    /// or a test).
    pub env: Option<HashMap<String, String>>,
    /// The job this rank belongs to (torchrun's `rdzv_id`), checked at rendezvous by the
    /// `tcp` and `nccl` backends: a rank never joins a world of another job id. `None` reads
    /// `FSDP_JOB_ID`, else `TORCHELASTIC_RUN_ID`, else no id (which matches only no id).
    pub job_id: Option<String>,
    /// The job's secret, which every connection of the rendezvous must prove (see
    /// [`JobAuth`](super::JobAuth)); `None` reads `FSDP_JOB_SECRET`, and without it the
    /// store and mesh are open, as c10d's. `fsdp launch` always sets one.
    pub job_secret: Option<super::JobSecret>,
}

impl InitOptions {
    /// `backend` with everything else from the environment and the default timeout.
    pub fn new(backend: &str) -> Self {
        InitOptions {
            backend: backend.to_string(),
            init_method: None,
            world_size: None,
            rank: None,
            local_rank: None,
            local_world_size: None,
            timeout: None,
            heartbeat_timeout: None,
            env: None,
            job_id: None,
            job_secret: None,
        }
    }

    /// Rank `rank` of `world_size` thread ranks meeting under the in-process name `name`
    /// (`init_method = "threads://NAME"`); reads no environment.
    pub fn threads(name: &str, world_size: usize, rank: usize) -> Self {
        InitOptions {
            init_method: Some(format!("threads://{name}")),
            world_size: Some(world_size),
            rank: Some(rank),
            env: Some(HashMap::new()),
            ..Self::new("threads")
        }
    }

    /// Reads the torchrun variables from `vars` instead of the process environment.
    pub fn with_env<K: Into<String>, V: Into<String>>(
        mut self,
        vars: impl IntoIterator<Item = (K, V)>,
    ) -> Self {
        self.env = Some(
            vars.into_iter()
                .map(|(k, v)| (k.into(), v.into()))
                .collect(),
        );
        self
    }

    /// Sets the rendezvous and collective timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Sets the heartbeat timeout of the `tcp` and `nccl` backends.
    pub fn with_heartbeat_timeout(mut self, timeout: Duration) -> Self {
        self.heartbeat_timeout = Some(timeout);
        self
    }

    /// An explicit duration, else the variable `var` in seconds, else `default`.
    fn seconds(
        &self,
        explicit: Option<Duration>,
        var: &str,
        default: Duration,
    ) -> Result<Duration> {
        let d = match (explicit, self.var(var)?) {
            (Some(d), _) => d,
            (None, Some(raw)) if !raw.trim().is_empty() => {
                parse_seconds(raw.trim()).map_err(|why| {
                    Error::InvalidArgument(format!("environment variable {var}='{raw}' {why}"))
                })?
            }
            (None, _) => default,
        };
        Ok(d)
    }

    /// Sets the job id and secret (instead of `FSDP_JOB_ID` and `FSDP_JOB_SECRET`).
    pub fn with_job(mut self, job_id: &str, secret: Option<super::JobSecret>) -> Self {
        self.job_id = Some(job_id.to_string());
        self.job_secret = secret;
        self
    }

    /// The job id and secret: explicit, else from the environment.
    fn job(&self) -> Result<super::JobAuth> {
        use super::auth::{JOB_ID_VAR, JOB_SECRET_VAR, RUN_ID_VAR};
        let id = match &self.job_id {
            Some(id) => id.clone(),
            None => match self.var(JOB_ID_VAR)? {
                Some(id) => id,
                None => self.var(RUN_ID_VAR)?.unwrap_or_default(),
            },
        };
        let secret = match &self.job_secret {
            Some(k) => Some(k.clone()),
            None => match self.var(JOB_SECRET_VAR)? {
                Some(k) if !k.is_empty() => Some(super::JobSecret::new(k)?),
                _ => None,
            },
        };
        super::JobAuth::new(id.trim(), secret)
    }

    fn var(&self, name: &str) -> Result<Option<String>> {
        match &self.env {
            Some(map) => Ok(map.get(name).cloned()),
            None => match std::env::var(name) {
                Ok(v) => Ok(Some(v)),
                Err(std::env::VarError::NotPresent) => Ok(None),
                Err(std::env::VarError::NotUnicode(v)) => Err(Error::InvalidArgument(format!(
                    "environment variable {name}={v:?} is not valid UTF-8"
                ))),
            },
        }
    }

    /// An explicit value, else the variable parsed as an integer (`min` or more), else
    /// `None`.
    fn number(&self, explicit: Option<usize>, var: &str, min: usize) -> Result<Option<usize>> {
        if let Some(v) = explicit {
            return Ok(Some(v));
        }
        let Some(raw) = self.var(var)? else {
            return Ok(None);
        };
        match raw.trim().parse::<usize>() {
            Ok(n) if n >= min => Ok(Some(n)),
            _ => Err(Error::InvalidArgument(format!(
                "environment variable {var}='{raw}' is not an integer >= {min}"
            ))),
        }
    }

    /// Checks the options and fills what is missing from the environment, without joining
    /// anything: what [`init_process_group`](super::init_process_group) would use.
    ///
    /// # Errors
    /// `Unsupported` for `mpi` and `ucc`, and for `nccl` in a build without the `cuda` feature;
    /// `InvalidArgument` for an unknown backend or init method, a missing required variable
    /// (`WORLD_SIZE`, `RANK`, and for `env://` `MASTER_ADDR`, `MASTER_PORT`) or a bad value,
    /// naming the variable and the value, and for ranks out of range; `InvalidArgument` for
    /// a bad job id (`FSDP_JOB_ID`) or a job secret shorter than 16 characters
    /// (`FSDP_JOB_SECRET`, never shown).
    pub fn resolve(&self) -> Result<Rendezvous> {
        let backend = self.backend.trim().to_ascii_lowercase();
        let backend = match backend.as_str() {
            "threads" => "threads",
            "tcp" | "gloo" => "tcp",
            #[cfg(feature = "cuda")]
            "nccl" => "nccl",
            #[cfg(not(feature = "cuda"))]
            "nccl" => {
                return Err(Error::Unsupported(
                    "backend \"nccl\" needs a build with `--features cuda`; use backend \"threads\" or \"tcp\"".into(),
                ))
            }
            "mpi" | "ucc" => {
                return Err(Error::Unsupported(format!(
                    "backend \"{backend}\"; this build has \"threads\" and \"tcp\" (alias \"gloo\")"
                )))
            }
            _ => crate::error::bail_arg!(
                "init_process_group: unknown backend '{}'; expected \"threads\" or \"tcp\" (alias \"gloo\")",
                self.backend
            ),
        };
        // A value and where it came from, as the caller's API names it: the argument
        // (`rank`, `fsdp_init_options.rank`), or the environment variable read in its place.
        let from = |given: bool, field: &str, env: &str, value: usize| -> String {
            match (given, crate::error::Api::current()) {
                (false, _) => format!("{} {value} (from {env})", field.replace('_', " ")),
                (true, crate::error::Api::Rust) => format!("{} {value}", field.replace('_', " ")),
                (true, crate::error::Api::C) => format!("fsdp_init_options.{field} {value}"),
            }
        };
        let unset = |field: &str| match crate::error::Api::current() {
            crate::error::Api::Rust => field.to_string(),
            crate::error::Api::C => format!("fsdp_init_options.{field} (negative)"),
        };
        let world_size = self.number(self.world_size, "WORLD_SIZE", 1)?.ok_or_else(|| {
            Error::InvalidArgument(format!(
                "init_process_group: {} not given and environment variable WORLD_SIZE is not set (fsdp launch and torchrun set it)",
                unset("world_size")
            ))
        })?;
        if world_size == 0 {
            crate::error::bail_arg!("init_process_group: world_size must be at least 1");
        }
        let rank = self.number(self.rank, "RANK", 0)?.ok_or_else(|| {
            Error::InvalidArgument(format!(
                "init_process_group: {} not given and environment variable RANK is not set (fsdp launch and torchrun set it)",
                unset("rank")
            ))
        })?;
        if rank >= world_size {
            crate::error::bail_arg!(
                "init_process_group: {} is not below the {}",
                from(self.rank.is_some(), "rank", "RANK", rank),
                from(
                    self.world_size.is_some(),
                    "world_size",
                    "WORLD_SIZE",
                    world_size
                )
            );
        }
        let local_world_size = self.number(self.local_world_size, "LOCAL_WORLD_SIZE", 1)?;
        let local_rank = self.number(self.local_rank, "LOCAL_RANK", 0)?;
        if let Some(lws) = local_world_size {
            if lws == 0 || lws > world_size {
                crate::error::bail_arg!(
                    "init_process_group: local world size {lws} (LOCAL_WORLD_SIZE) must be in 1..={world_size} (WORLD_SIZE)"
                );
            }
        }
        if let (Some(lr), Some(lws)) = (local_rank, local_world_size) {
            if lr >= lws {
                crate::error::bail_arg!(
                    "init_process_group: local rank {lr} (LOCAL_RANK) is not below the local world size {lws} (LOCAL_WORLD_SIZE)"
                );
            }
        }
        let timeout = self.seconds(self.timeout, TIMEOUT_VAR, super::threads::DEFAULT_TIMEOUT)?;
        if timeout.is_zero() {
            crate::error::bail_arg!("init_process_group: timeout must be positive");
        }
        let heartbeat_timeout = self.seconds(
            self.heartbeat_timeout,
            HEARTBEAT_TIMEOUT_VAR,
            DEFAULT_HEARTBEAT_TIMEOUT,
        )?;
        if heartbeat_timeout < MIN_HEARTBEAT_TIMEOUT {
            crate::error::bail_arg!(
                "init_process_group: heartbeat timeout {:?} is below the least, {:?}",
                heartbeat_timeout,
                MIN_HEARTBEAT_TIMEOUT
            );
        }
        let key = match self.init_method.as_deref().map(str::trim) {
            None | Some("env://") => {
                let addr = self.var("MASTER_ADDR")?.unwrap_or_default();
                if addr.trim().is_empty() {
                    crate::error::bail_arg!(
                        "init_process_group: env:// rendezvous needs environment variable MASTER_ADDR, which is not set"
                    );
                }
                let port = self.var("MASTER_PORT")?.ok_or_else(|| {
                    Error::InvalidArgument(
                        "init_process_group: env:// rendezvous needs environment variable MASTER_PORT, which is not set".into(),
                    )
                })?;
                let port = port.trim().parse::<u16>().map_err(|_| {
                    Error::InvalidArgument(format!(
                        "environment variable MASTER_PORT='{port}' is not a port number (0..=65535)"
                    ))
                })?;
                format!("{}:{port}", addr.trim())
            }
            Some(m) if m.starts_with("tcp://") => {
                let rest = &m["tcp://".len()..];
                match rest.rsplit_once(':') {
                    Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => {
                        rest.to_string()
                    }
                    _ => crate::error::bail_arg!(
                        "init_process_group: init_method '{m}' is not tcp://HOST:PORT"
                    ),
                }
            }
            Some(m) if m.starts_with("threads://") && m.len() > "threads://".len() => {
                if backend == "tcp" {
                    crate::error::bail_arg!(
                        "init_process_group: init_method '{m}' names an in-process world; backend tcp meets at env:// or tcp://HOST:PORT"
                    );
                }
                m.to_string()
            }
            Some(m) => crate::error::bail_arg!(
                "init_process_group: init_method '{m}' is not env://, tcp://HOST:PORT or threads://NAME"
            ),
        };
        Ok(Rendezvous {
            job: if backend == "threads" {
                super::JobAuth::default()
            } else {
                self.job()?
            },
            backend,
            key,
            world_size,
            rank,
            local_rank,
            local_world_size,
            timeout,
            heartbeat_timeout,
        })
    }
}

/// What [`InitOptions::resolve`] settled on: the rendezvous key and this rank's place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendezvous {
    /// The backend: `"threads"` or `"tcp"` (also for `"gloo"`).
    pub backend: &'static str,
    /// Ranks with the same key join the same world: `"HOST:PORT"` or `"threads://NAME"`.
    pub key: String,
    /// Number of ranks in the world.
    pub world_size: usize,
    /// This rank, `0..world_size`.
    pub rank: usize,
    /// Rank within the node, when given.
    pub local_rank: Option<usize>,
    /// Ranks on this node, when given.
    pub local_world_size: Option<usize>,
    /// Rendezvous and collective timeout.
    pub timeout: Duration,
    /// How long a peer may send no heartbeat (`tcp` and `nccl` backends).
    pub heartbeat_timeout: Duration,
    /// The job id and secret the `tcp` and `nccl` backends check at rendezvous (the open,
    /// id-less job on `threads`).
    pub job: super::JobAuth,
}

/// The least heartbeat timeout: a beat goes out every fifth of it, and a beat needs a few
/// milliseconds on a busy machine.
pub const MIN_HEARTBEAT_TIMEOUT: Duration = Duration::from_millis(500);

/// A number of seconds that is finite and above 0 (`"2.5"`, `"300"`); `Err` says what is
/// wrong with it, for a message that names its source first.
///
/// # Errors
/// The reason, as `is not a number of seconds` or `must be above 0 seconds`.
pub fn parse_seconds(text: &str) -> std::result::Result<Duration, String> {
    let s: f64 = text
        .trim()
        .parse()
        .map_err(|_| "is not a number of seconds".to_string())?;
    if !s.is_finite() {
        return Err("is not a finite number of seconds".into());
    }
    if s <= 0.0 {
        return Err("must be above 0 seconds".into());
    }
    Duration::try_from_secs_f64(s).map_err(|_| "is too large a number of seconds".into())
}
